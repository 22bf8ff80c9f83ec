"""Rollout corrections for the training-inference mismatch: the weights and rejection masks that grpo.py, ppo.py
and cispo.py put on their per-token loss. Pure functions, no gradient through any of them; the losses stay in the
scripts. docs/corrections.md has the table (flag, formula, source, cost).

Notation (docs/algorithms.md): per response token t of sequence i, rho_t = pi_old(y_t) / mu(y_t), log rho_t = old_logp -
mu_logp, computed in log space; m_t the response mask, L_i = sum_t m_t. Two kinds of correction:
- a weight w_t (--is-correction, one of WEIGHTS), fixed before training from old_logp and mu_logp;
- rejection rules (--is-reject, any of REJECTS, and --is-veto), each a keep mask; a rejected token's loss term is
  zeroed (its weight set to 0). They combine by AND with each other and multiply the weight, so that verl's presets
  (a weight plus a rejection, plus the veto) are flag combinations, not code paths. Each rule reads the ratio of
  `ref_logp` over mu: the script passes old_logp, or pi_theta's log-probs when pi_old is mu (--old-logp mu, verl's
  bypass mode, where that is the only ratio left); OPSM always reads pi_theta (DeepSeek-V3.2 eq. 9).

Sources read for each definition, and the defaults followed:
- verl (volcengine/verl, early 2026): verl/trainer/ppo/rollout_corr_helper.py (IS weights: token / sequence,
  truncated at rollout_is_threshold = 2.0; rejection "token", "geometric" = seq_mean_k1, seq_mean_k3, and before its
  Jan 2026 rewrite the per-token veto rollout_token_veto_threshold) and the presets in
  verl/trainer/config/algorithm.py (decoupled_geo_rs 0.999_1.001, decoupled_k3_rs 0.01, veto 1e-4).
- TRL: trl/trainer/grpo_trainer.py get_off_policy_mask (OPSM) and grpo_config.py off_policy_mask_threshold.
- IcePop: "Every Step Evolves" (Ring-1T, arXiv 2510.18855), Sec. IcePop eq. (the J_IcePop objective) and its
  training recipe (alpha 0.5, beta 5).
- The FP16 study (arXiv 2510.26788): Token-TIS and Seq-MIS as grpo.py always had them.
"""
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

WEIGHTS = ("none", "token-tis", "seq-tis", "seq-mis", "icepop")
REJECTS = ("token-mis", "geo-mis", "k3-mis", "opsm")
# verl clamps log-ratios to +-20 before exp (rollout_corr_helper.SAFETY_BOUND): exp(20) = 4.9e8 is far past every
# threshold here, so a clamped token is judged the same, and exp never overflows to inf (inf - inf would be nan)
LOG_RATIO_MAX = 20.0


@dataclass
class Corrections:
    """The rollout-correction flags, one Args field (`corrections`) of grpo.py, ppo.py and cispo.py: flat on the
    command line (--is-correction) and in config.json. C is the script's --is-threshold."""
    is_correction: Literal["none", "token-tis", "seq-tis", "seq-mis", "icepop"] = "none"
    """rollout-correction weight on each token's loss, rho_t = pi_old/mu: 'token-tis' min(rho_t, C); 'seq-tis'
    min(rho, C) and 'seq-mis' rho 1{rho <= C}, rho = prod_t rho_t over the sequence; 'icepop' rho_t where it lies in
    --icepop-bounds, else 0 (arXiv 2510.18855)"""
    icepop_bounds: tuple[float, float] = (0.5, 5.0)
    """[alpha, beta] of --is-correction icepop (arXiv 2510.18855: 0.5, 5)"""
    is_reject: tuple[Literal["token-mis", "geo-mis", "k3-mis", "opsm"], ...] = ()
    """rejection rules, any number, each zeroing the loss of what it rejects, on top of the weight: 'token-mis' a
    token whose rho_t leaves --token-mis-bounds; 'geo-mis' a sequence whose exp(mean_t log rho_t) leaves
    --geo-mis-bounds; 'k3-mis' a sequence whose mean_t (rho_t - log rho_t - 1) exceeds --k3-mis-threshold; 'opsm' a
    sequence with A < 0 whose mean_t log(mu / pi_theta) exceeds --opsm-delta (DeepSeek-V3.2 eq. 9)"""
    is_veto: float = 0.0
    """reject a sequence when any of its rho_t is below this (verl's veto; its presets: 1e-4); 0: off"""
    token_mis_bounds: tuple[float, float] = (0.5, 2.0)
    """[lo, hi] of --is-reject token-mis (verl: [1/C, C], C = 2)"""
    geo_mis_bounds: tuple[float, float] = (0.999, 1.001)
    """[lo, hi] of --is-reject geo-mis (verl's geo-RS presets)"""
    k3_mis_threshold: float = 0.01
    """threshold of --is-reject k3-mis (verl's k3-RS presets)"""
    opsm_delta: float = 0.5
    """delta of --is-reject opsm (the example of TRL's off_policy_mask_threshold; DeepSeek-V3.2 gives no value)"""


