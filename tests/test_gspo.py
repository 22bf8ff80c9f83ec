"""gspo.py's pure functions against hand-computed values and their limits (docs/algorithms.md: GSPO, Zheng et al. 2025,
eq. 5-7), and gspo.py end to end under torchrun on the built-in task."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gspo import policy_loss, std_advantages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_std_advantages_hand_computed():
    r = torch.tensor([1., 0., 0., 0., 1., 1., 0., 0., 1., 1., 1., 1.])
    adv = std_advantages(r, 4)
    # group 0: mean 0.25, deviations 0.75, -0.25 x3; unbiased var (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5
    assert adv[:4].tolist() == pytest.approx([0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001])
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    # group 1: mean 0.5, unbiased var 4 * 0.25 / 3 = 1/3 (the population std would be 0.5, giving +-1)
    s = math.sqrt(1 / 3) + 1e-6
    assert adv[4:8].tolist() == pytest.approx([0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s])
    # group 2: all right, std 0: A = 0 / 1e-6 = 0, no nan
    assert adv[8:].tolist() == [0.0] * 4


def hand_case():
    # per-token log ratios logp - old_logp; s_i = exp(mean over the response tokens)
    # seq 0: A = +1,   0.3, -0.1, 0.1      -> mean 0.1  -> s = e^0.1  = 1.10517 (inside [0.8, 1.2])
    # seq 1: A = -0.5, -0.5, -0.3, (5.0)   -> mean -0.4 -> s = e^-0.4 = 0.67032 (below 0.8, A < 0: clipped)
    # seq 2: A = +2,   0.5, 0.5, (5.0)     -> mean 0.5  -> s = e^0.5  = 1.64872 (above 1.2, A > 0: clipped)
    # seq 3: A = +1,   -0.5, (5.0), (5.0)  -> s = e^-0.5 = 0.60653 (below 0.8 but A > 0: the unclipped term is the min)
    # (masked tokens in brackets: a mean over all three tokens would change every s)
    log_ratio = torch.tensor([[0.3, -0.1, 0.1], [-0.5, -0.3, 5.0], [0.5, 0.5, 5.0], [-0.5, 5.0, 5.0]])
    old = -torch.rand(4, 3, generator=torch.Generator().manual_seed(0)) * 3
    logp = old + log_ratio
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0, 1.0])
    return logp, old, adv, mask


def test_policy_loss_hand_computed():
    logp, old, adv, mask = hand_case()
    loss, stats = policy_loss(logp, old, adv, mask, 0.2, 0.2, num_seqs=4)
    # -min(s A, clip(s) A) per sequence: seq 0: -1.10517; seq 1: -min(-0.33516, 0.8 * -0.5 = -0.4) = +0.4;
    # seq 2: -min(3.29744, 1.2 * 2 = 2.4) = -2.4; seq 3: -min(0.60653, 0.8) = -0.60653; sum / N_seq (4)
    expected = (-math.exp(0.1) + 0.4 - 2.4 - math.exp(-0.5)) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(-0.927925, abs=1e-6)
    assert stats["policy/clip_frac"][0] == 2 and stats["policy/clip_frac"][1] == 4 and stats["policy/approx_kl"][1] == 8  # seqs 1 and 2 clipped
    k3 = sum(math.expm1(x) - x for x in [0.3, -0.1, 0.1, -0.5, -0.3, 0.5, 0.5, -0.5])  # per token, masked out
    assert stats["policy/approx_kl"][0] == pytest.approx(k3, rel=1e-5)


def test_gradient_matches_written_out_formula():
    logp, old, adv, mask = hand_case()
    logp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, mask, 0.2, 0.2, 4)
    (grad,) = torch.autograd.grad(loss, logp)
    # written out: s_i = (prod_t pi_theta(y_it) / pi_old(y_it))^(1 / |y_i|), the product over the response tokens
    x = logp.detach().clone().requires_grad_(True)
    terms = []
    for i in range(4):
        n = int(mask[i].sum())
        s = (x[i, :n].exp() / old[i, :n].exp()).prod() ** (1.0 / n)
        terms.append(-torch.min(s * adv[i], s.clamp(0.8, 1.2) * adv[i]))
    (expected,) = torch.autograd.grad(sum(terms) / 4, x)
    torch.testing.assert_close(grad, expected)
    # closed form: ds_i/dlogp_it = s_i / |y_i| on every response token; 0 where the clip is active (seqs 1, 2)
    closed = torch.zeros(4, 3)
    closed[0, :3] = -1.0 * math.exp(0.1) / 3 / 4
    closed[3, :1] = -1.0 * math.exp(-0.5) / 1 / 4
    torch.testing.assert_close(grad, closed)


def test_first_minibatch_ratio_is_one():
    """On the first mini-batch the policy is still pi_old: logp == old_logp, so s_i == 1 exactly, nothing is clipped
    and the loss is -(1/N) sum_i A_i: 0 up to rounding when the mini-batch holds whole groups of std-normalized
    advantages, while its gradient -A_i / (|y_i| N) on each token is not."""
    torch.manual_seed(0)
    old = -torch.rand(8, 6) * 3
    logp = old.clone().requires_grad_(True)
    mask = torch.arange(6)[None] < torch.tensor([6, 1, 3, 4, 2, 6, 5, 3])[:, None]
    adv = std_advantages(torch.tensor([1., 0., 0., 0., 1., 1., 0., 1.]), 4)
    loss, stats = policy_loss(logp, old, adv, mask, 3e-4, 4e-4, 8)
    assert loss.item() == -(adv.sum() / 8).item()
    assert abs(loss.item()) < 1e-6
    assert stats["policy/clip_frac"][0] == 0 and stats["policy/approx_kl"][0] == 0
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -adv[:, None] * mask / mask.sum(-1, keepdim=True) / 8)


def test_normalizer_independent_of_micro_batching_and_ranks():
    torch.manual_seed(0)
    B, T = 8, 7
    old = -torch.rand(B, T) * 3
    logp = (old + 0.01 * torch.randn(B, T)).requires_grad_(True)  # some sequences clipped, some not
    mask = torch.rand(B, T) > 0.3
    mask[:, 0] = True
    adv = torch.randn(B)
    full, stats = policy_loss(logp, old, adv, mask, 3e-3, 4e-3, B)
    assert 0 < stats["policy/clip_frac"][0] < B
    (g_full,) = torch.autograd.grad(full, logp)
    for world_size, micro in [(1, [[0, 1, 2], [3], [4, 5, 6, 7]]), (2, [[0, 1], [2, 3]]), (4, [[0], [1]])]:
        per_rank = B // world_size
        total, grad = 0.0, torch.zeros_like(logp)
        for r in range(world_size):  # each rank's loss times world_size; FSDP then averages over ranks
            for mb in micro:
                idx = [r * per_rank + i for i in mb]
                loss, _ = policy_loss(logp[idx], old[idx], adv[idx], mask[idx], 3e-3, 4e-3, B)
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
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_gspo_runs_under_torchrun_and_checkpoint_reloads(tmp_path):
    run_dir = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "gspo.py",
           "--run-dir", run_dir, *SMALL]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "train/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["step"] for r in rows if "eval/eval/accuracy" in r] == [0, 1, 2]
    for r in steps:
        for key in ["train/loss", "mismatch/kl_k3", "optim/grad_norm", "policy/approx_kl", "policy/clip_frac",
                    "is/ratio_mean", "is/token_clip_frac", "train/entropy"]:
            assert math.isfinite(r[key]), (key, r[key])
        assert r["mismatch/kl_k3"] >= 0 and 0 <= r["policy/clip_frac"] <= 1
    ckpts = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert ckpts == ["step_000002"]
    path = os.path.join(run_dir, "checkpoints", ckpts[0])
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok.encode("12+3=")])
    assert torch.isfinite(model(ids).logits).all()
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    assert config["exp_name"] == "gspo" and (config["eps_low"], config["eps_high"]) == (3e-4, 4e-4)
    assert "is_correction" not in config


def test_group_of_one_fails_fast(tmp_path):
    p = subprocess.run([sys.executable, "gspo.py", "--run-dir", str(tmp_path), "--group-size", "1"], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--group-size 1: must be at least 2" in p.stderr, p.stderr[-2000:]
    assert "Loading weights" not in p.stderr
