"""Exact mode on a GPU (skipped without CUDA or vLLM; docs/exact.md): the trainer's old_logp equals vLLM's mu bit for
bit for every response token (a count, not kl_k3), at fp16 and bf16, on randomly initialised models of
Qwen2.5-0.5B's shape (head_dim 64: vLLM's Triton attention), Qwen2.5-1.5B's (head_dim 128: FA3), SmolLM2-135M's
(Llama) and Qwen3-0.6B's (q/k norms), over mixed prompt and response lengths, with a temperature, in train mode with
gradients, and after a weight sync; on two ranks under FSDP2 where two GPUs are present; and grpo.py --exact for four
steps with mismatch/unequal_tokens 0 and the rollout corrections no-ops. One engine per process: each case runs
tests/exact_gpu_check.py (or grpo.py) in a subprocess.

    pytest -s tests/test_exact_gpu.py                     # everything (prints a summary table last)
    pytest -s tests/test_exact_gpu.py -k "1.5b and bf16"  # one case
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (family, vocabulary, shape): the layer shapes of Qwen2.5-0.5B and -1.5B (0.5B ties its embeddings, 1.5B's head is
# its own), SmolLM2-135M-Instruct (Llama: no biases, head_dim 64, tied) and Qwen3-0.6B (q/k norms, head_dim 128)
SHAPES = {"0.5b": ("qwen2", 151936, dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)),
          "1.5b": ("qwen2", 151936, dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=False)),
          "llama": ("llama", 49152, dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                         tie_word_embeddings=True)),
          "qwen3": ("qwen3", 151936, dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                          num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                          tie_word_embeddings=True))}
SUMMARY = []  # one line per case and phase, printed at the end of the session


def build_model(path: str, family: str = "qwen2", vocab_size: int = 151936, **shape) -> str:
    """A randomly initialised model of `family` (the library's init, on the GPU), saved in bf16 (exact in both fp16
    and bf16 rounding paths: each side casts the same values), with the tests' character tokenizer."""
    from conftest import make_char_tokenizer
    import transformers
    config_class, model_class = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig",
                                 "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[family]
    cfg = getattr(transformers, config_class)(vocab_size=vocab_size, max_position_embeddings=4096, pad_token_id=0,
                                              eos_token_id=1, bos_token_id=None, **shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = getattr(transformers, model_class)(cfg).to(torch.bfloat16)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    built = {}

    def get(shape):
        if shape not in built:
            family, vocab, dims = SHAPES[shape]
            built[shape] = build_model(str(tmp_path_factory.mktemp(shape)), family, vocab, **dims)
        return built[shape]
    return get


@pytest.fixture(scope="session", autouse=True)
def summary_table():
    yield
    if SUMMARY:
        print("\n\nexact mode on the GPU: response tokens whose old_logp equals mu bit for bit")
        print(f"{'case':<24} {'phase':<14} {'tokens':>8} {'equal':>8} {'max |diff|':>11}  (grpo: kl_k3, weights)")
        print("\n".join(SUMMARY))


def _check(cmd: list[str], case: str) -> dict:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    for r in result["ranks"]:
        print(f"\n[exact gpu] {case} rank {r['rank']}: {r['exact']}; start {r['start_s']} s")
        for phase, c in r["phases"].items():
            SUMMARY.append(f"{case + ' r' + str(r['rank']):<24} {phase:<14} {c['tokens']:>8} {c['equal']:>8} "
                           f"{c['max_abs_diff']:>11.3g}")
            print(f"  {phase}: {c['equal']}/{c['tokens']} equal, max |diff| {c['max_abs_diff']:.3g}, kl_k3 "
                  f"{c['kl_k3']:.3g}, first differing (seq, pos, old, mu): {c['first_diffs']}"
                  + (f"; sample {c['sample_s']} s, recompute {c['recompute_s']} s" if "sample_s" in c else ""))
    return result


def _assert_bitwise(result: dict):
    for r in result["ranks"]:
        for phase, c in r["phases"].items():
            assert c["tokens"] > 0 and c["equal"] == c["tokens"], (r["rank"], phase, c)
        assert r["phases"]["train"]["grads_finite"]
        assert r["tokens_moved_by_step"] > 0  # the step moved the weights: after_sync compared new weights


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", ["1.5b", "0.5b", "llama", "qwen3"])
def test_old_logp_equals_mu_bitwise(model_dirs, shape, precision):
    case = f"{shape} {precision} 1 rank"
    _assert_bitwise(_check([sys.executable, "tests/exact_gpu_check.py", "--model", model_dirs(shape), "--precision",
                            precision], case))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("precision", ["bf16"])
def test_old_logp_equals_mu_bitwise_fsdp2_two_ranks(model_dirs, precision):
    case = f"1.5b {precision} 2 ranks"
    _assert_bitwise(_check([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                            "tests/exact_gpu_check.py", "--model", model_dirs("1.5b"), "--precision", precision],
                           case))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_grpo_exact_has_no_mismatch(tmp_path, precision):
    """grpo.py --exact, 4 steps of 16 x 8 responses with Token-TIS and Token-MIS on, the recompute on steps 1, 2 and 4
    (--exact-check-every 2; step 3 takes old_logp = mu and counts on its first mini-batch): mu and old_logp agree bit
    for bit every step (mismatch/unequal_tokens 0 over a nonzero number of tokens), so every weight is 1 and nothing
    is rejected. A 4-layer model of the 1.5B layer shape (head_dim 128, FA3) with the character vocabulary (42 tokens,
    which vLLM's head pads to 64 rows), so that rewards are computed on real text."""
    from conftest import make_char_tokenizer
    family, _, dims = SHAPES["1.5b"]
    assert len(make_char_tokenizer()) <= 64
    model = build_model(str(tmp_path / "m"), family, 64, **{**dims, "num_hidden_layers": 4})
    data = tmp_path / "add.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{a}+{a * 7 % 90}=", "answer": str(a + a * 7 % 90)}) + "\n"
                            for a in range(10, 74)))
    # a reward that varies within a group of a random model's responses (their length's parity), so that the weights
    # move and steps 2-4 sample from synced weights
    (tmp_path / "parity_reward.py").write_text("def reward(response, answer):\n    return float(len(response) % 2)\n")
    run_dir = str(tmp_path / "run")
    cmd = [sys.executable, "grpo.py", "--exact", "--sampler", "vllm", "--model", model, "--dataset", str(data),
           "--prompt-template", "{problem}", "--reward", "parity_reward:reward", "--precision", precision,
           "--num-steps", "4",
           "--num-prompts", "16", "--group-size", "8", "--max-response-len", "256", "--max-prompt-len", "32",
           "--lr", "1e-4", "--save-every", "0", "--eval-every", "0", "--is-correction", "token-tis",
           "--is-reject", "token-mis", "--exact-check-every", "2", "--run-dir", run_dir]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    steps = [json.loads(ln) for ln in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [s for s in steps if "mismatch/kl_k3" in s]
    assert len(steps) == 4
    for s in steps:
        tokens = s["mismatch/unequal_tokens"] / s["mismatch/unequal_frac"] if s["mismatch/unequal_frac"] else None
        SUMMARY.append(f"{'grpo --exact ' + precision:<24} {'step ' + str(s['step']):<14} unequal tokens "
                       f"{s['mismatch/unequal_tokens']:.0f} (frac {s['mismatch/unequal_frac']}), kl_k3 "
                       f"{s['mismatch/kl_k3']}, is/weight_mean {s['is/weight_mean']}, time/recompute "
                       f"{s['time/recompute']:.2f} s")
        print(f"\n[exact gpu] grpo {precision} step {s['step']}: unequal_tokens {s['mismatch/unequal_tokens']}, "
              f"unequal_frac {s['mismatch/unequal_frac']} ({tokens} tokens), logp_abs_diff_max "
              f"{s['mismatch/logp_abs_diff_max']}, kl_k3 {s['mismatch/kl_k3']}, is/weight_mean {s['is/weight_mean']}, "
              f"is/reject_token_frac {s['is/reject_token_frac']}, time/step {s['time/step']:.2f} s (sample "
              f"{s['time/sample']:.2f}, recompute {s['time/recompute']:.2f}, train {s['time/train']:.2f})")
    assert "[exact]" in p.stdout and "differ from the sampler's" not in p.stdout
    for s in steps:
        # a count over tokens that exist: unequal_frac is 0/n with n > 0 (NaN over no tokens)
        assert s["mismatch/unequal_tokens"] == 0 and s["mismatch/unequal_frac"] == 0.0
        assert s["mismatch/logp_abs_diff_max"] == 0.0 and s["train/response_len_mean"] > 0
        assert s["is/weight_mean"] == 1.0 and s["is/weight_max"] == 1.0
        assert s["is/weight_clip_token_frac"] == 0.0 and s["is/reject_token_frac"] == 0.0
        assert math.isfinite(s["train/loss"])
    assert any(s["optim/grad_norm"] > 0 for s in steps)
