"""The GPU checks behind exact mode (docs/exact.md), each in isolation, for what reading vLLM 0.25.1's source left open,
in one go: a table of (variant, model, precision, probe, bitwise equal, max |diff|, note), printed last, and
probe.md / probe.json in --out-dir. A probe that fails prints its error in one line and the others go on; each
variant runs in a process of its own (one engine per process; batch-invariant mode is process-wide), its log in
<out-dir>/logs/.

Variants:
- kernels (no engine): the C++ fused add + RMSNorm on 1 row against the same row in a 300-row launch (vllm#48271), the
  fixed-order replacement likewise; the persistent matmul on 1 row against many, fused q/k/v (gate/up) against one
  matmul per projection, the lm_head; FA3 and the Triton attention at head_dim 64 and 128: a row's output from a
  packed prefill, a paged prefill, a decode step, a mixed step (a prefill chunk beside decodes), alone or in a batch;
  the log-prob and temperature kernels on 1 row against many; each op's backward against autograd of fp32 torch.
- graphs-v2: the engine as --exact runs it (CUDA graphs of decode steps over the eager kernels, no torch.compile,
  Model Runner V2, the RMSNorm patch): end to end only (a graph runs no hooks), as eager-v2's end to end.
- eager-v2: the same engine without graphs. Hooks on vLLM's layers during
  one prefill step (6 requests, 720 tokens) and the decode step after it: every op of the trainer's exact forward
  applied to vLLM's own inputs, compared with vLLM's outputs (decode attention: the trainer's causal attention over
  the whole sequence, its last row); then end to end: a rollout of mixed lengths recomputed by the trainer, with
  fused / per-projection q/k/v and gate/up and paged / packed K/V, at temperature 1 and 0.7; the default trainer
  (Hugging Face path) beside it, for its mismatch.
- compiled-v2: vLLM's torch.compile with CUDA graphs, every custom op on its kernel: end to end only; NOT bitwise
  (Inductor regenerates kernels), kept to show it.
- eager-v2-nopatch: as eager-v2 without the RMSNorm patch (vLLM's own C++ fused add + RMSNorm): shows what the patch
  is for. eager-v1: Model Runner V1 (its log-softmax), the trainer calling that one.
The secondary variants (eager, compiled, nopatch, v1) run on the first model and precision only, unless --full. --parallel
processes run at once (a probe's numbers do not depend on what else runs on the GPU).

    python sanity/exact_probe.py                                  # random 2-layer models of the 1.5B and 0.5B shapes
    python sanity/exact_probe.py --model DIR --precisions bf16    # a real model
    python sanity/exact_probe.py --variants kernels graphs-v2 --shapes hd128
"""
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Literal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch
import tyro

from common import exits

VARIANTS = {"kernels": None, "graphs-v2": {}, "eager-v2": {"engine": "eager"},
            "compiled-v2": {"engine": "compiled"}, "eager-v2-nopatch": {"engine": "eager", "rmsnorm_patch": False},
            "eager-v1": {"engine": "eager", "runner": "v1"}}
SECONDARY = ("eager-v2", "compiled-v2", "eager-v2-nopatch", "eager-v1")
# random 2-layer Qwen2 models with the layer shapes of Qwen2.5-1.5B (head_dim 128: FA3) and -0.5B (64: Triton)
SHAPES = {"hd128": dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                        tie_word_embeddings=False),
          "hd64": dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                       tie_word_embeddings=True)}
PREFILL_LENS = [300, 120, 45, 17, 230, 8]  # distinct (a decode row is told by its position); 720 >= 256 tokens
E2E_PROMPT_LENS = [3, 17, 64, 130, 257, 400, 9, 700]  # the end-to-end rollout: prompt lengths and response limits
E2E_LIMITS = [900, 5, 300, 64, 1, 512, 129, 33]


