"""The run directory holds one run, and one run at a time uses it (docs/faults.md, "The run directory"); its
checkpoints, as a script saves and resumes them (docs/checkpoints.md)."""
import fcntl
import os
import shutil
import socket

import torch.distributed as dist

from common.checkpoint import (find_resume_dir, load_training_state, rng_state, save_checkpoint, set_aside_newer,
                               set_rng_state)
from common.preflight import check_shared_dir

RUN_FILES = ("config.json", "metrics.jsonl", "metrics.jsonl.prev", "metrics.jsonl.tmp", "checkpoints",
             "critic_checkpoints", "wandb")  # what the scripts and their logger write
LOCK_FILE = ".lock"


class RunDir:
    """A run's directory: claimed for this run (claim_run_dir: one run per directory, one run at a time), seen by every
    rank (check_shared_dir), and its checkpoints, <path>/checkpoints/step_NNNNNN. A checkpoint holds `parts`:
    {folder in it ("" for its root): (model, optimizer, {name: an object with state_dict() and load_state_dict()})},
    and the random streams (this process's and the sampler's generator). Collective: every rank builds it."""

    def __init__(self, path: str, infra, device):
        self.path, self.keep_last = path, infra.keep_last
        self.checkpoints = os.path.join(path, "checkpoints")
        self.lock = claim_run_dir(path, infra.resume is not None, infra.overwrite)  # rank 0 holds it for the run
        check_shared_dir(path, device)  # every rank writes its shards into the checkpoints: fail now, not at a save
        self.resume_dir = find_resume_dir(infra.resume, self.checkpoints) if infra.resume else None

    def save(self, step: int, tokenizer, parts: dict, sampler) -> str:
        """Collective: save_checkpoint of every part and stream."""
        return save_checkpoint(self.checkpoints, step, tokenizer,
                               {folder: (model, optimizer, {name: obj.state_dict() for name, obj in state.items()})
                                for folder, (model, optimizer, state) in parts.items()},
                               rng_state(getattr(sampler, "generator", None)), self.keep_last)

    def load(self, parts: dict, sampler) -> int:
        """Collective. Restore every part's optimizer and state objects and the random streams from resume_dir (its
        weights come with building the models from it), set the checkpoints of later steps aside (set_aside_newer),
        and return its step; 0 without --resume."""
        if self.resume_dir is None:
            return 0
        for folder, (model, optimizer, state) in parts.items():
            trainer_state, rank_state = load_training_state(os.path.join(self.resume_dir, folder), model, optimizer)
            for name, obj in state.items():
                obj.load_state_dict(trainer_state[name])
            if folder == "":
                step = trainer_state["step"]
                if rank_state:
                    set_rng_state(rank_state, getattr(sampler, "generator", None))
        if dist.get_rank() == 0:
            print(f"[resume] from {self.resume_dir} at step {step}", flush=True)
        set_aside_newer(self.checkpoints, step)  # from an older step: the later checkpoints are moved aside
        return step


def claim_run_dir(run_dir: str, resume: bool, overwrite: bool):
    """Collective (where a process group exists). Make run_dir, lock it and check it holds no other run (overwrite:
    remove that run's files); ValueError, one line, on every rank otherwise (docs/faults.md). Returns the lock on
    rank 0 (an open file: keep a reference to it for the whole run), None elsewhere."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    lock, error = None, None
    if rank == 0:
        try:
            lock = _lock(run_dir)
            found = [name for name in RUN_FILES if os.path.lexists(os.path.join(run_dir, name))]
            if found and overwrite:
                for name in found:
                    path = os.path.join(run_dir, name)
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)
                    else:
                        os.remove(path)
                print(f"[run-dir] --overwrite: removed {', '.join(found)} from {run_dir}", flush=True)
            elif found and not resume:
                how = ": continue it with --resume latest, " if "checkpoints" in found else " that saved no checkpoint: "
                error = (f"--run-dir {run_dir!r} holds another run ({', '.join(found)}){how}remove it with "
                         "--overwrite, or give another --run-dir")
        except (ValueError, OSError) as e:
            error = str(e) if isinstance(e, ValueError) else f"--run-dir {run_dir!r}: {e.strerror or e}"
    if dist.is_initialized() and dist.get_world_size() > 1:  # every rank stops with the same line, or none does
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error:
        if lock is not None:
            lock.close()
        raise ValueError(error)
    return lock


def _lock(run_dir: str):
    """The open, locked <run_dir>/.lock, with this process's pid and host in it (for the message of the run that
    finds it locked). On a filesystem without locks (some network filesystems) it warns and returns the file."""
    os.makedirs(run_dir, exist_ok=True)
    f = open(os.path.join(run_dir, LOCK_FILE), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise ValueError(f"--run-dir {run_dir!r}: another run is using it{f' ({holder})' if holder else ''}; wait "
                         "for it to end or give another --run-dir") from None
    except OSError as e:
        print(f"[run-dir] cannot lock {os.path.join(run_dir, LOCK_FILE)} ({e.strerror}): a second run started in "
              "this directory at the same time would not be stopped", flush=True)
        return f
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f
