"""The run directory, one run at a time (docs/faults.md, "The run directory"); its checkpoints: docs/checkpoints.md."""
import json
import os
import re
import shutil
import time
from functools import partial

import filelock
import torch.distributed as dist

from common import checkpoint, exits
from common.checkpoint import find_resume_dir, load_training_state, rng_state, set_rng_state
from common.config import check_resume_config
from common.dist import agree_on_error
from common.logger import CONFIG_RESUME, rows_after
from common.preflight import check_shared_dir

RUN_FILES = ("config.json", "config.json.tmp", "metrics.jsonl", "metrics.jsonl.prev", "metrics.jsonl.tmp",
             "checkpoints", "wandb")  # what the scripts and their logger write
LOCK_FILE = ".lock"
# a Hugging Face model's files: a directory holding any is a model's, never a run's (a run's are in checkpoints/)
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
RUN_CONFIG_KEYS = ("exp_name", "seed", "num_steps")  # in every script's config.json (with "script" since it is kept)
# checkpoints/: step_NNNNNN, a save unfinished (.tmp), what a resume from an older step set aside (abandoned_<time>)
CHECKPOINT_ENTRY = re.compile(r"^(step_\d+(\.tmp)?|abandoned_[\d_-]+)$")


def run_files(run_dir: str) -> list[str]:
    """The names of a run's files in run_dir (RUN_FILES, and the config_resume_*.json of its resumes)."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    return sorted(name for name in names if name in RUN_FILES or CONFIG_RESUME.match(name.removesuffix(".tmp")))


def _json_object(path: str) -> dict | None:
    """The JSON object in path (None for anything else)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):  # (UnicodeDecodeError is a ValueError)
        return None
    return data if isinstance(data, dict) else None


def not_a_run(run_dir: str) -> str | None:
    """Why no run may write into or clear run_dir (a model, another config.json, files named as a run's), or None."""
    models = [name for name in MODEL_FILES if os.path.lexists(os.path.join(run_dir, name))]
    held = f"; it holds {', '.join(models)}" if models else ""
    config = None
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        config = _json_object(os.path.join(run_dir, "config.json"))
        if config is None:
            return "its config.json is not a run's (not a JSON object)" + held
        if "model_type" in config or "architectures" in config:
            return f"it holds a model (config.json of a Hugging Face model{', ' if models else ''}{', '.join(models)})"
        if "script" not in config and not all(key in config for key in RUN_CONFIG_KEYS):
            return f"its config.json is not a run's (no {', '.join(('script',) + RUN_CONFIG_KEYS)} keys)" + held
    if models:
        return f"it holds a model ({', '.join(models)})"
    found, tracked = run_files(run_dir), bool(config and config.get("track"))
    for name in found:
        path = os.path.join(run_dir, name)
        if name == "checkpoints":
            if not os.path.isdir(path) or os.path.islink(path):
                return f"its {name} is not a run's checkpoints (not a directory)"
            if odd := [e for e in sorted(os.listdir(path)) if not CHECKPOINT_ENTRY.match(e) and not e.startswith(".")]:
                return (f"its {name}/ is not a run's checkpoints (it holds {', '.join(odd[:4])}"
                        f"{', ...' if len(odd) > 4 else ''}, not step_NNNNNN folders)")
        elif config is None and name != "wandb":
            return f"its {name} is not a run's (no run's config.json beside it)"
        elif CONFIG_RESUME.match(name) and config is not None:
            tracked = tracked or bool((_json_object(path) or {}).get("track"))
    if "wandb" in found and not tracked:
        return "its wandb/ is not a run's (no run's settings beside it logged to W&B, --track)"
    return None


