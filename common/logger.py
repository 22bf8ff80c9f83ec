"""Logging on rank 0: a progress bar, one readable line per step, metrics.jsonl in the run directory, and wandb
only with --track (offline when no account is configured). Other ranks get a logger that does nothing."""
import json
import math
import os

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
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")  # append: a resumed run keeps its history
        self.bar = tqdm(total=total_steps, initial=start_step, desc=run_name or "train", dynamic_ncols=True,
                        disable=None)  # None: a bar on a terminal, none in a log file
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
            parts = [f"step {step}"] + [f"{short} {fmt(metrics[k])}" for k, short in LINE_KEYS if k in metrics]
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


def fmt(x) -> str:
    if isinstance(x, float) and math.isfinite(x) and x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e5):
        return f"{x:.2e}"
    return f"{x:.4g}" if isinstance(x, float) else str(x)
