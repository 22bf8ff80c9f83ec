"""Rollout corrections for the training-inference mismatch: the weights and rejection masks that grpo.py, ppo.py
and cispo.py put on their per-token loss, and the is/* keys of what they did. Pure functions and the flags' dataclass,
no gradient through any of them; the losses stay in the scripts. docs/corrections.md has the table (flag, formula,
source, cost).

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
import tyro

from common.metrics import mismatch

WEIGHTS = ("none", "token-tis", "seq-tis", "seq-mis", "icepop")
REJECTS = ("token-mis", "geo-mis", "k3-mis", "opsm")
# verl clamps log-ratios to +-20 before exp (rollout_corr_helper.SAFETY_BOUND): exp(20) = 4.9e8 is far past every
# threshold here, so a clamped token is judged the same, and exp never overflows to inf (inf - inf would be nan)
LOG_RATIO_MAX = 20.0
RATIO_KEYS = ("is/token_clip_frac", "is/seq_mask_frac", "is/ratio_mean", "is/ratio_max")  # measure's is/ keys


@dataclass
class Corrections:
    """The rollout corrections: their flags (one Args field, `corrections`, of grpo.py, ppo.py and cispo.py: flat on the
    command line, --is-correction, and in config.json), and what the scripts' step asks of them: measure (the
    mismatch and the ratio's is/ diagnostics), weights (the constant weight of each token's loss) and keep (the
    rejection rules' mask); each writes its own is/* keys (docs/corrections.md) into the step's StepStats."""
    is_correction: Literal["none", "token-tis", "seq-tis", "seq-mis", "icepop"] = "none"
    """rollout-correction weight on each token's loss, rho_t = pi_old/mu: 'token-tis' min(rho_t, C); 'seq-tis'
    min(rho, C) and 'seq-mis' rho 1{rho <= C}, rho = prod_t rho_t over the sequence; 'icepop' rho_t where it lies in
    --icepop-bounds, else 0 (arXiv 2510.18855)"""
    is_threshold: float = 3.0
    """C of the corrections (the study's text: 3; its code used 2 for Token-TIS and 10 for Seq-MIS; verl: 2)"""
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

    def check(self, old_logp: str = "recompute") -> None:
        """Bad input, before a model loads: raises ValueError with a one-line message. old_logp: the script's
        --old-logp (with mu, pi_old is mu and no weight is left to apply)."""
        if old_logp == "mu" and self.is_correction != "none":
            raise ValueError(f"--is-correction {self.is_correction} with --old-logp mu: pi_old is then mu, so the PPO "
                             "ratio pi_theta/mu is already the importance weight (verl's bypass mode applies no other)")
        if not (math.isfinite(self.is_threshold) and self.is_threshold > 0):
            raise ValueError(f"--is-threshold must be finite and > 0, got {self.is_threshold}")
        for flag, value in {"--icepop-bounds": self.icepop_bounds, "--token-mis-bounds": self.token_mis_bounds,
                            "--geo-mis-bounds": self.geo_mis_bounds, "--k3-mis-threshold": self.k3_mis_threshold,
                            "--opsm-delta": self.opsm_delta, "--is-veto": self.is_veto or 1.0}.items():
            lo, hi = value if isinstance(value, tuple) else (value, value)
            if not 0 < lo <= hi:
                raise ValueError(f"{flag} must be positive (and lo <= hi), got {value}")

    @property
    def rules(self) -> dict:
        """The active rejection rules and their thresholds, {name: threshold or (lo, hi)}."""
        params = {"token-mis": self.token_mis_bounds, "geo-mis": self.geo_mis_bounds,
                  "k3-mis": self.k3_mis_threshold, "opsm": self.opsm_delta}
        rules = {r: params[r] for r in dict.fromkeys(self.is_reject)}
        if self.is_veto > 0:
            rules["veto"] = self.is_veto
        return rules

    def measure(self, stats, old_logp_BT, mu_logp_BT, mask_BT) -> None:
        """measure() with this correction's C, is/ratio_* over sequences for a sequence-level weight."""
        measure(stats, old_logp_BT, mu_logp_BT, mask_BT, self.is_threshold,
                seq_ratio=self.is_correction in ("seq-tis", "seq-mis"))

    def weights(self, stats, old_logp_BT, mu_logp_BT, mask_BT) -> torch.Tensor:
        """w_BT, the constant weight of each token's loss (--is-correction; importance_weights), and its is/weight_*
        keys into stats: its mean and max over the response tokens, the tokens and sequences where it is not the
        ratio itself (truncated by tis, zeroed by seq-mis or icepop)."""
        w_BT, clipped_BT = importance_weights(old_logp_BT, mu_logp_BT, mask_BT, self.is_correction, self.is_threshold,
                                              self.icepop_bounds)
        m = mask_BT.bool()
        n_tok, n_seq = m.sum(), len(m)
        stats.add("is/weight_mean", (w_BT * m).sum(), n_tok)
        stats.max("is/weight_max", w_BT.masked_fill(~m, 0).max() if m.any() else 0.0)
        stats.add("is/weight_clip_token_frac", clipped_BT.sum(), n_tok)
        stats.add("is/weight_clip_seq_frac", clipped_BT.any(-1).sum(), n_seq)
        return w_BT

    def keep(self, stats, ref_logp_BT, logp_BT, mu_logp_BT, adv_B, mask_BT) -> torch.Tensor:
        """keep_BT (rejection_mask of the --is-reject rules and --is-veto), and the fractions of the micro-batch's
        response tokens and sequences each rule and all of them rejected into stats (is/reject_*, is/<rule>_*): every
        token is seen once a step, so the sums over micro-batches are fractions of the rollout batch."""
        keep_BT, counts = rejection_mask(ref_logp_BT, logp_BT, mu_logp_BT, adv_B, mask_BT, self.rules)
        n_tok, n_seq = mask_BT.sum(), len(mask_BT)
        for name in ["reject", *(r.replace("-", "_") for r in self.rules)]:
            stats.add(f"is/{name}_token_frac", counts[f"{name}_tokens"], n_tok)
            stats.add(f"is/{name}_seq_frac", counts[f"{name}_seqs"], n_seq)
        return keep_BT


# an Args field's type: the flags are --is-correction, not --corrections.is-correction
CorrectionsField = tyro.conf.OmitArgPrefixes[Corrections]


def measure(stats, old_logp_BT, mu_logp_BT, mask_BT, threshold: float, seq_ratio: bool,
            keys: tuple[str, ...] = RATIO_KEYS) -> None:
    """The mismatch of pi_old against mu (common.metrics.mismatch: mismatch/*) and what the ratio rho_t = pi_old/mu
    would make a correction do, whether or not one is applied (`keys`, of RATIO_KEYS): is/token_clip_frac (rho_t > C),
    is/seq_mask_frac (rho > C, rho = prod_t rho_t), is/ratio_mean and is/ratio_max over the token ratios, or over
    the sequence ratios when seq_ratio. Any set of whole sequences, as mismatch."""
    mismatch(stats, old_logp_BT, mu_logp_BT, mask_BT)
    m = mask_BT.float()
    n_tok, n_seq = m.sum(), len(m)
    d_BT = (old_logp_BT - mu_logp_BT) * m  # log rho_t, 0 off the mask
    log_rho_B, rho_BT = d_BT.sum(-1), torch.exp(d_BT)
    rho_B = torch.exp(log_rho_B)
    values = {"is/token_clip_frac": (((rho_BT > threshold) & mask_BT).sum(), n_tok),
              "is/seq_mask_frac": ((log_rho_B > math.log(threshold)).sum(), n_seq),
              "is/ratio_mean": (rho_B.sum(), n_seq) if seq_ratio else ((rho_BT * m).sum(), n_tok)}
    stats.update({k: v for k, v in values.items() if k in keys})
    if "is/ratio_max" in keys:
        stats.max("is/ratio_max", rho_B.max() if seq_ratio else rho_BT.masked_fill(~mask_BT, 0).max())


def importance_weights(old_logp_BT, mu_logp_BT, mask_BT, is_correction: str, threshold: float,
                       icepop_bounds: tuple[float, float] = (0.5, 5.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_BT, clipped_BT): the constant per-token weights of the rollout correction, rho_t = exp(old_logp - mu_logp),
    and where the weight is not the ratio itself (truncated or masked), on the mask:
    none: 1.  token-tis: w_t = min(rho_t, C).  seq-tis: w_t = min(rho_i, C) and seq-mis: w_t = rho_i 1{rho_i <= C},
    rho_i = prod_t rho_t over the sequence's response tokens.  icepop: w_t = rho_t if alpha <= rho_t <= beta else 0."""
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
    0-d tensors (no host sync): rejected tokens and sequences (any token rejected), per rule ({rule}_tokens,
    {rule}_seqs, the rule's name with _ for -) and overall (reject_tokens, reject_seqs)."""
    keep_BT = mask_BT.bool().clone()
    if not rules:
        return keep_BT, {"reject_tokens": torch.zeros((), device=mask_BT.device),
                         "reject_seqs": torch.zeros((), device=mask_BT.device)}
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
        stats[f"{key}_tokens"], stats[f"{key}_seqs"] = bad_BT.sum(), bad_BT.any(-1).sum()
        keep_BT &= ~bad_BT
    rejected_BT = m & ~keep_BT
    stats["reject_tokens"], stats["reject_seqs"] = rejected_BT.sum(), rejected_BT.any(-1).sum()
    return keep_BT, stats
