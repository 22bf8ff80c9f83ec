"""GPU checks (skipped without CUDA): the fallback sampler's log-probs against the trainer's on the GPU, and grpo.py
--precision fp16 / bf16 for a few steps on a randomly initialised model of Qwen2.5-0.5B's shape (char vocabulary).
Prints step time and mismatch (kl_k3) per precision: `pytest -s tests/test_gpu.py` shows them."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    """Qwen2.5-0.5B's layer shape (hidden 896, 24 layers, 14 heads of 64, 2 KV heads), random weights."""
    from conftest import make_char_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM
    path = str(tmp_path_factory.mktemp("qwen05b_shape"))
    tok = make_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_sampler_vs_trainer_logprobs_on_gpu(small_model_dir, precision):
    from common.dist import setup_distributed
    from common.fsdp import load_policy
    from common.logprobs import collate
    from common.precision import DTYPES
    from common.sampler import HFSampler
    _, _, device = setup_distributed()
    dtype = DTYPES[precision]
    sampler = HFSampler(small_model_dir, dtype, device, seed=0)
    out = sampler.generate([[4, 5, 13, 6, 14], [7, 14]], n=4, max_new_tokens=64, temperature=1.0)
    model = load_policy(small_model_dir, dtype, device, gradient_checkpointing=False)
    ids, attn, rmask = collate(out.prompt_ids, out.response_ids, 0, device)
    with torch.no_grad():
        logp, _ = model(ids, attn, rmask, 1.0, 512)
    mu = torch.zeros_like(logp)
    for b, lp in enumerate(out.logprobs):
        mu[b, :len(lp)] = lp.to(device)
    d = (logp - mu)[rmask]
    k3 = (torch.expm1(d) - d).mean().item()
    print(f"\n[gpu] {precision}: sampler vs trainer |dlogp| mean {d.abs().mean():.2e} max {d.abs().max():.2e} "
          f"kl_k3 {k3:.2e}")
    bound = {"fp32": 1e-4, "bf16": 0.2, "fp16": 0.05}[precision]
    assert d.abs().mean().item() < bound


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_grpo_few_steps_on_gpu(small_model_dir, tmp_path, precision):
    run_dir = str(tmp_path / precision)
    cmd = [sys.executable, "grpo.py", "--model", small_model_dir, "--dataset", _addition_file(tmp_path),
           "--prompt-template", "{problem}", "--reward", "exact", "--precision", precision, "--num-steps", "3",
           "--num-prompts", "16", "--group-size", "8", "--max-response-len", "256", "--max-prompt-len", "32",
           "--lr", "1e-5", "--save-every", "0", "--run-dir", run_dir]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "train/accuracy" in r]
    assert len(steps) == 3
    for r in steps:
        assert all(math.isfinite(r[k]) for k in ("train/loss", "mismatch/kl_k3", "optim/loss_scale"))
    last = steps[-1]
    kls = ", ".join(f"{r['mismatch/kl_k3']:.2e}" for r in steps)
    print(f"\n[gpu] grpo {precision}: step {last['time/step']:.2f}s (sample {last['time/sample']:.2f}, "
          f"recompute {last['time/recompute']:.2f}, train {last['time/train']:.2f}, sync {last['time/sync']:.3f}); "
          f"kl_k3 {kls}; loss scale {last['optim/loss_scale']}; "
          f"sample {last['perf/sample_tok_s']:.0f} tok/s, train {last['perf/train_tok_s']:.0f} tok/s")


def _addition_file(tmp_path):
    path = tmp_path / "add.jsonl"
    with open(path, "w") as f:
        for a in range(10, 74):
            f.write(json.dumps({"problem": f"{a}+{a * 7 % 90}=", "answer": str(a + a * 7 % 90)}) + "\n")
    return str(path)


# ---------------------------------------------------------------------------------------------------------------
# The vLLM sampler on the GPU (skipped without vLLM). One engine per process: each check runs in a subprocess.

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory):
    """A tiny model with large random weights: peaked distributions, so greedy decoding has no near-ties."""
    from conftest import make_tiny_model_dir
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("peaked")), head_dim=64)


def _check(model, precision, mode):
    p = subprocess.run([sys.executable, "tests/vllm_gpu_check.py", "--model", model, "--precision", precision,
                        "--mode", mode], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    print(f"\n[gpu vllm] {result}")
    return result


@needs_vllm
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_vllm_sync_and_sleep_on_gpu(peaked_model_dir, precision):
    r = _check(peaked_model_dir, precision, "sync")
    # Greedy decoding equals transformers' generate exactly in fp32. In 16 bits vLLM's and transformers' kernels
    # round differently and near-ties flip greedy continuations (bf16: 5 of 8 equal after a sync, 8 of 8 before), so
    # there the proof that the sync moved the new weights in is the trainer-vs-vLLM log-prob agreement on them.
    if precision == "fp32":
        assert r["greedy_eq_hf_before"] == r["greedy_eq_hf_after"] == "8/8"
    assert r["greedy_changed_by_sync"]
    # stale weights give kl_k3 >> 0.1 here; measured on one H100: fp32 3e-6 (vLLM's fp32 matmuls are not exact
    # there), fp16 8e-6, bf16 6e-4
    assert r["kl_k3_after_sync"] < {"fp32": 1e-4, "fp16": 1e-3, "bf16": 1e-2}[precision]
    assert r["level2_refuses_stale_weights"]
    for level in (1, 2):
        awake, asleep, woken = r[f"sleep{level}_gib"]
        assert asleep < awake - 0.5 and abs(woken - awake) < 0.5  # the KV cache (and weights) released, restored
        assert r[f"greedy_same_after_sleep{level}"]


@needs_vllm
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_vllm_mismatch_and_speed_on_gpu(small_model_dir, precision):
    r = _check(small_model_dir, precision, "speed")
    bound = {"fp32": 1e-6, "fp16": 1e-4, "bf16": 1e-2}[precision]
    assert 0 <= r["kl_k3"] < bound


@needs_vllm
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_grpo_with_vllm_on_gpu(small_model_dir, tmp_path, precision):
    run_dir = str(tmp_path / precision)
    cmd = [sys.executable, "grpo.py", "--sampler", "vllm", "--model", small_model_dir, "--dataset",
           _addition_file(tmp_path), "--prompt-template", "{problem}", "--reward", "exact", "--precision", precision,
           "--num-steps", "3", "--num-prompts", "16", "--group-size", "8", "--max-response-len", "256",
           "--max-prompt-len", "32", "--lr", "1e-5", "--save-every", "0", "--run-dir", run_dir]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in steps if "train/accuracy" in r]
    assert len(steps) == 3 and all(math.isfinite(r["mismatch/kl_k3"]) for r in steps)
    last = steps[-1]
    # GPU memory per phase: vLLM's KV cache is in use while it samples and released (sleep) for the training
    assert last["mem/sample_used_gib"] > last["mem/train_used_gib"] and last["mem/train_peak_gib"] > 0
    kls = ", ".join(f"{r['mismatch/kl_k3']:.2e}" for r in steps)
    mem = ", ".join(f"{ph} {last[f'mem/{ph}_used_gib']:.1f}" for ph in ("sample", "recompute", "train", "sync"))
    print(f"\n[gpu] grpo --sampler vllm {precision}: step {last['time/step']:.2f}s (sample {last['time/sample']:.2f}, "
          f"recompute {last['time/recompute']:.2f}, train {last['time/train']:.2f}, sync {last['time/sync']:.3f}); "
          f"kl_k3 {kls}; sample {last['perf/sample_tok_s']:.0f} tok/s; GiB in use after {mem}")
