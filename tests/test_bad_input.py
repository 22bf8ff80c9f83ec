"""Bad input and faults as a new user meets them, in all four scripts (grpo.py, pg_is.py, gspo.py, ppo.py): values
out of range, run directories (one run per directory, one at a time), broken model directories, a reward that always
fails, Ctrl-C. Bad input ends in a one-line error and exit code 2 before any model loads; a fault in exit code 3;
Ctrl-C in exit code 130 with the step and how to resume (docs/faults.md)."""
import contextlib
import fcntl
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tasks import rewards
from common.cli import RANGES, Infra, check_ranges
from common.preflight import check_model_dir
from tasks.rewards import evaluate
from tasks.rewards import score_rollout
from conftest import SCRIPTS
from early_exit import early_exits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
SMALL = ["--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2", "--eval-every", "0", "--save-every",
         "0"]


def script(name):
    return importlib.import_module(name.removesuffix(".py"))


def run(name, *args, timeout=600):
    return subprocess.run([sys.executable, name, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(p, code, message):
    assert p.returncode == code, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and message in errors[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr


# ---------------------------------------------------------------------------------------------------------------
# values out of range: refused by validate, before any model loads


BAD_VALUES = [  # (flags, the flag the one-line error must name); every script
    (["--max-response-len", "0"], "--max-response-len"), (["--max-prompt-len", "0"], "--max-prompt-len"),
    (["--num-minibatches", "0"], "--num-minibatches"), (["--num-prompts", "0"], "--num-prompts"),
    (["--num-prompts", "-8"], "--num-prompts"), (["--group-size", "-2"], "--group-size"),
    (["--group-size", "0"], "--group-size"), (["--num-steps", "0"], "--num-steps"), (["--eval-k", "0"], "--eval-k"),
    (["--seed", "-1"], "--seed"), (["--micro-batch-tokens", "0"], "--micro-batch-tokens"),
    (["--sampler-batch-size", "0"], "--sampler-batch-size"), (["--vllm-tp", "0"], "--vllm-tp"),
    (["--logprob-chunk", "0"], "--logprob-chunk"), (["--kl-baseline-steps", "0"], "--kl-baseline-steps"),
    (["--max-skipped-steps", "-1"], "--max-skipped-steps"), (["--eval-every", "-1"], "--eval-every"),
    (["--eval-max-problems", "-1"], "--eval-max-problems"), (["--save-every", "-1"], "--save-every"),
    (["--keep-last", "-1"], "--keep-last"),
    (["--temperature", "nan"], "--temperature"), (["--temperature", "inf"], "--temperature"),
    (["--temperature", "0"], "--temperature"), (["--lr", "-1"], "--lr"), (["--lr", "nan"], "--lr"),
    (["--lr", "0"], "--lr"), (["--adam-betas", "0.9", "1.0"], "--adam-betas"),
    (["--adam-betas", "-0.1", "0.95"], "--adam-betas"), (["--weight-decay", "-0.1"], "--weight-decay"),
    (["--weight-decay", "nan"], "--weight-decay"), (["--max-grad-norm", "0"], "--max-grad-norm"),
    (["--max-grad-norm", "nan"], "--max-grad-norm"), (["--is-threshold", "0"], "--is-threshold"),
    (["--is-threshold", "nan"], "--is-threshold"), (["--truncated-reward", "nan"], "--truncated-reward"),
    (["--kl-warn-factor", "-1"], "--kl-warn-factor"), (["--kl-warn-factor", "nan"], "--kl-warn-factor"),
    (["--eval-temperature", "-0.5"], "--eval-temperature"), (["--eval-temperature", "nan"], "--eval-temperature"),
    (["--eval-top-p", "0"], "--eval-top-p"), (["--eval-top-p", "1.5"], "--eval-top-p"),
    (["--vllm-gpu-memory-utilization", "0"], "--vllm-gpu-memory-utilization"),
    (["--vllm-gpu-memory-utilization", "1.5"], "--vllm-gpu-memory-utilization"),
    (["--vllm-kv-cache-gib", "-1"], "--vllm-kv-cache-gib"), (["--vllm-kv-cache-gib", "inf"], "--vllm-kv-cache-gib"),
    (["--overwrite", "--resume", "latest"], "--overwrite"),
]
CLIP = [(["--eps-low", "1.0"], "--eps-low"), (["--eps-low", "-0.1"], "--eps-low"), (["--eps-high", "-0.1"], "--eps-high"),
        (["--eps-high", "nan"], "--eps-high")]  # the scripts with a PPO clip
CISPO_CLIP = [(["--eps-low", "1.5"], "--eps-low"), (["--eps-low", "-0.1"], "--eps-low"),
              (["--eps-high", "-0.1"], "--eps-high")]  # CISPO clips a weight: eps_low 1 (no lower bound) is valid
PPO = [(["--critic-lr", "0"], "--critic-lr"), (["--gamma", "1.5"], "--gamma"), (["--gamma", "nan"], "--gamma"),
       (["--lam", "-0.1"], "--lam"), (["--value-clip", "0"], "--value-clip"),
       (["--is-reject", "opsm"], "--is-reject")]  # opsm needs one advantage per sequence
CASES = ([(s, *case) for s in SCRIPTS for case in BAD_VALUES]
         + [(s, *case) for s in ("grpo.py", "gspo.py", "ppo.py") for case in CLIP]
         + [("ppo.py", *case) for case in PPO] + [("cispo.py", *case) for case in CISPO_CLIP])


@pytest.mark.parametrize("name,flags,flag", CASES, ids=[f"{c[0]}:{' '.join(c[1])}" for c in CASES])
def test_validate_refuses_values_out_of_range(name, flags, flag):
    m = script(name)
    with pytest.raises(ValueError) as e:
        m.validate(m.parse_args(flags), 1)
    message = str(e.value)
    assert flag in message and "\n" not in message, message


@pytest.mark.parametrize("name", SCRIPTS)
def test_defaults_pass_validate(name, tiny_model_dir):
    m = script(name)
    m.validate(m.parse_args([]), 1)  # the built-in task's defaults
    m.validate(m.parse_args(["--model", tiny_model_dir]), 1)  # the study's defaults
    m.validate(m.parse_args(["--eval-temperature", "0", "--max-skipped-steps", "0", "--kl-warn-factor", "0",
                             "--eval-every", "0", "--save-every", "0", "--keep-last", "0", "--seed", "0"]), 1)


def test_a_rank_share_that_the_mini_batches_cannot_split_is_refused_with_what_to_change():
    """The study's 64 prompts and 4 mini-batches on 32 GPUs: 2 prompts a rank, which 4 mini-batches cannot split."""
    m = script("grpo.py")
    m.validate(m.parse_args(["--num-prompts", "64", "--num-minibatches", "4"]), 16)
    with pytest.raises(ValueError) as e:
        m.validate(m.parse_args(["--num-prompts", "64", "--num-minibatches", "4"]), 32)
    assert str(e.value) == ("--num-prompts 64 over 32 ranks leaves 2 a rank, which --num-minibatches 4 does not "
                            "divide: lower --num-minibatches or raise --num-prompts")


def test_shared_checks_take_a_group_of_one():
    """common/cli.py asks only for a group of at least 1: that a group's mean is the baseline is an algorithm's rule,
    which a script with that baseline adds (GROUP_SIZE) and a fork with another baseline leaves out."""
    check_ranges(script("grpo.py").parse_args(["--group-size", "1"]), RANGES)
    with pytest.raises(ValueError, match="--group-size 0: must be at least 1"):
        check_ranges(script("grpo.py").parse_args(["--group-size", "0"]), RANGES)


@pytest.mark.parametrize("name", SCRIPTS)
def test_group_of_one_refused_where_the_script_says_so(name):
    """A script whose baseline is the group's mean says so in GROUP_SIZE, and its validate refuses a group of one
    with that reason; a script without it (ppo.py: the critic's value) takes one."""
    m = script(name)
    args = m.parse_args(["--group-size", "1"])
    if hasattr(m, "GROUP_SIZE"):
        with pytest.raises(ValueError, match="--group-size 1: must be " + re.escape(m.GROUP_SIZE[1])):
            m.validate(args, 1)
    else:
        m.validate(args, 1)


def test_ppo_takes_a_group_of_one():
    """ppo.py's baseline is the critic's value, not the group's mean: one response per prompt is plain PPO."""
    m = script("ppo.py")
    m.validate(m.parse_args(["--group-size", "1"]), 1)


@pytest.fixture(scope="module")
def refused(tmp_path_factory, request):
    """{(test, script): (its directory, the run's result)}: each script on a value out of range ("range"), on a
    directory that holds another run ("old", old_run) and on one whose lock a run in progress holds ("locked": this
    process holds it while they run), all in one early_exits; the scripts of the tests selected only (-k)."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if "refused" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")}
    tmp, cases, dirs = tmp_path_factory.mktemp("refused"), [], []
    for name in [s for s in SCRIPTS if s in selected]:
        for test in ("range", "old", "locked"):
            d = tmp / f"{test}_{name[:-3]}"
            if test == "range":
                cases.append((name, ["--run-dir", str(d / "run"), "--max-response-len", "0"]))
            else:
                d.mkdir()
                if test == "old":
                    old_run(d)
                cases.append((name, ["--run-dir", str(d), "--num-steps", "1", *SMALL]))
            dirs.append(((test, name), d))
    from common.rundir import LOCK_FILE
    with contextlib.ExitStack() as held:  # the runs in progress in the "locked" directories
        for (test, _), d in dirs:
            if test == "locked":
                f = held.enter_context(open(d / LOCK_FILE, "a"))
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        results = early_exits(cases, str(tmp), ENV)
    return {key: (d, p) for (key, d), p in zip(dirs, results)}


@pytest.mark.parametrize("name", SCRIPTS)
def test_out_of_range_value_exits_2_before_a_model_loads(name, refused):
    _, p = refused["range", name]
    assert_one_line_error(p, 2, "--max-response-len 0")
    assert "Loading weights" not in p.stderr and "[data]" not in p.stdout


# ---------------------------------------------------------------------------------------------------------------
# run directories: one run per directory, one at a time


RUN_CONFIG = {"script": "grpo.py", "exp_name": "grpo", "seed": 1, "num_steps": 5}  # what a run's config.json holds


def old_run(path):
    """What a finished run leaves, and a log a user tees into the directory."""
    os.makedirs(path / "checkpoints" / "step_000005")
    (path / "checkpoints" / "step_000005" / "trainer_state.json").write_text('{"step": 5}')
    (path / "config.json").write_text(json.dumps(RUN_CONFIG))
    (path / "metrics.jsonl").write_text('{"step": 5}\n')
    (path / "train.log").write_text("old log\n")


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_new_run_refuses_a_directory_holding_another_run(name, refused):
    tmp_path, p = refused["old", name]
    assert_one_line_error(p, 2, f"--run-dir {str(tmp_path)!r} holds another run")
    assert "--resume latest" in p.stderr and "--overwrite" in p.stderr
    assert "Loading weights" not in p.stderr and "[data]" not in p.stdout
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 5}\n'  # untouched


def test_overwrite_removes_the_old_run_and_keeps_other_files(tmp_path):
    """--overwrite removes the old run only once the new run's inputs are read and checked: a bad dataset stops the
    new run and leaves the old one as it was (before, it was gone by then); with good inputs the old run's files go
    and the other files of the directory stay."""
    from common.rundir import LOCK_FILE
    old_run(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    p = run("grpo.py", "--run-dir", str(tmp_path), "--overwrite", "--dataset", str(tmp_path / "empty.jsonl"))
    assert_one_line_error(p, 2, "the dataset is empty")
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 5}\n'
    assert os.path.isdir(tmp_path / "checkpoints" / "step_000005")
    p = run("grpo.py", "--run-dir", str(tmp_path), "--overwrite", "--num-steps", "1", *SMALL)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[run-dir] --overwrite: removed checkpoints, config.json, metrics.jsonl" in p.stdout
    assert sorted(os.listdir(tmp_path)) == [LOCK_FILE, "checkpoints", "config.json", "empty.jsonl", "metrics.jsonl",
                                            "train.log"]
    assert os.listdir(tmp_path / "checkpoints") == ["step_000001"] and json.loads(
        (tmp_path / "config.json").read_text())["num_steps"] == 1


def test_claim_run_dir_rules(tmp_path):
    from common.rundir import LOCK_FILE, claim_run_dir, clear_run_dir
    d = str(tmp_path / "run")
    lock = claim_run_dir(d, resume=False, overwrite=False)  # made, locked
    with pytest.raises(ValueError, match="another run is using it"):
        claim_run_dir(d, resume=True, overwrite=False)  # a second claim: refused while the first holds the lock
    lock.release()
    (tmp_path / "run" / "config.json").write_text(json.dumps(RUN_CONFIG))
    with pytest.raises(ValueError, match="holds another run"):
        claim_run_dir(d, resume=False, overwrite=False)
    claim_run_dir(d, resume=True, overwrite=False).release()  # resuming continues the run that is there
    lock = claim_run_dir(d, resume=False, overwrite=True)  # claimed, nothing removed yet
    assert sorted(os.listdir(d)) == [LOCK_FILE, "config.json"]
    clear_run_dir(d)  # once the new run's inputs are checked
    lock.release()
    assert os.listdir(d) == [LOCK_FILE]


def test_the_lock_of_a_killed_run_does_not_block(tmp_path):
    """A run killed (SIGKILL: nothing of it cleans up) leaves its .lock file, but the lock went with the process."""
    from common.rundir import claim_run_dir
    d = str(tmp_path / "run")
    code = f"import time; from common.rundir import claim_run_dir; lock = claim_run_dir({d!r}, False, False); " \
           "print('held', flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(ValueError, match="another run is using it"):
        claim_run_dir(d, resume=True, overwrite=False)
    holder.kill()
    holder.wait()
    claim_run_dir(d, resume=True, overwrite=False).release()


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_second_run_in_a_locked_directory_fails_at_once(name, refused):
    tmp_path, p = refused["locked", name]  # (a run in progress held its lock)
    assert_one_line_error(p, 2, f"--run-dir {str(tmp_path)!r}: another run is using it")
    assert "Loading weights" not in p.stderr and "[data]" not in p.stdout


# ---------------------------------------------------------------------------------------------------------------
# broken model directories


def test_truncated_weights_are_refused(tiny_model_dir, tmp_path):
    d = shutil.copytree(tiny_model_dir, tmp_path / "m")
    size = os.path.getsize(d / "model.safetensors")
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(size - 1000)  # an interrupted copy
    with pytest.raises(ValueError, match=rf"model.safetensors is not a complete safetensors file \({size - 1000:,} "
                                         r"bytes; safetensors: incomplete metadata, file not fully covered\): an "
                                         "interrupted copy"):
        check_model_dir(str(d))
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(4)  # not even the header's length
    with pytest.raises(ValueError, match=r"model.safetensors is not a complete safetensors file \(4 bytes; "
                                         "safetensors: header too small"):
        check_model_dir(str(d))


def test_sharded_weights_with_a_missing_or_truncated_shard_are_refused(tiny_model_dir, tmp_path):
    d = shutil.copytree(tiny_model_dir, tmp_path / "m")
    os.rename(d / "model.safetensors", d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors, listed in "
                                                "model.safetensors.index.json, is missing"):
        check_model_dir(str(d))
    shutil.copy(d / "model-00001-of-00002.safetensors", d / "model-00002-of-00002.safetensors")
    check_model_dir(str(d))
    with open(d / "model-00002-of-00002.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors is"):
        check_model_dir(str(d))


def test_weights_without_a_tokenizer_are_refused(tiny_model_dir, tmp_path):
    d = shutil.copytree(tiny_model_dir, tmp_path / "m")
    for name in os.listdir(d):
        if "token" in name:
            os.remove(d / name)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        check_model_dir(str(d))


@pytest.fixture(scope="module")
def broken_runs(tiny_model_dir, tmp_path_factory):
    """{kind: (the broken model directory, grpo.py's result on it)}, both runs in one early_exits."""
    tmp, dirs = tmp_path_factory.mktemp("broken"), {}
    for broken in ("truncated", "no tokenizer"):
        d = shutil.copytree(tiny_model_dir, tmp / broken.replace(" ", "_") / "m")
        if broken == "truncated":
            with open(d / "model.safetensors", "r+b") as f:
                f.truncate(os.path.getsize(d / "model.safetensors") // 2)
        else:
            os.remove(d / "tokenizer.json")
        dirs[broken] = d
    results = early_exits([("grpo.py", ["--model", str(d), "--run-dir", str(d.parent / "run"), "--reward", "exact",
                                        "--prompt-template", "{problem}"]) for d in dirs.values()], str(tmp), ENV)
    return {broken: (d, p) for (broken, d), p in zip(dirs.items(), results)}


@pytest.mark.parametrize("broken", ["truncated", "no tokenizer"])
def test_broken_model_directory_exits_2_before_a_model_loads(broken_runs, broken):
    d, p = broken_runs[broken]
    assert_one_line_error(p, 2, f"--model {str(d)!r}: ")
    assert "Loading weights" not in p.stderr and "[data]" not in p.stdout


# ---------------------------------------------------------------------------------------------------------------
# rewards that fail, and slow ones


class Sampler:  # one response "2" per sample
    def generate(self, prompts, n, max_new_tokens, temperature, top_p=1.0):
        from common.batches import Rollout
        out = Rollout()
        for p in prompts:
            for _ in range(n):
                out.prompt_ids.append(p)
                out.response_ids.append([4])
                out.logprobs.append(None)
                out.finished.append(True)
        return out


class Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["2" for _ in ids]


def failing_check(response, answer):
    raise RuntimeError("reward service down")


def test_evaluation_counts_reward_failures(process_group, monkeypatch):
    _, _, device = process_group
    problems = {"aime": [{"prompt_ids": [5, 6], "answer": "2"}, {"prompt_ids": [7], "answer": "3"}]}
    metrics = evaluate(Sampler(), Tokenizer(), problems, Infra(eval_k=3, eval_temperature=1.0, eval_top_p=1.0), 8,
                       "exact", 0, 1, device)
    assert metrics == {"eval/aime/accuracy": 0.5, "eval/aime/reward_failures": 0.0}
    monkeypatch.setitem(rewards._CHECKS, "exact", failing_check)
    metrics = evaluate(Sampler(), Tokenizer(), problems, Infra(eval_k=3, eval_temperature=1.0, eval_top_p=1.0), 8,
                       "exact", 0, 1, device)
    assert metrics == {"eval/aime/accuracy": 0.0, "eval/aime/reward_failures": 6.0}


def test_scoring_shows_progress_when_asked(monkeypatch, capsys):
    monkeypatch.setattr(rewards, "PROGRESS_EVERY_S", 0.0)  # a line at every check, as if each took long
    responses = ["1", "2", "3"]
    assert score_rollout(responses, ["1", "1", "3"], [True] * 3, "exact", progress=True) == ([1.0, 0.0, 1.0], 0)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[reward]")]
    assert lines[-1].startswith("[reward] 3 of 3 responses checked") and len(lines) == 3, lines
    score_rollout(responses, ["1", "1", "3"], [True] * 3, "exact")  # other ranks: quiet
    assert "[reward]" not in capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_reward_failing_on_every_response_stops_the_run(name, tmp_path):
    p = subprocess.run([sys.executable, "tests/fault_injection.py", name, "reward-all", "1", "--run-dir",
                        str(tmp_path), "--num-steps", "3", *SMALL], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert_one_line_error(p, 3, "step 1: every reward check of the step failed")
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert not [r for r in rows if "train/accuracy" in r]  # stopped before training on the zeros


# ---------------------------------------------------------------------------------------------------------------
# Ctrl-C


@pytest.mark.parametrize("name", SCRIPTS)
def test_ctrl_c_says_where_it_stopped_and_how_to_resume(name, tmp_path):
    proc = subprocess.Popen([sys.executable, name, "--run-dir", str(tmp_path), "--num-steps", "10000", *SMALL],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        logged = []
        for line in proc.stdout:  # no timing: the signal comes once step 1 is logged, whatever that takes
            if m := re.match(r"step (\d+) \|", line):
                logged.append(int(m.group(1)))
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    logged += [int(m.group(1)) for m in re.finditer(r"^step (\d+) \|", out, re.M)]
    assert proc.returncode == 130, err[-3000:]
    # (--save-every 0: no checkpoint to resume from, which the message says)
    how = ", before the run's first checkpoint: nothing to resume; start it again with --overwrite"
    m = re.search(rf"^{name}: interrupted at step (\d+){re.escape(how)}$", err, re.M)
    assert m, err[-3000:]
    # the step in progress: the last one logged, or the next one if it had begun
    assert int(m.group(1)) in (logged[-1], logged[-1] + 1), (m.group(0), logged)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