@dataclass
class Args:
    out_dir: str = "runs/exact_probe"
    """where probe.md, probe.json, models/ and logs/ go"""
    model: str | None = None
    """a local Qwen2 model directory to probe instead of the random models of --shapes"""
    shapes: tuple[Literal["hd128", "hd64"], ...] = ("hd128", "hd64")
    """random 2-layer models (vocabulary 151,936) of the 1.5B layer shape (hd128) and the 0.5B one (hd64)"""
    precisions: tuple[Literal["bf16", "fp16"], ...] = ("bf16", "fp16")
    """precisions probed"""
    variants: tuple[str, ...] = tuple(VARIANTS)
    """which variants (kernels, graphs-v2, eager-v2, compiled-v2, eager-v2-nopatch, eager-v1)"""
    full: bool = False
    """run the secondary variants on every model and precision too"""
    timeout_s: int = 600
    """time limit of each variant's process"""
    parallel: int = 3
    """processes run at once (each holds a small engine and model: a few GiB of GPU memory)"""
    job: str | None = None
    """(internal) run one job in this process: variant:model_dir:name:precision"""
    rows_file: str | None = None
    """(internal) where the job appends its rows"""


# ----------------------------------------------------------------------------------------------------------------
# Rows

class Rows:
    """Appends result rows (one JSON line each, flushed: a crash keeps what came before) for one job."""

    def __init__(self, path: str, **ctx):
        self.path, self.ctx = path, ctx

    def add(self, probe: str, equal, max_abs_diff=None, note: str = ""):
        row = {**self.ctx, "probe": probe, "equal": equal, "max_abs_diff": max_abs_diff, "note": note}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def compare(self, probe: str, a: torch.Tensor, b: torch.Tensor, note: str = ""):
        """a against b: bitwise equal everywhere? (as 'n/m' elements when not), and max |a - b|."""
        from sanity.mismatch_anatomy import bitwise_equal
        a, b = a.detach(), b.detach()
        if a.shape != b.shape:
            return self.add(probe, False, None, f"shapes {tuple(a.shape)} vs {tuple(b.shape)} {note}".strip())
        eq = bitwise_equal(a, b)
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        self.add(probe, True if bool(eq.all()) else f"{int(eq.sum())}/{eq.numel()}", diff, note)

    def run(self, probe: str, fn):
        """fn(), its exception as a row of one line."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (a probe's failure is a result; the next probe runs)
            self.add(probe, False, None, f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                                          [:300])
            traceback.print_exc()


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:300]


# ----------------------------------------------------------------------------------------------------------------
# Rollouts and comparisons shared with tests/exact_gpu_check.py

def rollout_mixed(sampler, prompts, max_tokens, n, temperature):
    """VLLMSampler.generate with a length limit per prompt, so that one engine batch mixes short and long responses
    (the engine's steps then mix prefills and decodes of many lengths). Returns a common.sampler.Rollout."""
    from vllm.inputs import TokensPrompt
    from common.vllm_sampler import rollout_of
    params = [sampler.sampling_params(n, m, temperature) for m in max_tokens]
    return rollout_of(prompts, sampler.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                                    use_tqdm=False))


def compare_logprobs(old: list[torch.Tensor], mu: list[torch.Tensor]) -> dict:
    """Token by token: how many are bitwise equal, the largest |difference|, kl_k3, and the first few that differ
    as (sequence, position, old, mu)."""
    n = equal = 0
    worst, k3, first = 0.0, 0.0, []
    for i, (a, b) in enumerate(zip(old, mu)):
        same = a.view(torch.int32) == b.view(torch.int32)
        n += len(a)
        equal += int(same.sum())
        d = a.double() - b.double()
        worst = max(worst, float(d.abs().max()) if len(a) else 0.0)
        k3 += float((torch.expm1(d) - d).sum())
        first += [[i, j, float(a[j]), float(b[j])] for j in (~same).nonzero().flatten().tolist()][:5 - len(first)]
    return {"tokens": n, "equal": equal, "max_abs_diff": worst, "kl_k3": k3 / max(n, 1), "first_diffs": first}


# ----------------------------------------------------------------------------------------------------------------
# kernels: no engine

def _attention(kind, q, kc, vc, cu_q, max_q, seq_lens, max_k, block_table, scale):
    """One call of vLLM's attention kernel as its backend makes it in batch-invariant mode, on paged K/V."""
    if kind == "fa3":
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
        return flash_attn_varlen_func(q=q, k=kc, v=vc, max_seqlen_q=max_q, cu_seqlens_q=cu_q, max_seqlen_k=max_k,
                                      seqused_k=seq_lens, block_table=block_table, softmax_scale=scale, causal=True,
                                      fa_version=3, num_splits=1)
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    out = torch.empty_like(q)
    ones = torch.ones(1, dtype=torch.float32, device=q.device).expand(len(seq_lens), kc.shape[2])
    unified_attention(q=q, k=kc, v=vc, out=out, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=seq_lens,
                      max_seqlen_k=max_k, softmax_scale=scale, causal=True, window_size=(-1, -1),
                      block_table=block_table, softcap=0, q_descale=None, k_descale=ones, v_descale=ones)
    return out


