"""A step's metrics (StepStats), the mismatch/* keys (docs/algorithms.md) and the collapse warning (MismatchMonitor)."""
import math
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist


# PyTorch counts a sleeping vLLM engine's tensors as allocated, though sleep released their GPU memory: `released`
# bytes of them now, and the real peak of the phase's windows closed so far (a window: constant `released`)
_pool = {"released": 0, "peak": 0}


def set_released(n: int) -> None:
    """The sampler's sleep and wake: closes the window of the old value (a peak reset), so that no mem/*_peak_gib
    counts memory that was released, nor leaves out memory that was in use."""
    _pool["peak"] = max(_pool["peak"], torch.cuda.max_memory_allocated() - _pool["released"])
    torch.cuda.reset_peak_memory_stats()
    _pool["released"] = n


class StepStats:
    """A step's metrics on this rank, added where computed (0-d tensors may stay on the GPU: no sync before reduce)."""

    def __init__(self, device):
        self.device = device
        self.totals, self.counts, self.maxes, self.mins, self.values = {}, {}, {}, {}, {}
        self.rates = {}  # key: (amount key, phase): amount summed over the ranks per second of this rank's phase
        self.t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def add(self, key: str, total, count=None) -> None:
        """A mean, total / count over all ranks (count None: the total itself, a sum)."""
        self.totals[key] = self.totals.get(key, 0.0) + total
        if count is not None:
            self.counts[key] = self.counts.get(key, 0.0) + count

    def update(self, means: dict) -> None:  # {key: (total, count)}, as a loss returns
        for key, (total, count) in means.items():
            self.add(key, total, count)

    def max(self, key: str, value) -> None:
        self.maxes.setdefault(key, []).append(value)

    def min(self, key: str, value) -> None:
        self.mins.setdefault(key, []).append(value)

    def set(self, key: str, value) -> None:  # no reduction: the same on every rank, or rank 0's own
        self.values[key] = value

    def rate(self, key: str, amount, phase: str) -> None:
        """key = the amount, summed over the ranks, per second of this rank's `phase` (perf/ keys)."""
        self.add(f"_{key}", amount)
        self.rates[key] = (f"_{key}", phase)

    @contextmanager
    def phase(self, name: str):
        """time/<name>, and on a GPU mem/<name>_peak_gib (PyTorch's peak allocation, a sleeping vLLM engine's released
        pool left out) and mem/<name>_used_gib (the device's memory in use at its end, vLLM's included) unless
        memory(name) recorded them earlier in the phase."""
        t0 = time.perf_counter()
        if self.device.type == "cuda":  # (what ran between phases, or after memory() in the last one, is not counted)
            torch.cuda.reset_peak_memory_stats(self.device)
            _pool["peak"] = 0
        yield
        if f"mem/{name}_used_gib" not in self.values:
            self.memory(name)
        self.values[f"time/{name}"] = time.perf_counter() - t0

    def memory(self, name: str) -> None:
        """The GPU memory of phase `name` now (see phase), and a new peak from here."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            peak = max(_pool["peak"], torch.cuda.max_memory_allocated(self.device) - _pool["released"])
            self.values[f"mem/{name}_peak_gib"] = peak / 2**30
            self.values[f"mem/{name}_used_gib"] = (total - free) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
            _pool["peak"] = 0

    def reduce(self, all_ranks: bool = True) -> dict:
        """Collective (two: a sum, a max of maxima and negated minima): every metric over all ranks (all_ranks=False:
        this rank's); time/step since construction. A mean, max or min of nothing is NaN, never a measured-looking 0."""
        means, sums = sorted(self.counts), sorted(k for k in self.totals if k not in self.counts)
        hi, lo = sorted(self.maxes), sorted(self.mins)
        s = torch.tensor([float(self.totals[k]) for k in means + sums] + [float(self.counts[k]) for k in means],
                         dtype=torch.float64, device=self.device)
        m = torch.tensor([max(map(float, self.maxes[k])) for k in hi] + [-min(map(float, self.mins[k])) for k in lo],
                         dtype=torch.float64, device=self.device)
        if all_ranks and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(s)
            dist.all_reduce(m, op=dist.ReduceOp.MAX)
        s, m = s.tolist(), m.tolist()
        n, nan = len(means), float("nan")
        out = {k: s[i] / s[n + len(sums) + i] if s[n + len(sums) + i] else nan for i, k in enumerate(means)}
        out.update((k, s[n + i]) for i, k in enumerate(sums))
        out.update((k, m[i] if m[i] != -math.inf else nan) for i, k in enumerate(hi))
        out.update((k, -m[len(hi) + i] if m[len(hi) + i] != -math.inf else nan) for i, k in enumerate(lo))
        out.update(self.values)
        for key, (amount, phase) in self.rates.items():
            out[key] = out.pop(amount) / self.values[f"time/{phase}"]
        out["time/step"] = time.perf_counter() - self.t0
        return out


def mismatch(stats: StepStats, old_logp_BT: torch.Tensor, mu_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> None:
    """The mismatch/* keys (docs/algorithms.md) into stats: old_logp the trainer's pi_old, mu_logp the sampler's, fp32
    B x T on one device, mask_BT bool. Any set of whole sequences: micro-batches' sums add up to the batch's."""
    m = mask_BT.float()
    n_tok, n_seq = m.sum(), float(mask_BT.shape[0])
    d = (old_logp_BT - mu_logp_BT) * m  # log pi_old - log mu, 0 off the mask
    prob_diff = (mu_logp_BT.exp() - old_logp_BT.exp()).abs() * m
    seq_log_ratio_B = d.sum(-1)  # log rho_i
    stats.add("mismatch/kl_k1", (-d).sum(), n_tok)  # k1 of KL(mu || pi_old): samples from mu
    stats.add("mismatch/kl_k2", (0.5 * d ** 2).sum(), n_tok)
    stats.add("mismatch/kl_k3", ((torch.expm1(d) - d) * m).sum(), n_tok)  # exp(d) - 1 - d >= 0, unbiased
    stats.add("mismatch/prob_abs_diff_mean", prob_diff.sum(), n_tok)
    stats.max("mismatch/prob_abs_diff_max", prob_diff.max())
    stats.add("mismatch/seq_log_ratio_mean", seq_log_ratio_B.sum(), n_seq)
    stats.min("mismatch/seq_log_ratio_min", seq_log_ratio_B.min())
    stats.max("mismatch/seq_log_ratio_max", seq_log_ratio_B.max())
    # a count, not an estimate: kl_k3 is exactly 0 in fp32 for |d| < 2^-23 although the log-probs differ
    unequal_BT = (old_logp_BT != mu_logp_BT) & mask_BT
    stats.add("mismatch/unequal_tokens", unequal_BT.sum())
    stats.add("mismatch/unequal_frac", unequal_BT.sum(), n_tok)
    stats.max("mismatch/logp_abs_diff_max", torch.where(mask_BT, d.abs(), float("-inf")).max())


def reference_kl(stats: StepStats, old_logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor | None,
                 mask_BT: torch.Tensor) -> None:
    """The kl_ref/* keys (--kl-coef; None: nothing) into stats: k1 and k3 of KL(pi_old || ref) on pi_old's samples."""
    if ref_logp_BT is None:
        return
    m = mask_BT.float()
    d = (ref_logp_BT - old_logp_BT) * m  # log ref - log pi_old, 0 off the mask
    stats.add("kl_ref/kl_k1", (-d).sum(), m.sum())
    stats.add("kl_ref/kl_k3", ((torch.expm1(d) - d) * m).sum(), m.sum())


class MismatchMonitor:
    """Early warning of collapse (docs/algorithms.md, "The collapse warning"); its state goes into checkpoints."""

    def __init__(self, factor: float, window: int, floor: float = 1e-6, exact: bool = False):
        self.factor, self.window, self.floor, self.exact = factor, window, floor, exact
        self.baseline: float | None = None
        self.recent: list[float] = []  # the first `window` values until the baseline exists, then the last `window`
        self.warning = False

    def update(self, step_metrics: dict) -> tuple[dict, str | None]:
        """This step's metrics, and a message when the warning switches, or with exact on any unequal log-prob."""
        out, message = self._growth(step_metrics["mismatch/kl_k3"])
        if self.exact and (unequal := step_metrics.get("mismatch/unequal_tokens", 0)):
            message = (f"[exact] {unequal:.0f} response tokens' log-probs differ from the sampler's (max |diff| "
                       f"{step_metrics.get('mismatch/logp_abs_diff_max', float('nan')):.3g}): exact mode is not "
                       "bitwise on this setup; check the [exact] line at start and docs/exact.md (supported models, "
                       "the pinned vLLM)" + (f"\n{message}" if message else ""))
        return out, message

    def _growth(self, kl: float) -> tuple[dict, str | None]:
        if self.factor <= 0 or not self.window:
            return {}, None
        self.recent = (self.recent + [kl])[-self.window:]
        if self.baseline is None:
            if len(self.recent) == self.window:
                self.baseline = sum(self.recent) / self.window
            return {}, None
        growth = sum(self.recent) / self.window / max(self.baseline, self.floor)
        warning, message = growth > self.factor, None
        if warning != self.warning:
            message = (f"[warning] the training-inference mismatch grew {growth:.1f}x over its early baseline "
                       f"(kl_k3 {self.baseline:.2e} -> {sum(self.recent) / self.window:.2e}): in the FP16 study this "
                       "came before collapse" if warning else
                       f"[warning] the mismatch is back under {self.factor:g}x its early baseline")
        self.warning = warning
        return {"mismatch/kl_growth": growth, "mismatch/collapse_warning": float(warning)}, message

    def state_dict(self) -> dict:
        return {"baseline": self.baseline, "recent": self.recent, "warning": self.warning}

    def load_state_dict(self, state: dict) -> None:
        self.baseline = None if state["baseline"] is None else float(state["baseline"])  # (numbers, not just JSON)
        self.recent, self.warning = [float(kl) for kl in state["recent"]], bool(state["warning"])

