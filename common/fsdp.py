"""FSDP2 wrapping of a Hugging Face causal LM (fp32 masters, gradients and AdamW states, in CPU memory with cpu_offload;
compute in the train precision), and gathering its full weights for the sampler and checkpoints (docs/scale.md)."""
import json
import os
from contextlib import contextmanager

import torch
import torch.nn as nn
from safetensors import safe_open
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from common.logprobs import PolicyModel


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    base = getattr(lm, lm.base_model_prefix)
    if not hasattr(base, "layers") or not hasattr(lm, "lm_head"):
        raise ValueError(f"{type(lm).__name__}: expected a decoder-only LM with .{lm.base_model_prefix}.layers and "
                         ".lm_head (Llama/Qwen/Mistral-style)")
    return base.layers


def without_dropout(config) -> dict:
    """Set every dropout rate of a Hugging Face config to 0 (attention_dropout, resid_pdrop, ..., also in nested
    configs) and return the ones changed: the trainer's forwards run in train mode (docs/scale.md, Dropout)."""
    changed = {}
    for key, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a nested config (e.g. text_config)
            changed.update({f"{key}.{k}": v for k, v in without_dropout(value).items()})
        elif ("dropout" in key or "pdrop" in key) and type(value) in (int, float) and value != 0:
            changed[key] = value
            setattr(config, key, 0.0)
    return changed


def load_sharded(path: str, wrap, param_dtype: torch.dtype, device: torch.device, gradient_checkpointing: bool,
                 attn_implementation: str = "sdpa", cpu_offload: bool = False, compile: bool = False,
                 master_dtype: torch.dtype = torch.float32) -> nn.Module:
    """A Hugging Face causal LM with dropout off and fp32 master weights (`master_dtype`: a frozen model keeps its
    compute precision), wrapped (`wrap(lm)` -> the root, e.g. PolicyModel) and sharded per decoder layer, then the root.
    Each rank reads only its rows of the safetensors files (docs/scale.md, Loading); what they lack (buffers, a value
    head) is built on every rank. compile: compile_layers, on a GPU only (on a CPU: minutes of compiling for little)."""
    config = AutoConfig.from_pretrained(path)
    without_dropout(config)
    with _parameters_on_meta():
        lm = AutoModelForCausalLM.from_config(config, dtype=master_dtype, attn_implementation=attn_implementation)
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        lm.generation_config = GenerationConfig.from_pretrained(path)
    for m in lm.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # (an nn.Dropout whose rate a config field did not set)
    if gradient_checkpointing:
        checkpoint_layers(lm)
    lm.config.use_cache = False
    model = wrap(lm)
    prefix = next(n for n, m in model.named_children() if m is lm) + "."
    built = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta}
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # pinned: faster copies to and from the GPU, overlapping compute; on a CPU pin_memory() raises (and offload is moot)
    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(lm):
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    # uninitialised shards and buffers, with offload on the CPU (FSDP2 checks the shards are there and won't move them)
    model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    with torch.no_grad():
        for name, t in model.named_buffers():
            t.data = built[name].to(device)  # (to_empty took them to the CPU too, with offload)
        read_shards(path, {n[len(prefix):]: p for n, p in model.named_parameters() if n not in built})
        for name, p in model.named_parameters():
            if name in built:
                local, offset = _local_rows(p)
                local.copy_(built[name][offset:offset + local.shape[0]])
    if compile and device.type == "cuda":
        compile_layers(lm)
    return model


def checkpoint_layers(lm: nn.Module, **checkpoint_kwargs) -> None:
    """Hugging Face's gradient checkpointing of each decoder layer, non-reentrant, with `checkpoint_kwargs` (exact mode:
    context_fn). Callable again on a sharded model: sets each layer's checkpoint function and hooks the embedding."""
    kwargs = {"use_reentrant": False, **checkpoint_kwargs}
    if hasattr(lm, "activation_checkpointing_enable"):  # the name since transformers 5.2x
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_layers(lm: nn.Module) -> None:
    """torch.compile each decoder layer's forward in place (docs/results.md, Benchmarks); FSDP2's hooks, checkpointing
    and names stay. The recompile limit covers the layers' shared graph per case (shapes, grad mode, train/eval, padding
    mask): past it dynamo runs eagerly, and an eager recompute of a compiled forward fails checkpointing's check."""
    import torch._dynamo
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for layer in decoder_layers(lm):
        layer.forward = torch.compile(layer.forward)


