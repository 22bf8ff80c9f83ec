"""Precision: the flags' dtypes, FP16 dynamic loss scaling and the check of every step's log-probs; what each flag sets
and what stays fp32: docs/algorithms.md, "Precision"."""
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
    """The flag's name of a dtype (fp16, bf16, fp32), for messages."""
    return next(name for name, d in DTYPES.items() if d == dtype)


class LossScaler:
    """Dynamic loss scaling for FP16 (a no-op at scale 1 for bf16/fp32): the order of operations, and why not
    torch.amp.GradScaler (it decides to skip from one rank's shards; here the global gradient norm decides, so every
    rank skips the same steps): docs/algorithms.md, "FP16 loss scaling". A skipped step leaves the weights untouched.
    `fault` says when the run should stop rather than skip on: a non-finite gradient without loss scaling, or
    `max_consecutive_skips` fp16 steps in a row skipped (0: never).
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, min_scale: float = 1.0,
                 max_consecutive_skips: int = 20):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval, self.growth_factor = growth_interval, growth_factor
        self.backoff_factor, self.min_scale = backoff_factor, min_scale
        self.good_steps = 0  # finite steps since the last change of scale
        self.skipped_steps = 0  # total, for the log
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self.fault: str | None = None  # why the run should stop (set by step), else None
        self.norms: list[float] = []  # the gradient norms of the steps since the last log()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def step(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_grad_norm: float
             ) -> tuple[float, bool]:
        """Unscale the gradients, clip them, and take the optimizer step unless the gradients hold an inf or a NaN.
        Returns (grad norm before clipping, unscaled; skipped). Gradients are zeroed either way."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.enabled:
            inv = 1.0 / self.scale
            for g in grads:
                g.mul_(inv)
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2: the norm over every rank's shard
            norm = norm.full_tensor()
        norm = norm.item()
        self.norms.append(norm)
        skipped = not math.isfinite(norm)
        if skipped:
            self.skipped_steps += 1
            self.consecutive_skips += 1
        else:
            self.consecutive_skips = 0
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.enabled:
            if skipped:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self.good_steps = 0
            else:
                self.good_steps += 1
                if self.good_steps >= self.growth_interval:
                    self.scale *= self.growth_factor
                    self.good_steps = 0
        if skipped and not self.enabled:
            self.fault = f"non-finite gradient norm ({norm}) without loss scaling: the loss or the model is broken"
        elif self.max_consecutive_skips and self.consecutive_skips >= self.max_consecutive_skips:
            self.fault = (f"{self.consecutive_skips} fp16 optimizer steps in a row skipped for non-finite gradients "
                          f"(loss scale now {self.scale:g})")
        return norm, skipped

    def log(self, prefix: str = "optim") -> dict:
        """<prefix>/grad_norm (the mean of the finite gradient norms of the steps since the last call: a skipped
        step's is inf; nan when all were), <prefix>/loss_scale and <prefix>/skipped_steps (in the whole run)."""
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
    """Collective. Raise TrainingFault, on every rank, when a response token's log-prob (the trainer's old_logp, the
    sampler's mu_logp) is NaN or infinite on any rank: a NaN would otherwise pass silently into the metrics and,
    through a rollout correction's weights, into the loss (docs/algorithms.md, "Range checks")."""
    counts = {name: float((~torch.isfinite(t) & mask_BT).sum()) for name, t in logp_BT.items()}
    counts = reduce_stats(counts, "sum", device)
    bad = {name: int(n) for name, n in counts.items() if n}
    if bad:
        side = {"old_logp": f"the trainer ({precision_name(train)})",
                "mu_logp": f"the sampler ({precision_name(rollout)})"}
        which = "; ".join(f"{n} response tokens with a non-finite {name} from {side.get(name, name)}"
                          for name, n in bad.items())
        raise TrainingFault(f"step {step}: {which}. The model's forward likely overflows in 16 bits: try "
                            "--train-precision / --rollout-precision bf16 or fp32 for that side")
