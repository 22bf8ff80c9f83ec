"""Precision policies and FP16 dynamic loss scaling.

`--precision` sets the trainer's compute dtype (FSDP2 param_dtype; master weights and optimizer states stay fp32)
and the sampler's weight dtype; `--train-precision` / `--rollout-precision` override one side. Log-probs are fp32
everywhere: they are never rounded to 16 bits.
"""
import math

import torch


class TrainingFault(RuntimeError):
    """A numerical fault the run cannot train through; the scripts save the last good state and stop."""

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_precisions(precision: str, train: str | None, rollout: str | None) -> tuple[str, str]:
    """(train precision, rollout precision): each side is `precision` unless overridden."""
    train, rollout = train or precision, rollout or precision
    for name in (train, rollout):
        if name not in DTYPES:
            raise ValueError(f"unknown precision {name!r}: choose one of {', '.join(DTYPES)}")
    return train, rollout


class LossScaler:
    """Dynamic loss scaling for FP16 (a no-op at scale 1 for bf16/fp32), in the order nanoGPT uses with GradScaler:
    scale -> backward -> unscale -> clip -> step (skipped on inf/nan, scale halved) -> grow after a run of good steps.

    Why not torch.amp.GradScaler: under FSDP2 every rank holds a shard of the gradients, and GradScaler decides to
    skip from the shards it sees, so one rank can skip a step that another takes. Here the decision comes from the
    global gradient norm (clip_grad_norm_ all-reduces it over the shards), so every rank skips the same steps.

    A skipped step leaves the weights untouched. `fault` says when the run should stop rather than skip on: a
    non-finite gradient without loss scaling (bf16/fp32: no overflow to blame, something is broken), or
    `max_consecutive_skips` fp16 steps in a row skipped (the scale no longer recovers; 0: never).
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

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped_steps = state["scale"], state["good_steps"], state["skipped_steps"]
        self.consecutive_skips = state.get("consecutive_skips", 0)