def _weights_and_clipped(old_logp_BT, mu_logp_BT, mask_BT, is_correction: str, threshold: float,
                         icepop_bounds: tuple[float, float]):
    """(w_BT, clipped_BT): the weight, and where it is not the ratio itself (truncated or masked), on the mask."""
    m = mask_BT.bool()
    d_BT = (old_logp_BT - mu_logp_BT) * mask_BT  # log rho_t, 0 off the mask
    if is_correction == "none":
        return torch.ones_like(old_logp_BT), torch.zeros_like(m)
    if is_correction == "token-tis":  # study, verl rollout_is="token": min(rho_t, C)
        return torch.exp(d_BT).clamp(max=threshold), (d_BT > math.log(threshold)) & m
    if is_correction == "icepop":  # arXiv 2510.18855: M(rho_t) = rho_t on [alpha, beta], else 0
        lo, hi = icepop_bounds
        inside = (d_BT >= math.log(lo)) & (d_BT <= math.log(hi))
        return torch.where(inside, torch.exp(d_BT), torch.zeros_like(d_BT)), ~inside & m
    log_rho_B1 = d_BT.sum(-1, keepdim=True)  # log rho_i = sum_t log rho_t
    over_B1 = log_rho_B1 > np.log(threshold)
    if is_correction == "seq-tis":  # verl rollout_is="sequence": min(rho_i, C), in log space (no overflow)
        w_B1 = torch.exp(log_rho_B1.clamp(max=np.log(threshold)))
    elif is_correction == "seq-mis":  # study: rho_i 1{rho_i <= C}
        # where(), not rho * mask: an overflowing rho (inf) would give inf * 0 = nan
        w_B1 = torch.where(log_rho_B1 <= np.log(threshold), torch.exp(log_rho_B1), torch.zeros_like(log_rho_B1))
    else:
        raise ValueError(f"unknown is_correction {is_correction!r}")
    return w_B1.expand_as(old_logp_BT), over_B1 & m


def importance_weights(old_logp_BT, mu_logp_BT, mask_BT, is_correction: str, threshold: float,
                       icepop_bounds: tuple[float, float] = (0.5, 5.0)) -> torch.Tensor:
    """Constant per-token weights of the rollout correction (--is-correction), rho_t = exp(old_logp - mu_logp):
    none: 1.  token-tis: w_t = min(rho_t, C).  seq-tis: w_t = min(rho_i, C) and seq-mis: w_t = rho_i 1{rho_i <= C},
    rho_i = prod_t rho_t over the sequence's response tokens.  icepop: w_t = rho_t if alpha <= rho_t <= beta else 0."""
    return _weights_and_clipped(old_logp_BT, mu_logp_BT, mask_BT, is_correction, threshold, icepop_bounds)[0]


