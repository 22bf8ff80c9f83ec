"""The anatomy of the training-inference mismatch: on the same token ids, where the trainer's forward and vLLM's first
differ, op by op and layer by layer, how the difference grows through the layers, and which part of kl_k3 comes
from which cause (docs/exact.md). No training: the same weights on both sides.

For each precision p, vLLM (in p) samples --num-prompts x --samples responses at temperature 1, recording mu. Then:
(i) op by op, for --op-sequences of those sequences (spread over the lengths): prompt + response scored by vLLM as one
    prompt in one prefill (forward hooks on its modules; an eager engine, since a compiled or graph-replayed one runs
    no hooks) and by the trainer's forward (PolicyModel in p, unsharded, hooks on the Hugging Face modules; with
    --exact also the exact forward of exact.py). Per op group (embedding, input norm, q/k/v, RoPE, attention,
    o_proj, residual sums, post-attention norm, gate/up, SiLU-and-mul, down_proj, final norm, lm_head, log-prob) and
    layer: max |diff|, mean |diff| and the fraction of bitwise-equal elements, both "accumulated" (each side from its
    own inputs: how the difference grows) and "isolated" (the trainer's op applied to vLLM's own inputs: which ops
    differ by themselves); and the first op, in execution order, that is not bitwise equal.
(ii) decode against prefill: mu (decoding) against vLLM's prefill scoring of the same sequences (prompt log-probs),
    all sequences in one batch;
(iii) alone against batch: each sequence scored alone against in that batch, by vLLM and by the trainer (the
    trainer's batch: micro-batches of --micro-batch-tokens, right-padded, as grpo.py's step 3);
(iv) the decomposition of kl_k3 (grpo.py's mismatch/kl_k3 of this batch, d = log pi_old - log mu per response token)
    along the chain mu (decode) -> vLLM prefill (batch) -> vLLM prefill (alone) -> trainer (alone) -> trainer (batch).
    The links' per-token differences add up to the total's exactly; kl_k3 = mean(e^d - 1 - d) ~ mean(d^2) / 2 does
    not: mean(d^2) splits into the links' mean squares plus cross terms (negative where links cancel), reported as
    they are.

Temperature 1 throughout (vLLM's prompt log-probs are taken before any temperature). vLLM runs eager here unless
--no-vllm-eager (then as grpo.py's default sampler, compiled with CUDA graphs, and (i) is skipped): an eager engine's
numbers differ from a compiled one's, whose RMSNorm, SiLU and RoPE Inductor generates.

    python sanity/mismatch_anatomy.py                       # the built-in model, fp32, on a CPU or GPU
    python sanity/mismatch_anatomy.py --model DIR --dataset math500.jsonl --precisions fp16 bf16 --out-dir runs/anat
    python sanity/mismatch_anatomy.py --model DIR --dataset math500.jsonl --precisions fp16 bf16 --exact \\
        --out-dir runs/anat_exact                           # vLLM batch-invariant, the exact forward beside

Writes anatomy.md, anatomy.json and growth.png into --out-dir.
"""
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # (as the other sanity tools: idle OpenMP threads spin otherwise)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python sanity/mismatch_anatomy.py` from anywhere
    sys.path.insert(0, ROOT)

import numpy as np
import torch
import torch.nn.functional as F

from common import exits
from common.cli import config_changes, parse
from common.dist import print0

Precision = Literal["fp16", "bf16", "fp32"]
# op groups in execution order within a layer ("residual" at layer i: the stream entering layer i, i >= 1; at the
# number of layers: the stream entering the final norm)
LAYER_OPS = ("residual", "input_norm", "qkv", "rope_q", "rope_k", "attention", "o_proj", "residual_mid", "post_norm",
             "gate_up", "act", "mlp_out")
HEAD_OPS = ("final_norm", "logits", "logprob")  # rows: the positions that predict the next token (all but the last)


@dataclass
class Args:
    """Defaults are for a real model (--model); without --model the built-in task's preset BUILTIN (below) replaces
    some of them, under the command line; the run prints at start every value that differs from these."""
    out_dir: str = "runs/anatomy"
    """where anatomy.md, anatomy.json and growth.png go"""
    model: str | None = None
    """local Hugging Face model directory (default: the built-in task's model)"""
    dataset: str | None = None
    """prompts: .jsonl/.json/.parquet with a problem field (default: the built-in training set)"""
    num_prompts: int = 32
    """prompts taken from the dataset (a random subset fixed by --seed)"""
    samples: int = 4
    """responses sampled per prompt"""
    precisions: tuple[Precision, ...] = ("fp16", "bf16")
    """precisions measured, each on both sides"""
    op_sequences: int = 4
    """sequences compared op by op, (i) (each holds every layer's activations of both sides in GPU memory)"""
    exact: bool = False
    """vLLM in batch-invariant mode as grpo.py --exact runs it, and the trainer's exact forward (exact.py)
    measured beside its default one. The mode is process-wide: the default forward then runs with aten's log_softmax,
    softmax, mean and bmm replaced by vLLM's Triton kernels and TF32 off (docs/exact.md)"""
    vllm_eager: bool = True
    """run vLLM eager (the hooks of (i) need it); False: as grpo.py's sampler (compiled, CUDA graphs; with --exact,
    CUDA graphs over the eager kernels), and (i) is skipped"""
    seed: int = 1
    """seed of the prompt subset and of the sampler"""
    prompt_template: str = "chat"
    """'chat' (the tokenizer's chat template with the R1-distill instruction), 'chat:<format>' or a raw format string
    with {problem}"""
    max_prompt_len: int = 1024
    """prompts longer than this (tokens) are skipped"""
    max_response_len: int = 1024
    """response length limit in tokens"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (the trainer shares the GPU)"""
    vllm_kv_cache_gib: float = 0.0
    """GiB of KV cache for vLLM, fixed instead of measured at start (0: measure), as in the algorithm scripts"""
    micro_batch_tokens: int = 32768
    """token budget of the trainer's batch scoring (rows x longest row), as grpo.py's"""
    logprob_chunk: int = 2048
    """tokens per chunk of the trainer's log-prob head, as grpo.py's"""


