"""The run directory holds one run, and one run at a time uses it (docs/faults.md, "The run directory"); its
checkpoints, as a script saves and resumes them (docs/checkpoints.md)."""
import json
import os
import re
import shutil
import time
from functools import partial

import filelock
import torch.distributed as dist

from common import checkpoint
from common.checkpoint import find_resume_dir, load_training_state, rng_state, set_rng_state
from common import exits
from common.config import check_resume_config
from common.logger import CONFIG_RESUME, rows_after
from common.preflight import check_shared_dir

RUN_FILES = ("config.json", "config.json.tmp", "metrics.jsonl", "metrics.jsonl.prev", "metrics.jsonl.tmp",
             "checkpoints", "wandb")  # what the scripts and their logger write
LOCK_FILE = ".lock"
# A Hugging Face model's files: a directory holding any of them is a model's, never a run's (a run's models are in
# its checkpoints/ subdirectories)
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
RUN_CONFIG_KEYS = ("exp_name", "seed", "num_steps")  # in every script's config.json (with "script" since it is kept)
# what checkpoints/ holds: step_NNNNNN, a save in progress or cut short
# (step_NNNNNN.tmp) and the lines a resume from an older step set aside (abandoned_<time>; docs/checkpoints.md)
CHECKPOINT_ENTRY = re.compile(r"^(step_\d+(\.tmp)?|abandoned_[\d_-]+)$")


