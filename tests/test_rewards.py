import threading
import time

import pytest

from common import rewards
from common.rewards import REWARD_FNS, exact_match_reward, extract_boxed, math_reward, score_responses

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
    monkeypatch.setattr(rewards, "_KILL_GRACE_S", -1.5)  # parent deadline: timeout - 1.5 s
    n_live = len(rewards._live)
    t0 = time.time()
    assert math_reward(r"\boxed{7^{7^{7^{7^{7}}}}}", "3", timeout_s=TIMEOUT_S) == 0.0
    assert time.time() - t0 < TIMEOUT_S
    assert len(rewards._live) == n_live - 1  # killed, not returned to the pool
    monkeypatch.setattr(rewards, "_KILL_GRACE_S", 1.0)
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
    assert REWARD_FNS == {"math": math_reward, "exact": exact_match_reward}


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