BUILTIN = dict(prompt_template="{problem}", max_prompt_len=16, max_response_len=8, num_prompts=8, samples=2,
               precisions=("fp32",), micro_batch_tokens=4096)


# ----------------------------------------------------------------------------------------------------------------
# vLLM's side

def prefill_logprobs(llm, seqs: list[list[int]]) -> list[torch.Tensor]:
    """vLLM's log-prob of each token after the first, scoring each sequence as a prompt (prompt_logprobs: one prefill,
    the model's raw log-probs), all sequences in one generate call. Returns fp32 tensors of len(seq) - 1."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
    return [torch.tensor([entry[t].logprob for entry, t in zip(list(o.prompt_logprobs)[1:], s[1:])],
                         dtype=torch.float32) for o, s in zip(outs, seqs)]


class VllmCapture:
    """Forward hooks on vLLM's Qwen2 modules (model_executor/models/qwen2.py) recording, while `active`, each op's
    output of every engine step, and the RoPE's inputs (its kernel rotates in place). Each output is copied at once:
    vLLM's fused add + norm and RoPE write into their inputs. The RoPE module is shared by the layers: a pre-hook on
    each layer says which one runs."""

    def __init__(self, model):
        self.active, self.steps, self.layer, self.handles = False, [], -1, []
        base = model.model
        hook = lambda mod, fn: self.handles.append(mod.register_forward_hook(fn))  # noqa: E731

        def put(name, layer, x):
            self.steps[-1][(name, layer)] = x.detach().clone()

        def on_embed(mod, args, out):
            if self.active:
                self.steps.append({("ids", -1): args[0].detach().clone(), "logits": [], "logits_in": []})
                put("embedding", -1, out)
        hook(base.embed_tokens, on_embed)
        for i, layer in enumerate(base.layers):
            self.handles.append(layer.register_forward_pre_hook(lambda mod, args, i=i: setattr(self, "layer", i)))
            attn, mlp = layer.self_attn, layer.mlp

            def norm_out(name, sum_name, i):
                def fn(mod, args, out):
                    if self.active:
                        if isinstance(out, tuple):  # fused add + norm: (normed, the sum)
                            put(name, i, out[0])
                            put(sum_name, i, out[1])
                        else:
                            put(name, i, out)
                return fn

            def first(name, i):
                def fn(mod, args, out):
                    if self.active:
                        put(name, i, out[0] if isinstance(out, tuple) else out)
                return fn
            hook(layer.input_layernorm, norm_out("input_norm", "residual", i))
            hook(attn.qkv_proj, first("qkv", i))
            hook(attn.attn, first("attention", i))
            hook(attn.o_proj, first("o_proj", i))
            hook(layer.post_attention_layernorm, norm_out("post_norm", "residual_mid", i))
            hook(mlp.gate_up_proj, first("gate_up", i))
            hook(mlp.act_fn, first("act", i))
            hook(mlp.down_proj, first("mlp_out", i))
        rotary = base.layers[0].self_attn.rotary_emb

        def rope_in(mod, args):
            if self.active:
                put("positions", -1, args[0])
                put("rope_in_q", self.layer, args[1])
                put("rope_in_k", self.layer, args[2])

        def rope_out(mod, args, out):
            if self.active:
                put("rope_q", self.layer, out[0])
                put("rope_k", self.layer, out[1])
        self.handles.append(rotary.register_forward_pre_hook(rope_in))
        hook(rotary, rope_out)
        n_layers = len(base.layers)

        def final_norm(mod, args, out):
            if self.active:
                put("final_norm", -1, out[0])
                put("residual", n_layers, out[1])
        hook(base.norm, final_norm)

        def on_logits(mod, args, out):  # LogitsProcessor.forward(lm_head, hidden_states)
            if self.active:
                self.steps[-1]["logits"].append(out.detach().clone())
                self.steps[-1]["logits_in"].append(args[1].detach().clone())
        hook(model.logits_processor, on_logits)

    def sequence(self, seq: list[int]) -> dict:
        """The recorded step that ran `seq` (one request, one prefill) as {(op, layer): rows}, its rows cut to the
        sequence (an engine may pad a step); the logits: the prompt log-probs' calls (after the sampler's one row)."""
        L = len(seq)
        ids = torch.tensor(seq)
        step = next(s for s in self.steps if torch.equal(s[("ids", -1)][:L].cpu().long(), ids))
        out = {k: v[:L] for k, v in step.items() if k not in ("logits", "logits_in")}
        out[("logits", -1)] = torch.cat(step["logits"][1:])[:L - 1]
        self.steps = []
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


# ----------------------------------------------------------------------------------------------------------------
# The trainer's side

def hf_capture(model, seq: list[int], chunk: int) -> dict:
    """The trainer's default forward (PolicyModel over a Hugging Face Qwen2, unsharded) on one sequence, recorded by
    hooks on its modules: {(op, layer): rows}, as VllmCapture's. Scored as prompt = the first token, so that every
    later position's log-prob comes out. RoPE is not a module there: its outputs are transformers' own
    apply_rotary_pos_emb on the recorded q, k and the model's cos/sin, as its attention computes them."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    from common.logprobs import collate
    lm = model.lm
    base = lm.model
    got, handles = {}, []

    def fwd(mod, name, i):
        handles.append(mod.register_forward_hook(lambda m, a, o: got.__setitem__((name, i), o.detach()[0].clone())))

    def pre(mod, name, i):
        handles.append(mod.register_forward_pre_hook(lambda m, a: got.__setitem__((name, i), a[0].detach()[0].clone())))
    fwd(base.embed_tokens, "embedding", -1)
    for i, layer in enumerate(base.layers):
        at, mlp = layer.self_attn, layer.mlp
        if i:
            pre(layer, "residual", i)
        fwd(layer.input_layernorm, "input_norm", i)
        for name, mod in (("q", at.q_proj), ("k", at.k_proj), ("v", at.v_proj), ("o_proj", at.o_proj),
                          ("post_norm", layer.post_attention_layernorm), ("gate", mlp.gate_proj),
                          ("up", mlp.up_proj), ("mlp_out", mlp.down_proj)):
            fwd(mod, name, i)
        pre(at.o_proj, "attention", i)
        pre(layer.post_attention_layernorm, "residual_mid", i)
        pre(mlp.down_proj, "act", i)
    pre(base.norm, "residual", len(base.layers))
    fwd(base.norm, "final_norm", -1)
    handles.append(base.rotary_emb.register_forward_hook(
        lambda m, a, o: got.__setitem__(("cos_sin", -1), (o[0].detach(), o[1].detach()))))
    ids, attn, rmask = collate([seq[:1]], [seq[1:]], 0, next(model.parameters()).device)
    try:
        with torch.no_grad():
            logp, _ = model(ids, attn, rmask, 1.0, chunk)
    finally:
        for h in handles:
            h.remove()
    L, (cos, sin) = len(seq), got[("cos_sin", -1)]  # (kept: the isolated RoPE uses them)
    for i, layer in enumerate(base.layers):
        hd = layer.self_attn.head_dim
        q, k, v = (got.pop((n, i)) for n in ("q", "k", "v"))
        got[("qkv", i)] = torch.cat([q, k, v], dim=-1)
        q_rot, k_rot = apply_rotary_pos_emb(q.view(1, L, -1, hd).transpose(1, 2), k.view(1, L, -1, hd).transpose(1, 2),
                                            cos, sin)
        got[("rope_q", i)] = q_rot.transpose(1, 2).reshape(L, -1)
        got[("rope_k", i)] = k_rot.transpose(1, 2).reshape(L, -1)
        got[("gate_up", i)] = torch.cat([got.pop(("gate", i)), got.pop(("up", i))], dim=-1)
    h = got[("final_norm", -1)][:L - 1]
    with torch.no_grad():  # the default head's matmul, chunk by chunk as common.logprobs._chunk_logprobs runs it
        got[("logits", -1)] = torch.cat([F.linear(h[j:j + chunk], lm.lm_head.weight) for j in range(0, L - 1, chunk)])
    got[("logprob", -1)] = logp[0, :L - 1].float()
    return got


