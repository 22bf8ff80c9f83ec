"""Distributed setup: one process per GPU under torchrun (or one process on its own), rank-aware printing, seeding.

Every run has a process group, also a single process without torchrun (a group of one): FSDP2 and the in-process
vLLM engine (external_launcher) then take the same code path on 1 or N ranks.
"""
import gc
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (imported before any group exists: see cleanup_distributed)
from torch.distributed.device_mesh import DeviceMesh


def backend_for(cuda: bool, cpu_offload: bool) -> str:
    """The process group's backend. GPU: nccl, and gloo beside it only with cpu_offload, for the offloaded gradients'
    norm (gloo's start can fail on a cluster's wrong interface: docs/checkpoints.md, GLOO_SOCKET_IFNAME); object
    collectives run over nccl. CPU: gloo."""
    if not cuda:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def setup_distributed(cpu_offload: bool = False) -> tuple[int, int, torch.device]:
    """Initialise the process group (backend_for: nccl on GPU, with gloo for CPU tensors when cpu_offload; gloo on
    CPU). Returns (rank, world_size, device)."""
    torchrun = "RANK" in os.environ
    rank, world_size = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if torchrun else (0, 1)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # (object collectives over nccl use the current device)
        # device_id binds the nccl side to this GPU; vLLM's external_launcher only reads this group's ranks and
        # makes its own nccl and gloo groups
    else:
        device = torch.device("cpu")
    backend = backend_for(device.type == "cuda", cpu_offload)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if not torchrun:  # plain `python script.py`: a group of one on a free local port
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                kwargs.update(init_method=f"tcp://127.0.0.1:{s.getsockname()[1]}", rank=0, world_size=1)
        dist.init_process_group(backend, **kwargs)
    return rank, world_size, device


def cleanup_distributed(barrier: bool = True) -> None:
    """Destroy the process groups and free them, so that gloo's threads (gloo_tcp_loop, pt_gloo_runloop) end here.
    Call it after main() has returned: its model's FSDP states hold the group. A group that is destroyed but still
    referenced keeps its threads to the interpreter's teardown, where freeing it can abort the finished process
    ("terminate called without an active exception", torchrun exit -6). What else holds a group: DeviceMeshes that
    DTensor's caches keep (each mesh's _pg_registry), and torch.distributed.nn's functions, whose default
    `group=group.WORLD` is the default group if that module is first imported after the group exists (vLLM imports
    it): it is imported at the top of this file instead. barrier=False on an error exit, where the other ranks may
    not come."""
    if dist.is_initialized():  # (a sampler's shutdown may have destroyed it already)
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()  # main()'s model and optimizer (FSDP modules are reference cycles)
    # type(o), not isinstance: isinstance reads o.__class__, which on torch.distributed.reduce_op prints a FutureWarning
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:
        getattr(mesh, "_pg_registry", {}).clear()  # (a private attribute: getattr, for torch versions without it)
    gc.collect()


def print0(*args, **kwargs) -> None:
    """print on rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def seed_everything(seed: int) -> None:
    """The same seed on every rank, so that every rank builds the same initial weights (e.g. a value head).
    Sampling streams differ per rank: the samplers take stream_seed(seed, rank) for their own generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def stream_seed(seed: int, stream: int) -> int:
    """The seed of random stream `stream` (a rank) of a run seeded `seed`: a numpy SeedSequence of the pair, so that
    streams of runs with different seeds never coincide (with `seed + rank`, rank 1 of seed 1 drew what rank 0 of
    seed 2 drew)."""
    return int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])  # 32 bits: what every consumer takes


def reduce_stats(values: dict, op: str = "sum", device=None) -> dict:
    """Reduce a dict of floats over all ranks with one collective (op: sum, max or min), in float64."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return dict(zip(keys, t.tolist()))

