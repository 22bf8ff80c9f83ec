"""cispo.py's loss against hand-computed values and gradients (MiniMax-M1, arXiv 2506.13585 eq. 4-5), its token-count
normalizer under micro-batching and ranks, and cispo.py end to end under torchrun on the built-in task."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from cispo import policy_loss, std_advantages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hand_case():
    # seq 0: A = +1, ratios 1.0, 7.0 (above 1 + eps_high = 5), 0.1; seq 1: A = -0.5, ratios 0.5, 2.0 (third masked)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -7.0]])
    ratio = torch.tensor([[1.0, 7.0, 0.1], [0.5, 2.0, 9.0]])
    logp = old + ratio.log()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return logp, old, torch.tensor([1.0, -0.5]), mask


def test_std_advantages_as_grpo_with_std():
    adv = std_advantages(torch.tensor([1., 0., 0., 0., 1., 1., 1., 1.]), 4)
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)  # unbiased std 0.5
    assert adv[4:].tolist() == [0.0] * 4  # std 0: no nan


def test_cispo_loss_and_gradient_hand_computed():
    logp, old, adv, mask = hand_case()
    logp = logp.clone().requires_grad_(True)
    w = torch.tensor([[1.0, 1.0, 2.0], [1.0, 0.5, 1.0]])  # a rollout correction's weight multiplies each term
    loss, stats = policy_loss(logp, old, adv, w, mask, 1.0, 4.0, num_tokens=5)
    # weights sg[clip(r, 0, 5)]: 1, 5, 0.1 | 0.5, 2; loss = -(1/5) sum w * r_clip * A * logp
    r_clip = torch.tensor([[1.0, 5.0, 0.1], [0.5, 2.0, 0.0]])
    expected = -(w * r_clip * adv[:, None] * logp.detach() * mask).sum() / 5
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    # every kept token keeps a gradient, the clipped one (r = 7) included, unlike PPO's clip: -w r_clip A / N_tok
    torch.testing.assert_close(logp.grad, -(w * r_clip * adv[:, None]) * mask / 5)
    assert stats["policy/clip_frac"][0] == 1 and stats["policy/clip_frac"][1] == 5  # only r = 7 is outside [0, 5]
    k3 = sum(r - 1 - math.log(r) for r in [1.0, 7.0, 0.1, 0.5, 2.0])
    assert stats["policy/approx_kl"][0] == pytest.approx(k3, rel=1e-5)


def test_cispo_lower_bound_applies_when_set():
    logp, old, adv, mask = hand_case()
    loss, stats = policy_loss(logp, old, adv, torch.ones_like(old), mask, 0.2, 0.28, num_tokens=5)
    r_clip = torch.tensor([[1.0, 1.28, 0.8], [0.8, 1.28, 0.0]])
    assert loss.item() == pytest.approx((-(r_clip * adv[:, None] * logp * mask).sum() / 5).item(), rel=1e-6)
    assert stats["policy/clip_frac"][0] == 4


def test_all_zero_weights_give_zero_loss_and_no_gradient():
    logp, old, adv, mask = hand_case()
    logp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, torch.zeros_like(old), mask, 1.0, 4.0, num_tokens=5)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))


def test_normalizer_independent_of_micro_batching_and_ranks():
    torch.manual_seed(0)
    B, T = 8, 7
    old = -torch.rand(B, T) * 3
    logp = (old + 0.5 * torch.randn(B, T)).requires_grad_(True)
    mask = torch.rand(B, T) > 0.3
    adv, w = torch.randn(B), torch.rand(B, T) + 0.5
    n_tok = float(mask.sum())
    full, _ = policy_loss(logp, old, adv, w, mask, 1.0, 4.0, n_tok)
    (g_full,) = torch.autograd.grad(full, logp)
    for world_size, micro in [(1, [[0, 1, 2], [3], [4, 5, 6, 7]]), (2, [[0, 1], [2, 3]]), (4, [[0], [1]])]:
        per_rank = B // world_size
        total, grad = 0.0, torch.zeros_like(logp)
        for r in range(world_size):
            for mb in micro:
                idx = [r * per_rank + i for i in mb]
                loss, _ = policy_loss(logp[idx], old[idx], adv[idx], w[idx], mask[idx], 1.0, 4.0, n_tok)
                (g,) = torch.autograd.grad(loss * world_size, logp)
                total += loss.item()
                grad += g / world_size
        assert total == pytest.approx(full.item(), abs=1e-6)
        torch.testing.assert_close(grad, g_full)


SMALL = ["--num-steps", "2", "--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2",
         "--micro-batch-tokens", "96", "--eval-every", "1", "--eval-k", "2", "--eval-max-problems", "8",
         "--save-every", "1", "--keep-last", "1"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_cispo_runs_under_torchrun(tmp_path):
    run_dir = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "cispo.py",
           "--run-dir", run_dir, *SMALL, "--is-correction", "token-tis"]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "train/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for key in ["train/loss", "mismatch/kl_k3", "optim/grad_norm", "policy/approx_kl", "policy/clip_frac",
                    "is/weight_mean", "train/entropy"]:
            assert math.isfinite(r[key]), (key, r[key])
    assert os.listdir(os.path.join(run_dir, "checkpoints")) == ["step_000002"]
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    assert config["exp_name"] == "cispo" and (config["eps_low"], config["eps_high"]) == (1.0, 4.0)


def test_group_of_one_fails_fast(tmp_path):
    p = subprocess.run([sys.executable, "cispo.py", "--run-dir", str(tmp_path), "--group-size", "1"], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--group-size 1: must be at least 2" in p.stderr, p.stderr[-2000:]
    assert "Loading weights" not in p.stderr
