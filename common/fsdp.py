"""FSDP2 wrapping of a Hugging Face causal LM, and gathering its full weights (for the sampler and checkpoints).

fp32 master weights and optimizer states; compute in the train precision (MixedPrecisionPolicy.param_dtype);
gradients reduced in fp32. `fully_shard` per decoder layer, then the root, on any number of ranks including 1.
"""
import os

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from common.logprobs import PolicyModel


def check_model_dir(path: str) -> None:
    """Fail fast, before anything is loaded, on a model path that cannot be a Hugging Face model directory."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--model {path!r}: no such directory (give a local Hugging Face model directory)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--model {path!r}: no config.json there, not a Hugging Face model directory")
    if not os.access(os.path.join(path, "config.json"), os.R_OK):
        raise PermissionError(f"--model {path!r}: config.json is not readable")


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    base = getattr(lm, lm.base_model_prefix)
    if not hasattr(base, "layers") or not hasattr(lm, "lm_head"):
        raise ValueError(f"{type(lm).__name__}: expected a decoder-only LM with .{lm.base_model_prefix}.layers and "
                         ".lm_head (Llama/Qwen/Mistral-style)")
    return base.layers


def without_dropout(config) -> dict:
    """Set every dropout rate of a Hugging Face config to 0 (attention_dropout, hidden_dropout, resid_pdrop, ...,
    also in nested configs) and return the ones changed. The trainer's forwards run in train mode (gradient
    checkpointing acts only there), so a checkpoint that sets a dropout rate would otherwise make old_logp and logp
    random draws (differences of several nats) rather than the policy's log-probs. The sampler never drops out."""
    changed = {}
    for key, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a nested config (e.g. text_config)
            changed.update({f"{key}.{k}": v for k, v in without_dropout(value).items()})
        elif ("dropout" in key or "pdrop" in key) and type(value) in (int, float) and value != 0:
            changed[key] = value
            setattr(config, key, 0.0)
    return changed


def load_sharded(path: str, wrap, param_dtype: torch.dtype, device: torch.device, gradient_checkpointing: bool,
                 attn_implementation: str = "sdpa") -> nn.Module:
    """Load a Hugging Face causal LM's fp32 master weights, wrap it (`wrap(lm)` -> the root module, e.g. PolicyModel),
    and shard with FSDP2: each decoder layer, then the root, which so owns the embedding, the final norm and the
    lm_head (kept together: they may be tied) and whatever the wrapper adds. Dropout is off (without_dropout), also
    in the config that checkpoints save."""
    config = AutoConfig.from_pretrained(path)
    without_dropout(config)
    lm = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                              attn_implementation=attn_implementation)
    for m in lm.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # (an nn.Dropout whose rate a config field did not set)
    if gradient_checkpointing:
        if hasattr(lm, "activation_checkpointing_enable"):  # the name since transformers 5.2x
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.config.use_cache = False
    model = wrap(lm).to(device)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(lm):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def load_policy(path: str, param_dtype: torch.dtype, device: torch.device, gradient_checkpointing: bool,
                attn_implementation: str = "sdpa") -> PolicyModel:
    """The policy: the FSDP2-sharded PolicyModel wrapper (its forward returns the response tokens' log-probs)."""
    def wrap(lm):
        if lm.lm_head.bias is not None:
            raise ValueError("lm_head with a bias is not supported by the chunked log-prob head")
        return PolicyModel(lm)
    return load_sharded(path, wrap, param_dtype, device, gradient_checkpointing, attn_implementation)


@torch.no_grad()
def iter_full_state(lm: nn.Module, dtype: torch.dtype | None = None, device: torch.device | None = None):
    """Yield (Hugging Face name, full tensor) one parameter at a time: each sharded tensor is all-gathered on its own,
    so at most one full tensor beyond the shards is alive. Each shard is cast to `dtype` before the gather (a 16-bit
    rollout precision moves half the bytes of the fp32 masters), and a tensor held under two names (a tied embedding
    and lm_head) is sent once, under its first name (the samplers, like from_pretrained, tie it themselves).
    A collective: every rank must iterate to the end."""
    aliases = {n for n, _ in lm.named_parameters(remove_duplicate=False)} - {n for n, _ in lm.named_parameters()}
    for name, t in lm.state_dict().items():
        if name in aliases:
            continue
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)  # a DTensor casts its local shard
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield name, (t.to(device) if device is not None else t)