@contextmanager
def _parameters_on_meta():
    """Parameters built inside go on the meta device (no memory, no init), buffers stay real (rotary frequencies are in
    no checkpoint). Not accelerate's init_empty_weights: it re-wraps a parameter already on meta, untying lm_head."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)
    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _local_rows(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's rows of a parameter, the index of its first row in the full tensor): FSDP2 shards dim 0."""
    if not hasattr(p, "to_local"):
        return p.data, 0
    if any(not (pl.is_shard(0) or pl.is_replicate()) for pl in p.placements):
        raise ValueError(f"unexpected placements {p.placements} (FSDP2 shards dim 0)")
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return p.to_local(), (offset[0] if len(offset) else 0)


@torch.no_grad()
def read_shards(path: str, params: dict[str, torch.Tensor]) -> None:
    """Fill each (sharded) parameter, by Hugging Face name, with only its rows, sliced from the safetensors files."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json (safetensors weights "
                                "are needed to load each rank's shard alone)")
    missing = sorted(n for n in params if n not in weight_map)
    if missing:
        raise ValueError(f"{path}: {len(missing)} parameters of the model are not in its weights, e.g. {missing[:3]}")
    for name, p in params.items():
        # opened per tensor: the file is memory-mapped, and the pages a slice touched stay resident until it closes
        with safe_open(os.path.join(path, weight_map[name]), "pt") as f:
            rows = f.get_slice(name)
            if tuple(rows.get_shape()) != tuple(p.shape):
                raise ValueError(f"{path}: {name} has shape {tuple(rows.get_shape())} in the file, {tuple(p.shape)} "
                                 "in the model")
            local, offset = _local_rows(p)
            if local.numel():
                local.copy_(rows[offset:offset + local.shape[0]])


def load_policy(path: str, param_dtype: torch.dtype, device: torch.device, gradient_checkpointing: bool,
                attn_implementation: str = "sdpa", cpu_offload: bool = False, compile: bool = False) -> PolicyModel:
    """The policy: the FSDP2-sharded PolicyModel wrapper (its forward returns the response tokens' log-probs)."""
    def wrap(lm):
        if lm.lm_head.bias is not None:
            raise ValueError("lm_head with a bias is not supported by the chunked log-prob head")
        return PolicyModel(lm)
    return load_sharded(path, wrap, param_dtype, device, gradient_checkpointing, attn_implementation, cpu_offload,
                        compile)


def load_reference(path: str, param_dtype: torch.dtype, device: torch.device, cpu_offload: bool = False,
                   compile: bool = False) -> PolicyModel:
    """A frozen policy (a KL term's reference): load_policy's model, sharded alike, eval mode, no gradients; its shards
    in `param_dtype` (no optimizer: half the bytes of fp32 masters in 16 bits), no checkpointing (no backward)."""
    ref = load_sharded(path, lambda lm: PolicyModel(lm), param_dtype, device, False, cpu_offload=cpu_offload,
                       compile=compile, master_dtype=param_dtype)
    return ref.requires_grad_(False).eval()


def tied_aliases(lm: nn.Module) -> dict[str, list[str]]:
    """{name of a parameter: its other names} (a tied lm_head: {embed_tokens.weight: [lm_head.weight]})."""
    names = {}
    for name, p in lm.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {ns[0]: ns[1:] for ns in names.values() if len(ns) > 1}


def full_state_names(lm: nn.Module) -> list[tuple[str, tuple, torch.dtype]]:
    """(Hugging Face name, full shape, dtype) of what iter_full_state(lm, float32, aliases=False) yields, in order."""
    aliases = {a for names in tied_aliases(lm).values() for a in names}
    return [(n, tuple(t.shape), torch.float32 if t.is_floating_point() else t.dtype)
            for n, t in lm.state_dict().items() if n not in aliases]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a DTensor: a collective), or `t` itself. An offloaded shard (on the CPU, its
    mesh the GPU's) goes to the GPU first, so that NCCL, not gloo, gathers it, as torch's state-dict gather does."""
    if not hasattr(t, "full_tensor"):
        return t
    if t.device.type != t.device_mesh.device_type:
        t = t.to(t.device_mesh.device_type)
    return t.full_tensor()


@torch.no_grad()
def iter_full_state(lm: nn.Module, dtype: torch.dtype | None = None, device: torch.device | None = None,
                    aliases: bool = True):
    """Yield (Hugging Face name, full tensor), one gathered at a time, each shard first cast to `dtype` (16-bit rollouts
    move half the bytes). A tied tensor is gathered once and yielded under each name (vLLM wants both), or with
    aliases=False its first (as a checkpoint stores it). A collective: every rank must iterate to the end."""
    tied = tied_aliases(lm)
    skip = {a for names in tied.values() for a in names}
    for name, t in lm.state_dict().items():
        if name in skip:
            continue
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)  # a DTensor casts its local shard
        t = full_tensor(t) if device is None else full_tensor(t).to(device)
        for n in ([name, *tied.get(name, [])] if aliases else [name]):
            yield n, t
