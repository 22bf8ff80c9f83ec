"""Checkpoints, written by every rank and readable by any number of ranks: a Hugging Face model directory (fp32
model.safetensors, streamed by rank 0), optimizer/ (DCP shards, resharded on load), trainer_state.json and
rng_rank{r}.json. What each file holds, the phases of a save, resuming from an older step: docs/checkpoints.md.
"""
import contextlib
import dataclasses
import enum
import importlib
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
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from tqdm import tqdm

from common.exits import SigintDeferred
from common.fsdp import full_state_names, iter_full_state
from common.preflight import check_model_dir, not_json
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
    keep_last, counting this one, after the durable rename. Ctrl-C during a save is held until the end of the phase
    (SigintDeferred), then every rank raises KeyboardInterrupt with the previous checkpoint intact. The phases and
    what a failure leaves: docs/checkpoints.md."""
    with SigintDeferred() as sigint:
        return _save_checkpoint(ckpt_root, step, tokenizer, parts, rank_state, keep_last, sigint)


def _save_checkpoint(ckpt_root, step, tokenizer, parts, rank_state, keep_last, sigint):
    rank = dist.get_rank()
    final = os.path.join(ckpt_root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    what = f"step {step}: checkpoint {final} not saved"
    def attempt(fn) -> str | None:
        """fn(); None, or its error line (INTERRUPTED for a KeyboardInterrupt raised inside: a Ctrl-C that came
        before the deferral, or one raised by code this process runs)."""
        try:
            fn()
            return None
        except KeyboardInterrupt:
            return INTERRUPTED
        except Exception as e:
            return error_line(e, where=tmp)

    def agree(error):
        agree_on_failure(error, what, interrupted=sigint.pending)

    def phase1():  # every rank: the directories (none writes into one it has not seen made) and its RNG streams
        for folder in parts:
            os.makedirs(os.path.join(tmp, folder), exist_ok=True)
        write_json(os.path.join(tmp, f"rng_rank{rank}.json"), rng_to_json(rank_state))
    agree(attempt(phase1))
    for folder, (model, optimizer, trainer_state) in parts.items():
        out = os.path.join(tmp, folder)
        if optimizer is not None:  # 2. each rank writes its shard of the AdamW state (DCP fsyncs its files)
            try:
                dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
                         checkpoint_id=os.path.join(out, "optimizer"))
                error = None
            except CheckpointException as e:  # DCP gathers every rank's failure and raises it on every rank
                error = INTERRUPTED if interrupted_inside(e) else first_failure(e, where=tmp)
            except KeyboardInterrupt:
                error = INTERRUPTED
            except Exception as e:
                error = error_line(e, where=tmp)
            agree(error)
        # 3. the weights, fp32, gathered one tensor at a time and written by rank 0 as they come (a tied lm_head is
        # stored once, as the embedding: what from_pretrained and vLLM expect)
        lm = model.lm
        entries = full_state_names(lm)
        tensors = iter_full_state(lm, torch.float32, torch.device("cpu"), aliases=False)

        def until_interrupted(items):
            """The tensors, up to a Ctrl-C: it stops rank 0's writing (raised in this wrapper, so `tensors` itself
            stays alive and the gathers below go on: the other ranks take part in all of them)."""
            for item in items:
                yield item
                if sigint.pending:
                    raise KeyboardInterrupt

        def phase3():
            write_safetensors(os.path.join(out, "model.safetensors"), entries, until_interrupted(tensors))
            lm.config.save_pretrained(out)
            if lm.generation_config is not None:
                lm.generation_config.save_pretrained(out)
            tokenizer.save_pretrained(out)
            arrays = {k: v for k, v in trainer_state.items()  # tensors (ppo.py's value head): <k>.safetensors
                      if isinstance(v, dict) and v and all(isinstance(t, torch.Tensor) for t in v.values())}
            for name, state in arrays.items():
                safetensors.torch.save_file(state, os.path.join(out, f"{name}.safetensors"))
            write_json(os.path.join(out, "trainer_state.json"),
                       {"step": step, **{k: v for k, v in trainer_state.items() if k not in arrays}}, indent=2)
        error = attempt(phase3) if rank == 0 else None
        while True:  # the gathers are collectives: every rank takes part in all of them, rank 0 after a failure too
            try:
                for _ in tensors:
                    pass
                break
            except KeyboardInterrupt:  # raised between two gathers (signals run between bytecodes): go on gathering
                error = error or INTERRUPTED
        agree(error)

    def phase4():  # into place, durably, then prune
        fsync_tree(tmp)  # every rank's files and the directories, before the rename makes them a checkpoint
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(ckpt_root)  # the rename itself survives a crash
        if keep_last > 0:
            older = [c for c in list_checkpoints(ckpt_root) if checkpoint_step(c) < step]
            for old in older[:max(len(older) - (keep_last - 1), 0)]:
                shutil.rmtree(old, ignore_errors=True)
    agree(attempt(phase4) if rank == 0 else None)
    return final


INTERRUPTED = "KeyboardInterrupt"  # a phase's "error" when it was interrupted: every rank then raises KeyboardInterrupt


def interrupted_inside(e: CheckpointException) -> bool:
    """Whether DCP's exception wraps a KeyboardInterrupt (DCP catches BaseException in its writer and reader)."""
    return any(isinstance(err, KeyboardInterrupt) for err, _traceback in e.failures.values())


