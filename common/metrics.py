"""The training-inference mismatch metrics of every step (docs/algorithms.md), over all response tokens of the rollout
batch on every rank: local sums / maxes / mins here, reduced across ranks by common.dist.reduce_stats."""
import numpy as np
import torch


def mismatch_stats(old_logp_BT: torch.Tensor, mu_logp_BT: torch.Tensor, mask_BT: torch.Tensor, threshold: float,
                   seq_ratio: bool) -> tuple[dict, dict, dict]:
    """old_logp: the trainer's recompute (pi_old), mu_logp: the sampler's own log-probs, both fp32.
    Returns (sums, maxes, mins); means are sums divided by the counts `n_tokens` / `n_seqs` after reduction.
    is/ratio_* are over the token ratios exp(old - mu), or over the sequence ratios rho when `seq_ratio`."""
    m = mask_BT.float()
    d = (old_logp_BT - mu_logp_BT) * m  # log pi_old - log mu, 0 off the mask
    prob_diff = (mu_logp_BT.exp() - old_logp_BT.exp()).abs() * m
    seq_log_ratio_B = d.sum(-1)  # log rho_i
    tok_ratio = torch.exp(d)
    sums = {
        "n_tokens": m.sum(), "n_seqs": torch.tensor(float(mask_BT.shape[0])),
        "kl_k1": (-d).sum(), "kl_k2": (0.5 * d ** 2).sum(), "kl_k3": ((torch.expm1(d) - d) * m).sum(),
        "prob_abs_diff": prob_diff.sum(), "seq_log_ratio": seq_log_ratio_B.sum(),
        "token_clip": ((tok_ratio > threshold) & mask_BT).sum(),
        "seq_mask": (seq_log_ratio_B > torch.log(torch.tensor(threshold))).sum(),
    }
    if seq_ratio:
        rho_B = torch.exp(seq_log_ratio_B)
        sums["ratio"], ratio_max = rho_B.sum(), rho_B.max()
    else:
        sums["ratio"], ratio_max = (tok_ratio * m).sum(), tok_ratio.masked_fill(~mask_BT, 0).max()
    maxes = {"prob_abs_diff": prob_diff.max(), "seq_log_ratio": seq_log_ratio_B.max(), "ratio": ratio_max}
    mins = {"seq_log_ratio": seq_log_ratio_B.min()}
    as_float = lambda dct: {k: float(v) for k, v in dct.items()}
    return as_float(sums), as_float(maxes), as_float(mins)


def mismatch_metrics(sums: dict, maxes: dict, mins: dict, seq_ratio: bool) -> dict:
    """Metric keys of docs/algorithms.md from reduced statistics."""
    n_tok, n_seq = max(sums["n_tokens"], 1.0), max(sums["n_seqs"], 1.0)
    return {
        "mismatch/kl_k1": sums["kl_k1"] / n_tok, "mismatch/kl_k2": sums["kl_k2"] / n_tok,
        "mismatch/kl_k3": sums["kl_k3"] / n_tok,
        "mismatch/prob_abs_diff_mean": sums["prob_abs_diff"] / n_tok, "mismatch/prob_abs_diff_max": maxes["prob_abs_diff"],
        "mismatch/seq_log_ratio_mean": sums["seq_log_ratio"] / n_seq,
        "mismatch/seq_log_ratio_min": mins["seq_log_ratio"], "mismatch/seq_log_ratio_max": maxes["seq_log_ratio"],
        "is/token_clip_frac": sums["token_clip"] / n_tok, "is/seq_mask_frac": sums["seq_mask"] / n_seq,
        "is/ratio_mean": sums["ratio"] / (n_seq if seq_ratio else n_tok), "is/ratio_max": maxes["ratio"],
    }


def first_minibatch_mismatch(first_logp: dict, mu_logp_BT: torch.Tensor, mask_BT: torch.Tensor, entropy: float,
                             threshold: float, seq_ratio: bool, device) -> dict:
    """Collective. The mismatch/* keys, is/ diagnostics and train/entropy when nothing recomputes pi_old: over the
    sequences of the step's first mini-batch, from the log-probs (and entropy sum) of their training forward, which
    runs before any optimizer step and so with the weights that sampled the batch. first_logp: {row: 1-D fp32}."""
    from common.dist import reduce_stats
    from common.logprobs import pad_float
    rows = sorted(first_logp)
    old_BT = pad_float([first_logp[i] for i in rows], mu_logp_BT.shape[1], "cpu")
    sums, maxes, mins = mismatch_stats(old_BT, mu_logp_BT[rows], mask_BT[rows], threshold, seq_ratio)
    sums["entropy"] = entropy
    g, g_max, g_min = (reduce_stats(d, op, device) for d, op in ((sums, "sum"), (maxes, "max"), (mins, "min")))
    return {**mismatch_metrics(g, g_max, g_min, seq_ratio), "train/entropy": g["entropy"] / max(g["n_tokens"], 1.0)}


