"""Distributed setup, rank-aware printing, seeding. Every run has a process group, a plain `python script.py` one of
one, so that FSDP2 and the in-process vLLM engine (external_launcher) take the same code path on 1 or N ranks."""
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
    """GPU: nccl (object collectives too), with gloo beside it only with cpu_offload, for the offloaded gradients' norm
    (gloo's start can fail on a cluster's wrong interface: docs/checkpoints.md, GLOO_SOCKET_IFNAME). CPU: gloo."""
    return ("cuda:nccl,cpu:gloo" if cpu_offload else "nccl") if cuda else "gloo"


def setup_distributed(cpu_offload: bool = False) -> tuple[int, int, torch.device]:
    """Initialise the process group (backend_for). Returns (rank, world_size, device)."""
    torchrun = "RANK" in os.environ
    rank, world_size = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if torchrun else (0, 1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # (object collectives over nccl use the current device)
    if not dist.is_initialized():
        # device_id binds nccl to this GPU; vLLM's external_launcher takes only this group's ranks, makes its own groups
        kwargs = {"device_id": device} if cuda else {}
        if not torchrun:  # plain `python script.py`: a group of one on a free local port
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                kwargs.update(init_method=f"tcp://127.0.0.1:{s.getsockname()[1]}", rank=0, world_size=1)
        dist.init_process_group(backend_for(cuda, cpu_offload), **kwargs)
    return rank, world_size, device


def cleanup_distributed(barrier: bool = True) -> None:
    """Destroy and free the process groups after main() returned (its model's FSDP states hold them), so that gloo's
    threads end here: a destroyed group still referenced keeps them to the teardown, where freeing it can abort the
    process ("terminate called without an active exception", torchrun exit -6). Other holders: DeviceMeshes in
    DTensor's caches, and torch.distributed.nn's default `group=group.WORLD`, bound to the group if first imported after
    it exists (vLLM imports it): hence the import at the top. barrier=False: an error exit (the others may not come)."""
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
    if not dist.is_initialized() or dist.get_rank() == 0:  # print on rank 0 only
        print(*args, **kwargs, flush=True)


def seed_everything(seed: int) -> None:
    """The same on every rank, which builds the same initial weights (e.g. a value head); samplers use stream_seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def stream_seed(seed: int, stream: int) -> int:
    """The seed of stream `stream` (a rank) of a run seeded `seed`: a SeedSequence of the pair, so that streams of runs
    with other seeds never coincide (with `seed + rank`, rank 1 of seed 1 drew what rank 0 of seed 2 drew)."""
    return int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])  # 32 bits: what every consumer takes


def agree_on_error(error: str | None, exc: type[Exception] = ValueError) -> None:
    """Collective where a process group of several ranks exists: the first failing rank's error raised as `exc` on
    every rank, so that all stop with the same line and none waits in a collective the failing one never joins."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise exc(error)


def reduce_stats(values: dict, op: str = "sum", device=None) -> dict:
    """Reduce a dict of floats over all ranks with one collective (op: sum, max or min), in float64."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return dict(zip(keys, t.tolist()))