def error_line(e: BaseException, rank: int | None = None, where: str | None = None) -> str:
    """`rank r: Type: first line of the message` (r: this rank unless given). torch.save turns the ENOSPC of a short
    write into `RuntimeError: unexpected pos A vs B` (and DCP's gathering of the failure drops the OSError behind it):
    that line asks whether the disk of `where`, the directory being written, is full."""
    text = str(e).strip().splitlines()
    line = f"rank {dist.get_rank() if rank is None else rank}: {type(e).__name__}: {text[0] if text else ''}"
    return line + (f" (a write into {where} fell short: is its disk full?)" if "unexpected pos" in line else "")


def agree_on_failure(error: str | None, what: str, interrupted: bool = False) -> None:
    """Collective: every rank gives its error line of a phase (None: it succeeded) and whether a Ctrl-C is pending.
    When any rank was interrupted, every rank raises KeyboardInterrupt (the save is abandoned where it stands, the
    previous checkpoint intact); else when any rank failed, every rank raises CheckpointError with the same line (the
    first failing rank's, and how many others failed), so that no rank goes on to a collective that a failed rank
    will never join."""
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (error, interrupted or error == INTERRUPTED))
    if any(stop for _, stop in reports):
        raise KeyboardInterrupt
    failed = [e for e, _ in reports if e is not None]
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


def find_resume_dir(resume: str, ckpt_root: str) -> str:
    """The checkpoint of --resume ('latest': the newest complete one in ckpt_root), checked before anything is loaded
    or written: no file in it that a checkpoint of ours never holds (check_checkpoint_files), and its root and each
    part's folder (ppo.py's critic/) as --model's directory (config and tokenizer files, complete safetensors
    weights), with a trainer_state.json that has the step, and optimizer/.metadata holding checkpoint metadata only
    (check_dcp_metadata). A damaged or foreign checkpoint is a one-line error naming the file."""
    path = resume
    if resume == "latest":
        found = list_checkpoints(ckpt_root)
        if not found:
            raise FileNotFoundError(f"--resume latest: no checkpoint in {ckpt_root}")
        path = found[-1]
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise FileNotFoundError(f"--resume {resume!r}: {path} is not a complete checkpoint (no trainer_state.json)")
    for part in [path, *check_checkpoint_files(path)]:
        check_model_dir(part, "--resume")
        state = read_json(os.path.join(part, "trainer_state.json"), "--resume")
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError(f"--resume: {os.path.join(part, 'trainer_state.json')} has no step: not a checkpoint's")
        metadata = os.path.join(part, "optimizer", ".metadata")
        if os.path.exists(metadata):
            check_dcp_metadata(metadata)
    return path


# The files a checkpoint of ours holds, in its root and in each part's folder (a folder with a trainer_state.json:
# ppo.py's critic/): the weights, JSON files (the model's config and generation config, the tokenizer's files,
# trainer_state.json, rng_rank{r}.json), a tokenizer's text, sentencepiece and chat-template files, and optimizer/:
# DCP's .metadata and its shards. (rng_rank{r}.pt, an older version's, is never read.) Anything else is refused before
# anything is read: torch may load a file that we never write, and run the code a pickle in it carries (torch 2.13
# unpickles optimizer/__<rank>.metadata when .metadata does not load).
CHECKPOINT_FILE = re.compile(r"(model|value_head)\.safetensors|.+\.(json|txt|model|jinja)|rng_rank\d+\.pt")
DCP_SHARD = re.compile(r"__\d+_\d+\.distcp")  # __<rank>_<n>.distcp: a rank's n-th file