def exact_capture(model, ex, seq: list[int], chunk: int) -> dict:
    """The trainer's exact forward on one sequence, recorded through its taps, as hf_capture's."""
    from common.logprobs import collate
    got = {}

    def tap(name, layer, x):
        key = (name, layer)
        got[key] = torch.cat([got[key], x]) if key in got and name in HEAD_OPS else x.clone()
    ex.tap, model.exact = tap, ex
    ids, attn, rmask = collate([seq[:1]], [seq[1:]], 0, next(model.parameters()).device)
    try:
        with torch.no_grad():
            logp, _ = model(ids, attn, rmask, 1.0, chunk)
    finally:
        ex.tap, model.exact = None, None
    got[("logprob", -1)] = logp[0, :len(seq) - 1].float()
    return got


class HfOps:
    """The trainer's default ops, applied to given inputs (the isolated comparison): its own modules and functions."""

    def __init__(self, model, cos_sin):
        self.lm, self.cos_sin = model.lm, cos_sin

    def norm(self, x, module, layer=None):
        return module(x)

    def linear(self, x, modules):
        return torch.cat([m(x) for m in modules], dim=-1)

    def rope(self, q, k, layer, positions):
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
        L, hd = q.shape[0], layer.self_attn.head_dim
        cos, sin = (x[:, positions] for x in self.cos_sin)
        qr, kr = apply_rotary_pos_emb(q.view(1, L, -1, hd).transpose(1, 2), k.view(1, L, -1, hd).transpose(1, 2),
                                      cos, sin)
        return qr.transpose(1, 2).reshape(L, -1), kr.transpose(1, 2).reshape(L, -1)

    def attention(self, q, k, v, layer, pack):  # (one sequence: causal over all of q's rows)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        at, L = layer.self_attn, q.shape[0]
        q4, k4, v4 = (x.reshape(1, L, -1, at.head_dim).transpose(1, 2) for x in (q, k, v))
        out, _ = sdpa_attention_forward(at, q4, k4, v4, None, dropout=0.0, scaling=at.scaling)
        return out.reshape(L, -1)

    def act(self, gu, layer):
        g, u = gu.chunk(2, dim=-1)
        return layer.mlp.act_fn(g) * u

    def logits(self, h, chunk):
        return torch.cat([F.linear(h[j:j + chunk], self.lm.lm_head.weight) for j in range(0, h.shape[0], chunk)])

    def logprob(self, logits, targets):
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)


