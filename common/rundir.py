"""The run directory holds one run, and one run at a time uses it (docs/faults.md, "The run directory")."""
import fcntl
import os
import shutil
import socket

import torch.distributed as dist

RUN_FILES = ("config.json", "metrics.jsonl", "metrics.jsonl.prev", "metrics.jsonl.tmp", "checkpoints",
             "critic_checkpoints", "wandb")  # what the scripts and their logger write
LOCK_FILE = ".lock"


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