def weight_stats(old_logp_BT, mu_logp_BT, mask_BT, is_correction: str, threshold: float,
                 icepop_bounds: tuple[float, float]) -> tuple[dict, dict]:
    """Local (sums, maxes) of the weight over the response tokens: its sum and max, and the tokens and sequences
    where it is not the ratio (truncated by tis, zeroed by seq-mis / icepop). Floats, for common.dist.reduce_stats."""
    c = Corrections(is_correction=is_correction, icepop_bounds=icepop_bounds)
    return correction_weights(old_logp_BT, mu_logp_BT, mask_BT, c, threshold)[1:]


def correction_weights(old_logp_BT, mu_logp_BT, mask_BT, c: Corrections, threshold: float):
    """(w_BT, sums, maxes): the weights of importance_weights and the statistics of weight_stats, in one pass."""
    w_BT, clipped_BT = _weights_and_clipped(old_logp_BT, mu_logp_BT, mask_BT, c.is_correction, threshold,
                                            c.icepop_bounds)
    m = mask_BT.bool()
    sums = {"is_weight": float((w_BT * m).sum()), "is_clip_tokens": float(clipped_BT.sum()),
            "is_clip_seqs": float(clipped_BT.any(-1).sum())}
    return w_BT, sums, {"is_weight": float(w_BT.masked_fill(~m, 0).max()) if m.any() else 0.0}


def correction_rules(c: Corrections) -> dict:
    """reject_rules of the flags."""
    return reject_rules(c.is_reject, c.is_veto, c.token_mis_bounds, c.geo_mis_bounds, c.k3_mis_threshold,
                        c.opsm_delta)


def reject_rules(is_reject: tuple[str, ...], veto: float, token_mis_bounds: tuple[float, float],
                 geo_mis_bounds: tuple[float, float], k3_mis_threshold: float, opsm_delta: float) -> dict:
    """The active rejection rules and their thresholds, {name: threshold or (lo, hi)}, from the scripts' flags."""
    params = {"token-mis": token_mis_bounds, "geo-mis": geo_mis_bounds, "k3-mis": k3_mis_threshold,
              "opsm": opsm_delta}
    rules = {r: params[r] for r in dict.fromkeys(is_reject)}
    if veto > 0:
        rules["veto"] = veto
    return rules


@torch.no_grad()
def rejection_mask(ref_logp_BT, logp_BT, mu_logp_BT, adv_B, mask_BT, rules: dict) -> tuple[torch.Tensor, dict]:
    """keep_BT (bool): False where any rule rejects the token; with log rho_t = ref_logp - mu_logp on the mask:
    token-mis (verl rollout_rs="token"): reject the token when rho_t is outside [lo, hi].
    geo-mis (verl "geometric" / seq_mean_k1): reject the sequence when exp(mean_t log rho_t) is outside [lo, hi].
    k3-mis (verl seq_mean_k3): reject the sequence when mean_t (rho_t - log rho_t - 1) > threshold.
    veto (verl rollout_token_veto_threshold): reject the sequence when any rho_t < threshold.
    opsm (DeepSeek-V3.2 eq. 9, TRL get_off_policy_mask): reject the sequence when A_i < 0 and
        mean_t (mu_logp - logp) > delta, logp = pi_theta's (this micro-batch's forward, detached).
    Bounds are inclusive (a ratio equal to a bound is kept), as in verl and the papers. Also returns local sums,
    0-d tensors (no host sync): rejected tokens and sequences (any token rejected) per rule and overall."""
    keep_BT = mask_BT.bool().clone()
    if not rules:
        return keep_BT, {"rej_tokens": torch.zeros((), device=mask_BT.device),
                         "rej_seqs": torch.zeros((), device=mask_BT.device)}
    m = mask_BT.bool()
    n_B = m.sum(-1).clamp(min=1)
    d_BT = ((ref_logp_BT - mu_logp_BT) * m).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)  # log rho_t, 0 off the mask
    stats = {}
    for name, th in rules.items():
        if name == "token-mis":
            bad_BT = ((d_BT < math.log(th[0])) | (d_BT > math.log(th[1]))) & m
        elif name == "geo-mis":
            mean_B = d_BT.sum(-1) / n_B
            bad_BT = ((mean_B < math.log(th[0])) | (mean_B > math.log(th[1])))[:, None] & m
        elif name == "k3-mis":
            k3_B = ((torch.exp(d_BT) - d_BT - 1) * m).sum(-1) / n_B
            bad_BT = (k3_B > th)[:, None] & m
        elif name == "veto":
            bad_BT = ((d_BT < math.log(th)) & m).any(-1, keepdim=True) & m
        elif name == "opsm":
            kl_B = ((mu_logp_BT - logp_BT) * m).sum(-1) / n_B  # mean_t log(mu / pi_theta)
            bad_BT = ((adv_B < 0) & (kl_B > th))[:, None] & m
        else:
            raise ValueError(f"unknown rejection rule {name!r}")
        key = name.replace("-", "_")
        stats[f"rej_{key}_tokens"], stats[f"rej_{key}_seqs"] = bad_BT.sum(), bad_BT.any(-1).sum()
        keep_BT &= ~bad_BT
    rejected_BT = m & ~keep_BT
    stats["rej_tokens"], stats["rej_seqs"] = rejected_BT.sum(), rejected_BT.any(-1).sum()
    return keep_BT, stats


