"""Exact mode on a CPU (exact.py; docs/exact.md): what is refused and how (one line, exit 2 through grpo.py),
the packing of right-padded rows into vLLM's layout, the backward of every op against its forward (gradcheck, fp64),
and the whole exact forward wired through an FSDP2 PolicyModel with torch reference kernels standing in for vLLM's:
the same log-probs, entropy and gradients as the default forward up to fp32 rounding. vLLM's own kernels and the
bitwise equality run on a GPU: tests/test_exact_gpu.py, sanity/exact_probe.py."""
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from exact import (PINNED_VLLM, SUPPORTED, ExactForward, ExactPlan, Pack, TorchKernels, _Attention, _Linear,
                          _RMSNorm, _Rope, _SiluAndMul, _Temperature, _TokenLogprob, check_exact, describe, engine_kwargs,
                          fused_add_rms_norm_fixed, install_rmsnorm_patch, padded_sdpa, paged, prepare_vllm_process,
                          remove_rmsnorm_patch, rope_cache, verify_engine)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN2 = {"model_type": "qwen2", "vocab_size": 151936, "hidden_act": "silu", "hidden_size": 1536,
         "num_attention_heads": 12, "num_key_value_heads": 2,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
         "use_sliding_window": False}
OK = dict(train_precision="bf16", rollout_precision="bf16", sampler="vllm", vllm_tp=1, top_p=1.0,
          vllm_version=PINNED_VLLM, capability=(9, 0))


def test_supported_configurations_get_their_attention_backend():
    assert check_exact(QWEN2, **OK) == ExactPlan(head_dim=128, attention="FLASH_ATTN")
    small = {**QWEN2, "hidden_size": 896, "num_attention_heads": 14, "head_dim": 64}
    assert check_exact(small, **{**OK, "train_precision": "fp16", "rollout_precision": "fp16"}).attention == \
        "TRITON_ATTN"
    assert check_exact(QWEN2, **OK).engine == "graphs" and check_exact(QWEN2, **OK, engine="eager").engine == "eager"
    # Llama (SmolLM2-135M-Instruct's shape: head_dim 64, no biases, tied head) and Qwen3 (q/k norms; head_dim from the
    # config, not hidden / heads)
    llama = {"model_type": "llama", "vocab_size": 49152, "hidden_act": "silu", "hidden_size": 576,
             "num_attention_heads": 9, "num_key_value_heads": 3, "rope_scaling": None, "attention_bias": False,
             "mlp_bias": False}
    assert check_exact(llama, **OK) == ExactPlan(head_dim=64, attention="TRITON_ATTN")
    qwen3 = {"model_type": "qwen3", "hidden_act": "silu", "hidden_size": 1024, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "rope_parameters": {"rope_type": "default"}}
    assert check_exact(qwen3, **OK) == ExactPlan(head_dim=128, attention="FLASH_ATTN")


