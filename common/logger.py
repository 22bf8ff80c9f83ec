"""Logging on rank 0: a progress bar, one readable line per step (ending with the elapsed time and eta_s), metrics.jsonl
in the run directory, and wandb only with --track (offline without an account). Other ranks' logger does nothing."""
import json
import math
import os
import time

from tqdm import tqdm

# the keys shown in the readable per-step line, with their short names
LINE_KEYS = [("train/accuracy", "acc"), ("train/response_len_mean", "len"), ("mismatch/kl_k3", "kl_k3"),
             ("policy/clip_frac", "clip"), ("optim/grad_norm", "gnorm"), ("optim/loss_scale", "scale"),
             ("time/step", "s")]


class Logger:
    def __init__(self, run_dir: str, config: dict, enabled: bool, total_steps: int, start_step: int = 0,
                 track: bool = False, project: str = "rl-mismatch", run_name: str | None = None):
        self.enabled = enabled
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)
        self.file = open_metrics(os.path.join(run_dir, "metrics.jsonl"), start_step)
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
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if advance:
            now = time.monotonic()
            self.intervals.append(now - self.t_last)
            self.t_last = now
            parts = [f"step {step}"] + [f"{short} {fmt(metrics[k])}" for k, short in LINE_KEYS if k in metrics]
            parts.append(f"elapsed {fmt_duration(now - self.t_start)}")
            left = eta_s(self.intervals, self.total_steps - step)
            if left is not None:
                parts.append(f"left ~{fmt_duration(left)}")
            self.bar.write(" | ".join(parts))
            self.bar.update(1)
        else:
            self.bar.write(f"step {step} | " + " | ".join(f"{k} {fmt(v)}" for k, v in metrics.items()))

    def close(self) -> None:
        if not self.enabled:
            return
        self.bar.close()
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def open_metrics(path: str, start_step: int):
    """metrics.jsonl for appending. A resumed run keeps the rows up to its checkpoint's step and drops later ones,
    which a crash left behind and the resumed run logs anew. A fresh run moves an old file aside to .prev."""
    if os.path.exists(path):
        if start_step == 0:
            os.replace(path, path + ".prev")
            print(f"[log] {path} existed: moved to {path}.prev (use --resume latest to continue that run)")
        else:
            with open(path) as f:
                lines = f.readlines()
            keep = [line for line in lines if _step(line) is not None and _step(line) <= start_step]
            if len(keep) < len(lines):
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    f.writelines(keep)
                os.replace(tmp, path)
                print(f"[log] dropped {len(lines) - len(keep)} rows of metrics.jsonl logged after step {start_step}, "
                      "the checkpoint resumed from")
    return open(path, "a")


def _step(line: str) -> int | None:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # a row torn by a crash mid-write
        return None


def eta_s(intervals: list[float], steps_left: int) -> float | None:
    """Seconds left: steps_left times the mean of `intervals`, the wall times between this run's consecutive step
    lines, leaving out the first (it carries one-time costs: compilation, CUDA graph capture, the initial evaluation,
    a resume's loading). The intervals include the evaluations and checkpoints that fell between steps, which recur in
    the rest of the run. None before a second step (there is no estimate yet)."""
    later = intervals[1:]
    if not later:
        return None
    return max(steps_left, 0) * sum(later) / len(later)


def fmt_duration(seconds: float) -> str:
    """45s, 3m05s, 2h07m: two units at most, rounded down."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt(x) -> str:
    if isinstance(x, float) and math.isfinite(x) and x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e5):
        return f"{x:.2e}"
    return f"{x:.4g}" if isinstance(x, float) else str(x)