def kernel_probes(rows_path: str, precisions):
    from exact import ExactPlan, Pack, TorchKernels, VllmKernels, _Attention, _Linear, _RMSNorm, _Rope, \
        _SiluAndMul, _TokenLogprob, fused_add_rms_norm_fixed, paged, prepare_vllm_process, rope_cache
    from common.logprobs import collate
    prepare_vllm_process(ExactPlan(head_dim=128, attention="FLASH_ATTN"))
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.batch_invariant import (init_batch_invariance, linear_batch_invariant,
                                                            rms_norm_batch_invariant)
    init_batch_invariance()  # what the engine's start does (the fp16 matmul tile is set there)
    dev = torch.device("cuda")
    for p in precisions:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[p]
        rows = Rows(rows_path, variant="kernels", model="-", precision=p)
        g = torch.Generator(device=dev).manual_seed(0)
        rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=dev) * scale).to(dtype)  # noqa: E731
        H = 1536

        def add_norm():
            x, r, w = rnd(300, H), rnd(300, H), rnd(H, scale=0.1) + 1
            one = [t[:1].clone() for t in (x, r)]
            many = [t.clone() for t in (x, r)]
            ops.fused_add_rms_norm(one[0], one[1], w, 1e-6)
            ops.fused_add_rms_norm(many[0], many[1], w, 1e-6)
            rows.compare("C++ fused add+RMSNorm: 1 row vs the same row in 300 (normed)", one[0][0], many[0][0],
                         "vllm#48271: unequal means vLLM needs the patch")
            rows.compare("C++ fused add+RMSNorm: 1 row vs 300 (sum)", one[1][0], many[1][0])
            f1 = fused_add_rms_norm_fixed(rms_norm_batch_invariant, x[:1], r[:1], w, 1e-6)
            f300 = fused_add_rms_norm_fixed(rms_norm_batch_invariant, x, r, w, 1e-6)
            rows.compare("fixed-order add+RMSNorm: 1 row vs 300", f1[0][0], f300[0][0])
            rows.compare("C++ fused vs fixed-order add+RMSNorm (300 rows)", many[0], f300[0], "info: they round "
                         "differently (two roundings vs one)")
        rows.run("add+norm", add_norm)

        def matmul():
            x = rnd(2048, H)
            for name, n_out in (("q/k/v", (1536, 256, 256)), ("gate/up", (8960, 8960))):
                ws = [rnd(n, H, scale=0.02) for n in n_out]
                fused = linear_batch_invariant(x, torch.cat(ws))
                split = torch.cat([linear_batch_invariant(x, w) for w in ws], dim=-1)
                rows.compare(f"matmul {name}: fused vs per projection", fused, split)
                rows.compare(f"matmul {name}: 1 row vs 2048", linear_batch_invariant(x[:1], torch.cat(ws))[0],
                             fused[0])
            w = rnd(151936, H, scale=0.02)
            rows.compare("matmul lm_head: 3 rows vs 64", linear_batch_invariant(x[:3], w),
                         linear_batch_invariant(x[:64], w)[:3])
        rows.run("matmul", matmul)

        for hd, heads in ((128, (12, 2)), (64, (14, 2))):
            for kind in ("fa3", "triton"):
                def attention(hd=hd, heads=heads, kind=kind):
                    lens = [300, 513, 77]
                    ids, attn, rmask = collate([[1] * (n - 1) for n in lens], [[1]] * 3, 0, dev)
                    pack = Pack(ids, attn, rmask, page_size=16)
                    N, scale = sum(lens), hd ** -0.5
                    q, k, v = rnd(N, heads[0], hd), rnd(N, heads[1], hd), rnd(N, heads[1], hd)
                    kc, vc = paged(k, pack), paged(v, pack)
                    last = pack.cu_seqlens[1:].long() - 1
                    prefill = _attention(kind, q, kc, vc, pack.cu_seqlens, pack.max_len, pack.seq_lens,
                                         pack.max_len, pack.block_table, scale)
                    tag = f"{kind} hd{hd}"
                    if kind == "fa3":
                        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
                        packed = flash_attn_varlen_func(q=q, k=k, v=v, max_seqlen_q=pack.max_len,
                                                        cu_seqlens_q=pack.cu_seqlens, max_seqlen_k=pack.max_len,
                                                        cu_seqlens_k=pack.cu_seqlens, softmax_scale=scale,
                                                        causal=True, fa_version=3, num_splits=1)
                        rows.compare(f"{tag}: packed vs paged prefill", packed, prefill)
                    arange = torch.arange(4, dtype=torch.int32, device=dev)
                    decode = _attention(kind, q[last], kc, vc, arange, 1, pack.seq_lens, pack.max_len,
                                        pack.block_table, scale)
                    rows.compare(f"{tag}: decode vs prefill (last rows)", decode, prefill[last],
                                 "the lead: equal at head_dim 128 for FA3")
                    alone = _attention(kind, q[last[1:2]], kc, vc, arange[:2], 1, pack.seq_lens[1:2], lens[1],
                                       pack.block_table[1:2], scale)
                    rows.compare(f"{tag}: decode alone vs in a batch of 3", alone[0], decode[1])
                    # a mixed step: the last 40 rows of sequence 0 as a prefill chunk beside decodes of 1 and 2
                    mix_rows = torch.cat([torch.arange(int(last[0]) - 39, int(last[0]) + 1, device=dev), last[1:]])
                    cu = torch.tensor([0, 40, 41, 42], dtype=torch.int32, device=dev)
                    mixed = _attention(kind, q[mix_rows], kc, vc, cu, 40, pack.seq_lens, pack.max_len,
                                       pack.block_table, scale)
                    rows.compare(f"{tag}: mixed step vs prefill (chunk rows and decode rows)", mixed,
                                 prefill[mix_rows])
                rows.run(f"attention {kind} hd{hd}", attention)

        def head():
            x = torch.randn(64, 151936, generator=g, device=dev) * 3
            vk = VllmKernels(ExactPlan(head_dim=128, attention="FLASH_ATTN"))
            t = torch.randint(0, 151936, (64,), generator=g, device=dev)
            rows.compare("log-prob kernel (V2): 1 row vs 64", vk.token_logprobs(x[:1], t[:1]),
                         vk.token_logprobs(x, t)[:1])
            rows.compare("log-prob kernel (V2) vs torch log_softmax", vk.token_logprobs(x, t),
                         torch.log_softmax(x, -1).gather(-1, t[:, None]).squeeze(-1),
                         "info; torch's is vLLM's batch-invariant Triton log_softmax here (the V1 runner's)")
            rows.compare("temperature kernel 0.7: 1 row vs 64", vk.temperature(x[:1], 0.7), vk.temperature(x, 0.7)[:1])
            rows.compare("temperature kernel vs torch x / 0.7", vk.temperature(x, 0.7), x / 0.7, "info")
        rows.run("log-prob head", head)

        def backward():
            """Each Function (vLLM's forward, the torch backward) on the GPU against autograd through the torch
            reference forward in fp64 on the CPU (on the GPU, batch-invariant mode replaces aten's bmm, softmax and
            mean, which have no fp64 kernels there)."""
            vk, vt = (VllmKernels(ExactPlan(head_dim=hd, attention=a)) for hd, a in ((128, "FLASH_ATTN"),
                                                                                      (64, "TRITON_ATTN")))
            ctx = {}
            for where in ("cuda", "cpu"):
                ids, attn, rmask = collate([[1] * 99, [1] * 40], [[1], [1]], 0, where)
                pack = Pack(ids, attn, rmask, page_size=16)
                ctx[where] = (pack, pack.positions_N, rope_cache(128, 4096, 1e6, dtype).to(where))
            N = int(ctx["cpu"][0].cu_seqlens[-1])
            targets = torch.randint(0, 1000, (N,), generator=g, device=dev)
            cases = {  # name: (fn(inputs..., kernels, (pack, positions, cache), targets), inputs)
                "rms_norm": (lambda x, w, k, c, t: _RMSNorm.apply(x, w, 1e-6, k.rms_norm), (rnd(N, H), rnd(H) + 1)),
                "linear": (lambda x, w, k, c, t: _Linear.apply(x, w, k.linear), (rnd(N, H), rnd(512, H, scale=0.02))),
                "rope": (lambda q, kk, k, c, t: torch.cat(_Rope.apply(q, kk, c[1], c[2], 128, k.rope), -1),
                         (rnd(N, 12 * 128), rnd(N, 2 * 128))),
                "silu_and_mul": (lambda x, k, c, t: _SiluAndMul.apply(x, k.silu_and_mul), (rnd(N, 2 * 512),)),
                "attention fa3": (lambda q, kk, v, k, c, t: _Attention.apply(q, kk, v, c[0], 128 ** -0.5, k.attention),
                                  (rnd(N, 12, 128), rnd(N, 2, 128), rnd(N, 2, 128))),
                "attention triton": (lambda q, kk, v, k, c, t: _Attention.apply(q, kk, v, c[0], 64 ** -0.5,
                                                                                k.attention),
                                     (rnd(N, 14, 64), rnd(N, 2, 64), rnd(N, 2, 64))),
                "token log-prob": (lambda x, k, c, t: _TokenLogprob.apply(x, t, k.token_logprobs),
                                   (torch.randn(N, 1000, generator=g, device=dev),)),
            }
            for name, (fn, inputs) in cases.items():
                xs = [x.detach().requires_grad_() for x in inputs]
                out = fn(*xs, vt if "triton" in name else vk, ctx["cuda"], targets)
                gout = torch.randn(out.shape, generator=g, device=dev).to(out.dtype)
                grads = torch.autograd.grad(out, xs, gout)
                refs = [x.detach().cpu().double().requires_grad_() for x in inputs]
                ref_out = fn(*refs, TorchKernels(), ctx["cpu"], targets.cpu())
                ref_grads = torch.autograd.grad(ref_out, refs, gout.cpu().double())
                cos = min(float(torch.nn.functional.cosine_similarity(a.cpu().double().flatten(), b.flatten(), dim=0))
                          for a, b in zip(grads, ref_grads))
                rows.add(f"backward {name}: gradient cosine vs fp64 autograd", cos > 0.999, round(1 - cos, 8),
                         f"cosine {cos:.6f} (16-bit forward: > 0.999 expected)")
        rows.run("backward", backward)


