"""Checkpoints, written by every rank and readable by any number of ranks (the optimizer's DCP shards resharded on
load): what each file holds, the phases of a save, resuming from an older step: docs/checkpoints.md."""
import contextlib
import dataclasses
import enum
import importlib
import itertools
import json
import math
import os
import pickle
import random
import re
import shutil

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from tqdm import tqdm

from common.dist import agree_on_error
from common.exits import SigintDeferred
from common.fsdp import full_state_names, iter_full_state
from common.preflight import check_model_dir, not_json
from common.precision import TrainingFault

STEP_DIR = re.compile(r"^step_(\d+)$")
INTERRUPTED = "KeyboardInterrupt"  # a phase's "error" when it was interrupted: every rank then raises KeyboardInterrupt
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def rng_state(generator: torch.Generator | None = None) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    state |= {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}
    state |= {"sampler": generator.get_state()} if generator is not None else {}
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
    """An rng_state() as plain JSON, so that a checkpoint's RNG file is read without unpickling (no code it runs)."""
    return {k: [v[0], v[1].tolist(), *v[2:]] if k == "numpy" else v.tolist() if torch.is_tensor(v) else v
            for k, v in state.items()}  # (Python's state, tuples of ints, is JSON as it is)


def rng_from_json(data: dict) -> dict:  # (rng_to_json's inverse)
    return {k: (v[0], tuple(v[1]), v[2]) if k == "python" else (v[0], np.array(v[1], dtype=np.uint32), *v[2:])
            if k == "numpy" else torch.tensor(v, dtype=torch.uint8) for k, v in data.items()}