def check_checkpoint_files(path: str, part: bool = False) -> list[str]:
    """Raise UnsafeCheckpoint, one line naming it, for the first entry of the checkpoint at `path` (a part's folder
    when `part`) that no checkpoint of ours holds (CHECKPOINT_FILE, DCP_SHARD). Returns the parts' folders, each
    checked the same way."""
    def foreign(entry: str, kind: str) -> UnsafeCheckpoint:
        return UnsafeCheckpoint(f"--resume: {entry}: no checkpoint holds such a {kind}; refused before anything is "
                                "read (torch may load a file we never write, and run code it carries; remove it if "
                                "you know what it is)")
    parts = []
    for name in sorted(os.listdir(path)):
        entry = os.path.join(path, name)
        if not os.path.isdir(entry):
            if not CHECKPOINT_FILE.fullmatch(name):
                raise foreign(entry, "file")
        elif name == "optimizer":
            for inner in sorted(os.listdir(entry)):
                ours = inner == ".metadata" or DCP_SHARD.fullmatch(inner)
                if not ours or os.path.isdir(os.path.join(entry, inner)):
                    raise foreign(os.path.join(entry, inner), "file")
        elif not part and os.path.isfile(os.path.join(entry, "trainer_state.json")):
            check_checkpoint_files(entry, part=True)
            parts.append(entry)
        else:
            raise foreign(entry, "directory")
    return parts


def read_json(path: str, what: str = ""):
    """json.load of path; a file that is not JSON (damaged, cut, not UTF-8) is a ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what + ': ' if what else ''}{path} is damaged: {not_json(e)}") from None


@contextlib.contextmanager
def damaged(path: str, what: str):
    """For a block that loads state read from `path`, a checkpoint's JSON file: valid JSON of the wrong shape (a key
    missing, a list for a dict, a string for a number, a random state of the wrong length) is a ValueError, one line
    naming the file and `what` of it is wrong, not the loader's traceback."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        raise ValueError(f"--resume: {path} is damaged: {what} ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None


# What torch.distributed.checkpoint pickles into optimizer/.metadata: its metadata dataclasses and enums (in the
# modules where torch versions keep them), torch.Size, dtypes, a layout by name, paths. Nothing else is let through.
_DCP_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                         "torch.distributed._shard.sharded_tensor.metadata")
_DCP_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                         ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                         ("pathlib", "PurePath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds checkpoint metadata only: any other global a pickle names (os.system, eval, a class
    whose construction runs code) is refused before it is looked up, so loading never runs code the file carries."""

    def find_class(self, module, name):
        if module in _DCP_METADATA_MODULES and "." not in name:
            cls = getattr(importlib.import_module(module), name, None)
            if isinstance(cls, type) and (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
                return cls
        elif (module, name) in _DCP_METADATA_GLOBALS:
            return getattr(importlib.import_module(module), name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is no part of checkpoint metadata")


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that would run code if PyTorch loaded it as it does (a pickle naming other globals)."""


def check_dcp_metadata(path: str):
    """The Metadata in `path`, a DCP .metadata file, unpickled with _MetadataUnpickler; UnsafeCheckpoint (one line,
    naming the file) unless it is checkpoint metadata of the shape torch reads (its storage_meta a StorageMeta or
    None, every storage entry in a shard of the folder). torch's FileSystemReader.read_metadata reads that file with
    plain pickle.load (torch 2.13), which runs whatever a pickle names: this check comes first, and CheckedReader
    reads it this way instead. (The metadata classes allowed are looked up in each module where torch versions keep
    them.)"""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    def unsafe(why: str) -> UnsafeCheckpoint:
        return UnsafeCheckpoint(f"--resume: {path} is not a checkpoint's optimizer metadata ({why}); refused")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 -- UnpicklingError, EOFError: a foreign, damaged or cut file
        raise UnsafeCheckpoint(f"--resume: {path} is not a checkpoint's optimizer metadata ({type(e).__name__}: "
                               f"{' '.join(str(e).split())[:200]}); refused: unpickling it could run code (to train "
                               "from a checkpoint of unknown origin, give it as --model: weights only)") from None
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
    """DCP's file reader, except that it reads .metadata as check_dcp_metadata does, and never a rank's own
    __<rank>.metadata: torch 2.13 falls back to that file (with plain pickle.load) when .metadata does not load, and
    a checkpoint of ours never holds one."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta
        metadata = check_dcp_metadata(os.path.join(self.path, ".metadata"))
        if metadata.storage_meta is None:  # (as FileSystemReader.read_metadata does)
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that each non-tensor value of the state dict (the optimizer's lr, betas,
    ...: a torch.save pickle inside a .distcp file) is first read with torch.load(weights_only=True): the default
    planner loads them with weights_only=False, which would run code that a .distcp file carries."""

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 -- UnpicklingError for a forbidden global, or a damaged value
            raise UnsafeCheckpoint(f"its value {read_item.dest_index.fqn} is not plain data "
                                   f"({' '.join(str(e).split())[:200]}); refused: loading it could run code") from None
        value.seek(0)
        super().load_bytes(read_item, value)  # the same bytes, now known to build plain data only