# ----------------------------------------------------------------------------------------------------------------
# an engine variant

def engine_probes(rows_path: str, variant: str, model_dir: str, name: str, precision: str):
    from transformers import AutoModelForCausalLM
    from common.dist import setup_distributed
    from exact import enable_exact, plan_for_run
    from common.logprobs import PolicyModel
    from common.precision import DTYPES
    from common.vllm_sampler import VLLMSampler
    rows = Rows(rows_path, variant=variant, model=name, precision=precision)
    base = plan_for_run(model_dir, train_precision=precision, rollout_precision=precision, sampler="vllm",
                        vllm_tp=1, top_p=1.0)
    plan = dataclasses.replace(base, **VARIANTS[variant])
    setup_distributed()
    t0 = time.perf_counter()
    try:
        sampler = VLLMSampler(model_dir, DTYPES[precision], seed=0, max_model_len=2048, gpu_memory_utilization=0.15,
                              sleep_level=0, kv_cache_gib=2.0, exact=plan)
    except Exception as e:  # noqa: BLE001
        rows.add("engine start", False, None, one_line(e))
        traceback.print_exc()
        return
    facts = sampler.exact_facts
    rows.add("engine", True, None, f"{time.perf_counter() - t0:.0f} s; runner {facts['runner']}, "
             f"{facts['attention_impl']} (FA {facts['fa_version']}), pages of {facts['block_size']}, custom ops "
             f"{sorted(set(facts['op_forwards'].values()))}, enforce_eager {facts['enforce_eager']}")
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[precision], attn_implementation="sdpa")
    model = PolicyModel(lm.to("cuda")).eval()
    ex = enable_exact(model, plan, facts)
    if plan.engine == "eager":
        rows.run("hooks", lambda: hook_probes(rows, sampler, model, ex, lm.config.vocab_size))
    rows.run("end to end", lambda: end_to_end(rows, sampler, model, ex, plan, lm.config.vocab_size))
    sampler.shutdown()


