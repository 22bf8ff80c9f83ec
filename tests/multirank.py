"""Checks that need several ranks, run by tests/test_fsdp.py under torchrun on CPU (gloo):

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/multirank.py CHECK MODEL_DIR OUT_DIR

Each rank writes what its check returns to OUT_DIR/rank<r>.json for the test to read."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.dist import setup_distributed  # noqa: E402
from common.fsdp import iter_full_state, load_policy  # noqa: E402


class GatheredBytes(TorchDispatchMode):
    """Counts the bytes this rank puts into all-gathers (a DTensor's full_tensor() is one)."""

    def __init__(self):
        super().__init__()
        self.bytes, self.calls = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_gather" in str(func):
            self.bytes += args[0].numel() * args[0].element_size()
            self.calls += 1
        return func(*args, **(kwargs or {}))


def check_sync_bytes(path, device):
    """The weight sync gathers each tensor once, in the rollout precision."""
    model = load_policy(path, torch.float32, device, gradient_checkpointing=False)
    numel = sum(p.numel() for p in model.lm.parameters())  # a tied weight counted once
    with GatheredBytes() as mode:
        names = [name for name, _ in iter_full_state(model.lm, torch.bfloat16, device)]
    return {"bytes": mode.bytes, "calls": mode.calls, "names": names, "bf16_shard_bytes": 2 * numel / dist.get_world_size()}


if __name__ == "__main__":
    check, path, out = sys.argv[1:4]
    rank, world_size, device = setup_distributed()
    result = globals()[f"check_{check}"](path, device)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