class ExactOps:
    """The exact forward's ops (vLLM's kernels), applied to given inputs."""

    def __init__(self, ex, model):
        self.ex, self.k, self.lm = ex, ex.k, model.lm

    def norm(self, x, module, layer=None):
        return self.k.rms_norm(x, module.weight, module.variance_epsilon)

    def linear(self, x, modules):
        biases = [m.bias for m in modules if m.bias is not None]
        return self.ex.linear(x, [m.weight for m in modules], biases or None)

    def rope(self, q, k, layer, positions):
        return self.k.rope(positions, q, k, self.ex.cos_sin_cache, layer.self_attn.head_dim)

    def attention(self, q, k, v, layer, pack):
        at, L = layer.self_attn, q.shape[0]
        return self.k.attention(q.view(L, -1, at.head_dim), k.view(L, -1, at.head_dim),
                                v.reshape(L, -1, at.head_dim), pack, at.scaling).reshape(L, -1)

    def act(self, gu, layer):
        return self.k.silu_and_mul(gu)

    def logits(self, h, chunk):
        return torch.cat([self.k.linear(h[j:j + chunk], self.lm.lm_head.weight) for j in range(0, h.shape[0], chunk)])

    def logprob(self, logits, targets):
        return self.k.token_logprobs(logits.float(), targets)


@torch.no_grad()
def isolated(ops, model, v: dict, positions, pack, targets=None, chunk: int = 2048) -> dict:
    """Each op of the trainer (`ops`) applied to vLLM's own inputs for it (v: the rows of one engine step, as
    VllmCapture records them): what the op alone does differently, whatever came before. positions: the rows'
    positions; pack: the rows' sequences for the attention (None: no attention, e.g. a decode step, whose keys are
    in earlier steps); targets: the next tokens of the rows before the last, for the head (None: no head)."""
    base = model.lm.model
    n_layers, out = len(base.layers), {}
    for i, layer in enumerate(base.layers):
        at, mlp = layer.self_attn, layer.mlp
        s_in = v[("embedding", -1)] if i == 0 else v[("residual", i)]
        nq, nkv = at.q_proj.weight.shape[0], at.k_proj.weight.shape[0]
        out[("input_norm", i)] = ops.norm(s_in, layer.input_layernorm)
        out[("qkv", i)] = ops.linear(v[("input_norm", i)], [at.q_proj, at.k_proj, at.v_proj])
        out[("rope_q", i)], out[("rope_k", i)] = ops.rope(v[("rope_in_q", i)], v[("rope_in_k", i)], layer,
                                                          positions)
        if pack is not None:
            value = v[("qkv", i)].split([nq, nkv, nkv], dim=-1)[2]
            out[("attention", i)] = ops.attention(v[("rope_q", i)], v[("rope_k", i)], value, layer, pack)
        out[("o_proj", i)] = ops.linear(v[("attention", i)], [at.o_proj])
        out[("residual_mid", i)] = v[("o_proj", i)] + s_in
        out[("post_norm", i)] = ops.norm(v[("residual_mid", i)], layer.post_attention_layernorm)
        out[("gate_up", i)] = ops.linear(v[("post_norm", i)], [mlp.gate_proj, mlp.up_proj])
        out[("act", i)] = ops.act(v[("gate_up", i)], layer)
        out[("mlp_out", i)] = ops.linear(v[("act", i)], [mlp.down_proj])
        out[("residual", i + 1)] = v[("mlp_out", i)] + v[("residual_mid", i)]
    out[("final_norm", -1)] = ops.norm(v[("residual", n_layers)], base.norm)
    if targets is not None:
        out[("logits", -1)] = ops.logits(v[("final_norm", -1)][:len(targets)], chunk)
        out[("logprob", -1)] = ops.logprob(v[("logits", -1)], targets)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Statistics (pure)

