"""FP16 dynamic loss scaling under FSDP2 (a process group of one), and the precision flags."""
import pytest
import torch

from common.fsdp import load_policy
from common.logprobs import collate
from common.precision import LossScaler, resolve_precisions


def test_resolve_precisions():
    assert resolve_precisions("fp16", None, None) == (torch.float16, torch.float16)  # resolved once, to dtypes
    assert resolve_precisions("fp16", "bf16", "fp32") == (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        resolve_precisions("fp8", None, None)


def _model_and_loss(tiny_model_dir, device):
    """The FSDP2 policy (fp16 compute), its sharded parameters (taken before the forward: the root's parameters
    are unsharded plain tensors between its forward and backward) and a loss."""
    model = load_policy(tiny_model_dir, torch.float16, device, gradient_checkpointing=False)
    params = list(model.parameters())
    ids, attn, rmask = collate([[4, 5, 13]], [[6, 7, 1]], 0, device)
    logp, _ = model(ids, attn, rmask, 1.0, 2)
    return model, params, -logp.sum()


def test_injected_inf_skips_step_keeps_weights_and_halves_scale(tiny_model_dir, process_group):
    _, _, device = process_group
    model, params, loss = _model_and_loss(tiny_model_dir, device)
    opt = torch.optim.AdamW(params, lr=1e-2)
    scaler = LossScaler(enabled=True, init_scale=1024.0)
    scaler.scale_loss(loss).backward()
    params[3].grad.to_local().view(-1)[0] = float("inf")  # an fp16 overflow in one gradient
    before = [p.detach().full_tensor().clone() for p in params]
    norm, skipped = scaler.step(params, opt, max_grad_norm=1.0)
    assert skipped and scaler.skipped_steps == 1 and scaler.scale == 512.0
    for b, p in zip(before, params):
        assert torch.equal(b, p.detach().full_tensor())
    assert all(p.grad is None for p in params)


def test_finite_step_updates_and_scale_grows_after_interval(tiny_model_dir, process_group):
    _, _, device = process_group
    model, params, loss = _model_and_loss(tiny_model_dir, device)
    opt = torch.optim.AdamW(params, lr=1e-2)
    scaler = LossScaler(enabled=True, init_scale=1024.0, growth_interval=1)
    scaled = scaler.scale_loss(loss)
    assert scaled.item() == pytest.approx(loss.item() * 1024.0, rel=1e-3)
    scaled.backward()
    # the unscaled gradient norm is what an unscaled backward gives
    before = [p.detach().full_tensor().clone() for p in params]
    norm, skipped = scaler.step(params, opt, max_grad_norm=1e9)
    assert not skipped and scaler.scale == 2048.0 and scaler.skipped_steps == 0
    assert any(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, params))
    model2, params2, loss2 = _model_and_loss(tiny_model_dir, device)
    loss2.backward()
    ref = torch.nn.utils.clip_grad_norm_(params2, 1e9).full_tensor().item()
    assert norm == pytest.approx(ref, rel=1e-2)


def test_disabled_scaler_is_identity_and_still_skips_nonfinite(tiny_model_dir, process_group):
    _, _, device = process_group
    model, params, loss = _model_and_loss(tiny_model_dir, device)
    opt = torch.optim.AdamW(params, lr=1e-2)
    scaler = LossScaler(enabled=False)
    assert scaler.scale_loss(loss) is loss
    (loss * float("nan")).backward()
    norm, skipped = scaler.step(params, opt, 1.0)
    assert skipped and scaler.scale == 1.0 and scaler.skipped_steps == 1
