"""common/fsdp.py: the trainer's model as the scripts load it. Dropout is off although the forwards run in train
mode (gradient checkpointing acts only there)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import assert_close_to_rounding, fp32_rounding_bound, make_tiny_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dropout_off_in_the_trainer(tmp_path, process_group):
    """A checkpoint whose config sets attention dropout: two train-mode forwards of the same batch give the same
    log-probs, those of the model without dropout (with dropout on they differed by nats)."""
    from common.fsdp import load_policy
    from common.logprobs import collate
    _, _, device = process_group
    path = make_tiny_model_dir(str(tmp_path / "m"), attention_dropout=0.5)
    model = load_policy(path, torch.float32, device, gradient_checkpointing=True)
    assert model.lm.config.attention_dropout == 0.0
    model.train()
    ids, attn, rmask = collate([[4, 5, 13, 6, 14], [7, 14]], [[5, 6, 7, 1], [8, 9]], 0, device)
    with torch.no_grad():
        a, _ = model(ids, attn, rmask, 1.0, 16)
        b, _ = model(ids, attn, rmask, 1.0, 16)
        model.eval()
        c, _ = model(ids, attn, rmask, 1.0, 16)
    assert torch.equal(a, b) and torch.allclose(a, c, atol=1e-6)


def torchrun(nproc, check, path, out):
    """tests/multirank.py's `check` on `nproc` ranks; returns what each rank's check returned, by rank."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    os.makedirs(out, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                        "tests/multirank.py", check, path, out], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(nproc)]


def test_weight_sync_gathers_each_tensor_once_in_the_rollout_precision(tmp_path):
    """2 ranks, a tied model, a bf16 rollout: each rank puts its bf16 shard of every distinct tensor into the
    all-gathers (the fp32 masters, and the tied embedding under both names, once moved 2.x times the bytes). The
    tied tensor is still sent under both names (vLLM's CPU engine keeps its own lm_head copy)."""
    path = make_tiny_model_dir(str(tmp_path / "m"))
    for r in torchrun(2, "sync_bytes", path, str(tmp_path / "out")):
        assert "lm_head.weight" in r["names"] and "model.embed_tokens.weight" in r["names"]
        assert r["bytes"] <= 1.05 * r["bf16_shard_bytes"], r  # (shards are padded to equal sizes)


@pytest.mark.parametrize("nproc,tie", [(2, True), (3, False)])
def test_sharded_load_equals_from_pretrained(tmp_path, nproc, tie):
    """Each rank reads only its rows of every tensor; put together they are the checkpoint's (3 ranks: uneven shards,
    the vocabulary of 42 rows does not divide)."""
    path = make_tiny_model_dir(str(tmp_path / "m"), tie=tie)
    for r in torchrun(nproc, "load", path, str(tmp_path / "out")):
        assert r["equal"] and r["tied"] == tie
        assert r["names"] == r["ref_names"]  # a tied lm_head under its own name too


