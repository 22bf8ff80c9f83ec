"""Determinism and exact resume of grpo.py on CPU in fp32 (the fallback sampler's stream is saved and restored)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--num-steps", "3", "--num-prompts", "8", "--group-size", "4", "--eval-every", "0", "--save-every", "1",
        "--keep-last", "0"]
KEYS = ["train/accuracy", "train/loss", "mismatch/kl_k3", "optim/grad_norm", "policy/approx_kl", "train/entropy"]


def run(run_dir, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "grpo.py", "--run-dir", run_dir, *ARGS, *extra], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "train/accuracy" in r}


def test_same_seed_same_metrics_and_resume_continues_identically(tmp_path):
    a = run(str(tmp_path / "a"))
    b = run(str(tmp_path / "b"))
    for step in (1, 2, 3):  # determinism: the same seed on the same machine
        assert [a[step][k] for k in KEYS] == [b[step][k] for k in KEYS]
    # interrupted after step 2 (its checkpoint), resumed: step 3 as in the uninterrupted run
    c_dir = str(tmp_path / "c")
    run(c_dir, "--num-steps", "2")
    c = run(c_dir, "--resume", "latest")
    assert [a[3][k] for k in KEYS] == [c[3][k] for k in KEYS]
    other = run(str(tmp_path / "d"), "--seed", "2")
    assert [a[1][k] for k in KEYS] != [other[1][k] for k in KEYS]