class RunDir:
    """Collective: a run's directory, claimed and seen by every rank, and its checkpoints of `parts`, {folder ("" the
    root): (model, optimizer, {name: object with state_dict() and load_state_dict()})}, and the random streams."""

    def __init__(self, path: str, infra, device, config: dict):
        """Nothing in the directory changes before start(). config: the settings (run_config) a checkpoint records."""
        self.path, self.keep_last, self.config, self.overwrite = path, infra.keep_last, config, infra.overwrite
        self.checkpoints = os.path.join(path, "checkpoints")
        self.lock = claim_run_dir(path, infra.resume, infra.overwrite)  # rank 0 holds it for the run
        check_shared_dir(path, device)  # every rank writes its shards into the checkpoints: fail now, not at a save
        exits.progress.hint = None if infra.overwrite else partial(resume_hint, self.checkpoints)  # (Ctrl-C)
        self.resume_dir = find_resume_dir(infra.resume, self.checkpoints) if infra.resume else None
        if self.resume_dir:  # the settings that define the run must be the checkpoint's (--accept-changes: on purpose)
            check_resume_config(self.resume_dir, path, config, infra.accept_changes)
            step = checkpoint.read_json(os.path.join(self.resume_dir, "trainer_state.json"), "--resume")["step"]
            if config["num_steps"] <= step:  # nothing to train: refused before anything is loaded or moved
                raise ValueError(f"--num-steps {config['num_steps']}: the checkpoint {self.resume_dir} is at step "
                                 f"{step} already: nothing to train; give --num-steps above {step} to continue the run")

    def start(self, step: int) -> None:
        """Collective, once every input is checked: clear the old run (--overwrite) or set later checkpoints aside."""
        if self.overwrite:
            clear_run_dir(self.path)
        if self.resume_dir:
            error = None
            if dist.get_rank() == 0:
                try:
                    set_aside_newer(self.checkpoints, step, os.path.join(self.path, "metrics.jsonl"))
                except OSError as e:
                    error = f"--resume: cannot move the checkpoints after step {step} aside in {self.checkpoints}: {e}"
            agree_on_error(error)
        exits.progress.hint = partial(resume_hint, self.checkpoints)  # (not a lambda: it would keep self, the lock)

    def save(self, step: int, tokenizer, parts: dict, sampler) -> str:
        """Collective: save_checkpoint of every part and stream."""
        states = {folder: (model, optimizer, {name: obj.state_dict() for name, obj in state.items()})
                  for folder, (model, optimizer, state) in parts.items()}
        states[""][2]["config"] = self.config  # the settings it was trained with, which a resume is checked against
        t0 = time.perf_counter()
        path = checkpoint.save_checkpoint(self.checkpoints, step, tokenizer, states,
                                          rng_state(getattr(sampler, "generator", None)), self.keep_last)
        if dist.get_rank() == 0:
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
            print(f"[checkpoint] {path}: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
        return path

    def load(self, parts: dict, sampler) -> int:
        """Collective. Restore the parts' optimizers and state objects and the random streams from resume_dir (the
        models are built from it); returns its step (0 without --resume). Damaged state: one line on every rank."""
        if self.resume_dir is None:
            return 0
        t0 = time.perf_counter()
        for folder, (model, optimizer, state) in parts.items():
            path = os.path.join(self.resume_dir, folder)
            trainer_state, rank_state = load_training_state(path, model, optimizer)
            for name, obj in state.items():  # ({}: a state a checkpoint of an older version did not keep)
                with checkpoint.damaged(os.path.join(path, "trainer_state.json"), f"its {name} is not the state of "
                                        f"a {type(obj).__name__}"):
                    obj.load_state_dict(trainer_state.get(name, {}))
            if folder == "":
                step, streams = trainer_state["step"], rank_state
        # the streams last: a damaged rng_rank<r>.json (this rank's alone) stops every rank, after the collectives
        error = None
        if streams:
            try:
                with checkpoint.damaged(os.path.join(self.resume_dir, f"rng_rank{dist.get_rank()}.json"),
                                        "not a random state this run can restore"):
                    set_rng_state(streams, getattr(sampler, "generator", None))
            except ValueError as e:
                error = str(e)
        agree_on_error(error)
        if dist.get_rank() == 0:
            print(f"[resume] from {self.resume_dir} at step {step} (optimizer and state read in "
                  f"{time.perf_counter() - t0:.1f} s)", flush=True)
        return step


def resume_hint(ckpt_root: str) -> str:
    """How the line on Ctrl-C goes on: --resume latest where a checkpoint exists, else that there is none."""
    if found := checkpoint.list_checkpoints(ckpt_root):
        return f"; resume with --resume latest (step {checkpoint.checkpoint_step(found[-1])})"
    return ", before the run's first checkpoint: nothing to resume; start it again with --overwrite"


def set_aside_newer(ckpt_root: str, step: int, metrics_path: str) -> None:
    """A resume from an older step starts a new line: later checkpoints and their log rows move, never deleted, to
    ckpt_root/abandoned_<time>_<pid>/, which --resume latest and --keep-last skip (the next save fsyncs ckpt_root)."""
    newer = [c for c in checkpoint.list_checkpoints(ckpt_root) if checkpoint.checkpoint_step(c) > step]
    if not newer:
        return
    aside = os.path.join(ckpt_root, f"abandoned_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}")
    os.makedirs(aside)
    if rows := rows_after(metrics_path, step):  # first: the log of the line left behind goes with its checkpoints
        with open(os.path.join(aside, "metrics.jsonl"), "w") as f:
            f.writelines(rows)
    for c in newer:
        os.replace(c, os.path.join(aside, os.path.basename(c)))
    steps = ", ".join(str(checkpoint.checkpoint_step(c)) for c in newer)
    print(f"[resume] {ckpt_root} held checkpoints after step {step} ({steps}) of the line this resume leaves: moved "
          f"into {aside}" + (f" with the {len(rows)} rows of metrics.jsonl after step {step}" if rows else ""),
          flush=True)


def claim_run_dir(run_dir: str, resume: str | bool | None, overwrite: bool):
    """Collective. Make run_dir (not for --resume latest), lock it, check it holds no other run (but to overwrite)
    nor anything not a run (else ValueError on every rank). Returns the lock on rank 0 (keep it for the run)."""
    lock, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            if resume == "latest" and not os.path.isdir(run_dir):
                raise ValueError(f"--resume latest: --run-dir {run_dir!r} does not exist, so it holds no run to "
                                 "resume; give the run's --run-dir, or leave out --resume to start a new run")
            os.makedirs(run_dir, exist_ok=True)
            lock = filelock.FileLock(os.path.join(run_dir, LOCK_FILE), timeout=0)
            lock.acquire()  # flock: the system frees it when the process ends, so a dead run's lock never blocks
            foreign, found = not_a_run(run_dir), run_files(run_dir)
            if foreign:
                error = (f"--run-dir {run_dir!r}: {foreign}: a run's files would mix with it (and --overwrite would "
                         "delete it); give another --run-dir")
            elif found and overwrite:
                print(f"[run-dir] --overwrite: the run in {run_dir} ({', '.join(found)}) is removed once this run's "
                      "inputs are read and checked", flush=True)
            elif found and not resume:
                how = (": continue it with --resume latest, " if "checkpoints" in found
                       else " that saved no checkpoint: ")
                error = (f"--run-dir {run_dir!r} holds another run ({', '.join(found)}){how}remove it with "
                         "--overwrite, or give another --run-dir")
        except filelock.Timeout:  # (an OSError: before the clause below)
            lock = None
            error = f"--run-dir {run_dir!r}: another run is using it; wait for it to end or give another --run-dir"
        except (ValueError, OSError) as e:
            error = str(e) if isinstance(e, ValueError) else f"--run-dir {run_dir!r}: {e.strerror or e}"
    if error and lock is not None:
        lock.release()
    agree_on_error(error)
    return lock


def clear_run_dir(run_dir: str) -> None:
    """Collective. --overwrite: remove the run's files (not others: a log teed there) once every input is checked."""
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        found = run_files(run_dir)
        try:
            for name in found:
                path = os.path.join(run_dir, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            if found:
                print(f"[run-dir] --overwrite: removed {', '.join(found)} from {run_dir}", flush=True)
        except OSError as e:
            error = f"--overwrite: cannot remove the old run's {e.filename or run_dir}: {e.strerror or e}"
    agree_on_error(error)