def test_load_peak_host_memory_is_about_a_shard(tmp_path):
    """2 ranks, a 40M-parameter model (165 MB in fp32): loading adds about one shard to each rank's peak host memory,
    not the whole model (every rank once built the full fp32 model first)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(tmp_path / "m"))
    for r in torchrun(2, "load_memory", str(tmp_path / "m"), str(tmp_path / "out")):
        print(f"\n[load] peak host memory added: {r['peak_added'] / 2**20:.0f} MiB; fp32 model "
              f"{r['fp32_bytes'] / 2**20:.0f} MiB")
        assert r["peak_added"] < 0.75 * r["fp32_bytes"], r


@pytest.mark.parametrize("nproc", [1, 2])
def test_cpu_offload_takes_the_same_step(tmp_path, nproc):
    """--cpu-offload on CPU (FSDP2 takes a CPUOffloadPolicy with a CPU mesh; only pinning needs a GPU): one step
    (forward, backward, clip_grad_norm_ over the ranks, AdamW) gives exactly the loss, log-probs, gradient norm and
    weights it gives without offload, with every parameter under the offload policy and its shard, gradient and AdamW
    states on the CPU. Exact: on a CPU both run the same kernels on the same tensors (on a GPU: tests/test_gpu.py)."""
    path = make_tiny_model_dir(str(tmp_path / "m"))
    for r in torchrun(nproc, "offload_step", path, str(tmp_path / "out")):
        assert r["loss"][0] == r["loss"][1] and r["logp_equal"] and r["norm"][0] == r["norm"][1], r
        assert r["norm"][0] > 0.5  # the clip acted (max_grad_norm 0.5): its all-reduced norm is in the weights
        assert r["weights_max_diff"] == 0.0 and r["weights_moved"] > 1e-4, r  # every tensor took the step
        (n_plain, _), (n_offload, total) = r["offloaded"]
        assert n_plain == 0 and n_offload == total > 0, r  # every parameter under the offload policy
        assert r["devices_offload"] == {"grads": ["cpu"], "params": ["cpu"], "adamw": ["cpu"]}, r


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on a CPU needs a C++ compiler")
def test_compiled_layers_give_the_same_numbers(tmp_path, process_group):
    """compile_layers (the scripts' --compile, used on GPUs) changes no number: the same no-grad log-probs (the
    recompute), then the same training log-probs, loss and gradients over micro-batches of other shapes, with and
    without padding, through gradient checkpointing (fp32 on CPU; equal up to what the fused kernels' other
    summation order can change: fp32_rounding_bound), and the parameters keep their Hugging Face names."""
    from common.fsdp import compile_layers, load_policy
    from common.logprobs import collate
    _, _, device = process_group
    path = make_tiny_model_dir(str(tmp_path / "m"))
    batches = [collate([[4, 5, 13, 6, 14], [7, 14]], [[5, 6, 7, 1], [8, 9]], 0, device),  # padded
               collate([[4, 5, 6], [7, 8, 9]], [[5, 6, 7], [8, 9, 10]], 0, device),  # no padding: no mask
               collate([[3, 4], [5, 6], [7, 8]], [[9, 10, 11, 12, 13], [14], [9, 9]], 0, device)]
    from torch._dynamo.utils import counters
    counters.clear()
    runs = []
    for compiled in (False, True):
        model = load_policy(path, torch.float32, device, gradient_checkpointing=True)
        if compiled:  # (load_policy's compile=True does nothing on a CPU)
            compile_layers(model.lm)
        out = {"names": [n for n, _ in model.named_parameters()]}
        with torch.no_grad():
            out["recompute"] = [model(*b, 1.0, 16, with_entropy=True) for b in batches]
        model.train()
        out["train"] = []
        for b in batches:
            logp, _ = model(*b, 0.7, 16)
            (logp.sum() / 10).backward()
            out["train"].append(logp.detach())
        out["grads"] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        runs.append(out)
    eager, comp = runs
    assert eager["names"] == comp["names"]
    assert counters["stats"]["unique_graphs"] >= 1  # compiled for real, not run eagerly
    cfg = model.lm.config
    seq_len, n_tokens = max(b[0].shape[1] for b in batches), sum(b[0].numel() for b in batches)
    forward = fp32_rounding_bound(cfg, seq_len, n_tokens, backward=False)
    for (a, ea), (b, eb) in zip(eager["recompute"], comp["recompute"]):
        assert_close_to_rounding(b, a, forward)
        assert_close_to_rounding(eb, ea, forward)
    for a, b in zip(eager["train"], comp["train"]):
        assert_close_to_rounding(b, a, forward)
    # every gradient is a sum of products of the same back-propagated signals: the largest gradient of the model is
    # the magnitude of the terms (a tensor of small gradients, e.g. the second layer's q_proj, is computed from them)
    backward = fp32_rounding_bound(cfg, seq_len, n_tokens, backward=True)
    g_max = max(g.abs().max().item() for g in eager["grads"].values())
    for n, g in eager["grads"].items():
        assert g.abs().max() > 0, n
        diff = (comp["grads"][n] - g).abs().max().item()
        assert diff <= backward * g_max, f"{n}: max |difference| {diff:.3g} > {backward * g_max:.3g}"
