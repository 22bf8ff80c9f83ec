"""common/dist.py: which backends the process group gets. gloo (which connects every pair of ranks at start over the
interface the hostname resolves to) only where CPU tensors take part in collectives: on a CPU, and on GPUs with
--cpu-offload."""
import importlib

import pytest

from common.dist import backend_for
from conftest import SCRIPTS


def test_backend_gloo_only_where_cpu_tensors_are_reduced():
    assert backend_for(cuda=True, cpu_offload=False) == "nccl"
    assert backend_for(cuda=True, cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert backend_for(cuda=False, cpu_offload=False) == backend_for(cuda=False, cpu_offload=True) == "gloo"


class Stop(Exception):
    pass


@pytest.mark.parametrize("script", [s.removesuffix(".py") for s in SCRIPTS])
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