def op_order(n_layers: int) -> list[tuple[str, int]]:
    """The (op, layer) keys in execution order."""
    keys = [("embedding", -1)]
    for i in range(n_layers):
        keys += [(op, i) for op in LAYER_OPS if not (op == "residual" and i == 0)]
    return keys + [("residual", n_layers)] + [(op, -1) for op in HEAD_OPS]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same bits (so +0 and -0 differ, and a NaN equals the same NaN)."""
    if a.dtype == b.dtype and a.element_size() in (2, 4, 8):
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return a.contiguous().view(ints) == b.contiguous().view(ints)
    return a.double() == b.double()


class OpStats:
    """Per (path, kind, op, layer), summed over sequences: elements, bitwise-equal elements, sum and max of |diff|,
    sum of |reference|."""

    def __init__(self):
        self.acc = {}

    def add(self, path: str, kind: str, ref: dict, got: dict, n_layers: int) -> None:
        for key in op_order(n_layers):
            if key not in ref or key not in got:
                continue
            a, b = ref[key], got[key]
            rows = min(a.shape[0], b.shape[0])
            a, b = a[:rows].reshape(rows, -1), b[:rows].reshape(rows, -1)
            if a.shape != b.shape:
                raise ValueError(f"{path} {kind} {key}: vLLM {tuple(a.shape)}, trainer {tuple(b.shape)}")
            d = (a.double() - b.double()).abs()
            s = self.acc.setdefault((path, kind) + key, [0, 0, 0.0, 0.0, 0.0])
            s[0] += d.numel()
            s[1] += int(bitwise_equal(a, b).sum())
            s[2] += float(d.sum())
            s[3] = max(s[3], float(d.max()) if d.numel() else 0.0)
            s[4] += float(a.double().abs().sum())

    def table(self) -> list[dict]:
        return [{"path": k[0], "kind": k[1], "op": k[2], "layer": k[3], "elements": n, "frac_equal": eq / max(n, 1),
                 "mean_abs_diff": sd / max(n, 1), "max_abs_diff": mx, "mean_abs_ref": sr / max(n, 1)}
                for k, (n, eq, sd, mx, sr) in self.acc.items()]


def first_divergence(rows: list[dict], path: str, n_layers: int) -> dict | None:
    """The first (op, layer) in execution order, accumulated, that is not bitwise equal everywhere; None if none."""
    by_key = {(r["op"], r["layer"]): r for r in rows if r["path"] == path and r["kind"] == "accumulated"}
    return next((by_key[k] for k in op_order(n_layers) if k in by_key and by_key[k]["frac_equal"] < 1.0), None)


def link_stats(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """From log-probs a to log-probs b of the same tokens: d = b - a per token (in fp64: the differences of fp32 values
    are exact there, so the links of a chain add up exactly); kl_k3 = mean(e^d - 1 - d), mean d, mean d^2, max |d|,
    the fraction of tokens bitwise equal. Returns also d itself (key "d")."""
    x, y = torch.cat(a), torch.cat(b)
    d = y.double() - x.double()
    n = max(d.numel(), 1)
    return {"tokens": d.numel(), "frac_equal": float(bitwise_equal(x.float(), y.float()).sum()) / n,
            "max_abs_diff": float(d.abs().max()) if d.numel() else 0.0, "mean_diff": float(d.sum()) / n,
            "mean_sq_diff": float((d * d).sum()) / n, "kl_k3": float((torch.expm1(d) - d).sum()) / n, "d": d}


def decompose(chain: list[tuple[str, list[torch.Tensor]]]) -> dict:
    """The links of a chain of log-probs [(name, per-sequence tensors), ...]: each link's link_stats, the total's
    (first to last), each link's share of the total's mean d^2 and what the cross terms leave (1 - the shares)."""
    links = [{"from": chain[j][0], "to": chain[j + 1][0], **link_stats(chain[j][1], chain[j + 1][1])}
             for j in range(len(chain) - 1)]
    total = {"from": chain[0][0], "to": chain[-1][0], **link_stats(chain[0][1], chain[-1][1])}
    # the links' d add up to the total's exactly (each partial sum is a difference of two fp32 values, exact in fp64)
    residual = float((sum(link["d"] for link in links) - total["d"]).abs().max()) if links and total["tokens"] else 0.0
    msq = total["mean_sq_diff"]
    for link in links:
        link["share_of_mean_sq"] = link["mean_sq_diff"] / msq if msq > 0 else float("nan")
    cross = 1.0 - sum(link["share_of_mean_sq"] for link in links) if msq > 0 else float("nan")
    for x in links + [total]:
        x.pop("d")
    return {"links": links, "total": total, "cross_share": cross, "links_sum_residual": residual}


def spread(lengths: list[int], k: int) -> list[int]:
    """Indices of k sequences spread over the lengths (shortest, ..., longest)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if k >= len(order):
        return order
    return sorted({order[round(j * (len(order) - 1) / max(k - 1, 1))] for j in range(k)})


# ----------------------------------------------------------------------------------------------------------------
# Report

CHAIN_NAMES = {"mu": "mu (vLLM decode)", "vllm_batch": "vLLM prefill, batch", "vllm_alone": "vLLM prefill, alone",
               "hf_alone": "trainer, alone", "hf_batch": "trainer, batch", "exact_alone": "exact trainer, alone",
               "exact_batch": "exact trainer, batch"}