class MismatchMonitor:
    """Early warning of collapse: the mean kl_k3 of the last `window` steps over that of the first `window` (floored at
    `floor`), a warning past `factor` (docs/algorithms.md, "The collapse warning"). Its state goes into checkpoints."""

    def __init__(self, factor: float, window: int, floor: float = 1e-6):
        self.factor, self.window, self.floor = factor, window, floor
        self.baseline: float | None = None
        self.recent: list[float] = []  # the first `window` values until the baseline exists, then the last `window`
        self.warning = False

    def update(self, kl: float) -> tuple[dict, str | None]:
        """Metrics for this step, and a message when the warning switches on or off."""
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
        self.baseline, self.recent, self.warning = state["baseline"], list(state["recent"]), state["warning"]


def rollout_sums(rewards_B: torch.Tensor, group_size: int, reward_failures: int, finished: list[bool],
                 resp_lens: list[int], seq_lens: list[int], entropy_sum: float) -> tuple[dict, dict]:
    """Local (sums, maxes) of the rollout batch for the train/ keys of step_metrics, for common.dist.reduce_stats."""
    r_GN = rewards_B.view(-1, group_size)
    sums = {"reward": rewards_B.sum().item(), "reward_failures": float(reward_failures), "entropy": entropy_sum,
            "resp_len": float(sum(resp_lens)), "truncated": float(sum(not f for f in finished)),
            "seq_tokens": float(sum(seq_lens)), "all_correct": float((r_GN.min(-1).values == 1).sum()),
            "all_wrong": float((r_GN.max(-1).values == 0).sum())}
    return sums, {"resp_len": float(max(resp_lens))}


def mean_finite(values: list[float]) -> float:
    """The mean of the finite values (a skipped fp16 step's gradient norm is inf), nan when there is none."""
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def step_metrics(g: dict, g_max: dict, group_size: int, num_minibatches: int, grad_norms: list[float], scaler,
                 lr: float, times: dict) -> dict:
    """The train/, optim/, time/ and perf/ keys (docs/metrics.md) from the step's statistics reduced over all ranks (g: sums
    with rollout_sums' keys, mismatch_stats' n_seqs / n_tokens and the summed loss; g_max: maxes), the policy's grad
    norms (one per optimizer step) and loss scaler, and the phases' seconds (sample, recompute, train, sync)."""
    n_seqs, n_groups, n_tok = g["n_seqs"], g["n_seqs"] / group_size, max(g["n_tokens"], 1.0)
    return {
        "train/accuracy": g["reward"] / n_seqs, "train/reward_failures": g["reward_failures"],
        "train/all_correct_frac": g["all_correct"] / n_groups, "train/all_wrong_frac": g["all_wrong"] / n_groups,
        "train/response_len_mean": g["resp_len"] / n_seqs, "train/response_len_max": g_max["resp_len"],
        "train/truncated_frac": g["truncated"] / n_seqs, "train/entropy": g["entropy"] / n_tok,
        "train/loss": g["loss"] / num_minibatches,  # each rank's share sums to the mini-batch's loss
        "optim/grad_norm": mean_finite(grad_norms),
        "optim/loss_scale": scaler.scale, "optim/skipped_steps": scaler.skipped_steps, "optim/lr": lr,
        **{f"time/{k}": v for k, v in times.items()},
        "perf/sample_tok_s": g["resp_len"] / times["sample"],
        "perf/train_tok_s": g["seq_tokens"] / times["train"],  # prompt + response tokens, forward and backward
    }


def add_sums(total: dict, part: dict) -> None:
    """total[key] += part[key] for every key of part: a step's statistics summed over its micro-batches (0-d tensors
    stay on their device; common.dist.reduce_stats reads them once a step)."""
    for key, v in part.items():
        total[key] = total.get(key, 0.0) + v