@pytest.mark.parametrize("change, config_change, says", [
    ({"sampler": "hf"}, {}, "--sampler hf"),
    ({"vllm_version": None}, {}, "not installed"),
    ({"vllm_version": "0.32.0"}, {}, "vLLM 0.32.0 is installed"),
    ({"capability": None}, {}, "no CUDA GPU"),
    ({"capability": (8, 0)}, {}, "compute capability 8.0"),
    ({"capability": (10, 0)}, {}, "compute capability 10.0"),
    ({"vllm_tp": 2}, {}, "--vllm-tp 2"),
    ({"train_precision": "fp16"}, {}, "train precision fp16 and rollout precision bf16"),
    ({"train_precision": "fp32", "rollout_precision": "fp32"}, {}, "in fp32"),
    ({"top_p": 0.95}, {}, "top-p 0.95"),
    ({}, {"model_type": "mistral"}, "'mistral'"),
    ({}, {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "RoPE 'llama3'"),
    ({}, {"model_type": "llama", "mlp_bias": True}, "the MLP has biases"),
    ({}, {"qk_norm": True}, "q/k norms"),
    ({}, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({}, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE 'yarn'"),
    ({}, {"use_sliding_window": True}, "sliding window"),
    ({}, {"head_dim": 96}, "head_dim 96 differs"),
    ({}, {"hidden_size": 1280, "num_attention_heads": 16}, "head_dim 80"),
    ({}, {"vocab_size": 42}, "vocabulary size 42 is not a multiple of 64"),
])
def test_unsupported_is_refused_in_one_line_saying_what_is_supported(change, config_change, says):
    with pytest.raises(ValueError) as e:
        check_exact({**QWEN2, **config_change}, **{**OK, **change})
    msg = str(e.value)
    assert says in msg and msg.endswith(SUPPORTED) and "\n" not in msg, msg


def test_exact_check_every_goes_with_exact():
    import grpo
    with pytest.raises(ValueError, match="--exact-check-every goes with --exact"):
        grpo.validate(grpo.parse_args(["--exact-check-every", "3"]), 1)
    with pytest.raises(ValueError, match="--exact-check-every 0: must be at least 1"):
        grpo.validate(grpo.parse_args(["--exact", "--exact-check-every", "0"]), 1)
    grpo.validate(grpo.parse_args([]), 1)  # the default without --exact


def test_grpo_refuses_exact_before_loading_a_model(tmp_path):
    """grpo.py --exact where it cannot run (here: the fallback sampler): one line on stderr, exit status 2."""
    p = subprocess.run([sys.executable, "grpo.py", "--exact", "--sampler", "hf", "--num-steps", "1",
                        "--run-dir", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo.py: error: --exact needs the vLLM sampler"), p.stderr


# ---------------------------------------------------------------------------------------------------------------
# Packing

def _rows():
    from common.logprobs import collate
    prompts = [[4, 5, 6], [7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    responses = [[20, 21, 22, 23, 24], [25, 26], [27]]
    return prompts, responses, collate(prompts, responses, 0, "cpu")


def test_pack_lays_rows_out_one_after_another_with_their_pages():
    prompts, responses, (ids, attn, rmask) = _rows()
    pack = Pack(ids, attn, rmask, page_size=4)
    rows = [p + r for p, r in zip(prompts, responses)]
    assert pack.ids_N.tolist() == [t for r in rows for t in r]
    assert pack.positions_N.tolist() == [j for r in rows for j in range(len(r))]
    assert pack.lengths == [8, 3, 11] and pack.max_len == 11
    assert pack.cu_seqlens.tolist() == [0, 8, 11, 22] and pack.cu_seqlens.dtype == torch.int32
    assert pack.seq_lens.tolist() == [8, 3, 11] and pack.seq_lens.dtype == torch.int32
    # 2 + 1 + 3 pages of 4 tokens, each row on its own consecutive pages (unused entries 0)
    assert pack.num_pages == 6 and pack.block_table.tolist() == [[0, 1, 0], [2, 0, 0], [3, 4, 5]]
    x = torch.arange(22.0)[:, None, None].expand(22, 2, 3).contiguous()  # N x heads x dim, the token's index
    pages = paged(x, pack)
    for b, row in enumerate(rows):
        for j in range(len(row)):
            page, slot = pack.block_table[b, j // 4], j % 4
            assert (pages[page, slot] == pack.cu_seqlens[b] + j).all()
    # each response token, in row-major order as response_hidden gives them, and the position that predicts it
    assert pack.targets_N.tolist() == [t for r in responses for t in r]
    assert (pack.ids_N[pack.pred_N + 1] == pack.targets_N).all()
    assert (pack.row_N == torch.tensor([0] * 8 + [1] * 3 + [2] * 11)).all()


def test_pack_targets_match_the_default_response_hidden(tiny_model_dir):
    """The exact path's targets are response_hidden's, in its order (the log-probs are scattered back with the
    response mask by the same code)."""
    from transformers import AutoModelForCausalLM
    from common.logprobs import response_hidden
    _, _, (ids, attn, rmask) = _rows()
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    _, targets = response_hidden(lm, ids, attn, rmask)
    assert Pack(ids, attn, rmask).targets_N.tolist() == targets.tolist()


def test_pack_leaves_out_a_response_token_at_position_0(tiny_model_dir):
    """A row with no prompt: its first response token has no position before it to be predicted from, and no other
    row's token may stand in for it (without the guard the first row's predictor was -1, the last packed token, and a
    later row's the end of the row before). The targets are response_hidden's, each predicted within its own row."""
    from transformers import AutoModelForCausalLM
    from common.logprobs import collate, response_hidden
    prompts, responses = [[], [7, 8], []], [[20, 21, 22], [25], [26, 27]]
    ids, attn, rmask = collate(prompts, responses, 0, "cpu")
    pack = Pack(ids, attn, rmask)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    _, targets = response_hidden(lm, ids, attn, rmask)
    assert pack.targets_N.tolist() == targets.tolist() == [21, 22, 25, 27]
    assert (pack.pred_N >= 0).all() and (pack.ids_N[pack.pred_N + 1] == pack.targets_N).all()
    assert (pack.row_N[pack.pred_N] == pack.row_N[pack.pred_N + 1]).all()


def test_padded_sdpa_is_causal_attention_of_each_row_alone():
    _, _, (ids, attn, rmask) = _rows()
    pack = Pack(ids, attn, rmask)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(22, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    got = padded_sdpa(q, k, v, pack, 0.3)
    for b in range(pack.batch):
        a, e = int(pack.cu_seqlens[b]), int(pack.cu_seqlens[b + 1])
        qb, kb, vb = q[a:e].transpose(0, 1), k[a:e].repeat_interleave(2, 1).transpose(0, 1), \
            v[a:e].repeat_interleave(2, 1).transpose(0, 1)
        s = qb @ kb.transpose(1, 2) * 0.3
        s = s.masked_fill(torch.ones(e - a, e - a, dtype=torch.bool).triu(1), float("-inf"))
        want = (s.softmax(-1) @ vb).transpose(0, 1)
        torch.testing.assert_close(got[a:e], want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# The ops' backward passes against their forwards

def test_every_op_backward_matches_its_forward():
    """torch.autograd.gradcheck (fp64, the reference kernels): each Function's hand-written backward is the
    derivative of its forward."""
    K = TorchKernels
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    gradcheck = torch.autograd.gradcheck
    assert gradcheck(lambda x, w: _RMSNorm.apply(x, w, 1e-6, K.rms_norm), (r(5, 8), r(8)))
    assert gradcheck(lambda x, w: _Linear.apply(x, w, K.linear), (r(5, 8), r(3, 8)))
    cache = rope_cache(8, 32, 10000.0, torch.float64)
    positions = torch.tensor([0, 3, 1, 7, 31])
    assert gradcheck(lambda q, k: _Rope.apply(q, k, positions, cache, 8, K.rope), (r(5, 16), r(5, 8)))
    assert gradcheck(lambda x: _SiluAndMul.apply(x, K.silu_and_mul), (r(5, 8),))
    assert gradcheck(lambda x: _Temperature.apply(x, 0.7, K.temperature), (r(5, 8),))
    targets = torch.tensor([1, 0, 7, 3, 3])
    assert gradcheck(lambda x: _TokenLogprob.apply(x, targets, K.token_logprobs), (r(5, 8),))
    _, _, (ids, attn, rmask) = _rows()
    pack = Pack(ids, attn, rmask)
    assert gradcheck(lambda q, k, v: _Attention.apply(q, k, v, pack, 0.35, K.attention),
                     (r(22, 4, 3), r(22, 2, 3), r(22, 2, 3)))


def test_fixed_order_add_norm_and_its_patch():
    """vLLM's patched RMSNorm returns (norm(x + r), x + r), out of place (the C++ kernel it replaces writes into its
    inputs), and leaves the residual-free branch alone; installing twice wraps once; removing restores it."""
    calls = []

    def rms(x, w, eps=1e-6, residual=None):
        calls.append(residual is None)
        assert residual is None, "the original is only called without a residual"
        return TorchKernels.rms_norm(x, w, eps)
    module = types.SimpleNamespace(rms_norm_batch_invariant=rms)
    install_rmsnorm_patch(module)
    install_rmsnorm_patch(module)
    patched = module.rms_norm_batch_invariant
    assert patched.exact_original is rms
    x, res, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    x0, res0 = x.clone(), res.clone()
    normed, s = patched(x, w, 1e-5, residual=res)
    assert torch.equal(s, x0 + res0) and torch.equal(normed, TorchKernels.rms_norm(x0 + res0, w, 1e-5))
    assert torch.equal(x, x0) and torch.equal(res, res0)
    assert torch.equal(patched(x, w, 1e-5), TorchKernels.rms_norm(x, w, 1e-5))
    assert (normed, s)[1] is not x and fused_add_rms_norm_fixed(TorchKernels.rms_norm, x, res, w, 1e-5)[1].equal(s)
    remove_rmsnorm_patch(module)
    assert module.rms_norm_batch_invariant is rms


def test_batch_invariant_mode_must_come_before_vllm_is_imported(monkeypatch):
    plan = ExactPlan(head_dim=128, attention="FLASH_ATTN")
    for name in ("VLLM_BATCH_INVARIANT", "VLLM_USE_V2_MODEL_RUNNER"):  # (setenv first: restored after the test,
        monkeypatch.setenv(name, "")  # so that later tests' vLLM engines do not start in batch-invariant mode)
        monkeypatch.delenv(name)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    with pytest.raises(RuntimeError, match="imported before"):
        prepare_vllm_process(plan)
    monkeypatch.delitem(sys.modules, "vllm")
    for name in [m for m in sys.modules if m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    prepare_vllm_process(ExactPlan(head_dim=128, attention="FLASH_ATTN", runner="v1"))
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1" and os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_the_trainer_gets_its_cublas_settings_back_after_the_engine(monkeypatch):
    """Batch-invariant mode cuts cuBLAS's workspaces, prefers cuBLASLt and turns reduced-precision reductions off for
    the whole process (vLLM's enable_batch_invariant_mode); only the trainer's backward uses cuBLAS then, and it gets
    back what the process had before the engine started: a user's own setting kept, vLLM's removed."""
    import exact
    state, cleared = {"library": "Cublas"}, []

    def preferred(backend=None):
        if backend is not None:
            state["library"] = backend
        return state["library"]
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(1), raising=False)
    for name in ("_cuda_resetCublasWorkspaceSize", "_cuda_resetCublasLtWorkspaceSize", "_cuda_getCublasLtWorkspaceSize"):
        monkeypatch.delattr(torch._C, name, raising=False)  # (torch 2.11: no way to ask for the sizes again)
    m = torch.backends.cuda.matmul
    before = m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction
    m.allow_fp16_reduced_precision_reduction = m.allow_bf16_reduced_precision_reduction = True
    try:
        _blas_given_back(monkeypatch, exact, state, cleared, preferred, m)
    finally:
        m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = before


def _blas_given_back(monkeypatch, exact, state, cleared, preferred, m):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the user's own
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "")
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE")
    monkeypatch.setattr(exact, "_trainer_blas_settings", None)
    assert exact.trainer_blas() == "unchanged"  # no engine was prepared: nothing to give back
    monkeypatch.setattr(exact, "_trainer_blas_settings", exact.blas_settings())
    os.environ.update(CUBLAS_WORKSPACE_CONFIG=":16:8", CUBLASLT_WORKSPACE_SIZE="1")  # what vLLM does
    preferred("Cublaslt")
    m.allow_fp16_reduced_precision_reduction = m.allow_bf16_reduced_precision_reduction = False
    said = exact.trainer_blas()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and "CUBLASLT_WORKSPACE_SIZE" not in os.environ
    assert state["library"] == "Cublas" and cleared == [1]
    assert m.allow_fp16_reduced_precision_reduction and m.allow_bf16_reduced_precision_reduction
    assert "Cublas" in said and "CUBLAS_WORKSPACE_CONFIG=:4096:8" in said


def test_engine_arguments_and_the_engine_check():
    plan = ExactPlan(head_dim=128, attention="FLASH_ATTN")  # the default: CUDA graphs without torch.compile
    assert engine_kwargs(plan) == {"attention_config": {"backend": "FLASH_ATTN", "flash_attn_version": 3},
                                   "enforce_eager": False, "compilation_config": {
                                       "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["all"]}}
    assert engine_kwargs(ExactPlan(head_dim=64, attention="TRITON_ATTN", engine="eager")) == {
        "attention_config": {"backend": "TRITON_ATTN"}, "enforce_eager": True}
    assert engine_kwargs(ExactPlan(head_dim=64, attention="TRITON_ATTN", engine="compiled")) == {
        "attention_config": {"backend": "TRITON_ATTN"}, "enforce_eager": False,
        "compilation_config": {"custom_ops": ["all"]}}
    ops = {"RMSNorm": "forward_cuda", "SiluAndMul": "forward_cuda", "RotaryEmbedding": "forward_cuda"}
    facts = {"batch_invariant": True, "runner": "v2", "attention_impl": "FlashAttentionImpl", "fa_version": 3,
             "op_forwards": ops, "enforce_eager": False, "compilation_mode": "NONE",
             "cudagraph_mode": "FULL_DECODE_ONLY", "rope_cache": torch.zeros(1)}
    verify_engine(plan, facts)
    verify_engine(ExactPlan(head_dim=128, attention="FLASH_ATTN", engine="eager"),
                  {**facts, "compilation_mode": "NONE", "cudagraph_mode": "NONE", "enforce_eager": True})
    for bad, says in [({"runner": "v1"}, "model runner v1"), ({"fa_version": 2}, "FlashAttention 2"),
                      ({"batch_invariant": False}, "batch-invariant mode is off"),
                      ({"op_forwards": {**ops, "RMSNorm": "forward_native"}}, "not on their vLLM kernels: RMSNorm"),
                      ({"op_forwards": {"RMSNorm": "forward_cuda", "SiluAndMul": "forward_cuda"}},
                       "has no RotaryEmbedding"),  # another rotary class (Llama 3's) the trainer does not mirror
                      ({"attention_impl": "TritonAttentionImpl"}, "attention TritonAttentionImpl"),
                      ({"compilation_mode": "VLLM_COMPILE"}, "compilation mode VLLM_COMPILE"),
                      ({"cudagraph_mode": "FULL_AND_PIECEWISE"}, "CUDA graphs FULL_AND_PIECEWISE"),
                      ({"window": (4095, 0)}, "attention window")]:
        with pytest.raises(RuntimeError, match=says):
            verify_engine(plan, {**facts, **bad})
    facts.update(block_size=16)
    assert "NOT bitwise" not in describe(plan, facts) and "CUDA graphs" in describe(plan, facts)
    assert "NOT bitwise" in describe(ExactPlan(head_dim=128, attention="FLASH_ATTN", engine="compiled"), facts)


def test_recompute_runs_every_step_by_default_and_only_now_and_then_with_exact():
    from common.cli import recompute_due
    flags = types.SimpleNamespace(exact=False, exact_check_every=10)
    assert all(recompute_due(flags, step, 1) for step in range(1, 30))
    flags.exact = True
    assert [s for s in range(1, 31) if recompute_due(flags, s, 1)] == [1, 10, 20, 30]
    assert [s for s in range(7, 21) if recompute_due(flags, s, 7)] == [7, 10, 20]  # a resume's first step too
    flags.exact_check_every = 1
    assert all(recompute_due(flags, step, 1) for step in range(1, 30))


# ---------------------------------------------------------------------------------------------------------------
# The exact forward, wired through PolicyModel, with the reference kernels

def tiny_family_dir(path: str, family: str) -> str:
    """A tiny random Llama (no biases, tied head) or Qwen3 (q/k norms) with the tests' character tokenizer, as
    conftest.make_tiny_model_dir makes Qwen2's."""
    from conftest import make_char_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    config, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    tokenizer = make_char_tokenizer()
    cfg = config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                 tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    model = model_class(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif "norm" in name:  # norm weights away from 1, so that a q/k norm left out shows
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("family, gradient_checkpointing, fused", [("qwen2", False, True), ("qwen2", True, False),
                                                                   ("llama", False, True), ("qwen3", True, True)])
def test_exact_forward_equals_the_default_forward_up_to_rounding(tiny_model_dir, process_group, tmp_path, monkeypatch,
                                                                family, gradient_checkpointing, fused):
    """A PolicyModel (FSDP2, fp32) in exact mode, the torch reference kernels standing in for vLLM's: log-probs,
    entropy and gradients agree with the default forward within fp32 rounding (conftest.fp32_rounding_bound), with
    a temperature (the temperature op) and chunks smaller than the batch; model.exact = None goes back to the default
    forward bit for bit. This runs the packing, the layer dispatch under FSDP2 and gradient checkpointing, the
    chunked head and every Function's backward; on Qwen2
    (biases on q/k/v), Llama (no biases) and Qwen3 (q/k norms). The checkpoints' recompute rounds its matmuls
    otherwise than the first forward, as cuBLAS's against vLLM's on a GPU (here fp64 products, each rounded once)."""
    import exact
    from conftest import assert_close_to_rounding, fp32_rounding_bound
    from common.fsdp import load_policy
    monkeypatch.setattr(exact, "recompute_linear", lambda x, w: (x.double() @ w.double().t()).to(x.dtype))
    _, _, device = process_group
    model_dir = tiny_model_dir if family == "qwen2" else tiny_family_dir(str(tmp_path / family), family)
    prompts, responses, batch = _rows()
    runs = {}
    for mode in ("default", "exact", "back"):
        model = load_policy(model_dir, torch.float32, device, gradient_checkpointing=gradient_checkpointing)
        cfg = model.lm.config
        ex = ExactForward(TorchKernels(), rope_cache(cfg.head_dim, cfg.max_position_embeddings,
                                                     cfg.rope_parameters["rope_theta"], torch.float32),
                          page_size=4, fused=fused)
        ex.install(model.lm)
        model.exact = ex if mode == "exact" else None
        model.train()
        logp, ent = model(*batch, 0.7, 5, with_entropy=True)
        (logp.sum() / 10).backward()
        runs[mode + "_ent_grad"] = ent.requires_grad
        runs[mode] = (logp.detach(), ent.detach(),
                      torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()]))
    n = int(batch[2].sum())
    fwd, bwd = (fp32_rounding_bound(cfg, batch[0].shape[1], n, backward=b) for b in (False, True))
    (lp0, e0, g0), (lp1, e1, g1), (lp2, _, g2) = runs["default"], runs["exact"], runs["back"]
    assert_close_to_rounding(lp1, lp0, fwd)
    assert_close_to_rounding(e1, e0, fwd)
    assert_close_to_rounding(g1, g0, bwd)
    assert torch.equal(lp2, lp0) and torch.equal(g2, g0)
    assert (lp1[~batch[2]] == 0).all() and g1.abs().sum() > 0
    assert not runs["exact_ent_grad"]  # the entropy: a metric without a graph (test_logprobs says why)


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_a_checkpoints_recompute_runs_torchs_matmul_not_the_kernel(tiny_model_dir, process_group, monkeypatch,
                                                                   gradient_checkpointing):
    """The recompute of a checkpoint (gradient checkpointing's of each layer, the head's of each chunk, which always
    runs under gradient) calls torch's matmul (recompute_linear) for the projections, never the kernel's (vLLM's
    Triton matmul on a GPU, slower than cuBLAS in bf16); the first forward calls the kernel only, and its log-probs are
    the same bit for bit as a forward without any checkpoint (no_grad)."""
    import exact
    from common.fsdp import load_policy
    _, _, device = process_group
    _, _, batch = _rows()
    calls = {"kernel": 0, "torch": 0}

    class CountingKernels(TorchKernels):
        def linear(self, x, w):
            calls["kernel"] += 1
            return TorchKernels.linear(x, w)

    def torch_linear(x, w):
        calls["torch"] += 1
        return exact.F.linear(x, w)
    monkeypatch.setattr(exact, "recompute_linear", torch_linear)
    model = load_policy(tiny_model_dir, torch.float32, device, gradient_checkpointing=gradient_checkpointing)
    cfg = model.lm.config
    ex = ExactForward(CountingKernels(), rope_cache(cfg.head_dim, cfg.max_position_embeddings,
                                                    cfg.rope_parameters["rope_theta"], torch.float32), page_size=4)
    ex.install(model.lm)
    model.exact = ex
    model.train()
    with torch.no_grad():
        want, _ = model(*batch, 0.7, 5)
    logp, _ = model(*batch, 0.7, 5)
    layers, chunks = 4 * cfg.num_hidden_layers, 2  # q/k/v, o, gate/up, down; 8 response tokens in chunks of 5
    assert calls == {"kernel": 2 * (layers + chunks), "torch": 0}
    assert torch.equal(logp, want)
    logp.sum().backward()
    assert calls == {"kernel": 2 * (layers + chunks), "torch": chunks + (layers if gradient_checkpointing else 0)}
    assert not exact.recomputing()


# ---------------------------------------------------------------------------------------------------------------
# The GPU probe's harness (sanity/exact_probe.py): its comparisons, and a failing probe process reported as a row

def test_probe_comparisons_and_rows(tmp_path):
    from sanity.exact_probe import Rows, compare_logprobs, table
    old = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    mu = [torch.tensor([-1.0, -2.5]), torch.tensor([-0.5])]
    c = compare_logprobs(old, mu)
    assert c["tokens"] == 3 and c["equal"] == 2 and c["max_abs_diff"] == 0.5
    assert c["first_diffs"] == [[0, 1, -2.0, -2.5]]
    rows = Rows(str(tmp_path / "rows.jsonl"), variant="v", model="m", precision="bf16")
    rows.compare("same", torch.ones(3, dtype=torch.float16), torch.ones(3, dtype=torch.float16))
    rows.compare("one off", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    rows.run("raises", lambda: 1 / 0)
    got = [json.loads(line) for line in open(tmp_path / "rows.jsonl")]
    assert [(r["probe"], r["equal"]) for r in got] == [("same", True), ("one off", "1/2"), ("raises", False)]
    assert got[2]["note"].startswith("error: ZeroDivisionError") and "\n" not in got[2]["note"]
    md = table(got)
    assert "| v | m | bf16 | one off | **1/2** | 0.5 |" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels would run: this checks the harness")
def test_probe_reports_a_failed_process_as_a_row(tmp_path):
    p = subprocess.run([sys.executable, "sanity/exact_probe.py", "--variants", "kernels", "--out-dir",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads((tmp_path / "probe.json").read_text())
    assert rows and all(r["variant"] == "kernels" for r in rows)
    assert "| probe | bitwise equal |" in p.stdout and (tmp_path / "probe.md").is_file()