def anatomy_markdown(res: dict) -> str:
    from sanity.report import fmt, md_table
    c = res["config"]
    text = [f"{c['n_seqs']} sequences ({c['n_prompts']} prompts x {c['samples']}), responses up to "
            f"{c['max_response_len']} tokens, temperature 1; model {c['model']}; vLLM "
            f"{'batch-invariant (exact mode)' if c['exact'] else 'default mode'}, "
            f"{'eager' if c['vllm_eager'] else 'compiled with CUDA graphs'}; the trainer: PolicyModel in the same "
            "precision, unsharded (FSDP2 computes the same: it only gathers the same weights). d = log-prob of the "
            "later side minus the earlier, per token.", ""]
    for p, r in res["precisions"].items():
        text += [f"## {p}", ""]
        if r.get("ops"):
            rows = r["ops"]
            text += ["### (i) Op by op: vLLM against the trainer on the same ids", "",
                     f"{r['op_sequences']} sequences ({r['op_tokens']} tokens). Accumulated: each side from its own "
                     "inputs; isolated: the trainer's op on vLLM's inputs. Bitwise: fraction of elements with the "
                     "same bits.", ""]
            for path in r["paths"]:
                fd = r["first_divergence"].get(path)
                text.append(f"- {path}: first op not bitwise equal: " + (
                    f"**{fd['op']}** (layer {fd['layer']}), {fmt(1 - fd['frac_equal'])} of its elements differ, "
                    f"max abs diff {fmt(fd['max_abs_diff'])}" if fd else "none (every op bitwise equal)"))
            text.append("")
            for path in r["paths"]:
                table = []
                for op in ("embedding",) + LAYER_OPS + HEAD_OPS:
                    acc = [x for x in rows if x["path"] == path and x["op"] == op and x["kind"] == "accumulated"]
                    iso = [x for x in rows if x["path"] == path and x["op"] == op and x["kind"] == "isolated"]
                    if not acc:
                        continue
                    acc.sort(key=lambda x: x["layer"])
                    n_iso = sum(x["elements"] for x in iso)
                    table.append([op, fmt(acc[0]["max_abs_diff"]), fmt(acc[-1]["max_abs_diff"]),
                                  fmt(np.mean([x["mean_abs_diff"] for x in acc])),
                                  fmt(sum(x["frac_equal"] * x["elements"] for x in acc) /
                                      max(sum(x["elements"] for x in acc), 1)),
                                  fmt(max((x["max_abs_diff"] for x in iso), default=float("nan"))),
                                  fmt(sum(x["frac_equal"] * x["elements"] for x in iso) / n_iso if n_iso else
                                      float("nan")),
                                  fmt(np.mean([x["mean_abs_ref"] for x in acc]))])
                text += [f"**{path}** (per op group over the layers; first/last: the first and last layer)", "",
                         md_table(["op", "accum. max abs diff, first", "accum. max abs diff, last",
                                   "accum. mean abs diff", "accum. bitwise", "isolated max abs diff",
                                   "isolated bitwise", "mean abs value (vLLM)"], table), ""]
            growth = []
            n_layers = r["n_layers"]
            for i in range(1, n_layers + 1):
                row = [i]
                for path in r["paths"]:
                    x = next((x for x in rows if x["path"] == path and x["kind"] == "accumulated"
                              and x["op"] == "residual" and x["layer"] == i), None)
                    row += [fmt(x["mean_abs_diff"]), fmt(x["frac_equal"])] if x else ["", ""]
                growth.append(row)
            text += ["Growth through the layers: the residual stream entering layer i (i = the number of layers: "
                     "entering the final norm), accumulated", "",
                     md_table(["layer"] + [h for path in r["paths"] for h in (f"{path} mean abs diff",
                                                                                f"{path} bitwise")], growth), ""]
        text += ["### (ii)-(iv) Log-probs of the response tokens along the chain", "",
                 "Each link: from its first side to its second over every response token; kl_k3 = mean(e^d - 1 - d); "
                 "share = the link's mean d^2 over the total's. The links' d add up to the total's token by token; "
                 "their kl_k3 add up only if the links are uncorrelated, so the cross terms' share (1 - the shares) is "
                 "given as it is (negative: links that cancel).", ""]
        for path, dec in r["chains"].items():
            t = dec["total"]
            table = [[f"{CHAIN_NAMES[x['from']]} -> {CHAIN_NAMES[x['to']]}", x["tokens"], fmt(x["frac_equal"]),
                      fmt(x["max_abs_diff"]), fmt(x["mean_diff"]), fmt(x["kl_k3"]), fmt(x["share_of_mean_sq"])]
                     for x in dec["links"]]
            table.append([f"**total: {CHAIN_NAMES[t['from']]} -> {CHAIN_NAMES[t['to']]}**", t["tokens"],
                          fmt(t["frac_equal"]), fmt(t["max_abs_diff"]), fmt(t["mean_diff"]), fmt(t["kl_k3"]), "1"])
            table.append(["cross terms", "", "", "", "", "", fmt(dec["cross_share"])])
            text += [f"**{path}**", "", md_table(["link", "tokens", "bitwise", "max abs d", "mean d", "kl_k3",
                                                 "share of mean d^2"], table), ""]
        if r.get("growth_png"):
            text += [f"![growth]({r['growth_png']})", ""]
    return "\n".join(text)


