"""pg_is.py's pure functions against hand-computed values and their limits (docs/algorithms.md: PG-Seq-IS, the FP16
study's eq. 5), and pg_is.py end to end under torchrun on the built-in task."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from corrections import LOG_RATIO_MAX
from pg_is import drgrpo_advantages, policy_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LN2 = math.log(2.0)


def test_advantages_are_drgrpo_group_mean_without_std():
    r = torch.tensor([1., 0., 0., 1., 1., 1., 1., 1.])
    assert drgrpo_advantages(r, 4).tolist() == [0.5, -0.5, -0.5, 0.5, 0., 0., 0., 0.]


def hand_case():
    # seq 0: A = +1, logp -1, -2, -0.5; logp - mu = ln 2, 0, 0 -> rho_0 = 2
    # seq 1: A = -0.5, logp -0.3, -1.2 (third token masked out); logp - mu = 0, ln 0.5 -> rho_1 = 0.5
    #        (the masked token's logp - mu = -7 would give rho_1 = 0.5 e^-7 if the mask were ignored)
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -7.0]])
    mu = logp - torch.tensor([[LN2, 0.0, 0.0], [0.0, -LN2, -7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5])
    # pi_old only enters the approx KL: token ratios pi_theta/pi_old 1.0, 1.5, 0.7 | 0.5, 1.1 (masked: 9)
    old = logp - torch.tensor([[1.0, 1.5, 0.7], [0.5, 1.1, 9.0]]).log()
    return logp, old, mu, adv, mask


@pytest.mark.parametrize("mode,C,expected", [
    # l_it = -w_i A_i logp_it, summed over the response tokens, / L_max (4) / N_seq (2)
    # is:        seq 0: -2 * 1 * (-1 - 2 - 0.5) = 7;   seq 1: -0.5 * (-0.5) * (-0.3 - 1.2) = -0.375
    ("is", 3.0, (7.0 - 0.375) / 4 / 2),
    # tis, C 3:  both rho below C, as is
    ("tis", 3.0, (7.0 - 0.375) / 4 / 2),
    # tis, C 1.5: w_0 = min(2, 1.5) = 1.5 -> seq 0: 1.5 * 3.5 = 5.25; seq 1 unchanged
    ("tis", 1.5, (5.25 - 0.375) / 4 / 2),
    # mis, C 1.5: rho_0 = 2 > 1.5 -> w_0 = 0; seq 1 unchanged
    ("mis", 1.5, (0.0 - 0.375) / 4 / 2),
])
def test_policy_loss_hand_computed(mode, C, expected):
    logp, old, mu, adv, mask = hand_case()
    loss, stats, rho_max = policy_loss(logp, old, mu, adv, mask, mode, C, max_response_len=4, num_seqs=2)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # the is/ sums: rho is the untruncated ratio whatever the mode; the weight what the loss used
    assert stats["is/ratio_mean"][0] == pytest.approx(2.5) and rho_max == pytest.approx(2.0)
    assert stats["is/seq_mask_frac"][0] == (1 if C == 1.5 else 0) and stats["is/ratio_mean"][1] == 2 and stats["policy/approx_kl"][1] == 5
    w0 = {"is": 2.0, "tis": min(2.0, C), "mis": 2.0 if 2.0 <= C else 0.0}[mode]
    assert stats["is/weight_mean"][0] == pytest.approx(w0 + 0.5)
    k3 = sum(r - 1 - math.log(r) for r in [1.0, 1.5, 0.7, 0.5, 1.1])  # k3 of KL(pi_old || pi_theta), masked out: 9
    assert stats["policy/approx_kl"][0] == pytest.approx(k3, rel=1e-5)


def test_weights_above_C_truncated_or_masked_and_overflow_safe():
    # log rho = ln 2, ln 5, 1000 (exp overflows in fp32), -1000 (underflows); C = 3
    log_rho = torch.tensor([LN2, math.log(5.0), 1000.0, -1000.0])
    logp = torch.stack([log_rho, torch.zeros(4)], dim=1)  # one response token per row; a masked second one
    mu = torch.tensor([[0.0, 50.0]] * 4)  # the masked token would add -50 if the mask were ignored
    mask = torch.tensor([[1, 0]] * 4, dtype=torch.bool)
    # w_i read off the gradient: with A = 1, L_max = N = 1, d loss / d logp_it = -w_i m_it
    expected = {"is": [2.0, 5.0, math.exp(LOG_RATIO_MAX), 0.0],  # capped, not inf
                "tis": [2.0, 3.0, 3.0, 0.0],  # min(rho, C)
                "mis": [2.0, 0.0, 0.0, 0.0]}  # rho 1{rho <= C}: the inf masked to 0, not nan
    # the loss stays finite with an overflowing rho in every mode, and so does its gradient
    for mode in ["is", "tis", "mis"]:
        x = logp.clone().requires_grad_(True)
        loss, stats, rho_max = policy_loss(x, logp.detach(), mu, torch.ones(4), mask, mode, 3.0, 1, 1)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
        assert (-x.grad[:, 0]).tolist() == pytest.approx(expected[mode]) and x.grad[:, 1].tolist() == [0.0] * 4
        assert stats["is/weight_mean"][0].item() == pytest.approx(sum(expected[mode]))
        assert stats["is/log_rho_clamp_frac"][0] == 1 and math.isfinite(stats["is/ratio_mean"][0]) and math.isfinite(rho_max)


@pytest.mark.parametrize("mode,C", [("is", 3.0), ("tis", 1.5), ("mis", 1.5), ("tis", 0.3), ("mis", 0.3)])
def test_weights_bit_identical_to_their_closed_forms(mode, C):
    """The weights come from corrections.importance_weights (--is-mode is: seq-tis at C = e^LOG_RATIO_MAX): bit for
    bit the closed forms in fp32, exp(min(log rho, 20)) | exp(min(log rho, ln C)) | rho where log rho <= ln C else 0,
    over log rho from tiny to huge and inf."""
    torch.manual_seed(0)
    logp = -torch.rand(64, 12) * 3
    mu = logp - torch.randn(64, 12) * torch.tensor([0.01, 1.0, 10.0, 1e4]).repeat(16)[:, None]
    mu[:5, 0] = logp[:5, 0] - torch.tensor([20.0, 20.00001, 19.99999, 88.7, math.inf])
    mask = torch.rand(64, 12) > 0.3
    mask[:5, 0] = True
    x = logp.clone().requires_grad_(True)
    loss, *_ = policy_loss(x, logp, mu, torch.ones(64), mask, mode, C, 1, 1)
    (grad,) = torch.autograd.grad(loss, x)  # -w_i m_it, as above
    log_rho = ((logp - mu) * mask).sum(-1)
    cap = LOG_RATIO_MAX if mode == "is" else math.log(C)
    w = (torch.where(log_rho <= cap, torch.exp(log_rho), torch.zeros_like(log_rho)) if mode == "mis"
         else torch.exp(log_rho.clamp(max=cap)))
    assert torch.equal(-grad, w[:, None] * mask)


def test_overflowing_rho_with_zero_advantage_is_not_nan():
    """--is-mode is: a sequence with log rho 100 (rho = inf in fp32) and A = 0 (a group all right or all wrong, the
    common case) once gave inf * 0 = NaN, which stopped the run. Below the cap the loss is the exact estimator."""
    logp = torch.tensor([[100.0, 0.0], [math.log(3.0), 0.0]])
    mu = torch.zeros(2, 2)
    mask = torch.tensor([[1, 0], [1, 0]], dtype=torch.bool)
    x = logp.clone().requires_grad_(True)
    loss, stats, rho_max = policy_loss(x, logp, mu, torch.tensor([0.0, 1.0]), mask, "is", 3.0, 1, 2)
    loss.backward()
    assert loss.item() == pytest.approx(-3.0 * math.log(3.0) / 2)  # only row 1: -rho A logp / N
    assert x.grad[0].tolist() == [0.0, 0.0] and torch.isfinite(x.grad).all()
    assert stats["is/log_rho_clamp_frac"][0] == 1


@pytest.mark.parametrize("mode,C", [("is", 3.0), ("tis", 1.5), ("mis", 1.5)])
def test_gradient_matches_written_out_formula(mode, C):
    logp, old, mu, adv, mask = hand_case()
    logp = logp.clone().requires_grad_(True)
    loss, *_ = policy_loss(logp, old, mu, adv, mask, mode, C, 4, 2)
    (grad,) = torch.autograd.grad(loss, logp)
    # the formula written out: rho_i = prod_t (pi_theta / mu) over the response tokens, a constant;
    # loss = -(1/N) sum_i w_i A_i sum_t logp_it / L_max
    with torch.no_grad():
        ratios = torch.where(mask, logp.exp() / mu.exp(), torch.ones_like(logp))
        rho = ratios.prod(-1)
        w = {"is": rho, "tis": rho.clamp(max=C), "mis": rho * (rho <= C)}[mode]
    x = logp.detach().clone().requires_grad_(True)
    written = -(w[:, None] * adv[:, None] * x * mask).sum() / 4 / 2
    (expected,) = torch.autograd.grad(written, x)
    torch.testing.assert_close(grad, expected)
    # and in closed form: d loss / d logp_it = -w_i A_i m_it / (L_max N), with w = (2 | 1.5 | 0, 0.5)
    w_hand = {"is": [2.0, 0.5], "tis": [1.5, 0.5], "mis": [0.0, 0.5]}[mode]
    closed = -torch.tensor(w_hand)[:, None] * adv[:, None] * mask / 4 / 2
    torch.testing.assert_close(grad, closed)


@pytest.mark.parametrize("mode", ["is", "tis", "mis"])
def test_reduces_to_reinforce_with_group_baseline_when_mu_equals_logp(mode):
    torch.manual_seed(0)
    logp = (-torch.rand(6, 5) * 3).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(6, 5)
    mask = torch.rand(6, 5) > 0.2
    adv = drgrpo_advantages(torch.tensor([1., 0., 1., 1., 0., 0.]), 3)
    loss, stats, rho_max = policy_loss(logp, old, logp.detach().clone(), adv, mask, mode, 3.0, 8, 6)
    reinforce = -(adv[:, None] * logp * mask).sum() / 8 / 6  # -A logp, Dr.GRPO's normalizer
    assert stats["is/ratio_mean"][0] == 6.0 and stats["is/weight_mean"][0] == 6.0  # every rho is exactly 1
    assert loss.item() == pytest.approx(reinforce.item(), abs=1e-7)
    g, = torch.autograd.grad(loss, logp)
    g_ref, = torch.autograd.grad(reinforce, logp)
    torch.testing.assert_close(g, g_ref)


def test_modes_agree_when_every_rho_is_below_C():
    torch.manual_seed(1)
    logp = (-torch.rand(8, 6) * 3).requires_grad_(True)
    mu = logp.detach() + 0.05 * torch.randn(8, 6)
    mask = torch.rand(8, 6) > 0.3
    adv = torch.randn(8)
    rhos = ((logp.detach() - mu) * mask).sum(-1).exp()
    assert (rhos < 3.0).all() and not torch.allclose(rhos, torch.ones(8))  # a real correction, below C
    results = []
    for mode in ["is", "tis", "mis"]:
        loss, *_ = policy_loss(logp, logp.detach(), mu, adv, mask, mode, 3.0, 10, 8)
        results.append((loss.item(), torch.autograd.grad(loss, logp)[0]))
    for loss_val, g in results[1:]:
        assert loss_val == results[0][0]
        assert torch.equal(g, results[0][1])


@pytest.mark.parametrize("mode", ["is", "tis", "mis"])
def test_normalizer_independent_of_micro_batching_and_ranks(mode):
    torch.manual_seed(0)
    B, T, L_max = 8, 7, 10
    logp = (-torch.rand(B, T) * 3).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(B, T)
    mu = logp.detach() + 0.2 * torch.randn(B, T)
    mask = torch.rand(B, T) > 0.3
    adv = torch.randn(B)
    full, *_ = policy_loss(logp, old, mu, adv, mask, mode, 1.5, L_max, B)
    (g_full,) = torch.autograd.grad(full, logp)
    for world_size, micro in [(1, [[0, 1, 2], [3], [4, 5, 6, 7]]), (2, [[0, 1], [2, 3]]), (4, [[0], [1]])]:
        per_rank = B // world_size
        total, grad = 0.0, torch.zeros_like(logp)
        for r in range(world_size):  # each rank's loss times world_size; FSDP then averages over ranks
            for mb in micro:
                idx = [r * per_rank + i for i in mb]
                loss, *_ = policy_loss(logp[idx], old[idx], mu[idx], adv[idx], mask[idx], mode, 1.5, L_max, B)
                (g,) = torch.autograd.grad(loss * world_size, logp)
                total += loss.item()  # = the mean over ranks of (loss * world_size)
                grad += g / world_size
        assert total == pytest.approx(full.item(), abs=1e-6)
        torch.testing.assert_close(grad, g_full)


# ----------------------------------------------------------------------------------------------------------------
# end to end, as tests/test_e2e.py does for grpo.py

SMALL = ["--num-steps", "2", "--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2",
         "--micro-batch-tokens", "96", "--eval-every", "1", "--eval-k", "2", "--eval-max-problems", "8",
         "--save-every", "1", "--keep-last", "1"]


def test_pg_is_runs_under_torchrun_and_checkpoint_reloads(tmp_path):
    run_dir = str(tmp_path / "run")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "pg_is.py",
           "--run-dir", run_dir, *SMALL, "--is-mode", "mis"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "train/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["step"] for r in rows if "eval/eval/accuracy" in r] == [0, 1, 2]
    for r in steps:
        for key in ["train/loss", "mismatch/kl_k3", "optim/grad_norm", "policy/approx_kl", "is/ratio_mean",
                    "is/ratio_max", "is/seq_mask_frac", "is/weight_mean", "train/entropy"]:
            assert math.isfinite(r[key]), (key, r[key])
        assert "policy/clip_frac" not in r  # no clip in PG-Seq-IS
        assert r["mismatch/kl_k3"] >= 0 and 0 <= r["is/seq_mask_frac"] <= 1
        assert r["is/weight_mean"] <= r["is/ratio_mean"] + 1e-9  # mis only removes weight
    ckpts = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert ckpts == ["step_000002"]
    path = os.path.join(run_dir, "checkpoints", ckpts[0])
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok.encode("12+3=")])
    assert torch.isfinite(model(ids).logits).all()
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    assert config["exp_name"] == "pg_is" and config["is_mode"] == "mis" and "eps_low" not in config
