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


def check_load(path, device):
    """The sharded load equals from_pretrained, tensor by tensor (uneven shards included), and ties what it ties."""
    from transformers import AutoModelForCausalLM
    model = load_policy(path, torch.float32, device, gradient_checkpointing=True)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    full = dict(iter_full_state(model.lm))
    return {"names": sorted(full), "ref_names": sorted(ref), "equal": all(torch.equal(full[k], ref[k]) for k in full),
            "tied": model.lm.lm_head.weight is model.lm.model.embed_tokens.weight}


def check_load_memory(path, device):
    """Peak host memory (max RSS) that loading the policy adds on this rank."""
    import resource
    import gc
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = load_policy(path, torch.float32, device, gradient_checkpointing=True)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_added": after - before, "fp32_bytes": 4 * sum(p.numel() for p in model.parameters())}


def optimizer_summary(model, optimizer):
    """Per parameter (by name): the sums of its full weight, its AdamW moments and its step count."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).double().sum().item()
               for n, p in model.named_parameters()}
    return {n: [weights[n], st["exp_avg"].double().sum().item(), st["exp_avg_sq"].double().sum().item(),
                float(st["step"])] for n, st in osd["state"].items()}


def check_save(path, device, cpu_offload=False):
    """One AdamW step on a fixed batch, then a checkpoint in path/checkpoints; returns the state it saved."""
    from transformers import AutoTokenizer
    from common.checkpoint import rng_state, save_checkpoint
    from common.logprobs import collate
    model = load_policy(path, torch.float32, device, gradient_checkpointing=False, cpu_offload=cpu_offload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, attn, rmask = collate([[4, 5, 13, 6, 14], [7, 14]], [[5, 6, 7, 1], [8, 9]], 0, device)
    logp, _ = model(ids, attn, rmask, 1.0, 16)
    (-logp.sum()).backward()
    optimizer.step()
    save_checkpoint(os.path.join(path, "checkpoints"), 1, AutoTokenizer.from_pretrained(path),
                    {"": (model, optimizer, {"scaler": {}})}, rng_state(), keep_last=0)
    return optimizer_summary(model, optimizer)


def check_resume(path, device, cpu_offload=False):
    """The state a run resumed from checkpoint `path` holds (on this many ranks)."""
    from common.checkpoint import load_training_state
    model = load_policy(path, torch.float32, device, gradient_checkpointing=False, cpu_offload=cpu_offload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state, _ = load_training_state(path, model, optimizer)
    assert state["step"] == 1
    return optimizer_summary(model, optimizer)


def check_save_faults(path, device):
    """Saves in which one rank's write fails with ENOSPC (a full disk), one after the other in one process group:
    rank 0 writing model.safetensors, rank 1 its RNG file, rank 1 its DCP shard, rank 0 the rename into place. Each
    save must raise the same CheckpointError on every rank (no rank left waiting in a collective: this check would
    hang, or a rank would die with another error, and torchrun fail), and the group must still work: a last save
    succeeds."""
    import contextlib
    import errno
    import torch.distributed.checkpoint.filesystem as dcp_fs
    from transformers import AutoTokenizer
    import common.checkpoint as ck
    model = load_policy(path, torch.float32, device, gradient_checkpointing=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # (an AdamW state to save)
    tokenizer, root, rank = AutoTokenizer.from_pretrained(path), os.path.join(path, "checkpoints"), dist.get_rank()

    def full(name):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)

    write_safetensors, write_json, replace = ck.write_safetensors, ck.write_json, os.replace
    create_stream = dcp_fs.FileSystem.create_stream

    def safetensors_fills_the_disk(file, entries, tensors, *a, **k):
        def first_then_full():  # the first tensor fits, then the disk is full
            yield next(tensors)
            raise full(file)
        return write_safetensors(file, entries, first_then_full(), *a, **k)

    def rng_fills_the_disk(file, obj, *a, **k):
        if "rng_rank" in file:
            raise full(file)
        return write_json(file, obj, *a, **k)

    @contextlib.contextmanager
    def shard_fills_the_disk(self, file, mode):
        if str(file).endswith(".distcp"):
            raise full(str(file))
        with create_stream(self, file, mode) as stream:
            yield stream

    def rename_fails(src, dst):
        if str(src).endswith(".tmp"):  # the checkpoint's rename into place, not another file's
            raise full(dst)
        return replace(src, dst)

    faults = [(0, ck, "write_safetensors", safetensors_fills_the_disk), (1, ck, "write_json", rng_fills_the_disk),
              (1, dcp_fs.FileSystem, "create_stream", shard_fills_the_disk), (0, os, "replace", rename_fails)]
    errors = []
    for step, (faulty_rank, where, name, fault) in enumerate(faults, start=1):
        original = getattr(where, name)
        if rank == faulty_rank:
            setattr(where, name, fault)
        try:
            ck.save_checkpoint(root, step, tokenizer, {"": (model, optimizer, {"scaler": {}})}, ck.rng_state())
            errors.append(None)
        except ck.CheckpointError as e:
            errors.append(str(e))
        finally:
            setattr(where, name, original)
    ck.save_checkpoint(root, len(faults) + 1, tokenizer, {"": (model, optimizer, {"scaler": {}})}, ck.rng_state())
    return {"errors": errors, "checkpoints": [os.path.basename(c) for c in ck.list_checkpoints(root)],
            "entries": sorted(os.listdir(root))}


def check_save_offload(path, device):
    return check_save(path, device, cpu_offload=True)


def check_resume_offload(path, device):
    return check_resume(path, device, cpu_offload=True)


def offloaded(model):
    """(FSDP2 parameters set to offload to the CPU, all FSDP2 parameters)."""
    from torch.distributed.fsdp import FSDPModule
    flags = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()  # (older torch: one parameter group, not a list)
            groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
            flags += [fp.offload_to_cpu for group in groups if group is not None for fp in group.fsdp_params]
    return sum(flags), len(flags)


def check_offload_step(path, device):
    """One training step as the scripts take it (forward, backward, LossScaler.step: clip_grad_norm_ and AdamW), from
    the same weights on the same batch, without and with cpu_offload: the loss, the log-probs, the gradient norm and
    the weights after the step of each, and where the offloaded model keeps its shards, gradients and AdamW states."""
    from common.logprobs import collate
    from common.precision import LossScaler
    ids, attn, rmask = collate([[4, 5, 13, 6, 14], [7, 14]], [[5, 6, 7, 1], [8, 9]], 0, device)
    local_devices = lambda ts: sorted({t.to_local().device.type for t in ts})
    runs = []
    for cpu_offload in (False, True):
        model = load_policy(path, torch.float32, device, gradient_checkpointing=True, cpu_offload=cpu_offload)
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        model.train()
        logp, _ = model(ids, attn, rmask, 1.0, 16)
        loss = -(logp * rmask).sum() / rmask.sum()
        loss.backward()
        grad_devices = local_devices(p.grad for p in params)
        norm, skipped = LossScaler(enabled=False).step(params, optimizer, max_grad_norm=0.5)
        assert not skipped
        runs.append({"loss": loss.item(), "logp": logp.detach(), "norm": norm, "offloaded": offloaded(model),
                     "weights": {n: t.clone() for n, t in iter_full_state(model.lm, torch.float32, device)},
                     "devices": {"grads": grad_devices, "params": local_devices(params),
                                 "adamw": local_devices(t for st in optimizer.state.values() for t in st.values()
                                                        if hasattr(t, "to_local"))}})
    plain, off = runs
    from safetensors.torch import load_file
    initial = load_file(os.path.join(path, "model.safetensors"))
    max_diff = lambda a, b: max((a[n] - b[n]).abs().max().item() for n in b)
    return {"loss": [plain["loss"], off["loss"]], "norm": [plain["norm"], off["norm"]],
            "logp_equal": torch.equal(plain["logp"], off["logp"]),
            "weights_max_diff": max_diff(plain["weights"], off["weights"]),
            "weights_moved": min((plain["weights"][n] - w).abs().max().item() for n, w in initial.items()),
            "offloaded": [plain["offloaded"], off["offloaded"]], "devices_offload": off["devices"]}


def check_shared_dir(path, device):
    """Each rank gives its own directory (as node-local run directories would be): refused on every rank."""
    from common.preflight import check_shared_dir
    check_shared_dir(path, device)  # one directory: fine
    try:
        check_shared_dir(os.path.join(path, f"node{dist.get_rank()}"), device)
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


if __name__ == "__main__":
    check, path, out = sys.argv[1:4]
    rank, world_size, device = setup_distributed()
    result = globals()[f"check_{check}"](path, device)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    # End here, without Python's finalization: after FSDP2 has run, gloo's threads (gloo_tcp_loop and two
    # pt_gloo_runloop) outlive destroy_process_group (DeviceMesh caches keep the group referenced), and destroying them
    # while the interpreter shuts down can call std::terminate ("terminate called without an active exception",
    # torchrun exit -6), on some machines 1 run in 3-8. The results are written and flushed above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
