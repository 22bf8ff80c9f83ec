import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from fractions import Fraction

import pytest

from tasks import rewards
from tasks import reward_pool
from tasks.rewards import (REWARD_FNS, exact_match_reward, extract_boxed, extract_number, math_reward, number_reward,
                            score_responses, score_rollout)

TIMEOUT_S = 2.0  # a short per-check timeout keeps the pathological tests fast
MARGIN_S = 2.0  # the worker answers at the timeout; it is killed at timeout + 1 s


def run_in_thread(fn, *args, **kwargs):
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)))
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    return out[0]


# ----------------------------------------------------------------------------
# extract_boxed


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{\frac{a^{2}}{b_{1}}}} done", r"\sqrt{\frac{a^{2}}{b_{1}}}"),
        (r"first \boxed{1}, then \boxed{2}, finally \boxed{3}", "3"),  # last wins
        (r"\fbox{7}", "7"),
        (r"\boxed{1} and \fbox{8}", "8"),
        (r"\boxed {5}", "5"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{\left\{ x \right.}", r"\left\{ x \right."),  # escaped braces don't count
        (r"\boxed{}", ""),
        (r"\boxed{\frac{1}{2}", None),  # unbalanced (cut off)
        (r"\boxed{1} then \boxed{\frac{1", None),  # the last one is unbalanced
        ("the answer is 42", None),
        (r"\boxed 42", None),
        ("", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# ----------------------------------------------------------------------------
# math_reward


@pytest.mark.parametrize(
    "response,answer",
    [
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{\dfrac12}", "1/2"),
        (r"\boxed{0.5}", r"\frac12"),
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
        (r"\boxed{x=3}", "3"),  # math-verify accepts an assignment for its value
        (r"\boxed{ 42 }", "42"),
        (r"\boxed{42}", 42),  # numbers as gold answers
        (r"\boxed{(x+1)^2}", "x^2+2x+1"),
        (r"\boxed{\{1, 2\}}", "1,2"),
        (r"\boxed{1,000}", "1000"),
        (r"Thinking... \boxed{7} no wait. Final: \boxed{\frac{3}{4}}", "0.75"),
        # gold given as a full worked solution: its last box is the answer
        (r"\boxed{\frac{1}{2}}", r"We have $x = \frac{2}{4}$, so the answer is $\boxed{\dfrac{1}{2}}$."),
        # GSM8K-style gold
        (r"\boxed{72}", "48 / 2 = 24 clips in May.\n48 + 24 = 72\n#### 72"),
    ],
)
def test_math_reward_equal(response, answer):
    assert math_reward(f"Some reasoning. {response}", str(answer)) == 1.0


@pytest.mark.parametrize(
    "response,answer",
    [
        (r"\boxed{3}", "4"),
        (r"\boxed{-1}", "1"),
        (r"\boxed{\frac{1}{3}}", "0.5"),
        (r"\boxed{\pi}", "3.14"),  # no rounding to the gold's precision
        (r"\boxed{x+1}", "x+2"),
        (r"\boxed{}", "0"),
        (r"\boxed{\frac{1}{0}}", "1"),
        (r"\boxed{}{}}}\frac", "1"),
        (r"\boxed{3", "3"),  # unbalanced: no answer
        ("the answer is 3", "3"),  # no box: no answer
        (r"\boxed{\frac{1}{2}}", r"a solution with a broken box \boxed{\frac{1}{3}"),
    ],
)
def test_math_reward_not_equal(response, answer):
    assert math_reward(response, answer) == 0.0


def test_math_reward_pathological_is_bounded():
    math_reward(r"\boxed{1}", "2")  # make sure a worker is up, so we time only the check
    for answer in [r"9^{9^{9^{9^{9}}}}", "+".join(f"x^{{{i}}}" for i in range(3000))]:
        t0 = time.time()
        assert math_reward(rf"\boxed{{{answer}}}", "3", timeout_s=TIMEOUT_S) == 0.0
        assert time.time() - t0 < TIMEOUT_S + MARGIN_S
    # and the pool still works afterwards
    assert math_reward(r"\boxed{0.25}", "1/4") == 1.0


def test_math_reward_in_a_thread():
    # math-verify's own timeout (signal.alarm) refuses to run outside the main thread
    assert run_in_thread(math_reward, r"\boxed{\dfrac{3}{6}}", "0.5") == 1.0
    assert run_in_thread(math_reward, r"\boxed{2}", "0.5") == 0.0
    t0 = time.time()
    assert run_in_thread(math_reward, r"\boxed{8^{8^{8^{8^{8}}}}}", "3", timeout_s=TIMEOUT_S) == 0.0
    assert time.time() - t0 < TIMEOUT_S + MARGIN_S


def test_stuck_worker_is_killed_and_replaced(monkeypatch):
    # Pretend the in-worker timer did not fire (as with code that never returns to Python):
    # the parent must give up at its own deadline, kill that worker, and start a fresh one.
    math_reward(r"\boxed{1}", "2")
    monkeypatch.setattr(reward_pool, "_KILL_GRACE_S", -1.5)  # parent deadline: timeout - 1.5 s
    n_live = len(reward_pool._live)
    t0 = time.time()
    assert math_reward(r"\boxed{7^{7^{7^{7^{7}}}}}", "3", timeout_s=TIMEOUT_S) == 0.0
    assert time.time() - t0 < TIMEOUT_S
    assert len(reward_pool._live) == n_live - 1  # killed, not returned to the pool
    monkeypatch.setattr(reward_pool, "_KILL_GRACE_S", 1.0)
    assert math_reward(r"\boxed{\frac{6}{8}}", "0.75") == 1.0


# ----------------------------------------------------------------------------
# exact match and score_responses


def test_exact_match():
    assert exact_match_reward(" 42\n", "42") == 1.0
    assert exact_match_reward("42", " 42 ") == 1.0
    assert exact_match_reward("41", "42") == 0.0
    assert exact_match_reward("42.0", "42") == 0.0
    assert exact_match_reward("", "42") == 0.0


def test_reward_fns():
    assert REWARD_FNS == {"math": math_reward, "exact": exact_match_reward, "number": number_reward}


# ----------------------------------------------------------------------------
# number_reward: the final number, GSM8K style


@pytest.mark.parametrize(
    "response,answer",
    [
        ("10 + 4 equals 14.", "14"),  # a sentence: the trailing period is not a decimal point
        ("The total is 1,234 apples", "1234"),  # thousands commas
        ("The total is 1234", "1,234"),
        ("It costs $1,234,567.", "1234567"),
        ("x = -5", "-5"),
        ("x = \u22125", "-5"),  # Unicode minus
        ("+5", "5"),
        ("It costs $3.50.", "3.5"),
        ("half is .5", "0.5"),
        ("14.0", "14"),
        ("0.3333333", "0.333333"),  # decimals: relative tolerance 1e-6
        ("I have 14apples", "14"),  # glued to a word
        ("So \\$14 in total", "14"),  # LaTeX dollar
        ("50%", "50"),  # the percent sign is ignored
        ("10-4 = 6", "6"),  # a binary minus is not a sign
        ("10-4", "4"),
        ("First 3 + 4 = 7, then 7 * 2 = 14.", "14"),  # the last number
        ("#### 42\nso maybe 43 in the end", "42"),  # after #### wins over a later number
        ("The answer is 7. Check: 3 + 4 = 7, and 8 is wrong", "7"),  # "the answer is" wins over a later number
        ("answer: 12 (from 5 + 7)", "12"),
        ("The final ANSWER is 9, not 10.", "9"),
        ("The answer is 3 #### 5", "5"),  # #### wins over "the answer is"
        ("The answer is unclear. I guess 8", "8"),  # the first number after the phrase
        ("#### \nno number after the marker, the last is 6", "6"),  # a marker without a number is passed over
        ("72", "Natalia sold 48 / 2 = 24 clips in May.\nShe sold 48 + 24 = 72 clips.\n#### 72"),  # GSM8K gold
        ("She has 1,000 left.", "#### 1,000"),
    ],
)
def test_number_reward_equal(response, answer):
    assert number_reward(response, answer) == 1.0


@pytest.mark.parametrize(
    "response,answer",
    [
        ("1, 2", "12"),  # a comma with a space separates two numbers: the last is 2
        ("1, 2", "1"),
        ("1,2345", "12345"),  # not a thousands group: 1 and 2345
        ("10 + 4 equals 15.", "14"),
        ("-5", "5"),
        ("5", "-5"),
        ("3.5", "3.6"),
        ("0.333", "0.333333"),  # beyond the tolerance
        ("123456789012", "123456789013"),  # integers are compared exactly (a float would say equal)
        ("#### 41\nso 42", "42"),
        ("The answer is 41. Or 42", "42"),
        ("no number at all", "42"),
        ("", "42"),
        ("42", "no number in the gold answer"),
        ("3/4", "0.75"),  # fractions are not read: "3/4" ends in 4
        ("1" * 5000, "1"),  # more digits than Python converts: no number, not an exception
    ],
)
def test_number_reward_not_equal(response, answer):
    assert number_reward(response, answer) == 0.0


def test_extract_number():
    assert extract_number("10 + 4 equals 14.") == 14
    assert extract_number("1,234.5") == Fraction(2469, 2)
    assert extract_number("\\$-3.50") == Fraction(-7, 2)
    assert extract_number("no digits") is None


def test_score_responses_number():
    assert score_responses(["10 + 4 equals 14.", "It is 15", "14"], ["14", "14", "14"], [True, True, False],
                           "number") == [1.0, 0.0, 0.0]


def test_score_responses_exact_with_truncation():
    responses = ["12", "12", "7", "12"]
    answers = ["12", "12", "12", "12"]
    finished = [True, False, True, True]
    assert score_responses(responses, answers, finished, "exact") == [1.0, 0.0, 0.0, 1.0]
    assert score_responses(responses, answers, finished, "exact", truncated_reward=-1.0) == [1.0, -1.0, 0.0, 1.0]


def test_score_responses_math_many():
    # a batch like one RL step: many responses, many repeats, some cut off
    responses, answers, finished, expected = [], [], [], []
    for i in range(200):
        k = i % 4
        responses.append([rf"... \boxed{{\frac{{{i % 7}}}{{2}}}}", rf"\boxed{{{i % 7 / 2}}}", "no answer", r"\boxed{1}"][k])
        answers.append(str(i % 7 / 2))
        finished.append(i % 10 != 9)
        ok = k in (0, 1) or (k == 3 and i % 7 == 2)
        expected.append(1.0 if ok and finished[-1] else 0.0)
    t0 = time.time()
    assert score_responses(responses, answers, finished, "math") == expected
    assert time.time() - t0 < 30


def test_score_responses_truncated_not_checked():
    # a cut-off response gets truncated_reward even if it already contains the right box
    assert score_responses([r"\boxed{2} and more", r"\boxed{2}"], ["2", "2"], [False, True], "math") == [0.0, 1.0]


def test_score_responses_errors():
    with pytest.raises(ValueError, match="unknown reward kind"):
        score_responses(["1"], ["1"], [True], "fuzzy")
    with pytest.raises(ValueError, match="2 responses, 1 answers"):
        score_responses(["1", "2"], ["1"], [True, True], "exact")
    assert score_responses([], [], [], "math") == []


# ----------------------------------------------------------------------------
# plug-in rewards: --reward module:function, called in the time-limited workers


PLUGIN = '''
import time


def contains(response, answer):
    return 1.0 if answer in response else 0.0


def exact(response, answer):
    return response.strip() == answer.strip()  # a bool is a number


def boom(response, answer):
    if response == "boom":
        raise ZeroDivisionError("plugin boom")
    return 1.0


def slow(response, answer):
    if response == "slow":
        time.sleep(60)
    return 1.0


def stubborn(response, answer):  # swallows the in-worker timer: only killing the worker stops it
    while response == "slow":
        try:
            time.sleep(60)
        except BaseException:
            pass
    return 1.0


def nan(response, answer):
    return float("nan")


def text(response, answer):
    return "1.0"


not_a_function = 3
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The name of a fresh plug-in module (fresh, as workers and sys.modules keep what they imported)."""
    name = f"plug_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_plugin_scores_in_a_worker(plugin):
    responses = ["so it is 14", "15", "it is 7", "no"]
    r = score_rollout(responses, ["14", "14", "7", "7"], [True] * 4, f"{plugin}:contains")
    assert r == ([1.0, 0.0, 1.0, 0.0], 0)
    assert score_responses([" 3 ", "4"], ["3", "3"], [True, True], f"{plugin}:exact") == [1.0, 0.0]
    assert plugin not in reward_pool._plugins  # called in the workers, not here


def test_plugin_found_in_the_current_directory(tmp_path, monkeypatch):
    name = f"plug_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.chdir(tmp_path)  # not on sys.path: found as the parent's cwd, in the parent and in the workers
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    rewards.check_reward(f"{name}:contains")
    assert score_responses(["a 1", "a 2"], ["1", "1"], [True, True], f"{name}:contains") == [1.0, 0.0]


def test_plugin_exception_is_a_counted_failure(plugin, capfd):
    rewards._reported.discard("ZeroDivisionError")
    r, failed = score_rollout(["1", "boom", "boom", "boom"], ["1"] * 4, [True, True, True, False], f"{plugin}:boom")
    assert r == [1.0, 0.0, 0.0, 0.0] and failed == 2  # the truncated one is not checked
    err = capfd.readouterr().err
    assert err.count("raised ZeroDivisionError") == 1 and "plugin boom" in err  # reported once


@pytest.mark.parametrize("fn,error", [("nan", "ValueError"), ("text", "TypeError")])
def test_plugin_non_number_is_a_counted_failure(plugin, capfd, fn, error):
    rewards._reported.discard(error)
    assert score_rollout(["1", "2"], ["1", "2"], [True, True], f"{plugin}:{fn}") == ([0.0, 0.0], 2)
    assert "not a" in capfd.readouterr().err


@pytest.mark.parametrize("fn", ["slow", "stubborn"])
def test_plugin_past_the_time_limit_is_a_counted_failure(plugin, monkeypatch, fn):
    # slow: stopped by the worker's timer; stubborn ignores it, so the parent kills the worker at its deadline
    monkeypatch.setattr(rewards, "PLUGIN_TIMEOUT_S", 1.0)
    score_responses(["1", "1"], ["1", "1"], [True, True], f"{plugin}:{fn}")  # workers up, the module imported
    t0 = time.time()
    assert score_rollout(["slow"], ["1"], [True], f"{plugin}:{fn}") == ([0.0], 1)
    assert time.time() - t0 < 1.0 + MARGIN_S
    # the run goes on: the other responses of a batch are scored, by a fresh worker where one was killed
    assert score_rollout(["slow", "1", "2"], ["1", "1", "1"], [True] * 3, f"{plugin}:{fn}") == ([0.0, 1.0, 1.0], 1)


@pytest.mark.parametrize("spec,message", [
    ("nocolon", "unknown reward kind"),
    ("fuzzy", "unknown reward kind"),
    ("a:b:c", "unknown reward kind"),
    ("nosuchmod_xyz:fn", "cannot import nosuchmod_xyz (ModuleNotFoundError"),
    ("{plugin}:missing", "has no attribute missing"),
    ("{plugin}:not_a_function", "is not callable"),
])
def test_check_reward_rejects_bad_specs(plugin, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        rewards.check_reward(spec.format(plugin=plugin))
    assert "\n" not in str(e.value)
    for kind in ["math", "exact", "number", f"{plugin}:contains", "tasks.rewards:number_reward"]:
        rewards.check_reward(kind)


def test_check_reward_module_that_fails_to_import(tmp_path, monkeypatch):
    (tmp_path / "plug_broken_syntax.py").write_text("def f(:\n")
    (tmp_path / "plug_raises_on_import.py").write_text("raise RuntimeError('no config\\nfound')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="cannot import plug_broken_syntax \\(SyntaxError"):
        rewards.check_reward("plug_broken_syntax:f")
    with pytest.raises(ValueError, match="RuntimeError: no config found"):
        rewards.check_reward("plug_raises_on_import:f")


# ----------------------------------------------------------------------------
# end to end: grpo.py --reward on the built-in task (CPU)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--num-steps", "2", "--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2",
        "--micro-batch-tokens", "96", "--eval-every", "0", "--eval-k", "2", "--eval-max-problems", "8",
        "--save-every", "0"]


def run_grpo(args, cwd):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, os.path.join(ROOT, "grpo.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def test_grpo_bad_reward_fails_fast(tmp_path):
    p = run_grpo(["--run-dir", str(tmp_path / "run"), "--reward", "nosuchmod:fn"], ROOT)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["grpo.py: error: --reward 'nosuchmod:fn': cannot import nosuchmod "
                      "(ModuleNotFoundError: No module named 'nosuchmod')"], p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "Loading weights" not in p.stderr


def test_grpo_trains_on_a_plugin_reward(tmp_path):
    # the module sits in the directory the run starts from, as a user's own reward file would
    (tmp_path / "my_rewards.py").write_text("def exact(response, answer):\n"
                                            "    return float(response.strip() == answer.strip())\n")
    run_dir = str(tmp_path / "run")
    p = run_grpo(["--run-dir", run_dir, "--reward", "my_rewards:exact", *FAST], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "train/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["train/reward_failures"] == 0 for r in steps)
    assert max(r["train/accuracy"] for r in steps) > 0  # the warm-started model solves about 40% at first
    assert any("eval/eval/accuracy" in r for r in rows)  # evaluation scores with the plug-in too


def test_the_worker_pool_is_apart_from_the_reward_semantics():
    """tasks/reward_pool.py runs as a worker script with nothing of the repository on its path: it never imports
    tasks/rewards.py (which imports it)."""
    code = "import sys; import tasks.reward_pool; assert 'tasks.rewards' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)) or ".")
