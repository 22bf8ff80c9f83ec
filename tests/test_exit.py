"""The scripts' exit under torchrun (2 ranks, gloo on CPU): once a script's `__main__` is done, no gloo thread is left
(tests/exit_check.py lists them). A thread left belongs to a process group destroyed but still referenced (FSDP2's
model, DeviceMeshes in DTensor's caches, torch.distributed.nn's default arguments, a frame pinned by an import error
that vLLM keeps); freeing it at the interpreter's teardown aborted finished runs now and then ("terminate called
without an active exception", torchrun exit -6). The check does not depend on that race: the threads are counted."""
import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import SCRIPTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-steps", "1", "--num-prompts", "4", "--group-size", "2", "--eval-every", "0", "--eval-k", "1",
        "--eval-max-problems", "1", "--save-every", "0"]


def threads_left(tmp_path, script, extra=(), code=0, before=()):
    """The gloo threads alive on each rank after `script` ran its __main__ on 2 ranks, which exited with `code`
    (`before`: the arguments before the script's own, for tests/fault_injection.py)."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "tests/exit_check.py", str(out), script, *before, "--run-dir", str(tmp_path / "run"), *TINY,
                        *extra],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ranks = [json.load(open(out / f"rank{r}.json")) for r in range(2)]
    assert [r["code"] for r in ranks] == [code, code], p.stderr[-3000:]
    return [r["gloo_threads"] for r in ranks]


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_gloo_thread_left_at_exit(tmp_path, script):
    assert threads_left(tmp_path, script) == [[], []]  # before the fix: gloo_tcp_loop and 2 pt_gloo_runloop


def test_no_gloo_thread_left_after_an_error_exit(tmp_path):
    """A training fault on both ranks (fp32, a NaN loss at step 1): exit code 3, and the group is freed on that path
    too. Before, it was freed only after main() returned: an error exit left the threads, and a full disk's exit
    aborted now and then (test_faults.py's full-disk test, -6 instead of 3)."""
    fault = ["grpo.py", "nan", "1"]
    assert threads_left(tmp_path, "tests/fault_injection.py", ["--precision", "fp32"], code=3, before=fault) == [[], []]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_no_gloo_thread_or_shared_memory_left_with_vllm(tmp_path):
    """--vllm-tp 2: vLLM's groups, our TP group and vLLM's CPU shared memory (/dev/shm/*cpushm*, released by
    destructors that a process ending through os._exit skips) are all gone."""
    before = set(glob.glob("/dev/shm/*cpushm*"))
    assert threads_left(tmp_path, "grpo.py", ["--sampler", "vllm", "--vllm-tp", "2",
                                              "--vllm-gpu-memory-utilization", "0.15"]) == [[], []]
    assert set(glob.glob("/dev/shm/*cpushm*")) <= before
