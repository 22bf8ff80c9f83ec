"""common/dist.py: which backends the process group gets. gloo (which connects every pair of ranks at start over the
interface the hostname resolves to) only where CPU tensors take part in collectives: on a CPU, and on GPUs with
--cpu-offload; and how a script ends its process."""
import importlib
import os

import pytest

from common.dist import backend_for


def test_backend_gloo_only_where_cpu_tensors_are_reduced():
    assert backend_for(cuda=True, cpu_offload=False) == "nccl"
    assert backend_for(cuda=True, cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert backend_for(cuda=False, cpu_offload=False) == backend_for(cuda=False, cpu_offload=True) == "gloo"


class Stop(Exception):
    pass


@pytest.mark.parametrize("script", ["grpo", "pg_is", "gspo", "ppo"])
@pytest.mark.parametrize("offload", [False, True])
def test_scripts_ask_for_gloo_only_with_cpu_offload(monkeypatch, script, offload):
    """Each script passes --cpu-offload to setup_distributed (stopped there: nothing is loaded)."""
    module = importlib.import_module(script)
    seen = []

    def fake_setup(cpu_offload=False):
        seen.append(cpu_offload)
        raise Stop
    monkeypatch.setattr(module, "setup_distributed", fake_setup)
    with pytest.raises(Stop):
        module.main(module.parse_args(["--cpu-offload"] if offload else []))
    assert seen == [offload]


def test_exit_process_runs_atexit_handlers_and_keeps_the_code():
    """exit_process skips the interpreter's teardown (where gloo's leftover threads can abort) but not the atexit
    handlers (the reward workers are killed there) nor buffered output."""
    import subprocess
    import sys
    code = ("import atexit, sys; from common.dist import exit_process; "
            "atexit.register(lambda: print('atexit ran', flush=True)); sys.stdout.write('buffered '); exit_process(3)")
    p = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    assert p.stdout == "buffered atexit ran\n", p.stdout