def correction_metrics(sums: dict, maxes: dict, rules: dict) -> dict:
    """The is/ keys of the corrections (docs/corrections.md) from statistics reduced over all ranks, as fractions of
    the rollout batch's response tokens (n_tokens) and sequences (n_seqs): the loss sees each of them once a step."""
    n_tok, n_seq = max(sums["n_tokens"], 1.0), max(sums["n_seqs"], 1.0)
    metrics = {"is/weight_mean": sums["is_weight"] / n_tok, "is/weight_max": maxes["is_weight"],
               "is/weight_clip_token_frac": sums["is_clip_tokens"] / n_tok,
               "is/weight_clip_seq_frac": sums["is_clip_seqs"] / n_seq,
               "is/reject_token_frac": sums["rej_tokens"] / n_tok, "is/reject_seq_frac": sums["rej_seqs"] / n_seq}
    for name in rules:
        key = name.replace("-", "_")
        metrics[f"is/{key}_token_frac"] = sums[f"rej_{key}_tokens"] / n_tok
        metrics[f"is/{key}_seq_frac"] = sums[f"rej_{key}_seqs"] / n_seq
    return metrics


def check_corrections(c: Corrections, threshold: float, old_logp: str) -> None:
    """check_correction_flags of the flags."""
    check_correction_flags(c.is_correction, threshold, old_logp,
                           {"--icepop-bounds": c.icepop_bounds, "--token-mis-bounds": c.token_mis_bounds,
                            "--geo-mis-bounds": c.geo_mis_bounds, "--k3-mis-threshold": c.k3_mis_threshold,
                            "--opsm-delta": c.opsm_delta, "--is-veto": c.is_veto or 1.0})


def check_correction_flags(is_correction: str, threshold: float, old_logp: str, bounds: dict) -> None:
    """Bad input, before a model loads: raises ValueError with a one-line message."""
    if old_logp == "mu" and is_correction != "none":
        raise ValueError(f"--is-correction {is_correction} with --old-logp mu: pi_old is then mu, so the PPO ratio "
                         "pi_theta/mu is already the importance weight (verl's bypass mode applies no other)")
    if threshold <= 0:
        raise ValueError(f"--is-threshold must be > 0, got {threshold}")
    for flag, value in bounds.items():
        lo, hi = value if isinstance(value, tuple) else (value, value)
        if not 0 < lo <= hi:
            raise ValueError(f"{flag} must be positive (and lo <= hi), got {value}")
