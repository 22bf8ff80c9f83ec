"""The precision flags' dtypes, FP16 dynamic loss scaling, the check of each step's log-probs (docs/algorithms.md)."""
import math

import torch

from common.dist import reduce_stats


class TrainingFault(RuntimeError):
    """A numerical fault the run cannot train through; the scripts save the last good state and stop."""


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # the flags' names


def resolve_precisions(precision: str, train: str | None, rollout: str | None) -> tuple[torch.dtype, torch.dtype]:
    """(train dtype, rollout dtype) of the flags: each side is `precision` unless overridden. Resolved once, here."""
    train, rollout = train or precision, rollout or precision
    for name in (train, rollout):
        if name not in DTYPES:
            raise ValueError(f"unknown precision {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[train], DTYPES[rollout]


def precision_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)  # the flag's name of a dtype, for messages


class LossScaler:
    """Dynamic loss scaling for FP16 (scale 1 for bf16/fp32). Not torch.amp.GradScaler, which skips from one rank's
    shards: the global gradient norm decides, so every rank skips the same steps (docs/algorithms.md)."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, min_scale: float = 1.0,
                 max_consecutive_skips: int = 20):
        self.enabled, self.scale = enabled, init_scale if enabled else 1.0
        self.growth_interval, self.growth_factor, self.backoff_factor = growth_interval, growth_factor, backoff_factor
        self.min_scale, self.max_consecutive_skips = min_scale, max_consecutive_skips  # 0: skips never stop the run
        # finite steps since the last change of scale; skipped steps in the whole run (for the log), and in a row
        self.good_steps = self.skipped_steps = self.consecutive_skips = 0
        self.fault: str | None = None  # why the run should stop (set by step), else None
        self.norms: list[float] = []  # the gradient norms of the steps since the last log()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def step(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_grad_norm: float
             ) -> tuple[float, bool]:
        """Unscale and clip the gradients, and step unless they hold an inf or a NaN (a skipped step leaves the weights
        untouched); zero them either way. Returns (the unscaled grad norm before clipping, skipped)."""
        if self.enabled:
            for g in [p.grad for p in params if p.grad is not None]:
                g.mul_(1.0 / self.scale)
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        # under FSDP2 a DTensor: full_tensor() is the norm over every rank's shard
        norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
        self.norms.append(norm)
        skipped = not math.isfinite(norm)
        self.skipped_steps += skipped
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if not skipped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.enabled and skipped:
            self.scale, self.good_steps = max(self.scale * self.backoff_factor, self.min_scale), 0
        elif self.enabled:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale, self.good_steps = self.scale * self.growth_factor, 0
        if skipped and not self.enabled:
            self.fault = f"non-finite gradient norm ({norm}) without loss scaling: the loss or the model is broken"
        elif self.max_consecutive_skips and self.consecutive_skips >= self.max_consecutive_skips:
            self.fault = (f"{self.consecutive_skips} fp16 optimizer steps in a row skipped for non-finite gradients "
                          f"(loss scale now {self.scale:g})")
        return norm, skipped

    def log(self, prefix: str = "optim") -> dict:
        """<prefix>/grad_norm (the mean of the finite norms since the last call; nan if none), <prefix>/loss_scale and
        <prefix>/skipped_steps (in the whole run)."""
        finite = [n for n in self.norms if math.isfinite(n)]
        self.norms = []
        return {f"{prefix}/grad_norm": sum(finite) / len(finite) if finite else float("nan"),
                f"{prefix}/loss_scale": self.scale, f"{prefix}/skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])  # (a number, not just JSON)
        self.skipped_steps, self.consecutive_skips = int(state["skipped_steps"]), int(state.get("consecutive_skips", 0))


def check_finite_logprobs(step: int, mask_BT: torch.Tensor, device, train: torch.dtype, rollout: torch.dtype,
                          **logp_BT) -> None:
    """Collective. TrainingFault on every rank when a response token's old_logp (trainer) or mu_logp (sampler) is not
    finite on any rank: a NaN would pass silently into the metrics and the loss (docs/algorithms.md, "Range checks")."""
    counts = {name: float((~torch.isfinite(t) & mask_BT).sum()) for name, t in logp_BT.items()}
    bad = {name: int(n) for name, n in reduce_stats(counts, "sum", device).items() if n}
    if bad:
        side = {"old_logp": f"the trainer ({precision_name(train)})",
                "mu_logp": f"the sampler ({precision_name(rollout)})"}
        which = "; ".join(f"{n} response tokens with a non-finite {name} from {side.get(name, name)}"
                          for name, n in bad.items())
        raise TrainingFault(f"step {step}: {which}. The model's forward likely overflows in 16 bits: try "
                            "--train-precision / --rollout-precision bf16 or fp32 for that side")
