"""Checkpoints, written by every rank and readable by any number of ranks: a Hugging Face model directory (fp32
model.safetensors, streamed by rank 0), optimizer/ (DCP shards, resharded on load), trainer_state.json and
rng_rank{r}.json. What each file holds, the phases of a save, resuming from an older step: docs/checkpoints.md.
"""
import json
import math
import os
import random
import re
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from tqdm import tqdm

from common.fsdp import full_state_names, iter_full_state
from common.precision import TrainingFault

STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state(generator: torch.Generator | None = None) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if generator is not None:
        state["sampler"] = generator.get_state()
    return state


def set_rng_state(state: dict, generator: torch.Generator | None = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if generator is not None and "sampler" in state:
        generator.set_state(state["sampler"])


def rng_to_json(state: dict) -> dict:
    """An rng_state() as plain JSON (numbers and lists): a checkpoint's RNG file is then read without unpickling,
    i.e. without running code a shared checkpoint could carry. (Python's state, tuples of ints, is JSON as it is.)"""
    out = {key: value.tolist() if torch.is_tensor(value) else value for key, value in state.items()}
    if "numpy" in state:
        name, keys, *rest = state["numpy"]
        out["numpy"] = [name, keys.tolist(), *rest]
    return out


def rng_from_json(data: dict) -> dict:
    """The inverse of rng_to_json."""
    out = {}
    for key, value in data.items():
        if key == "python":
            out[key] = (value[0], tuple(value[1]), value[2])
        elif key == "numpy":
            out[key] = (value[0], np.array(value[1], dtype=np.uint32), *value[2:])
        else:
            out[key] = torch.tensor(value, dtype=torch.uint8)
    return out


class CheckpointError(TrainingFault):
    """A checkpoint that could not be written (a full disk, a lost mount): the run stops (exit 3), every rank with the
    same line, and the previous checkpoint stays the newest complete one."""


def save_checkpoint(ckpt_root: str, step: int, tokenizer, parts: dict, rank_state: dict, keep_last: int = 0) -> str:
    """Collective: every rank calls it. parts: {folder in the checkpoint ("" for its root): (model, optimizer or None,
    trainer_state dict)}, `model` an FSDP root whose `lm` is the Hugging Face model (the policy at the root, ppo.py's
    critic in critic/). After each phase all ranks agree on success (agree_on_failure); keep_last: prune to the newest
    keep_last, counting this one, after the durable rename. The phases and what a failure leaves:
    docs/checkpoints.md."""
    rank = dist.get_rank()
    final = os.path.join(ckpt_root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    what = f"step {step}: checkpoint {final} not saved"
    try:  # 1. every rank: the directories (none writes into one it has not seen made) and its RNG streams
        for folder in parts:
            os.makedirs(os.path.join(tmp, folder), exist_ok=True)
        write_json(os.path.join(tmp, f"rng_rank{rank}.json"), rng_to_json(rank_state))
        error = None
    except Exception as e:
        error = error_line(e)
    agree_on_failure(error, what)
    for folder, (model, optimizer, trainer_state) in parts.items():
        if optimizer is not None:  # 2. each rank writes its shard of the AdamW state (DCP fsyncs its files)
            error = None
            try:
                dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
                         checkpoint_id=os.path.join(tmp, folder, "optimizer"))
            except CheckpointException as e:  # DCP gathers every rank's failure and raises it on every rank
                error = first_failure(e)
            except Exception as e:
                error = error_line(e)
            agree_on_failure(error, what)
        # 3. the weights, fp32, gathered one tensor at a time and written by rank 0 as they come (a tied lm_head is
        # stored once, as the embedding: what from_pretrained and vLLM expect)
        lm, out = model.lm, os.path.join(tmp, folder)
        entries = full_state_names(lm)
        tensors = iter_full_state(lm, torch.float32, torch.device("cpu"), aliases=False)
        error = None
        if rank == 0:
            try:
                write_safetensors(os.path.join(out, "model.safetensors"), entries, tensors)
                lm.config.save_pretrained(out)
                if lm.generation_config is not None:
                    lm.generation_config.save_pretrained(out)
                tokenizer.save_pretrained(out)
                write_json(os.path.join(out, "trainer_state.json"), {"step": step, **trainer_state}, indent=2)
            except Exception as e:
                error = error_line(e)
        for _ in tensors:  # the gathers are collectives: every rank takes part in all of them, rank 0 after a failure
            pass
        agree_on_failure(error, what)
    error = None
    if rank == 0:  # 4. into place, durably, then prune
        try:
            fsync_tree(tmp)  # every rank's files and the directories, before the rename makes them a checkpoint
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            fsync_dir(ckpt_root)  # the rename itself survives a crash
        except Exception as e:
            error = error_line(e)
        if error is None and keep_last > 0:
            older = [c for c in list_checkpoints(ckpt_root) if checkpoint_step(c) < step]
            for old in older[:max(len(older) - (keep_last - 1), 0)]:
                shutil.rmtree(old, ignore_errors=True)
    agree_on_failure(error, what)
    return final


def error_line(e: BaseException, rank: int | None = None) -> str:
    """`rank r: Type: first line of the message` (r: this rank unless given)."""
    text = str(e).strip().splitlines()
    rank = dist.get_rank() if rank is None else rank
    return f"rank {rank}: {type(e).__name__}: {text[0] if text else ''}"


def agree_on_failure(error: str | None, what: str) -> None:
    """Collective: every rank gives its error line of a phase (None: it succeeded). When any rank failed, every rank
    raises CheckpointError with the same line (the first failing rank's, and how many others failed), so that no rank
    goes on to a collective that a failed rank will never join."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e is not None]
    if failed:
        others = f" (and {len(failed) - 1} other rank{'s' if len(failed) > 2 else ''})" if len(failed) > 1 else ""
        raise CheckpointError(f"{what}: {failed[0]}{others}")


def write_json(path: str, obj, indent: int | None = None) -> None:
    """A JSON file, fsynced: on disk when this returns."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    """fsync a file or directory (a directory's entries, files created, renamed or removed in it, then survive a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and directory under path (path included), each directory after its contents."""
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            fsync_dir(os.path.join(dirpath, name))
        fsync_dir(dirpath)


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_safetensors(path: str, entries: list[tuple[str, tuple, torch.dtype]], tensors, progress=None,
                      progress_min_bytes: int = 2**30) -> None:
    """A safetensors file written one tensor at a time: the header (names, dtypes, shapes, byte offsets) first, from
    `entries`, then each tensor of the iterator `tensors` ((name, tensor) in the same order) as it comes.
    progress(bytes_written, total_bytes), when given, is called after each tensor; without it a file of
    progress_min_bytes or more shows a byte-count bar (a 1.5B model's fp32 weights are 6 GB: minutes of gathering
    and writing that would otherwise look like a hang)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    bar = tqdm(total=offset, unit="B", unit_scale=True, desc=f"[checkpoint] {os.path.basename(path)}", leave=False,
               mininterval=5.0, disable=progress is not None or offset < progress_min_bytes)  # (only rank 0 writes)
    written = 0
    with open(path, "wb") as f, bar:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for (name, shape, dtype), (got, t) in zip(entries, tensors, strict=True):
            if got != name or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise RuntimeError(f"write_safetensors: expected {name} {shape} {dtype}, got {got} {tuple(t.shape)} {t.dtype}")
            f.write(t.contiguous().view(torch.uint8).numpy().data)
            written += t.numel() * t.element_size()
            if progress is not None:
                progress(written, offset)
            bar.update(t.numel() * t.element_size())


def list_checkpoints(ckpt_root: str) -> list[str]:
    """Complete checkpoints, oldest first."""
    if not os.path.isdir(ckpt_root):
        return []
    steps = sorted((int(m.group(1)), d) for d in os.listdir(ckpt_root) if (m := STEP_DIR.match(d)))
    return [os.path.join(ckpt_root, d) for _, d in steps]


def checkpoint_step(path: str) -> int:
    return int(STEP_DIR.match(os.path.basename(path)).group(1))


def set_aside_newer(ckpt_root: str, step: int) -> str | None:
    """Collective. Move the checkpoints of steps after `step` into ckpt_root/abandoned_<time>/ (never deleted):
    a resume from an older checkpoint starts a new line of steps (docs/checkpoints.md). Returns that directory (None
    when there was nothing to move); raises ValueError, on every rank, when the move fails."""
    moved, error = None, None
    if dist.get_rank() == 0:
        newer = [c for c in list_checkpoints(ckpt_root) if checkpoint_step(c) > step]
        if newer:
            try:
                moved = base = os.path.join(ckpt_root, "abandoned_" + time.strftime("%Y%m%d-%H%M%S"))
                n = 1
                while os.path.lexists(moved):  # (a second resume within the same second)
                    n += 1
                    moved = f"{base}_{n}"
                os.makedirs(moved)
                for c in newer:
                    os.replace(c, os.path.join(moved, os.path.basename(c)))
                fsync_dir(moved)
                fsync_dir(ckpt_root)
                print(f"[resume] {ckpt_root} held checkpoints after step {step} "
                      f"({', '.join(str(checkpoint_step(c)) for c in newer)}), of the run's line this resume leaves: "
                      f"moved into {moved} (not deleted; --resume latest and --keep-last now see this line only)",
                      flush=True)
            except OSError as e:
                error = f"--resume: cannot move the checkpoints after step {step} aside in {ckpt_root}: {e}"
    if dist.get_world_size() > 1:  # every rank stops with the same line, or none does
        shared = [error, moved]
        dist.broadcast_object_list(shared, src=0)
        error, moved = shared
    if error:
        raise ValueError(error)
    return moved


def find_resume_dir(resume: str, ckpt_root: str) -> str:
    path = resume
    if resume == "latest":
        found = list_checkpoints(ckpt_root)
        if not found:
            raise FileNotFoundError(f"--resume latest: no checkpoint in {ckpt_root}")
        path = found[-1]
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise FileNotFoundError(f"--resume {resume!r}: {path} is not a complete checkpoint (no trainer_state.json)")
    return path


def first_failure(e: CheckpointException) -> str:
    """The first line of the first failing rank's error, out of DCP's exception (which gathers every rank's)."""
    for rank, (err, _traceback) in sorted(e.failures.items()):
        return error_line(err, rank)
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def load_training_state(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """Optimizer state (each rank reads the parts of the DCP shards it now holds: any number of ranks),
    trainer_state.json and this rank's RNG state (empty when the checkpoint was written by fewer ranks). The weights
    come from loading `path` as the model directory."""
    rank = dist.get_rank()
    if optimizer is not None:
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # the layout this run holds (zeros)
        try:
            dcp.load(state, checkpoint_id=os.path.join(path, "optimizer"))
        except CheckpointException as e:  # a BaseException, whose message holds every rank's traceback: one line
            raise ValueError(f"--resume {path}: its optimizer state does not fit this model and optimizer "
                             f"({first_failure(e)})") from e
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    with open(os.path.join(path, "trainer_state.json")) as f:
        trainer_state = json.load(f)
    rng_file = os.path.join(path, f"rng_rank{rank}.json")
    rank_state = {}
    if os.path.exists(rng_file):
        with open(rng_file) as f:
            rank_state = rng_from_json(json.load(f))
    elif rank == 0 and os.path.exists(os.path.join(path, f"rng_rank{rank}.pt")):  # (written by an older version)
        print(f"[resume] {path}: rng_rank*.pt not read (a pickle: loading it could run code); the random streams "
              "start afresh", flush=True)
    return trainer_state, rank_state