def run_files(run_dir: str) -> list[str]:
    """The names of a run's files in run_dir (RUN_FILES, and the config_resume_*.json of its resumes)."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    return sorted(name for name in names if name in RUN_FILES or CONFIG_RESUME.match(name.removesuffix(".tmp")))


def not_a_run(run_dir: str) -> str | None:
    """Why run_dir holds something that is not a run (a model's files, a config.json that is not a run's, a file
    named as a run's that no run wrote: not_ours), or None. Such a directory is never written into or cleared:
    --overwrite would delete what is not ours."""
    models = [name for name in MODEL_FILES if os.path.lexists(os.path.join(run_dir, name))]
    config = os.path.join(run_dir, "config.json")
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):  # (UnicodeDecodeError is a ValueError)
            data = None
        if not isinstance(data, dict):
            return "its config.json is not a run's (not a JSON object)" + (f"; it holds {', '.join(models)}" if
                                                                          models else "")
        if "model_type" in data or "architectures" in data:
            return f"it holds a model (config.json of a Hugging Face model{', ' if models else ''}{', '.join(models)})"
        if "script" not in data and not all(key in data for key in RUN_CONFIG_KEYS):
            return (f"its config.json is not a run's (no {', '.join(('script',) + RUN_CONFIG_KEYS)} keys)"
                    + (f"; it holds {', '.join(models)}" if models else ""))
    if models:
        return f"it holds a model ({', '.join(models)})"
    return not_ours(run_dir, data if os.path.isfile(config) else None)


def not_ours(run_dir: str, config: dict | None) -> str | None:
    """Why a file of run_dir named as a run's (run_files) was not written by a run of this project, or None. Each is
    recognised by what the scripts write: checkpoints/ holds their step folders only; a log
    and a record of settings (metrics.jsonl, config_resume_*.json, ...) lie beside a run's config.json (config: its
    contents, None without one); wandb/ beside the settings of a run that logged to it (--track). A run's files with
    anything else among them are neither written into (they would mix) nor removed by --overwrite."""
    tracked = bool(config and config.get("track"))
    for name in run_files(run_dir):
        path = os.path.join(run_dir, name)
        if name == "checkpoints":
            entries = sorted(os.listdir(path)) if os.path.isdir(path) and not os.path.islink(path) else None
            if entries is None:
                return f"its {name} is not a run's checkpoints (not a directory)"
            odd = [e for e in entries if not CHECKPOINT_ENTRY.match(e) and not e.startswith(".")]
            if odd:
                return (f"its {name}/ is not a run's checkpoints (it holds {', '.join(odd[:4])}"
                        f"{', ...' if len(odd) > 4 else ''}, not step_NNNNNN folders)")
        elif config is None and name != "wandb":
            return f"its {name} is not a run's (no run's config.json beside it)"
        elif CONFIG_RESUME.match(name) and config is not None:
            tracked = tracked or bool(_json_object(path).get("track"))
    if "wandb" in run_files(run_dir) and not tracked:
        return "its wandb/ is not a run's (no run's settings beside it logged to W&B, --track)"
    return None


def _json_object(path: str) -> dict:
    """The JSON object in path ({} for anything else)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class RunDir:
    """A run's directory: claimed for this run (claim_run_dir: one run per directory, one run at a time), seen by every
    rank (check_shared_dir), and its checkpoints, <path>/checkpoints/step_NNNNNN. A checkpoint holds `parts`:
    {folder in it ("" for its root): (model, optimizer, {name: an object with state_dict() and load_state_dict()})},
    and the random streams (this process's and the sampler's generator). Collective: every rank builds it."""

    def __init__(self, path: str, infra, device, config: dict):
        """Nothing in the directory changes here: a new run removes an old one (--overwrite) and a resume from an
        older step sets the later checkpoints aside in start(), once every input has been read and checked. config:
        the run's settings (common.config.run_config), which a resume must match (check_resume_config) and every
        checkpoint records."""
        self.path, self.keep_last, self.config, self.overwrite = path, infra.keep_last, config, infra.overwrite
        self.checkpoints = os.path.join(path, "checkpoints")
        self.lock = claim_run_dir(path, infra.resume, infra.overwrite)  # rank 0 holds it for the run
        check_shared_dir(path, device)  # every rank writes its shards into the checkpoints: fail now, not at a save
        exits.progress.hint = None if infra.overwrite else partial(resume_hint, self.checkpoints)  # (Ctrl-C)
        self.resume_dir = find_resume_dir(infra.resume, self.checkpoints) if infra.resume else None
        if self.resume_dir:  # the settings that define the run must be the checkpoint's (--accept-changes: on purpose)
            check_resume_config(self.resume_dir, path, config, infra.accept_changes)
            check_steps_left(self.resume_dir, config["num_steps"])

    def start(self, step: int) -> None:
        """Collective. Every input is read and checked: only now does the directory change. --overwrite removes the
        old run (clear_run_dir); a resume from an older step moves the later checkpoints, and their rows of the log,
        aside (set_aside_newer)."""
        if self.overwrite:
            clear_run_dir(self.path)
        if self.resume_dir:
            error = None
            if dist.get_rank() == 0:
                try:
                    set_aside_newer(self.checkpoints, step, os.path.join(self.path, "metrics.jsonl"))
                except OSError as e:
                    error = f"--resume: cannot move the checkpoints after step {step} aside in {self.checkpoints}: {e}"
            _raise_on_every_rank(error)
        exits.progress.hint = partial(resume_hint, self.checkpoints)  # (not a lambda: it would keep self, the lock)

    def save(self, step: int, tokenizer, parts: dict, sampler) -> str:
        """Collective: save_checkpoint of every part and stream."""
        states = {folder: (model, optimizer, {name: obj.state_dict() for name, obj in state.items()})
                  for folder, (model, optimizer, state) in parts.items()}
        states[""][2]["config"] = self.config  # the settings it was trained with, which a resume is checked against
        return checkpoint.save_checkpoint(self.checkpoints, step, tokenizer, states,
                               rng_state(getattr(sampler, "generator", None)), self.keep_last)

    def load(self, parts: dict, sampler) -> int:
        """Collective. Restore every part's optimizer and state objects and the random streams from resume_dir (its
        weights come with building the models from it), and return its step; 0 without --resume. State of the wrong
        shape is a one-line error naming its file, on every rank."""
        if self.resume_dir is None:
            return 0
        for folder, (model, optimizer, state) in parts.items():
            path = os.path.join(self.resume_dir, folder)
            trainer_state, rank_state = load_training_state(path, model, optimizer)
            for name, obj in state.items():  # ({}: a state a checkpoint of an older version did not keep)
                with checkpoint.damaged(os.path.join(path, "trainer_state.json"), f"its {name} is not the state of "
                                        f"a {type(obj).__name__}"):
                    obj.load_state_dict(trainer_state.get(name, {}))
            if folder == "":
                step, streams = trainer_state["step"], rank_state
        # the random streams last: rng_rank<r>.json is this rank's own, so a damaged one stops every rank here, after
        # the collectives of loading
        error = None
        if streams:
            try:
                with checkpoint.damaged(os.path.join(self.resume_dir, f"rng_rank{dist.get_rank()}.json"),
                                        "not a random state this run can restore"):
                    set_rng_state(streams, getattr(sampler, "generator", None))
            except ValueError as e:
                error = str(e)
        _raise_on_every_rank(error)
        if dist.get_rank() == 0:
            print(f"[resume] from {self.resume_dir} at step {step}", flush=True)
        return step


def resume_hint(ckpt_root: str) -> str:
    """How the line on Ctrl-C goes on: --resume latest when a checkpoint exists to resume from, else that there is
    none (a --resume latest would fail)."""
    found = checkpoint.list_checkpoints(ckpt_root)
    if found:
        return f"; resume with --resume latest (step {checkpoint.checkpoint_step(found[-1])})"
    return ", before the run's first checkpoint: nothing to resume; start it again with --overwrite"