class CheckpointError(TrainingFault):
    """A checkpoint not written (a full disk, a lost mount): every rank stops with the same line (exit 3)."""


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that would run code if PyTorch loaded it as it does (a pickle naming other globals)."""


def save_checkpoint(ckpt_root: str, step: int, tokenizer, parts: dict, rank_state: dict, keep_last: int = 0) -> str:
    """Collective. parts: {folder ("" for the root): (model, optimizer or None, trainer_state dict)}, model.lm the HF
    model; keep_last: prune to the newest keep_last, this one counted. Phases, failures, Ctrl-C: docs/checkpoints.md."""
    with SigintDeferred() as sigint:  # a Ctrl-C is held to the end of the phase: the previous checkpoint stays intact
        rank, final = dist.get_rank(), os.path.join(ckpt_root, f"step_{step:06d}")
        tmp = final + ".tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()  # no rank writes into tmp before rank 0 has cleared it

        def agree(error: str | None) -> None:  # after each phase: no rank goes on to a collective a failed one skips
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, (error, sigint.pending or error == INTERRUPTED))
            if any(stop for _, stop in reports):
                raise KeyboardInterrupt
            if failed := [e for e, _ in reports if e is not None]:  # the same line on every rank: the first failure
                others = f" (and {len(failed) - 1} other rank{'s' if len(failed) > 2 else ''})" if failed[1:] else ""
                raise CheckpointError(f"step {step}: checkpoint {final} not saved: {failed[0]}{others}")

        def phase1():  # every rank: the directories (none writes into one it has not seen made) and its RNG streams
            for folder in parts:
                os.makedirs(os.path.join(tmp, folder), exist_ok=True)
            write_json(os.path.join(tmp, f"rng_rank{rank}.json"), rng_to_json(rank_state))
        agree(attempt(phase1, tmp))
        for folder, (model, optimizer, trainer_state) in parts.items():
            out, lm = os.path.join(tmp, folder), model.lm
            if optimizer is not None:  # 2. each rank writes its shard of the AdamW state (DCP fsyncs its files)
                agree(attempt(lambda: dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
                                               checkpoint_id=os.path.join(out, "optimizer")), tmp))
            # 3. rank 0 writes the fp32 weights as they are gathered (a tied lm_head once, as HF and vLLM expect)
            entries = full_state_names(lm)
            tensors = iter_full_state(lm, torch.float32, torch.device("cpu"), aliases=False)

            def phase3():  # a Ctrl-C stops rank 0's writing (takewhile); the gathers of `tensors` go on below
                write_safetensors(os.path.join(out, "model.safetensors"), entries,
                                  itertools.takewhile(lambda _: not sigint.pending, tensors))
                lm.config.save_pretrained(out)
                if lm.generation_config is not None:
                    lm.generation_config.save_pretrained(out)
                tokenizer.save_pretrained(out)
                arrays = {k: v for k, v in trainer_state.items()  # tensors (ppo.py's value head): <k>.safetensors
                          if isinstance(v, dict) and v and all(isinstance(t, torch.Tensor) for t in v.values())}
                for name, tensor_state in arrays.items():
                    safetensors.torch.save_file(tensor_state, os.path.join(out, f"{name}.safetensors"))
                write_json(os.path.join(out, "trainer_state.json"),
                           {"step": step, **{k: v for k, v in trainer_state.items() if k not in arrays}}, indent=2)
            error = attempt(phase3, tmp) if rank == 0 else None
            while True:  # the gathers are collectives: every rank takes part in all of them, rank 0 after a failure too
                try:
                    for _ in tensors:
                        pass
                    break
                except KeyboardInterrupt:  # raised between two gathers (signals run between bytecodes): go on
                    error = error or INTERRUPTED
            agree(error)

        def phase4():  # all on disk before the rename makes it a checkpoint, then the rename itself, then prune
            for dirpath, _dirnames, filenames in os.walk(tmp, topdown=False):  # (each directory after its contents)
                for path in [os.path.join(dirpath, name) for name in filenames] + [dirpath]:
                    fsync_dir(path)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            fsync_dir(ckpt_root)  # the rename itself survives a crash
            if keep_last > 0:
                older = [c for c in list_checkpoints(ckpt_root) if checkpoint_step(c) < step]
                for old in older[:max(len(older) - (keep_last - 1), 0)]:
                    shutil.rmtree(old, ignore_errors=True)
        agree(attempt(phase4, tmp) if rank == 0 else None)
    return final


def attempt(fn, where: str) -> str | None:
    """fn(); None, or its error line."""
    try:
        fn()
    except (Exception, KeyboardInterrupt, CheckpointException) as e:  # noqa: BLE001 (DCP's: a BaseException)
        return error_line(e, where)
    return None


def error_line(e: BaseException, where: str | None = None) -> str:
    """`rank r: Type: first line` (of DCP's first failing rank), or INTERRUPTED for a Ctrl-C (that DCP caught too)."""
    failures = sorted(e.failures.items()) if isinstance(e, CheckpointException) else []  # [(rank, (error, traceback))]
    if isinstance(e, KeyboardInterrupt) or any(isinstance(err, KeyboardInterrupt) for _, (err, _tb) in failures):
        return INTERRUPTED
    rank, (e, _traceback) = failures[0] if failures else (dist.get_rank(), (e, None))
    text = str(e).strip().splitlines()
    line = f"rank {rank}: {type(e).__name__}: {text[0] if text else ''}"
    # torch.save turns the ENOSPC of a short write into `unexpected pos A vs B` (DCP drops the OSError behind it)
    return line + (f" (a write into {where} fell short: is its disk full?)" if "unexpected pos" in line else "")


def write_json(path: str, obj, indent: int | None = None) -> None:
    """A JSON file, fsynced: on disk when this returns."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    """fsync a file, or a directory: its entries (files created, renamed or removed in it) then survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: str, entries: list[tuple[str, tuple, torch.dtype]], tensors, progress=None,
                      progress_min_bytes: int = 2**30) -> None:
    """A safetensors file: the header from `entries` (name, shape, dtype), then each (name, tensor) of `tensors` as it
    comes. progress(written, total) after each, else a bar from progress_min_bytes (6 GB would look like a hang)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    bar = tqdm(total=offset, unit="B", unit_scale=True, desc=f"[checkpoint] {os.path.basename(path)}", leave=False,
               mininterval=5.0, disable=progress is not None or offset < progress_min_bytes)  # (only rank 0 writes)
    progress = progress or (lambda written, _total: bar.update(written - bar.n))
    with open(path, "wb") as f, bar:
        f.write(len(text).to_bytes(8, "little") + text)
        for (name, shape, dtype), (got, t) in zip(entries, tensors, strict=True):
            if got != name or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise RuntimeError(f"write_safetensors: expected {name} {shape} {dtype}, "
                                   f"got {got} {tuple(t.shape)} {t.dtype}")
            f.write(t.contiguous().view(torch.uint8).numpy().data)
            progress(header[name]["data_offsets"][1], offset)


def list_checkpoints(ckpt_root: str) -> list[str]:
    """Complete checkpoints, oldest first."""
    names = os.listdir(ckpt_root) if os.path.isdir(ckpt_root) else []
    return sorted((os.path.join(ckpt_root, d) for d in names if STEP_DIR.match(d)), key=checkpoint_step)


def checkpoint_step(path: str) -> int:
    return int(STEP_DIR.match(os.path.basename(path)).group(1))


# The files of our checkpoints (rng_rank{r}.pt, an older version's, is never read); any other is refused before
# anything is read: torch may load a file we never write and run its pickle (CheckedReader: __<rank>.metadata).
CHECKPOINT_FILE = re.compile(r"(model|value_head)\.safetensors|.+\.(json|txt|model|jinja)|rng_rank\d+\.pt")
DCP_SHARD = re.compile(r"__\d+_\d+\.distcp")  # __<rank>_<n>.distcp: a rank's n-th file


def find_resume_dir(resume: str, ckpt_root: str) -> str:
    """The checkpoint of --resume ('latest': the newest in ckpt_root), checked before anything is loaded or written."""
    found = list_checkpoints(ckpt_root) if resume == "latest" else [resume]
    if not found:
        raise FileNotFoundError(f"--resume latest: no checkpoint in {ckpt_root}")
    path = found[-1]
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise FileNotFoundError(f"--resume {resume!r}: {path} is not a complete checkpoint (no trainer_state.json)")
    foreign = ("--resume: {}: no checkpoint holds such a {}; refused before anything is read (torch may load a file "
               "we never write, and run code it carries; remove it if you know what it is)")
    parts = [path]  # and, as they are found, the parts' folders: a folder with a trainer_state.json (ppo.py's critic/)
    for part in parts:
        for name in sorted(os.listdir(part)):
            entry = os.path.join(part, name)
            kind = "directory" if os.path.isdir(entry) else "file"
            if kind == "directory" and name == "optimizer":
                for n in sorted(os.listdir(entry)):
                    if not (n == ".metadata" or DCP_SHARD.fullmatch(n)) or os.path.isdir(os.path.join(entry, n)):
                        raise UnsafeCheckpoint(foreign.format(os.path.join(entry, n), "file"))
            elif kind == "directory" and part == path and os.path.isfile(os.path.join(entry, "trainer_state.json")):
                parts.append(entry)
            elif kind == "directory" or not CHECKPOINT_FILE.fullmatch(name):
                raise UnsafeCheckpoint(foreign.format(entry, kind))
    for part in parts:
        check_model_dir(part, "--resume")
        state = read_json(os.path.join(part, "trainer_state.json"), "--resume")
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError(f"--resume: {os.path.join(part, 'trainer_state.json')} has no step: not a checkpoint's")
        if os.path.exists(os.path.join(part, "optimizer", ".metadata")):
            check_dcp_metadata(os.path.join(part, "optimizer", ".metadata"))
    return path


def read_json(path: str, what: str = ""):
    """json.load of path; a file that is not JSON (damaged, cut, not UTF-8) is a ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what + ': ' if what else ''}{path} is damaged: {not_json(e)}") from None