@torch.no_grad()
def hook_probes(rows, sampler, model, ex, vocab: int):
    """One prefill step and the decode step after it, recorded by hooks on vLLM's layers; every op of the exact
    forward on vLLM's own inputs against vLLM's outputs."""
    from exact import Pack
    from common.logprobs import collate
    from common.vllm_sampler import _model_runner, _sampled_logprobs
    from sanity.mismatch_anatomy import ExactOps, VllmCapture, isolated
    from vllm.inputs import TokensPrompt
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PREFILL_LENS]
    capture = VllmCapture(_model_runner(sampler.llm).model)
    capture.active = True
    try:
        outs = sampler.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                    sampler.sampling_params(1, 2, 1.0), use_tqdm=False)
    finally:
        capture.active = False
        capture.remove()
    steps = capture.steps
    rows.add("steps recorded", len(steps) >= 2, None, f"{len(steps)} steps with "
             f"{[int(s[('ids', -1)].shape[0]) for s in steps]} rows")
    ops = ExactOps(ex, model)
    sampled = [list(o.outputs[0].token_ids) for o in outs]
    mu = [_sampled_logprobs(o.outputs[0].logprobs, s) for o, s in zip(outs, sampled)]

    def report(prefix, v, got, n_rows):
        for op in ("input_norm", "qkv", "rope_q", "rope_k", "attention", "o_proj", "residual_mid", "post_norm",
                   "gate_up", "act", "mlp_out", "residual", "final_norm"):
            keys = [k for k in got if k[0] == op and k in v]
            if keys:
                a = torch.cat([v[k][:n_rows].flatten() for k in keys])
                b = torch.cat([got[k][:n_rows].flatten() for k in keys])
                rows.compare(f"{prefix} {op} (all layers)", b, a)

    # the prefill step: 6 sequences, one after another (positions restart at 0 for each)
    st = steps[0]
    N = sum(PREFILL_LENS)
    v = {k: t[:N] for k, t in st.items() if isinstance(k, tuple)}
    positions = v[("positions", -1)].long()
    starts = (positions == 0).nonzero().flatten().tolist() + [N]
    segs = [v[("ids", -1)][a:b].tolist() for a, b in zip(starts, starts[1:])]
    order = [prompts.index(s) for s in segs]  # the request of each segment
    pack = Pack(*collate([s[:1] for s in segs], [s[1:] for s in segs], 0, dev), page_size=ex.page_size)
    report("prefill", v, isolated(ops, model, v, positions, pack), N)
    # the sampler's rows: the last token of each sequence, in segment order
    W = model.lm.lm_head.weight
    logits_in, logits = st["logits_in"][0], st["logits"][0]
    rows.compare("prefill logits (lm_head on vLLM's sampled rows)", ex.k.linear(logits_in, W), logits)
    lp = ex.k.token_logprobs(logits.float(), torch.tensor([sampled[j][0] for j in order], device=dev))
    rows.compare("prefill log-prob of the sampled token vs mu", lp.cpu(), torch.tensor([mu[j][0] for j in order]))
    # the decode step: one row per request, told apart by its position (the prompt's length)
    st2 = next(s for s in steps[1:] if bool((s[("positions", -1)] > 0).all()))
    n2 = len(prompts)
    v2 = {k: t[:n2] for k, t in st2.items() if isinstance(k, tuple)}
    pos2 = v2[("positions", -1)].long()
    req2 = [PREFILL_LENS.index(int(x)) for x in pos2.tolist()]
    report("decode", v2, isolated(ops, model, v2, pos2, None), n2)
    # decode attention: the trainer's causal attention over each whole sequence (prefill keys + the new one), its
    # last row against vLLM's decode row
    full_rows = [PREFILL_LENS[j] + 1 for j in req2]
    fpack = Pack(*collate([[1] * (n - 1) for n in full_rows], [[1]] * n2, 0, dev), page_size=ex.page_size)
    seg_of = {j: (starts[s], starts[s + 1]) for s, j in enumerate(order)}
    got, ref = [], []
    for i, layer in enumerate(model.lm.model.layers):
        at = layer.self_attn
        nq, nkv = at.q_proj.weight.shape[0], at.k_proj.weight.shape[0]
        qs, ks, vs = [], [], []
        for r, j in enumerate(req2):
            a, b = seg_of[j]
            val_pre = v[("qkv", i)][a:b].split([nq, nkv, nkv], dim=-1)[2]
            val_new = v2[("qkv", i)][r:r + 1].split([nq, nkv, nkv], dim=-1)[2]
            qs.append(torch.cat([v[("rope_q", i)][a:b], v2[("rope_q", i)][r:r + 1]]))
            ks.append(torch.cat([v[("rope_k", i)][a:b], v2[("rope_k", i)][r:r + 1]]))
            vs.append(torch.cat([val_pre, val_new]))
        L = sum(full_rows)
        out = ex.k.attention(torch.cat(qs).view(L, -1, at.head_dim), torch.cat(ks).view(L, -1, at.head_dim),
                             torch.cat(vs).reshape(L, -1, at.head_dim), fpack, at.scaling).reshape(L, -1)
        got.append(out[fpack.cu_seqlens[1:].long() - 1])
        ref.append(v2[("attention", i)])
    rows.compare("decode attention: trainer's prefill over the whole sequence, last row, vs vLLM's decode",
                 torch.cat(got), torch.cat(ref))
    logits_in2, logits2 = st2["logits_in"][0], st2["logits"][0]
    rows.compare("decode logits (lm_head on vLLM's rows)", ex.k.linear(logits_in2, W), logits2)
    lp2 = ex.k.token_logprobs(logits2.float(), torch.tensor([sampled[j][1] for j in req2], device=dev))
    rows.compare("decode log-prob of the sampled token vs mu", lp2.cpu(), torch.tensor([mu[j][1] for j in req2]))