def set_aside_newer(ckpt_root: str, step: int, metrics_path: str) -> None:
    """A resume from an older step starts a new line of steps: the checkpoints of later steps are moved into
    ckpt_root/abandoned_<time>_<pid>/ (never deleted; --resume latest and --keep-last then see the new line only),
    with the rows of metrics_path after `step`, which the resumed run's log drops (docs/checkpoints.md). Not fsynced:
    the next save fsyncs ckpt_root; a crash before it may leave some in place (resume from the same step again)."""
    newer = [c for c in checkpoint.list_checkpoints(ckpt_root) if checkpoint.checkpoint_step(c) > step]
    if not newer:
        return
    aside = os.path.join(ckpt_root, f"abandoned_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}")
    os.makedirs(aside)
    rows = rows_after(metrics_path, step)
    if rows:  # first: the log of the line left behind goes with its checkpoints
        with open(os.path.join(aside, "metrics.jsonl"), "w") as f:
            f.writelines(rows)
    for c in newer:
        os.replace(c, os.path.join(aside, os.path.basename(c)))
    steps = ", ".join(str(checkpoint.checkpoint_step(c)) for c in newer)
    print(f"[resume] {ckpt_root} held checkpoints after step {step} ({steps}) of the line this resume leaves: moved "
          f"into {aside}" + (f" with the {len(rows)} rows of metrics.jsonl after step {step}" if rows else ""),
          flush=True)


def check_steps_left(resume_dir: str, num_steps: int) -> None:
    """A resume whose --num-steps is not past the checkpoint's step would train nothing (and evaluate the checkpoint
    again; from an older checkpoint, set the later ones aside): refused before anything is loaded or moved."""
    step = checkpoint.read_json(os.path.join(resume_dir, "trainer_state.json"), "--resume")["step"]
    if num_steps <= step:
        raise ValueError(f"--num-steps {num_steps}: the checkpoint {resume_dir} is at step {step} already: nothing to "
                         f"train; give --num-steps above {step} to continue the run")


def claim_run_dir(run_dir: str, resume: str | bool | None, overwrite: bool):
    """Collective (where a process group exists). Make run_dir, lock it and check that it holds no other run (with
    overwrite: that the run there may be removed, which clear_run_dir does once every input is checked) and nothing
    that is not a run; ValueError, one line, on every rank otherwise (docs/faults.md). Nothing is removed here, and
    with resume "latest" (--resume latest) a run_dir that does not exist is not made: there is nothing to resume.
    Returns the lock on rank 0 (held for the whole run: keep a reference to it), None elsewhere."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    lock, error = None, None
    if rank == 0:
        try:
            if resume == "latest" and not os.path.isdir(run_dir):
                raise ValueError(f"--resume latest: --run-dir {run_dir!r} does not exist, so it holds no run to "
                                 "resume; give the run's --run-dir, or leave out --resume to start a new run")
            lock = _lock(run_dir)
            foreign = not_a_run(run_dir)
            found = run_files(run_dir)
            if foreign:
                error = (f"--run-dir {run_dir!r}: {foreign}: a run's files would mix with it (and --overwrite would "
                         "delete it); give another --run-dir")
            elif found and overwrite:
                print(f"[run-dir] --overwrite: the run in {run_dir} ({', '.join(found)}) is removed once this run's "
                      "inputs are read and checked", flush=True)
            elif found and not resume:
                how = ": continue it with --resume latest, " if "checkpoints" in found else " that saved no checkpoint: "
                error = (f"--run-dir {run_dir!r} holds another run ({', '.join(found)}){how}remove it with "
                         "--overwrite, or give another --run-dir")
        except (ValueError, OSError) as e:
            error = str(e) if isinstance(e, ValueError) else f"--run-dir {run_dir!r}: {e.strerror or e}"
    if error and lock is not None:
        lock.release()
    _raise_on_every_rank(error)
    return lock


def clear_run_dir(run_dir: str) -> None:
    """Collective. --overwrite: remove the run's files from run_dir (claimed with claim_run_dir, so locked and known
    to hold a run), keeping any other file (a log teed there). Called once every input of the new run has been read
    and checked: a new run that stops on bad input leaves the old one as it was. ValueError on every rank when a file
    cannot be removed."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    error = None
    if rank == 0:
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
    _raise_on_every_rank(error)


def _raise_on_every_rank(error: str | None) -> None:
    """Collective (where a process group exists). Raise ValueError, on every rank, with the first failing rank's line,
    when any rank has one: every rank stops with the same line, or none does."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise ValueError(error)


def _lock(run_dir: str) -> filelock.FileLock:
    """<run_dir>/.lock, held (flock: the system frees it when the process ends, so a dead run's lock never blocks)."""
    os.makedirs(run_dir, exist_ok=True)
    lock = filelock.FileLock(os.path.join(run_dir, LOCK_FILE), timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise ValueError(f"--run-dir {run_dir!r}: another run is using it; wait for it to end or give another "
                         "--run-dir") from None
    return lock
