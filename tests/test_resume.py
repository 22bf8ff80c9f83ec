"""Determinism and exact resume of grpo.py on CPU in fp32 (the fallback sampler's stream is saved and restored), and
resuming on another number of ranks."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--num-steps", "3", "--num-prompts", "8", "--group-size", "4", "--eval-every", "0", "--save-every", "1",
        "--keep-last", "0"]
KEYS = ["train/accuracy", "train/loss", "mismatch/kl_k3", "optim/grad_norm", "policy/approx_kl", "train/entropy"]


def run(run_dir, *extra, output=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "grpo.py", "--run-dir", run_dir, *ARGS, *extra], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    if output is not None:
        output.append(p.stdout + p.stderr)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "train/accuracy" in r}


def test_same_seed_same_metrics_and_resume_continues_identically(tmp_path):
    """The same seed on the same machine: the same metrics at every step, in a run that stops after step 2 (--num-steps
    does not define the run: common/config.py) as in the uninterrupted one, and its resume's step 3 is that run's."""
    a = run(str(tmp_path / "a"))
    # interrupted after step 2 (its checkpoint), resumed: step 3 as in the uninterrupted run
    c_dir, logs = str(tmp_path / "c"), []
    first = run(c_dir, "--num-steps", "2", output=logs)
    assert sorted(first) == [1, 2]
    for step in (1, 2):  # determinism: a second run with the same seed
        assert [a[step][k] for k in KEYS] == [first[step][k] for k in KEYS], step
    c = run(c_dir, "--resume", "latest", output=logs)
    assert [a[3][k] for k in KEYS] == [c[3][k] for k in KEYS]
    # each save and the resume tell their size and time
    assert re.search(r"\[checkpoint\] \S+step_000002: \d+\.\d\d GB in \d+\.\d s", logs[0])
    assert re.search(r"\[resume\] from \S+step_000002 at step 2 \(optimizer and state read in \d+\.\d s\)", logs[1])
    other = run(str(tmp_path / "d"), "--seed", "2")
    assert [a[1][k] for k in KEYS] != [other[1][k] for k in KEYS]


def run_ranks(nproc, run_dir, *extra):
    if nproc == 1:
        return run(run_dir, *extra)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                        "grpo.py", "--run-dir", run_dir, *ARGS, *extra], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "train/accuracy" in r}


@pytest.mark.parametrize("saved_on,resumed_on", [(2, 1), (1, 2)])
def test_resume_on_another_number_of_ranks(tmp_path, saved_on, resumed_on):
    """Saved on 2 ranks, resumed on 1 (and the reverse): the sharded optimizer state is resharded on load (its exact
    restoration is checked in tests/test_checkpoint.py) and the run goes on. Its step 3 samples with the new number
    of ranks' streams, so its metrics are not those of the uninterrupted run."""
    run_dir = str(tmp_path / "run")
    run_ranks(saved_on, run_dir, "--num-steps", "2")
    rows = run_ranks(resumed_on, run_dir, "--resume", "latest")
    assert sorted(rows) == [1, 2, 3]
    assert all(math.isfinite(rows[3][k]) for k in KEYS)