def end_to_end(rows, sampler, model, ex, plan, vocab: int):
    """A rollout of mixed lengths (8 prompts x 4), recomputed by the trainer with each of its switches; old_logp
    against mu token by token. Then temperature 0.7; then the default trainer (Hugging Face path), for reference."""
    from exact import ExactForward, VllmKernels
    from sanity.mismatch_analysis import recompute_logp
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in E2E_PROMPT_LENS]
    limits = E2E_LIMITS
    out = rollout_mixed(sampler, prompts, limits, 4, 1.0)
    switches = [(f, pg) for f in (True, False) for pg in ((True, False) if plan.attention == "FLASH_ATTN" else (True,))]
    for fused, paged in switches:
        kern = VllmKernels(dataclasses.replace(plan, fused=fused, paged=paged))
        model.exact = ExactForward(kern, ex.cos_sin_cache, ex.page_size, fused)
        c = compare_logprobs(recompute_logp(model, out.prompt_ids, out.response_ids, 0, 1.0, 8192, 2048, dev),
                             out.logprobs)
        rows.add(f"end to end T=1: {'fused' if fused else 'per-projection'} q/k/v, {'paged' if paged else 'packed'} "
                 "K/V", True if c["equal"] == c["tokens"] else f"{c['equal']}/{c['tokens']}", c["max_abs_diff"],
                 f"kl_k3 {c['kl_k3']:.3g}; first diffs {c['first_diffs'][:2]}")
    model.exact = ex
    out7 = rollout_mixed(sampler, prompts, limits, 2, 0.7)
    c = compare_logprobs(recompute_logp(model, out7.prompt_ids, out7.response_ids, 0, 0.7, 8192, 2048, dev),
                         out7.logprobs)
    rows.add("end to end T=0.7 (temperature kernel)", True if c["equal"] == c["tokens"] else
             f"{c['equal']}/{c['tokens']}", c["max_abs_diff"], f"kl_k3 {c['kl_k3']:.3g}")
    model.exact = None
    c = compare_logprobs(recompute_logp(model, out.prompt_ids, out.response_ids, 0, 1.0, 8192, 2048, dev),
                         out.logprobs)
    rows.add("end to end T=1, default trainer (Hugging Face path), for reference", f"{c['equal']}/{c['tokens']}",
             c["max_abs_diff"], f"kl_k3 {c['kl_k3']:.3g}")
    model.exact = ex