@contextlib.contextmanager
def damaged(path: str, what: str):
    """Around loading state read from `path`: JSON of the wrong shape is a one-line ValueError, not a traceback."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        raise ValueError(f"--resume: {path} is damaged: {what} ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Builds checkpoint metadata only: any other global (os.system, eval, ...) is refused before it is looked up."""
    # What DCP pickles into .metadata (in each module where torch versions keep it); nothing else is let through.
    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
               "torch.distributed._shard.sharded_tensor.metadata")
    GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
               ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
               ("pathlib", "PurePath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module, name):
        if module in self.MODULES and "." not in name:
            cls = getattr(importlib.import_module(module), name, None)
            if isinstance(cls, type) and (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
                return cls
        elif (module, name) in self.GLOBALS:
            return getattr(importlib.import_module(module), name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is no part of checkpoint metadata")


def check_dcp_metadata(path: str):
    """The Metadata of a DCP .metadata file, read with _MetadataUnpickler and of the shape torch reads, else
    UnsafeCheckpoint. It comes first: torch 2.13 reads it with plain pickle.load, which runs what a pickle names."""
    def unsafe(why: str, more: str = "") -> UnsafeCheckpoint:
        return UnsafeCheckpoint(f"--resume: {path} is not a checkpoint's optimizer metadata ({why}); refused{more}")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 -- UnpicklingError, EOFError: a foreign, damaged or cut file
        raise unsafe(f"{type(e).__name__}: {' '.join(str(e).split())[:200]}", ": unpickling it could run code (to "
                     "train from a checkpoint of unknown origin, give it as --model: weights only)") from None
    if not isinstance(metadata, Metadata):
        raise unsafe(f"it holds a {type(metadata).__name__}")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise unsafe("its state_dict_metadata and storage_data are not both dicts")
    if not isinstance(metadata.storage_meta, (StorageMeta, type(None))):
        raise unsafe(f"its storage_meta is a {type(metadata.storage_meta).__name__}")
    for info in metadata.storage_data.values():
        where = getattr(info, "relative_path", None)
        if not isinstance(where, str) or not DCP_SHARD.fullmatch(where):
            raise unsafe(f"it reads {where!r}, no shard of a checkpoint")
    return metadata


class CheckedReader(FileSystemReader):
    """DCP's file reader, except that it reads .metadata with check_dcp_metadata, and never a rank's __<rank>.metadata
    (torch 2.13 falls back to it, with plain pickle.load, when .metadata does not load; ours never hold one)."""

    def read_metadata(self, *args, **kwargs):
        metadata = check_dcp_metadata(os.path.join(self.path, ".metadata"))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()  # (as FileSystemReader.read_metadata does)
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that each non-tensor value (lr, betas: a torch.save pickle in a .distcp
    file) is first read with weights_only=True: the default planner's weights_only=False would run code it carries."""

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 -- UnpicklingError for a forbidden global, or a damaged value
            raise UnsafeCheckpoint(f"its value {read_item.dest_index.fqn} is not plain data "
                                   f"({' '.join(str(e).split())[:200]}); refused: loading it could run code") from None
        value.seek(0)
        super().load_bytes(read_item, value)  # the same bytes, now known to build plain data only


def load_training_state(path: str, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """Collective. Optimizer state (resharded: any number of ranks), trainer_state.json and this rank's RNG state ({}
    for a rank the checkpoint did not have); nothing unpickled unchecked. The weights come with loading `path`."""
    rank, optimizer_dir = dist.get_rank(), os.path.join(path, "optimizer")
    if optimizer is not None:
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # the layout this run holds (zeros)
        if not os.path.isfile(os.path.join(optimizer_dir, ".metadata")):
            raise FileNotFoundError(f"--resume: {path} is not a complete checkpoint (no optimizer/.metadata)")
        check_dcp_metadata(os.path.join(optimizer_dir, ".metadata"))  # (CheckedReader reads it again, as this did)
        try:
            dcp.load(state, checkpoint_id=optimizer_dir, storage_reader=CheckedReader(optimizer_dir),
                     planner=WeightsOnlyLoadPlanner())
        except CheckpointException as e:  # a BaseException, whose message holds every rank's traceback: one line
            if error_line(e) == INTERRUPTED:
                raise KeyboardInterrupt from None
            if unsafe := [err for err, _ in e.failures.values() if isinstance(err, UnsafeCheckpoint)]:
                raise UnsafeCheckpoint(f"--resume: {optimizer_dir}: {unsafe[0]}") from None
            raise ValueError(f"--resume {path}: its optimizer state does not fit this model and optimizer "
                             f"({error_line(e)})") from None
        # the state without its settings (lr, betas, weight decay: this run's flags): torch takes the checkpoint's, so
        # a resume with a new --lr (or --critic-lr) would train at the old rate, log the new one and save the old one
        settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        for group, ours in zip(optimizer.param_groups, settings, strict=True):
            group.update(ours)
    trainer_state = read_json(os.path.join(path, "trainer_state.json"), "--resume")
    rng_file, rank_state, error = os.path.join(path, f"rng_rank{rank}.json"), {}, None
    try:  # this rank's own file: a damaged one is agreed on below, so that every rank stops with its line
        if os.path.exists(rng_file):
            data = read_json(rng_file, "--resume")
            with damaged(rng_file, "not a random state"):
                rank_state = rng_from_json(data)
        elif rank == 0 and os.path.exists(os.path.join(path, "rng_rank0.pt")):  # (written by an older version)
            print(f"[resume] {path}: rng_rank*.pt not read (a pickle: loading it could run code); the random streams "
                  "start afresh", flush=True)
    except ValueError as e:
        error = str(e)
    agree_on_error(error)
    return trainer_state, rank_state
