"""grpo.py's pure functions against hand-computed values, and the invariances docs/algorithms.md requires."""
import math

import pytest
import torch

from corrections import importance_weights as weights_and_clipped
from grpo import drgrpo_advantages, policy_loss


def test_drgrpo_advantages_subtract_group_mean_without_std():
    r = torch.tensor([1., 0., 0., 1., 1., 1., 1., 1.])
    assert drgrpo_advantages(r, 4).tolist() == [0.5, -0.5, -0.5, 0.5, 0., 0., 0., 0.]


def hand_case():
    # seq 0: A = +1, ratios 1.0, 1.5, 0.7; seq 1: A = -0.5, ratios 0.5, 1.1 (third token masked out)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -7.0]])
    ratio = torch.tensor([[1.0, 1.5, 0.7], [0.5, 1.1, 9.0]])
    logp = old + ratio.log()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5])
    return logp, old, adv, mask


def test_policy_loss_hand_computed():
    logp, old, adv, mask = hand_case()
    loss, stats = policy_loss(logp, old, adv, torch.ones_like(old), mask, 0.2, 0.28, max_response_len=4, num_seqs=2)
    # seq 0: -(1) - min(1.5, 1.28) - min(0.7, 0.8) = -2.98; seq 1 (A<0): -min(-.25, -.4) - min(-.55, -.55) = 0.95
    assert loss.item() == pytest.approx((-2.98 + 0.95) / 4 / 2, abs=1e-6)
    assert stats["policy/clip_frac"][0] == 2 and stats["policy/clip_frac"][1] == 5  # seq0 tok1 (above 1.28, A>0), seq1 tok0 (below 0.8, A<0)
    k3 = sum(r - 1 - math.log(r) for r in [1.0, 1.5, 0.7, 0.5, 1.1])
    assert stats["policy/approx_kl"][0] == pytest.approx(k3, rel=1e-5)


def test_policy_loss_gradient_matches_written_out_formula():
    logp, old, adv, mask = hand_case()
    logp = logp.clone().requires_grad_(True)
    w = torch.tensor([[1.0, 2.0, 0.5], [3.0, 1.0, 1.0]])
    loss, _ = policy_loss(logp, old, adv, w, mask, 0.2, 0.28, 4, 2)
    loss.backward()
    # d/dlogp of -w * r * A where the unclipped branch is the min, 0 where the clip is active, / (L_max * N)
    r = torch.exp(logp.detach() - old)
    unclipped = torch.tensor([[1., 0., 1.], [0., 1., 0.]])
    expected = -w * r * adv[:, None] * unclipped * mask / 4 / 2
    torch.testing.assert_close(logp.grad, expected)


def test_token_tis_weights_hand_computed():
    old = torch.tensor([[math.log(2.0), math.log(5.0), 0.0]])
    mu = torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    w = weights_and_clipped(old, mu, mask, "token-tis", 3.0)[0]
    assert w[0, :2].tolist() == pytest.approx([2.0, 3.0])


def test_seq_mis_weights_hand_computed():
    old = torch.tensor([[0.1, 0.2, 5.0], [0.5, 0.7, 0.0], [100.0, 100.0, 100.0]])
    mu = torch.zeros(3, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    w = weights_and_clipped(old, mu, mask, "seq-mis", 3.0)[0]
    assert w[0].tolist() == pytest.approx([math.exp(0.3)] * 3)  # rho = e^0.3 <= 3: kept, the masked 5.0 ignored
    assert w[1].tolist() == [0.0] * 3  # rho = e^1.2 > 3: masked
    assert w[2].tolist() == [0.0] * 3  # rho overflows to inf: masked, not nan


@pytest.mark.parametrize("mode", ["token-tis", "seq-mis"])
def test_corrections_reduce_to_drgrpo_when_mu_equals_old(mode):
    torch.manual_seed(0)
    old = -torch.rand(6, 5) * 3
    logp = old + 0.3 * torch.randn(6, 5)
    mask = torch.rand(6, 5) > 0.2
    adv = torch.randn(6)
    w = weights_and_clipped(old, old.clone(), mask, mode, 3.0)[0]
    plain, _ = policy_loss(logp, old, adv, torch.ones_like(old), mask, 0.2, 0.28, 8, 6)
    corrected, _ = policy_loss(logp, old, adv, w, mask, 0.2, 0.28, 8, 6)
    assert torch.equal(w, torch.ones_like(w))
    assert corrected.item() == plain.item()


def test_normalizer_independent_of_micro_batching_and_ranks():
    torch.manual_seed(0)
    B, T, L_max = 8, 7, 10
    old = -torch.rand(B, T) * 3
    logp = (old + 0.3 * torch.randn(B, T)).requires_grad_(True)
    mask = torch.rand(B, T) > 0.3
    adv = torch.randn(B)
    w = torch.rand(B, T) + 0.5
    full, _ = policy_loss(logp, old, adv, w, mask, 0.2, 0.28, L_max, B)
    (g_full,) = torch.autograd.grad(full, logp)
    for world_size, micro in [(1, [[0, 1, 2], [3], [4, 5, 6, 7]]), (2, [[0, 1], [2, 3]]), (4, [[0], [1]])]:
        per_rank = B // world_size
        total, grad = 0.0, torch.zeros_like(logp)
        for r in range(world_size):  # each rank's loss times world_size; FSDP then averages over ranks
            for mb in micro:
                idx = [r * per_rank + i for i in mb]
                loss, _ = policy_loss(logp[idx], old[idx], adv[idx], w[idx], mask[idx], 0.2, 0.28, L_max, B)
                (g,) = torch.autograd.grad(loss * world_size, logp)
                total += loss.item()  # = the mean over ranks of (loss * world_size)
                grad += g / world_size
        assert total == pytest.approx(full.item(), abs=1e-6)
        torch.testing.assert_close(grad, g_full)