# ----------------------------------------------------------------------------------------------------------------
# Orchestration

def build_model(path: str, shape: str) -> str:
    """A random 2-layer Qwen2 of the given layer shape (vocabulary 151,936), bf16 on disk, built on the CPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cfg = Qwen2Config(vocab_size=151936, num_hidden_layers=2, max_position_embeddings=4096, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None, **SHAPES[shape])
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def table(rows: list[dict]) -> str:
    from sanity.report import fmt, md_table
    return md_table(["variant", "model", "precision", "probe", "bitwise equal", "max abs diff", "note"],
                    [[r["variant"], r["model"], r["precision"], r["probe"],
                      {True: "yes", False: "**no**"}.get(r["equal"], f"**{r['equal']}**"),
                      fmt(r["max_abs_diff"]) if r["max_abs_diff"] is not None else "", r["note"]] for r in rows])


def main(args: Args) -> list[dict]:
    if args.job is not None:  # one job, in this process
        variant, model_dir, name, precision = args.job.split(":")
        if variant == "kernels":
            kernel_probes(args.rows_file, precision.split(","))
        else:
            engine_probes(args.rows_file, variant, model_dir, name, precision)
        return []
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    os.makedirs(os.path.join(args.out_dir, "logs"), exist_ok=True)
    if args.model is not None:
        from common.preflight import check_model_dir
        check_model_dir(args.model)
        models = [(os.path.abspath(args.model), os.path.basename(os.path.normpath(args.model)))]
    elif any(v != "kernels" for v in args.variants):
        models = [(build_model(os.path.abspath(os.path.join(args.out_dir, "models", s)), s), s) for s in args.shapes]
    else:
        models = []
    jobs = []
    for v in args.variants:
        if v == "kernels":
            jobs.append(f"kernels:-:-:{','.join(args.precisions)}")
            continue
        grid = [(m, p) for m in models for p in args.precisions]
        for (model_dir, name), p in (grid if args.full or v not in SECONDARY else grid[:1]):
            jobs.append(f"{v}:{model_dir}:{name}:{p}")
    rows_file = os.path.abspath(os.path.join(args.out_dir, "rows.jsonl"))
    open(rows_file, "w").close()
    running, pending = [], list(jobs)
    while running or pending:
        while pending and len(running) < max(1, args.parallel):
            job = pending.pop(0)
            v, _, name, p = job.split(":")
            log = os.path.join(args.out_dir, "logs", f"{v}_{name}_{p.replace(',', '_')}.log")
            f = open(log, "w")
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--job", job, "--rows-file",
                                     rows_file], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
            running.append((proc, f, job, log, time.perf_counter()))
        time.sleep(1)
        for item in list(running):
            proc, f, job, log, t0 = item
            rc = proc.poll()
            if rc is None and time.perf_counter() - t0 > args.timeout_s:
                proc.kill()
                rc = f"timeout ({args.timeout_s} s)"
            if rc is None:
                continue
            running.remove(item)
            f.close()
            v, _, name, p = job.split(":")
            if rc != 0:
                with open(log) as lf:
                    tail = [ln.strip() for ln in lf.read().splitlines() if ln.strip()][-1:] or [""]
                Rows(rows_file, variant=v, model=name, precision=p).add("process", False, None,
                                                                        f"exit {rc}: {tail[0][:250]} (log: {log})")
            print(f"[probe] {v} {name} {p}: {'ok' if rc == 0 else f'exit {rc}'} in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    with open(rows_file) as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    # the jobs' order, each job's rows in the order it wrote them (jobs ran side by side)
    rank = {tuple(j.split(":")[i] for i in (0, 2, 3)): k for k, j in enumerate(jobs)}
    first = {}
    for k, j in enumerate(jobs):
        first.setdefault(j.split(":")[0], k)
    rows.sort(key=lambda r: rank.get((r["variant"], r["model"], r["precision"]), first.get(r["variant"], len(jobs))))
    with open(os.path.join(args.out_dir, "probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    text = table(rows)
    with open(os.path.join(args.out_dir, "probe.md"), "w") as f:
        f.write("# Exact mode: the GPU probe\n\n" + text + "\n")
    print("\n" + text, flush=True)
    return rows


if __name__ == "__main__":
    exits.run(lambda: main(tyro.cli(Args)), __file__, steps=False)
