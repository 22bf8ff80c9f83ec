"""tests/conftest.py's units of work under pytest-xdist: every test that starts a vLLM engine is in the one unit of
them all (no two engines at once), and a test that needs vLLM outside that unit is refused at collection."""
import pytest

import conftest


def test_vllm_unit_holds_whole_files_and_single_tests():
    assert conftest.in_vllm_unit("tests/test_vllm.py::test_greedy[1]")
    assert conftest.in_vllm_unit("tests/test_exit.py::test_no_gloo_thread_or_shared_memory_left_with_vllm")
    assert not conftest.in_vllm_unit("tests/test_exit.py::test_no_gloo_thread_left_at_exit[ppo.py]")
    assert not conftest.in_vllm_unit("tests/test_vllm_like.py::test_x")


class Item:
    def __init__(self, nodeid: str, reason: str | None):
        self.nodeid, self.reason = nodeid, reason

    def iter_markers(self, name: str):
        assert name == "skipif"
        return [pytest.mark.skipif(True, reason=self.reason).mark] if self.reason else []


def test_a_test_needing_vllm_outside_the_unit_is_refused():
    ok = [Item("tests/test_vllm.py::test_a", conftest.NEEDS_VLLM), Item("tests/test_data.py::test_b", None),
          Item("tests/test_data.py::test_c", "needs a CUDA GPU")]
    conftest.pytest_collection_modifyitems(None, ok)
    with pytest.raises(pytest.UsageError, match="tests/test_data.py::test_new"):
        conftest.pytest_collection_modifyitems(None, ok + [Item("tests/test_data.py::test_new", conftest.NEEDS_VLLM)])