def plot_growth(res: dict, out: str) -> bool:
    from sanity.report import _plt
    series = []
    for p, r in res["precisions"].items():
        for path in r.get("paths", []):
            pts = sorted((x["layer"], x["mean_abs_diff"]) for x in r.get("ops", []) if x["path"] == path
                         and x["kind"] == "accumulated" and x["op"] == "residual")
            if pts:
                series.append((f"{p} {path}", pts))
    if not series:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, pts in series:
        ax.plot([x for x, _ in pts], [max(y, 1e-12) for _, y in pts], marker="o", markersize=3, label=name)
    ax.set(yscale="log", xlabel="layer (residual stream entering it)", ylabel="mean abs diff, vLLM - trainer",
           title="how the difference grows through the layers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> Args:
    """The command line over Args' defaults; when it names no --model, over the built-in task's preset BUILTIN."""
    return parse(Args, BUILTIN, argv)


def validate(args: Args) -> None:
    for name in ("num_prompts", "samples", "max_prompt_len", "max_response_len", "micro_batch_tokens",
                 "logprob_chunk"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.op_sequences < 0:
        raise ValueError("--op-sequences must be >= 0")
    if not 0 < args.vllm_gpu_memory_utilization <= 1:
        raise ValueError("--vllm-gpu-memory-utilization must be in (0, 1]")
    if args.model is not None:
        from common.preflight import check_model_dir
        check_model_dir(args.model)
    if args.dataset is not None and not os.path.isfile(args.dataset):
        raise FileNotFoundError(f"dataset {args.dataset!r}: no such file")
    from common.sampler import resolve_sampler
    resolve_sampler("vllm")  # the anatomy compares against vLLM: refused where it is not installed


def exact_plan(args: Args, model_path: str, precision: str):
    from exact import plan_for_run
    return plan_for_run(model_path, train_precision=precision, rollout_precision=precision, sampler="vllm",
                        vllm_tp=1, top_p=1.0, engine="eager" if args.vllm_eager else "graphs")


def run_precision(args: Args, p: str, model_path: str, prompts: list[list[int]], device) -> dict:
    from transformers import AutoModelForCausalLM
    from common.dist import setup_distributed
    from exact import Pack, enable_exact
    from common.logprobs import PolicyModel, collate
    from common.precision import DTYPES
    from common.vllm_sampler import VLLMSampler, _model_runner
    from sanity.mismatch_analysis import recompute_logp
    t0 = time.perf_counter()
    plan = exact_plan(args, model_path, p) if args.exact else None
    if not torch.distributed.is_initialized():  # vLLM's shutdown may have taken the group down; it needs one
        setup_distributed()
    # prefix caching off: every scoring run computes every token (the hooks see all of them)
    sampler = VLLMSampler(model_path, DTYPES[p], args.seed, args.max_prompt_len + args.max_response_len,
                          gpu_memory_utilization=args.vllm_gpu_memory_utilization, sleep_level=0,
                          kv_cache_gib=args.vllm_kv_cache_gib, exact=plan, enforce_eager=args.vllm_eager,
                          prefix_caching=False)
    llm = sampler.llm
    rollout = sampler.generate(prompts, args.samples, args.max_response_len, 1.0)
    keep = [i for i, r in enumerate(rollout.response_ids) if r]  # (an empty response has no token to compare)
    P = [rollout.prompt_ids[i] for i in keep]
    R = [rollout.response_ids[i] for i in keep]
    seqs = [p_ + r_ for p_, r_ in zip(P, R)]
    resp = lambda lp_all: [lp[len(p_) - 1:] for lp, p_ in zip(lp_all, P)]  # noqa: E731  (response tokens' part)
    lp = {"mu": [rollout.logprobs[i] for i in keep], "vllm_batch": resp(prefill_logprobs(llm, seqs))}
    print0(f"[anatomy] {p}: sampled {len(seqs)} sequences, {sum(map(len, R))} response tokens")

    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[p], attn_implementation="sdpa")
    model = PolicyModel(lm.to(device)).eval()
    ex = enable_exact(model, plan, sampler.exact_facts) if plan is not None else None
    if ex is not None:
        model.exact = None
    paths = ["trainer"] + (["exact trainer"] if ex is not None else [])
    capture = VllmCapture(_model_runner(llm).model) if args.vllm_eager and args.op_sequences else None
    chosen = set(spread([len(s) for s in seqs], args.op_sequences)) if capture is not None else set()
    stats, n_layers = OpStats(), lm.config.num_hidden_layers
    vllm_alone, op_tokens = [], 0
    for i, seq in enumerate(seqs):
        if i in chosen:
            capture.active = True
        try:
            vllm_alone.append(prefill_logprobs(llm, [seq])[0])
        finally:
            if capture is not None:
                capture.active = False
        if i not in chosen:
            continue
        v = capture.sequence(seq)
        v[("logprob", -1)] = vllm_alone[-1].to(device)
        op_tokens += len(seq)
        positions, targets = torch.arange(len(seq), device=device), torch.tensor(seq[1:], device=device)
        pack = Pack(*collate([seq[:1]], [seq[1:]], 0, device), page_size=ex.page_size if ex is not None else 16)
        got = hf_capture(model, seq, args.logprob_chunk)
        stats.add("trainer", "accumulated", v, got, n_layers)
        stats.add("trainer", "isolated", v, isolated(HfOps(model, got[("cos_sin", -1)]), model, v, positions, pack,
                                                     targets, args.logprob_chunk), n_layers)
        del got
        if ex is not None:
            stats.add("exact trainer", "accumulated", v, exact_capture(model, ex, seq, args.logprob_chunk), n_layers)
            stats.add("exact trainer", "isolated", v, isolated(ExactOps(ex, model), model, v, positions, pack,
                                                               targets, args.logprob_chunk), n_layers)
        del v
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if capture is not None:
        capture.remove()
    lp["vllm_alone"] = resp(vllm_alone)

    def trainer_logprobs(path):
        model.exact = ex if path == "exact" else None
        alone = [recompute_logp(model, [p_], [r_], 0, 1.0, args.micro_batch_tokens, args.logprob_chunk, device)[0]
                 for p_, r_ in zip(P, R)]
        batch = recompute_logp(model, P, R, 0, 1.0, args.micro_batch_tokens, args.logprob_chunk, device)
        model.exact = None
        return alone, batch
    lp["hf_alone"], lp["hf_batch"] = trainer_logprobs("hf")
    chains = {"trainer": decompose([(k, lp[k]) for k in ("mu", "vllm_batch", "vllm_alone", "hf_alone", "hf_batch")])}
    if ex is not None:
        lp["exact_alone"], lp["exact_batch"] = trainer_logprobs("exact")
        chains["exact trainer"] = decompose([(k, lp[k]) for k in ("mu", "vllm_batch", "vllm_alone", "exact_alone",
                                                                  "exact_batch")])
    facts = {k: v for k, v in (sampler.exact_facts or {}).items() if k != "rope_cache"}
    sampler.shutdown()
    del sampler
    rows = stats.table()
    out = {"n_layers": n_layers, "paths": paths if rows else [], "ops": rows, "op_sequences": len(chosen),
           "op_tokens": op_tokens, "first_divergence": {path: first_divergence(rows, path, n_layers)
                                                         for path in paths} if rows else {},
           "chains": chains, "seconds": round(time.perf_counter() - t0, 1),
           "exact_facts": facts}
    for path, dec in chains.items():
        print0(f"[anatomy] {p} {path}: kl_k3 {dec['total']['kl_k3']:.3g} ({dec['total']['frac_equal']:.3f} of the "
               "tokens bitwise equal); links: " + ", ".join(f"{x['from']}->{x['to']} {x['kl_k3']:.3g}"
                                                             for x in dec["links"]))
    for path, fd in out["first_divergence"].items():
        print0(f"[anatomy] {p} {path}: first op not bitwise equal: "
               + (f"{fd['op']} layer {fd['layer']}" if fd else "none"))
    return out


def main(args: Args) -> dict:
    validate(args)
    print0(config_changes(args, Args(), BUILTIN if args.model is None else {},
                          f"BUILTIN in {os.path.basename(__file__)} (no --model)"))
    from transformers import AutoTokenizer
    from tasks.data import encode_problems, load_problems
    from common.dist import setup_distributed
    model_path, dataset = args.model, args.dataset
    if model_path is None or dataset is None:
        from tasks.builtin import ensure_builtin_task
        task = ensure_builtin_task()
        model_path, dataset = model_path or task["model"], dataset or task["train"]
    if args.exact:  # refused before anything loads, for every precision asked
        for p in args.precisions:
            exact_plan(args, model_path, p)
    _, _, device = setup_distributed()
    os.makedirs(args.out_dir, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    problems = encode_problems(tokenizer, load_problems(dataset), args.prompt_template, args.max_prompt_len, dataset)
    order = np.random.default_rng(args.seed).permutation(len(problems))
    prompts = [problems[i]["prompt_ids"] for i in order[:args.num_prompts]]
    res = {"config": {**dataclasses.asdict(args), "model": args.model or "built-in", "n_prompts": len(prompts),
                      "n_seqs": len(prompts) * args.samples}, "precisions": {}}
    for p in dict.fromkeys(args.precisions):
        res["precisions"][p] = run_precision(args, p, model_path, prompts, device)
    if plot_growth(res, os.path.join(args.out_dir, "growth.png")):
        for r in res["precisions"].values():
            r["growth_png"] = "growth.png"
    with open(os.path.join(args.out_dir, "anatomy.json"), "w") as f:
        json.dump(res, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
    with open(os.path.join(args.out_dir, "anatomy.md"), "w") as f:
        f.write("# Mismatch anatomy\n\n" + anatomy_markdown(res))
    print0(f"[anatomy] wrote {args.out_dir}/anatomy.md, anatomy.json" + (", growth.png" if any(
        r.get("growth_png") for r in res["precisions"].values()) else ""))
    return res


if __name__ == "__main__":
    exits.run(lambda: main(parse_args()), __file__, steps=False)
