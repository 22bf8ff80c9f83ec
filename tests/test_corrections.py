"""corrections.py's weights and rejection rules on hand-made cases (a ratio just inside and just outside each bound),
their effect on grpo.py's and ppo.py's loss (all rejected gives 0, not NaN; gradients only where kept; exactly the
plain loss when every ratio is 1), and a short CPU run of each new flag of the scripts."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import ppo
from common.metrics import StepStats
from corrections import REJECTS, WEIGHTS, Corrections, importance_weights, rejection_mask
from grpo import policy_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IN, OUT = 1 + 1e-3, 1 - 1e-3  # "just inside" / "just outside" factors: far above float32's 6e-8 relative step


def tokens(*ratios):
    """One row of log-probs whose token ratios pi_old/mu are `ratios` (mu = 0), and its mask."""
    return torch.tensor([[math.log(r) for r in ratios]]), torch.zeros(1, len(ratios)), torch.ones(1, len(ratios),
                                                                                                    dtype=torch.bool)


def weights(old, mu, mask, kind, threshold, bounds=(0.5, 5.0)):
    return importance_weights(old, mu, mask, kind, threshold, bounds)[0]


def weight_metrics(old, mu, mask, kind, threshold, bounds):
    """The is/weight_* keys that Corrections.weights gives a step, as the scripts call it."""
    stats = StepStats(torch.device("cpu"))
    Corrections(is_correction=kind, is_threshold=threshold, icepop_bounds=bounds).weights(stats, old, mu, mask)
    return stats.reduce(all_ranks=False)


def keep_of(rules, old, mu, mask, logp=None, adv=None):
    keep, stats = rejection_mask(old, old if logp is None else logp, mu, torch.ones(len(old)) if adv is None else adv,
                                 mask, rules)
    return keep, {k: float(v) for k, v in stats.items()}


# ----------------------------------------------------------------------------------------------------------------
# weights (--is-correction)

def test_icepop_keeps_the_ratio_inside_its_bounds_and_zeroes_it_outside():
    old, mu, mask = tokens(0.5, 0.5 * OUT, 0.5 * IN, 5.0, 5.0 * IN, 5.0 * OUT, 1.0)
    w = weights(old, mu, mask, "icepop", 3.0, (0.5, 5.0))
    expected = [0.5, 0.0, 0.5 * IN, 5.0, 0.0, 5.0 * OUT, 1.0]  # the bounds themselves are inside (arXiv 2510.18855)
    assert w[0].tolist() == pytest.approx(expected, rel=1e-6)


def test_seq_tis_truncates_the_sequence_ratio_and_never_overflows():
    old = torch.tensor([[0.1, 0.2, 5.0], [0.5, 0.7, 0.0], [100.0, 100.0, 100.0]])
    mu = torch.zeros(3, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    w = weights(old, mu, mask, "seq-tis", 3.0)
    assert w[0].tolist() == pytest.approx([math.exp(0.3)] * 3)  # rho = e^0.3 <= 3, the masked 5.0 ignored
    assert w[1].tolist() == pytest.approx([3.0] * 3)  # rho = e^1.2 > 3: truncated to C
    assert w[2].tolist() == pytest.approx([3.0] * 3)  # rho = e^300 (inf in fp32): still C, not inf or nan


def test_weight_stats_count_what_each_weight_changes():
    old = torch.tensor([[math.log(4.0), 0.0], [0.1, 0.0]])
    mu, mask = torch.zeros(2, 2), torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    m = weight_metrics(old, mu, mask, "token-tis", 3.0, (0.5, 5.0))  # 3 response tokens, 2 sequences
    assert m["is/weight_mean"] == pytest.approx((3.0 + 1.0 + math.exp(0.1)) / 3)  # over tokens, not sequences
    assert m["is/weight_clip_token_frac"] == 1 / 3 and m["is/weight_clip_seq_frac"] == 0.5
    assert m["is/weight_max"] == 3.0
    m = weight_metrics(old, mu, mask, "seq-mis", 3.0, (0.5, 5.0))  # row 0: rho = 4 > 3 (masked), row 1 kept
    assert m["is/weight_clip_token_frac"] == 2 / 3 and m["is/weight_clip_seq_frac"] == 0.5
    m = weight_metrics(old, mu, mask, "none", 3.0, (0.5, 5.0))
    assert (m["is/weight_mean"], m["is/weight_clip_token_frac"], m["is/weight_clip_seq_frac"]) == (1.0, 0.0, 0.0)


# ----------------------------------------------------------------------------------------------------------------
# rejection rules (--is-reject, --is-veto)

def test_token_mis_rejects_tokens_outside_its_bounds():
    old, mu, mask = tokens(0.5, 0.5 * OUT, 2.0, 2.0 * IN, 1.0)
    keep, stats = keep_of({"token-mis": (0.5, 2.0)}, old, mu, mask)
    assert keep[0].tolist() == [True, False, True, False, True]
    assert stats["token_mis_tokens"] == 2 and stats["token_mis_seqs"] == 1 and stats["reject_tokens"] == 2


def test_geo_mis_rejects_sequences_whose_geometric_mean_ratio_leaves_its_bounds():
    # rows: geometric mean 1.001 * OUT (inside), 1.001 * IN (outside), 0.999 * IN (inside), 0.999 * OUT (outside)
    g = [1.001 * (1 - 1e-4), 1.001 * (1 + 1e-4), 0.999 * (1 + 1e-4), 0.999 * (1 - 1e-4)]
    old = torch.tensor([[math.log(x) + 0.3, math.log(x) - 0.3, 7.0] for x in g])  # the third token masked out
    mu, mask = torch.zeros(4, 3), torch.tensor([[1, 1, 0]] * 4, dtype=torch.bool)
    keep, stats = keep_of({"geo-mis": (0.999, 1.001)}, old, mu, mask)
    assert keep.tolist() == [[True, True, False], [False, False, False], [True, True, False], [False, False, False]]
    assert stats["geo_mis_seqs"] == 2 and stats["geo_mis_tokens"] == 4


def test_k3_mis_rejects_sequences_whose_mean_k3_exceeds_the_threshold():
    # one token each: k3(d) = e^d - d - 1; k3(0.13) = 0.00883 <= 0.01 < 0.01027 = k3(0.14); k3(-0.15) = 0.0107
    old = torch.tensor([[0.13], [0.14], [-0.15], [-0.14]])
    keep, _ = keep_of({"k3-mis": 0.01}, old, torch.zeros(4, 1), torch.ones(4, 1, dtype=torch.bool))
    assert keep[:, 0].tolist() == [True, False, False, True]
    # a mean over the response tokens: k3(0.14) twice with a masked token = 0.01027 (rejected), with k3(0) = 0.0051
    old = torch.tensor([[0.14, 0.14, 9.0], [0.14, 0.0, 9.0]])
    keep, _ = keep_of({"k3-mis": 0.01}, old, torch.zeros(2, 3), torch.tensor([[1, 1, 0]] * 2, dtype=torch.bool))
    assert keep.tolist() == [[False, False, False], [True, True, False]]


def test_veto_rejects_a_sequence_for_one_token_below_the_threshold():
    old = torch.tensor([[0.0, math.log(1e-4 * OUT), 0.0], [0.0, math.log(1e-4 * IN), 0.0], [0.0, 0.0, -50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    keep, stats = keep_of({"veto": 1e-4}, old, torch.zeros(3, 3), mask)
    assert keep.tolist() == [[False] * 3, [True] * 3, [True, True, False]]  # a masked-out token vetoes nothing
    assert stats["veto_seqs"] == 1 and stats["veto_tokens"] == 3


def test_opsm_drops_only_negative_advantage_sequences_far_from_mu():
    # mean_t log(mu / pi_theta) = 0.5 * IN (outside delta 0.5), 0.5 * OUT (inside), per sequence; advantages -1, 0, +1
    logp = torch.tensor([[-0.5 * IN] * 2, [-0.5 * OUT] * 2, [-0.5 * IN] * 2, [-0.5 * IN] * 2])
    adv = torch.tensor([-1.0, -1.0, 0.0, 1.0])
    old = torch.zeros(4, 2)  # pi_old = mu: OPSM reads pi_theta, not pi_old
    keep, stats = keep_of({"opsm": 0.5}, old, torch.zeros(4, 2), torch.ones(4, 2, dtype=torch.bool), logp, adv)
    assert keep[:, 0].tolist() == [False, True, True, True]
    assert stats["opsm_seqs"] == 1


def test_rules_combine_and_count_each_on_its_own():
    old, mu, mask = tokens(0.4, 1.0, 1.0)  # token-mis rejects token 0; geo-mean 0.74 is outside geo-mis's bounds
    c = Corrections(is_reject=("token-mis", "geo-mis"))
    keep, stats = keep_of(c.rules, old, mu, mask)
    assert keep.tolist() == [[False, False, False]]
    assert stats["token_mis_tokens"] == 1 and stats["geo_mis_tokens"] == 3 and stats["reject_tokens"] == 3
    step = StepStats(torch.device("cpu"))  # as the scripts call it: the is/ keys of the rollout batch
    assert torch.equal(c.keep(step, old, old, mu, torch.ones(1), mask), keep)
    metrics = step.reduce(all_ranks=False)
    assert metrics["is/token_mis_token_frac"] == pytest.approx(1 / 3) and metrics["is/geo_mis_seq_frac"] == 1.0
    assert metrics["is/reject_token_frac"] == 1.0 and metrics["is/reject_seq_frac"] == 1.0
    assert Corrections(is_veto=1e-4).rules == {"veto": 1e-4}
    assert Corrections().rules == {}


@pytest.mark.parametrize("flags,old_logp,message", [
    ({"is_correction": "token-tis"}, "mu", "--old-logp mu"),
    ({"is_threshold": 0.0}, "recompute", "--is-threshold"),
    ({"geo_mis_bounds": (1.001, 0.999)}, "recompute", "--geo-mis-bounds"),
    ({"k3_mis_threshold": -1.0}, "recompute", "--k3-mis-threshold"),
])
def test_bad_flags_are_refused(flags, old_logp, message):
    with pytest.raises(ValueError, match=message):
        Corrections(**flags).check(old_logp)


# ----------------------------------------------------------------------------------------------------------------
# in the loss: as grpo.py's loop applies them (weight where kept, 0 where rejected)

ALL_RULES = {"token-mis": (0.5, 2.0), "geo-mis": (0.999, 1.001), "k3-mis": 0.01, "veto": 1e-4, "opsm": 0.5}


def corrected_loss(loss_fn, logp, old, mu, adv, mask, weight, rules, adv_seq=None):
    keep, _ = rejection_mask(old, logp.detach(), mu, adv if adv_seq is None else adv_seq, mask, rules)
    w = torch.where(keep, weights(old, mu, mask, weight, 3.0), 0.0)
    return loss_fn(logp, old, adv, w, mask, 0.2, 0.28, 8, len(adv))[0]


@pytest.mark.parametrize("loss_fn", [policy_loss, ppo.policy_loss], ids=["grpo", "ppo"])
def test_an_all_rejected_micro_batch_gives_zero_loss_and_zero_gradient_not_nan(loss_fn):
    old = torch.tensor([[100.0, 0.0], [0.5, 9.0]])  # rho = e^100 (inf in fp32) and e^0.5
    mu = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    logp = (old + 0.1).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0]) if loss_fn is policy_loss else torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss = corrected_loss(loss_fn, logp, old, mu, adv, mask, "seq-mis", {"token-mis": (0.5, 2.0), "k3-mis": 0.01},
                          adv_seq=adv if adv.dim() == 1 else adv[:, 0])
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))


def test_gradient_flows_only_through_kept_tokens():
    old = torch.tensor([[0.0, 0.0, math.log(3.0)], [0.0, 0.0, 0.0]])  # token (0, 2): rho 3 > 2, rejected
    mu, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    logp = (old + 0.05).requires_grad_(True)
    loss = corrected_loss(policy_loss, logp, old, mu, torch.tensor([1.0, -1.0]), mask, "none",
                          {"token-mis": (0.5, 2.0)})
    loss.backward()
    nonzero = logp.grad != 0
    assert nonzero.tolist() == [[True, True, False], [True, True, True]]


@pytest.mark.parametrize("loss_fn", [policy_loss, ppo.policy_loss], ids=["grpo", "ppo"])
@pytest.mark.parametrize("weight", WEIGHTS)
@pytest.mark.parametrize("rules", [{}] + [{r: ALL_RULES[r]} for r in [*REJECTS, "veto"]] + [ALL_RULES],
                         ids=["no-rule", *REJECTS, "veto", "all"])
def test_every_correction_leaves_the_loss_exactly_unchanged_when_every_ratio_is_1(loss_fn, weight, rules):
    """mu = pi_old = pi_theta: every ratio (pi_old/mu for the weights and rules, pi_theta/mu for opsm) is 1."""
    torch.manual_seed(0)
    old = -torch.rand(6, 5) * 3
    mask = torch.rand(6, 5) > 0.2
    adv = torch.randn(6) if loss_fn is policy_loss else torch.randn(6, 5)
    plain_logp, logp = old.clone().requires_grad_(True), old.clone().requires_grad_(True)
    plain = loss_fn(plain_logp, old, adv, torch.ones_like(old), mask, 0.2, 0.28, 8, 6)[0]
    corrected = corrected_loss(loss_fn, logp, old, old.clone(), adv, mask, weight, rules,
                               adv_seq=adv if adv.dim() == 1 else adv[:, 0])
    plain.backward()
    corrected.backward()
    assert corrected.item() == plain.item() and torch.equal(logp.grad, plain_logp.grad)


@pytest.mark.parametrize("weight", WEIGHTS)
def test_weights_are_1_when_pi_old_is_mu_even_as_pi_theta_moves(weight):
    torch.manual_seed(1)
    old = -torch.rand(6, 5) * 3
    mask = torch.rand(6, 5) > 0.2
    assert torch.equal(weights(old, old.clone(), mask, weight, 3.0), torch.ones_like(old))


# ----------------------------------------------------------------------------------------------------------------
# each new flag, a short run of the built-in task on CPU

SMALL = ["--num-steps", "2", "--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2",
         "--micro-batch-tokens", "96", "--eval-every", "0", "--eval-k", "1", "--eval-max-problems", "4",
         "--save-every", "0"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
RUNS = {
    "grpo-seq-tis-all-rules": ("grpo.py", ["--is-correction", "seq-tis", "--is-reject", "token-mis", "geo-mis",
                                           "k3-mis", "opsm", "--is-veto", "1e-4"],
                               ["is/token_mis_token_frac", "is/geo_mis_seq_frac", "is/k3_mis_seq_frac",
                                "is/opsm_seq_frac", "is/veto_seq_frac"]),
    "grpo-icepop": ("grpo.py", ["--is-correction", "icepop"], ["is/weight_clip_token_frac"]),
    "grpo-old-logp-mu": ("grpo.py", ["--old-logp", "mu", "--is-reject", "k3-mis"], ["is/k3_mis_token_frac"]),
    "ppo-token-mis-old-logp-mu": ("ppo.py", ["--old-logp", "mu", "--is-reject", "token-mis"],
                                  ["is/token_mis_seq_frac", "critic/value_loss"]),
    "gspo-old-logp-mu": ("gspo.py", ["--old-logp", "mu"], []),
    "pg_is-first-minibatch": ("pg_is.py", ["--mismatch-from", "first-minibatch"], []),
}


@pytest.fixture(scope="module")
def flag_runs(tmp_path_factory):
    """{name: run directory}: every RUNS run, one after another in one process (tests/wiring.py plain-each: each as
    `python SCRIPT args`; a start of torch for each took about as long as its two steps)."""
    tmp = tmp_path_factory.mktemp("flag_runs")
    dirs = {name: tmp / name for name in RUNS}
    with open(tmp / "runs.json", "w") as f:
        json.dump([[script, "--run-dir", str(dirs[name]), *SMALL, *flags] for name, (script, flags, _) in RUNS.items()],
                  f)
    p = subprocess.run([sys.executable, "tests/wiring.py", "plain-each", str(tmp / "runs.json")], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return dirs


@pytest.mark.parametrize("name", RUNS)
def test_each_new_flag_runs_on_the_builtin_task(flag_runs, name):
    script, flags, keys = RUNS[name]
    with open(flag_runs[name] / "metrics.jsonl") as f:
        steps = [r for r in map(json.loads, f) if "train/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2]
    menu = script in ("grpo.py", "ppo.py")
    for r in steps:
        common = ["train/loss", "train/entropy", "mismatch/kl_k3", "is/ratio_mean"]
        common += ["is/weight_mean", "is/weight_max", "is/reject_token_frac", "is/reject_seq_frac"] if menu else []
        for key in common + keys:
            assert math.isfinite(r[key]), (key, r)
        assert r["mismatch/kl_k3"] >= 0
        fracs = [v for k, v in r.items() if k.startswith("is/") and k.endswith("_frac")]
        assert all(0 <= v <= 1 for v in fracs), r
    if script == "pg_is.py":
        assert all("policy/approx_kl" not in r for r in steps)  # no pi_old of mini-batch 2 without the recompute
