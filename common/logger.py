"""Logging on rank 0 (every rank calls it): a progress bar, a line per step, metrics.jsonl, and wandb with --track."""
import errno
import json
import math
import os
import re
import time

from tqdm import tqdm

from common.dist import agree_on_error
from common.precision import TrainingFault

LINE_KEYS = [("train/accuracy", "acc"), ("reward_model/score_mean", "rm"), ("train/response_len_mean", "len"),
             ("mismatch/kl_k3", "kl_k3"), ("policy/clip_frac", "clip"), ("optim/grad_norm", "gnorm"),
             ("optim/loss_scale", "scale"), ("time/step", "s")]
CONFIG_RESUME = re.compile(r"^config_resume_(\d+)(?:_(\d+))?\.json$")  # the files record_config writes at a resume


class LogWriteError(TrainingFault):
    """The run's log could not be written (a full disk, a lost mount): the run stops, exit code 3."""


class Logger:
    def __init__(self, run_dir: str, config: dict, enabled: bool, total_steps: int, start_step: int = 0,
                 track: bool = False, project: str = "rl-mismatch", run_name: str | None = None):
        """Collective where a process group exists; records the run's settings (record_config)."""
        self.enabled = enabled
        error = None
        if enabled:
            try:
                os.makedirs(run_dir, exist_ok=True)
                record_config(run_dir, config, start_step)
                self.path = os.path.join(run_dir, "metrics.jsonl")
                self.file = open_metrics(self.path, start_step)
            except OSError as e:
                error = write_error(e, getattr(e, "filename", None) or run_dir, f"step {start_step}")
        agree_on_error(error, LogWriteError)
        if not enabled:
            return
        self.bar = tqdm(total=total_steps, initial=start_step, desc=run_name or "train", dynamic_ncols=True,
                        disable=None)  # None: a bar on a terminal, none in a log file
        self.total_steps = total_steps
        self.t_start = self.t_last = time.monotonic()
        self.intervals = []  # wall seconds between this run's consecutive step lines
        self.wandb = None
        if track:
            import wandb
            has_account = bool(os.environ.get("WANDB_API_KEY")) or os.path.exists(os.path.expanduser("~/.netrc"))
            self.wandb = wandb.init(project=project, name=run_name, config=config, dir=run_dir,
                                    mode=os.environ.get("WANDB_MODE", "online" if has_account else "offline"))

    def log(self, metrics: dict, step: int, advance: bool = True) -> None:
        """Collective where a process group exists (every rank calls it; rank 0 writes)."""
        error = None
        if self.enabled:
            try:
                write_row(self.file, (json.dumps({"step": step, **metrics}) + "\n").encode())
            except OSError as e:
                error = write_error(e, self.path, f"step {step}")
        agree_on_error(error, LogWriteError)
        if not self.enabled:
            return
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if not advance:
            self.bar.write(f"step {step} | " + " | ".join(f"{k} {fmt(v)}" for k, v in metrics.items()))
            return
        now = time.monotonic()
        self.intervals.append(now - self.t_last)
        self.t_last = now
        parts = [f"step {step}"] + [f"{short} {fmt(metrics[k])}" for k, short in LINE_KEYS if k in metrics]
        parts.append(f"elapsed {fmt_duration(now - self.t_start)}")
        if (left := eta_s(self.intervals, self.total_steps - step)) is not None:
            parts.append(f"left ~{fmt_duration(left)}")
        self.bar.write(" | ".join(parts))
        self.bar.update(1)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()


def write_error(e: OSError, path: str, when: str) -> str:
    """`<when>: cannot write <path>: ...`, a full disk said as such."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{when}: cannot write {path}: no space left on {os.path.dirname(os.path.abspath(path))} ({e.strerror})"
    return f"{when}: cannot write {path} ({e.strerror or e})"


def write_row(file, data: bytes) -> None:
    """All of data into the unbuffered file (os.write may write part of it: a nearly full disk)."""
    view = memoryview(data)
    while view:
        view = view[file.write(view):]


def record_config(run_dir: str, config: dict, start_step: int) -> None:
    """The settings, atomically: config.json, or config_resume_<S>.json (_2, ...) for a run resumed at step S."""
    path = base = os.path.join(run_dir, f"config_resume_{start_step:06d}.json" if start_step else "config.json")
    n = 1
    while start_step and os.path.lexists(path):
        n += 1
        path = base.removesuffix(".json") + f"_{n}.json"
    with open(path + ".tmp", "w") as f:
        json.dump(config, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def open_metrics(path: str, start_step: int):
    """metrics.jsonl, unbuffered (a failed write leaves nothing to write at exit); a resumed run drops the rows after
    its step and torn ones (a lost last newline is restored), a fresh run moves an old file aside to .prev."""
    if os.path.exists(path) and start_step == 0:
        os.replace(path, path + ".prev")
        print(f"[log] {path} existed: moved to {path}.prev (use --resume latest to continue that run)")
    elif os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
        keep = [line for line in lines if (s := row_step(line)) is not None and s <= start_step]
        if len(keep) < len(lines) or (keep and not keep[-1].endswith("\n")):
            with open(path + ".tmp", "w") as f:
                f.writelines(line if line.endswith("\n") else line + "\n" for line in keep)
            os.replace(path + ".tmp", path)
        if len(keep) < len(lines):
            print(f"[log] dropped {len(lines) - len(keep)} rows of metrics.jsonl logged after step {start_step}, "
                  "the checkpoint resumed from (or torn by a crash)")
    return open(path, "ab", buffering=0)


def row_step(line: str) -> int | None:
    """The step of a metrics.jsonl row, or None for a row torn by a crash mid-write (or not a row)."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def rows_after(metrics_path: str, step: int) -> list[str]:
    """The complete rows of a metrics.jsonl logged after `step`, each ending in a newline."""
    if not os.path.isfile(metrics_path):
        return []
    with open(metrics_path, encoding="utf-8", errors="replace") as f:
        return [line if line.endswith("\n") else line + "\n" for line in f
                if (s := row_step(line)) is not None and s > step]


def eta_s(intervals: list[float], steps_left: int) -> float | None:
    """Seconds left: steps_left times the mean interval between step lines (evaluations and saves included, as they
    recur), leaving out the first (one-time costs: compilation, the first evaluation, loading). None before a second."""
    later = intervals[1:]
    return max(steps_left, 0) * sum(later) / len(later) if later else None


def fmt_duration(seconds: float) -> str:
    """45s, 3m05s, 2h07m: two units at most, rounded down."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    return f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt(x) -> str:
    if isinstance(x, float) and math.isfinite(x) and x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e5):
        return f"{x:.2e}"
    return f"{x:.4g}" if isinstance(x, float) else str(x)
