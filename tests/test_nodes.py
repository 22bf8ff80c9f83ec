"""Two "nodes" on one host (docs/scale.md): two torchrun launches with --nnodes 2 and one rank each, which meet through
c10d rendezvous at one address as two machines meet at their head node's. On CPU with gloo, the multi-node path for
real: the rendezvous, the shared run directory check, each node's own sampler, a checkpoint written by both and a
resume by both that repeats the uninterrupted run's next step."""
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--num-prompts", "8", "--group-size", "4", "--eval-every", "0", "--save-every", "1", "--keep-last", "0"]
KEYS = ["train/accuracy", "train/loss", "mismatch/kl_k3", "optim/grad_norm", "policy/approx_kl", "train/entropy"]


def two_nodes(run_dir: str, *extra: str) -> dict:
    """grpo.py launched as two nodes of one rank each; the metrics rows by step."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
                               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "nodes-test",
                               "--rdzv-endpoint", f"127.0.0.1:{port}", "grpo.py", "--run-dir", run_dir, *ARGS,
                               *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {r}:\n{out[-2000:]}\n{err[-3000:]}"
    assert "[setup] 2 rank(s)" in outs[0][0] + outs[1][0]  # one job of two ranks, not two jobs of one
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "train/accuracy" in r}


def test_two_nodes_train_save_and_resume(tmp_path):
    a = str(tmp_path / "a")
    uninterrupted = two_nodes(a, "--num-steps", "3")
    assert sorted(uninterrupted) == [1, 2, 3]
    step2 = os.path.join(a, "checkpoints", "step_000002")
    assert sorted(os.listdir(step2)).count("rng_rank1.json") == 1  # each node wrote its rank's state
    resumed = two_nodes(str(tmp_path / "b"), "--num-steps", "3", "--resume", step2)
    assert sorted(resumed) == [3]
    assert [uninterrupted[3][k] for k in KEYS] == [resumed[3][k] for k in KEYS]