def first_failure(e: CheckpointException, where: str | None = None) -> str:
    """The first line of the first failing rank's error, out of DCP's exception (which gathers every rank's)."""
    for rank, (err, _traceback) in sorted(e.failures.items()):
        return error_line(err, rank, where)
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def load_training_state(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """Optimizer state (each rank reads the parts of the DCP shards it now holds: any number of ranks),
    trainer_state.json and this rank's RNG state (empty when the checkpoint was written by fewer ranks). The weights
    come from loading `path` as the model directory. Nothing of the checkpoint is unpickled unchecked
    (CheckedReader, WeightsOnlyLoadPlanner)."""
    rank = dist.get_rank()
    if optimizer is not None:
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # the layout this run holds (zeros)
        metadata = os.path.join(path, "optimizer", ".metadata")
        if not os.path.isfile(metadata):
            raise FileNotFoundError(f"--resume: {path} is not a complete checkpoint (no optimizer/.metadata)")
        check_dcp_metadata(metadata)  # (CheckedReader reads it again, as this did)
        try:
            dcp.load(state, checkpoint_id=os.path.join(path, "optimizer"),
                     storage_reader=CheckedReader(os.path.join(path, "optimizer")), planner=WeightsOnlyLoadPlanner())
        except CheckpointException as e:  # a BaseException, whose message holds every rank's traceback: one line
            if interrupted_inside(e):
                raise KeyboardInterrupt from None
            unsafe = [err for err, _ in e.failures.values() if isinstance(err, UnsafeCheckpoint)]
            if unsafe:
                raise UnsafeCheckpoint(f"--resume: {os.path.join(path, 'optimizer')}: {unsafe[0]}") from None
            raise ValueError(f"--resume {path}: its optimizer state does not fit this model and optimizer "
                             f"({first_failure(e)})") from None
        set_state_keeping_settings(model, optimizer, state["optimizer"])
    trainer_state = read_json(os.path.join(path, "trainer_state.json"), "--resume")
    rng_file = os.path.join(path, f"rng_rank{rank}.json")
    rank_state = {}
    if os.path.exists(rng_file):
        try:
            rank_state = rng_from_json(read_json(rng_file, "--resume"))
        except (KeyError, TypeError, IndexError, AttributeError) as e:  # JSON, but not a random state's
            raise ValueError(f"--resume: {rng_file} is damaged: not a random state ({type(e).__name__}: {e})") from None
    elif rank == 0 and os.path.exists(os.path.join(path, f"rng_rank{rank}.pt")):  # (written by an older version)
        print(f"[resume] {path}: rng_rank*.pt not read (a pickle: loading it could run code); the random streams "
              "start afresh", flush=True)
    return trainer_state, rank_state


def set_state_keeping_settings(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a checkpoint's optimizer state (AdamW's moments and step counts) into `optimizer`, whose settings (lr,
    betas, weight decay: this run's flags) stay as they are. torch's load_state_dict takes the checkpoint's settings
    with its state, so a resume with --lr (or ppo.py's --critic-lr) would train on at the old rate, log the new one,
    and save the old one into the next checkpoint."""
    settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    set_optimizer_state_dict(model, optimizer, state)
    for group, ours in zip(optimizer.param_groups, settings, strict=True):
        group.update(ours)
