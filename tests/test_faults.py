"""Reliability: numerical faults stop a run with its last good state saved, reward failures are counted, the
collapse warning fires, a checkpoint killed mid-save leaves the previous one loadable, a resumed run's log drops the
rows of the lost steps. Runs on CPU; the scripts run in subprocesses with faults injected by fault_injection.py."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from common.checkpoint import find_resume_dir, list_checkpoints, load_training_state
from common.logger import open_metrics
from common.metrics import MismatchMonitor
from tasks.rewards import score_rollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
SMALL = ["--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2", "--eval-every", "0",
         "--save-every", "1", "--keep-last", "0"]


def inject(script, mode, from_step, run_dir, *args):
    return subprocess.run([sys.executable, "tests/fault_injection.py", script, mode, str(from_step), "--run-dir",
                           str(run_dir), *SMALL, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "train/accuracy" in line]


def weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


def builtin_weights():
    from tasks.builtin import ensure_builtin_task
    return weights(ensure_builtin_task()["model"])


# ---------------------------------------------------------------------------------------------------------------
# numerical faults


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_nonfinite_gradient_in_fp32_stops_with_the_last_good_state_saved(tmp_path, script):
    p = inject(script, "nan", 1, tmp_path, "--num-steps", "3", "--precision", "fp32")
    assert p.returncode == 3, p.stderr[-3000:]
    assert "non-finite gradient norm" in p.stderr and "last good state is saved" in p.stderr
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1] and rows[0]["optim/skipped_steps"] == 1  # logged, then stopped
    ckpts = list_checkpoints(os.path.join(tmp_path, "checkpoints"))
    assert [os.path.basename(c) for c in ckpts] == ["step_000001"]
    start, saved = builtin_weights(), weights(ckpts[0])
    assert all(torch.equal(start[k], saved[k]) for k in start)  # the first update never happened


def test_sustained_fp16_skips_stop_the_run_and_a_good_step_resets_the_count(tmp_path):
    # step 1 trains; from step 2 on every loss overflows: 2 skips in step 2, the 3rd in step 3 stops the run
    p = inject("grpo.py", "nan", 2, tmp_path, "--num-steps", "5", "--precision", "fp16", "--max-skipped-steps", "3")
    assert p.returncode == 3, p.stderr[-3000:]
    assert "3 fp16 optimizer steps in a row skipped" in p.stderr
    rows = metrics(tmp_path)
    assert [r["optim/skipped_steps"] for r in rows] == [0, 2, 3]
    assert [r["optim/loss_scale"] for r in rows] == [2.0**16, 2.0**14, 2.0**13]
    root = os.path.join(tmp_path, "checkpoints")
    assert [os.path.basename(c) for c in list_checkpoints(root)] == ["step_000001", "step_000002", "step_000003"]
    w1, w3 = weights(os.path.join(root, "step_000001")), weights(os.path.join(root, "step_000003"))
    assert all(torch.equal(w1[k], w3[k]) for k in w1)  # skipped steps never touched the weights
    assert not all(torch.equal(w1[k], v) for k, v in builtin_weights().items())  # but step 1 did
    # resumed without the fault, from the last good state: the loss scaler's state comes back with it
    p = subprocess.run([sys.executable, "grpo.py", "--run-dir", str(tmp_path), *SMALL, "--num-steps", "4",
                        "--precision", "fp16", "--max-skipped-steps", "3", "--resume", "latest"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    last = metrics(tmp_path)[-1]
    assert last["step"] == 4 and last["optim/loss_scale"] == 2.0**13 and last["optim/skipped_steps"] == 3


def test_scaler_fault_rules():
    from common.precision import LossScaler

    class Opt:
        def step(self):
            pass

        def zero_grad(self, set_to_none=True):
            pass

    def step(scaler, finite):
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.tensor([1.0, 1.0 if finite else float("inf")])
        return scaler.step([p], Opt(), 1.0)

    s = LossScaler(enabled=True, max_consecutive_skips=2)
    step(s, False)
    step(s, True)  # a good step in between resets the run of skips
    step(s, False)
    assert s.fault is None and s.skipped_steps == 2
    step(s, False)
    assert "2 fp16 optimizer steps in a row" in s.fault
    assert LossScaler(enabled=True, max_consecutive_skips=0).fault is None
    s = LossScaler(enabled=False)
    step(s, False)
    assert "without loss scaling" in s.fault


# ---------------------------------------------------------------------------------------------------------------
# rewards and the collapse warning


def test_reward_failures_score_zero_and_are_counted():
    def check(response, answer):
        if response == "boom":
            raise RuntimeError("bad reward")
        return float(response == answer)

    import tasks.rewards as rewards
    original = rewards._CHECKS["exact"]
    rewards._CHECKS["exact"] = check
    try:
        r, failed = score_rollout(["1", "boom", "2", "boom"], ["1", "1", "3", "1"], [True, True, True, False], "exact")
    finally:
        rewards._CHECKS["exact"] = original
    assert r == [1.0, 0.0, 0.0, 0.0] and failed == 1  # the truncated "boom" is never checked


def test_math_timeout_counts_as_a_failure(monkeypatch):
    from tasks import reward_pool
    monkeypatch.setattr(reward_pool, "check_math", lambda pred, gold, timeout_s: None)  # the worker did not answer in time
    assert score_rollout([r"\boxed{2^{2^{2^{99}}}}"], ["3"], [True], "math") == ([0.0], 1)


def test_training_goes_on_through_reward_failures(tmp_path):
    p = inject("grpo.py", "reward", 1, tmp_path, "--num-steps", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("injected reward failure") == 1  # reported once, not once per response
    rows = metrics(tmp_path)
    # every other check of the 32 responses raised (responses cut at the length limit are not checked)
    assert [r["step"] for r in rows] == [1, 2] and all(8 <= r["train/reward_failures"] <= 16 for r in rows)


def kl(value: float, **more) -> dict:
    return {"mismatch/kl_k3": value, **more}


def test_mismatch_monitor():
    m = MismatchMonitor(factor=10, window=2, floor=1e-6)
    assert m.update(kl(1e-5)) == ({}, None) and m.update(kl(3e-5)) == ({}, None)  # baseline 2e-5
    metrics, msg = m.update(kl(3e-5))
    assert metrics == {"mismatch/kl_growth": pytest.approx(1.5), "mismatch/collapse_warning": 0.0} and msg is None
    metrics, msg = m.update(kl(1e-3))  # the last 2 average 5.15e-4: 25.75x
    assert metrics["mismatch/collapse_warning"] == 1.0 and "grew 25.8x" in msg
    assert m.update(kl(1e-3))[1] is None  # said once
    restored = MismatchMonitor(factor=10, window=2)
    restored.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert restored.update(kl(1e-6)) == m.update(kl(1e-6))
    # an exact baseline (fp32 on CPU: ~1e-13) is floored, so noise does not warn
    m = MismatchMonitor(factor=10, window=1, floor=1e-6)
    m.update(kl(1e-13))
    assert m.update(kl(5e-6))[0]["mismatch/collapse_warning"] == 0.0
    assert MismatchMonitor(factor=0, window=2).update(kl(1.0)) == ({}, None)
    # exact mode: any unequal token is said at that step, with the count, whatever the growth
    m = MismatchMonitor(factor=10, window=2, exact=True)
    assert m.update(kl(0.0, **{"mismatch/unequal_tokens": 0.0})) == ({}, None)
    msg = m.update(kl(1e-12, **{"mismatch/unequal_tokens": 3.0, "mismatch/logp_abs_diff_max": 2e-7}))[1]
    assert msg.startswith("[exact] 3 response tokens") and "2e-07" in msg
    assert MismatchMonitor(factor=10, window=2).update(kl(1e-12, **{"mismatch/unequal_tokens": 3.0}))[1] is None


def test_a_jump_in_the_mismatch_warns_in_the_log_and_metrics(tmp_path):
    p = inject("grpo.py", "mismatch", 3, tmp_path, "--num-steps", "3", "--save-every", "0", "--kl-baseline-steps", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[warning] the training-inference mismatch grew" in p.stdout
    rows = metrics(tmp_path)
    assert "mismatch/collapse_warning" not in rows[0]  # step 1 is the baseline
    assert [r["mismatch/collapse_warning"] for r in rows[1:]] == [0.0, 1.0]


@pytest.mark.parametrize("script", ["grpo.py", "pg_is.py"])
def test_nonfinite_logprob_from_the_sampler_stops_with_a_clear_error(tmp_path, script):
    """A NaN mu_logp once passed silently into the metrics (grpo.py without correction trains on, its mismatch keys
    NaN); now it is a fault that names its side and the precisions to try."""
    p = inject(script, "nan-logprob", 2, tmp_path, "--num-steps", "3", "--precision", "fp32")
    assert p.returncode == 3, p.stderr[-3000:]
    assert "step 2:" in p.stderr and "non-finite mu_logp from the sampler (fp32)" in p.stderr, p.stderr[-2000:]
    assert [r["step"] for r in metrics(tmp_path)] == [1]


def test_forward_beyond_fp16_range_is_refused_before_training(tmp_path):
    """A model whose activations exceed 65,504 (here: the first layer's MLP output scaled up): fp16 rollouts are refused
    before the first step with the layer named and the precisions that hold it; fp32 on both sides runs."""
    from transformers import AutoModelForCausalLM
    from conftest import make_tiny_model_dir
    path = make_tiny_model_dir(str(tmp_path / "m"))
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1e5)
    model.save_pretrained(path)
    args = ["--model", path, "--num-steps", "1", "--num-prompts", "2", "--group-size", "2", "--num-minibatches", "1",
            "--max-prompt-len", "16", "--max-response-len", "4", "--prompt-template", "{problem}", "--reward", "exact",
            "--sampler", "hf", "--eval-every", "0", "--save-every", "0"]
    def run(rollout_precision):
        return subprocess.run([sys.executable, "grpo.py", "--run-dir", str(tmp_path / rollout_precision), *args,
                               "--precision", "fp32", "--rollout-precision", rollout_precision], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=600)
    p = run("fp32")
    assert p.returncode == 0, p.stderr[-3000:]
    p = run("fp16")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "overflows fp16 (rollouts)" in p.stderr and "model.layers.1 " in p.stderr, p.stderr[-2000:]
    assert "precisions whose range holds them: bf16, fp32" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------------------------------------------------------
# checkpoints and the log


KILLED_SAVE = textwrap.dedent("""
    import sys, time
    import torch
    from transformers import AutoTokenizer
    import common.checkpoint as ck
    from common.dist import setup_distributed
    from common.fsdp import load_policy
    model_dir, root = sys.argv[1], sys.argv[2]
    setup_distributed()
    model = load_policy(model_dir, torch.float32, torch.device("cpu"), False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ck.save_checkpoint(root, 1, tok, {"": (model, opt, {"scaler": {}})}, ck.rng_state(), keep_last=1)
    write_safetensors = ck.write_safetensors
    def save_and_hang(*args, **kwargs):  # the weights are on disk, the rest is not: now the kill comes
        write_safetensors(*args, **kwargs)
        print("WRITING", flush=True)
        time.sleep(600)
    ck.write_safetensors = save_and_hang
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ck.save_checkpoint(root, 2, tok, {"": (model, opt, {"scaler": {}})}, ck.rng_state(), keep_last=1)
""")


def test_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, tiny_model_dir, process_group):
    root = str(tmp_path / "checkpoints")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, tiny_model_dir, root], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # wait until the second save is half written
            if "WRITING" in line:
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert os.path.exists(os.path.join(root, "step_000002.tmp", "model.safetensors"))  # killed mid-save indeed
    assert [os.path.basename(c) for c in list_checkpoints(root)] == ["step_000001"]  # keep-last 1 kept it
    latest = find_resume_dir("latest", root)
    assert latest.endswith("step_000001")
    from common.fsdp import load_policy
    model = load_policy(latest, torch.float32, torch.device("cpu"), False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state, _ = load_training_state(latest, model, opt)
    assert state["step"] == 1
    start, saved = weights(tiny_model_dir), weights(latest)
    assert all(torch.equal(start[k], saved[k]) for k in saved)


def two_ranks(*argv):
    """`python *argv` as the 2 ranks of a gloo group, started directly (not by torchrun, whose agent stops the other
    workers when one exits) so that each one's exit code and output are its own: (processes, (stdout, stderr) each).
    The timeout only guards against a hang."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**ENV, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    return procs, [p.communicate(timeout=600) for p in procs]


def test_a_damaged_random_state_of_rank_1_stops_both_ranks_with_the_same_line(tmp_path):
    """rng_rank<r>.json is read by its own rank only. Before, rank 1 alone raised on a damaged one, and rank 0 went on
    to the next collective (exit 1 with gloo's traceback once rank 1 was gone, or a wait). Now both exit 2 with the
    same line naming rank 1's file."""
    procs, outs = two_ranks("grpo.py", "--run-dir", str(tmp_path), *SMALL, "--num-steps", "1")
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    rng_file = os.path.join(tmp_path, "checkpoints", "step_000001", "rng_rank1.json")
    with open(rng_file, "w") as f:
        json.dump({"python": [3]}, f)  # JSON (a file that is not is refused earlier, by every rank), not a state
    procs, outs = two_ranks("grpo.py", "--run-dir", str(tmp_path), *SMALL, "--num-steps", "2", "--resume", "latest")
    assert [p.returncode for p in procs] == [2, 2], outs[0][1][-3000:] + outs[1][1][-3000:]
    lines = [[line for line in err.splitlines() if line.startswith("grpo.py: error:")] for _, err in outs]
    assert lines[0] == lines[1] and len(lines[0]) == 1, lines
    assert f"{rng_file} is damaged: not a random state" in lines[0][0]


def test_a_full_disk_on_rank_0_stops_both_ranks_with_the_same_line(tmp_path):
    """2 ranks (gloo), rank 0's disk full while it writes model.safetensors at step 2's checkpoint. Before, rank 0
    died alone with a traceback while rank 1 waited in the all-gather of the next tensor. Now both exit 3 with the
    same one-line error naming rank 0 and the file, and step 1's checkpoint stays the newest complete one."""
    procs, outs = two_ranks("tests/fault_injection.py", "grpo.py", "save-enospc", "2", "--run-dir", str(tmp_path),
                            *SMALL, "--num-steps", "3")
    lines = []
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 3, err[-3000:]
        lines.append([line for line in err.splitlines() if line.startswith("grpo.py: error:")])
    assert lines[0] == lines[1] and len(lines[0]) == 1, lines
    assert "step 2: checkpoint" in lines[0][0] and "rank 0: OSError: [Errno 28] No space left on device" in lines[0][0]
    assert "model.safetensors" in lines[0][0] and "Traceback" not in outs[0][1] + outs[1][1]
    ckpts = os.path.join(tmp_path, "checkpoints")
    assert [os.path.basename(c) for c in list_checkpoints(ckpts)] == ["step_000001"]
    assert find_resume_dir("latest", ckpts).endswith("step_000001")
    assert not os.path.exists(os.path.join(ckpts, "step_000002"))  # only step_000002.tmp, never taken as complete


def test_resumed_log_drops_rows_after_the_checkpoint(tmp_path, capsys):
    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as f:
        for step in (0, 1, 2, 3):
            f.write(json.dumps({"step": step, "x": step}) + "\n")
        f.write('{"step": 4, "x"')  # torn by the crash
    open_metrics(path, start_step=2).close()
    with open(path) as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2]
    assert "dropped 2 rows" in capsys.readouterr().out
    open_metrics(path, start_step=0).close()  # a fresh run in the same directory keeps the old log aside
    assert os.path.getsize(path) == 0 and os.path.exists(path + ".prev")
