"""sanity/mismatch_anatomy.py: its statistics and report on synthetic data, and the whole tool on a CPU against vLLM's
CPU build (skipped where vLLM is not installed): every op group of every layer found on both sides, rows aligned (the
embedding gather bitwise equal), the chain's links adding up to the total exactly."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from sanity.mismatch_anatomy import (HEAD_OPS, LAYER_OPS, OpStats, anatomy_markdown, bitwise_equal, decompose,
                                     first_divergence, op_order, spread)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_op_order_is_execution_order():
    keys = op_order(2)
    assert keys[0] == ("embedding", -1) and keys[-3:] == [(op, -1) for op in HEAD_OPS]
    assert ("residual", 0) not in keys and keys.index(("residual", 1)) > keys.index(("mlp_out", 0))
    assert keys[-4] == ("residual", 2)
    assert len(keys) == 1 + 2 * len(LAYER_OPS) - 1 + 1 + len(HEAD_OPS)


def test_bitwise_equal_compares_bits():
    a = torch.tensor([0.0, 1.5, float("nan")], dtype=torch.float16)
    b = torch.tensor([-0.0, 1.5, float("nan")], dtype=torch.float16)
    assert bitwise_equal(a, b).tolist() == [False, True, True]
    assert bitwise_equal(torch.tensor([1.0]), torch.tensor([1.0 + 2 ** -23])).tolist() == [False]


def test_op_stats_and_the_first_divergence():
    ref = {("embedding", -1): torch.ones(3, 4), ("input_norm", 0): torch.ones(3, 4), ("qkv", 0): torch.ones(3, 8),
           ("logits", -1): torch.ones(3, 5)}
    got = {k: v.clone() for k, v in ref.items()}
    got[("qkv", 0)][1, 2] += 0.5
    got[("logits", -1)] = got[("logits", -1)][:2]  # the head's rows: one fewer on the trainer's side
    stats = OpStats()
    stats.add("trainer", "accumulated", ref, got, 1)
    rows = {(r["op"], r["layer"]): r for r in stats.table()}
    assert rows[("embedding", -1)]["frac_equal"] == 1.0 and rows[("logits", -1)]["elements"] == 10
    q = rows[("qkv", 0)]
    assert q["frac_equal"] == 23 / 24 and q["max_abs_diff"] == 0.5 and q["mean_abs_diff"] == 0.5 / 24
    assert first_divergence(stats.table(), "trainer", 1)["op"] == "qkv"
    with pytest.raises(ValueError, match="vLLM"):
        stats.add("trainer", "accumulated", ref, {("qkv", 0): torch.ones(3, 7)}, 1)


def test_the_chain_decomposition_adds_up():
    """Links of a chain: their d add up to the total's exactly; mean d^2 splits into the links' shares and the cross
    terms: here two links that cancel exactly (total 0, shares nan) and two independent ones."""
    a = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    b = [torch.tensor([-1.0, -2.5]), torch.tensor([-0.25])]
    c = [torch.tensor([-1.5, -2.5]), torch.tensor([-0.25])]
    dec = decompose([("mu", a), ("vllm_batch", b), ("hf_batch", c)])
    (l1, l2), t = dec["links"], dec["total"]
    assert dec["links_sum_residual"] == 0.0 and t["tokens"] == 3
    assert l1["mean_sq_diff"] == (0.25 + 0.0625) / 3 and l2["mean_sq_diff"] == 0.25 / 3
    assert t["mean_sq_diff"] == (0.25 + 0.25 + 0.0625) / 3
    # d_total^2 = d1^2 + d2^2 + 2 d1 d2 per token: d1 = (0, -0.5, 0.25), d2 = (-0.5, 0, 0), so no cross term here
    assert dec["cross_share"] == pytest.approx(0.0, abs=1e-12)
    assert abs(l1["share_of_mean_sq"] + l2["share_of_mean_sq"] + dec["cross_share"] - 1) < 1e-12
    assert t["kl_k3"] == pytest.approx(sum(math.expm1(d) - d for d in (-0.5, -0.5, 0.25)) / 3)
    assert l1["frac_equal"] == pytest.approx(1 / 3) and t["frac_equal"] == 0.0
    zero = decompose([("mu", a), ("vllm_batch", b), ("hf_batch", a)])
    assert zero["total"]["kl_k3"] == 0.0 and zero["total"]["frac_equal"] == 1.0


def test_spread_picks_short_to_long():
    lengths = [5, 50, 7, 100, 1, 30]
    assert spread(lengths, 3) == [2, 3, 4]  # the shortest (4), one from the middle (2), the longest (3)
    assert spread(lengths, 10) == sorted(range(6), key=lambda i: lengths[i])


def test_report_has_every_part():
    ops = [{"path": "trainer", "kind": k, "op": op, "layer": layer, "elements": 4, "frac_equal": 0.5,
            "mean_abs_diff": 1e-3, "max_abs_diff": 2e-3, "mean_abs_ref": 1.0}
           for k in ("accumulated", "isolated") for op, layer in op_order(1)]
    link = {"from": "mu", "to": "hf_batch", "tokens": 3, "frac_equal": 0.0, "max_abs_diff": 0.1, "mean_diff": 0.0,
            "mean_sq_diff": 0.01, "kl_k3": 0.005, "share_of_mean_sq": 1.0}
    res = {"config": {"n_seqs": 2, "n_prompts": 1, "samples": 2, "max_response_len": 8, "model": "m", "exact": False,
                      "vllm_eager": True},
           "precisions": {"bf16": {"n_layers": 1, "paths": ["trainer"], "ops": ops, "op_sequences": 1,
                                   "op_tokens": 4, "first_divergence": {"trainer": ops[0]},
                                   "chains": {"trainer": {"links": [link], "total": link, "cross_share": 0.0}}}}}
    md = anatomy_markdown(res)
    for part in ("## bf16", "(i) Op by op", "first op not bitwise equal: **embedding**", "Growth through the layers",
                 "(ii)-(iv)", "mu (vLLM decode) -> trainer, batch", "cross terms"):
        assert part in md, part


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_anatomy_on_cpu_with_vllm(tmp_path):
    """The built-in model in fp32 on a CPU, vLLM's CPU build against the trainer: every op group of every layer is
    recorded on both sides; the embedding (a gather of the same weights) is bitwise equal, which it is only if the
    rows line up; the log-probs agree to fp32 rounding (as tests/test_vllm.py measures: about 1e-5); the chain adds
    up exactly."""
    out = tmp_path / "anat"
    p = subprocess.run([sys.executable, "sanity/mismatch_anatomy.py", "--num-prompts", "3", "--samples", "2",
                        "--op-sequences", "2", "--out-dir", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (out / "anatomy.md").is_file() and (out / "growth.png").is_file()
    res = json.loads((out / "anatomy.json").read_text())
    r = res["precisions"]["fp32"]
    rows = {(x["op"], x["layer"]): x for x in r["ops"] if x["path"] == "trainer" and x["kind"] == "accumulated"}
    assert set(rows) == set(op_order(r["n_layers"]))
    assert rows[("embedding", -1)]["frac_equal"] == 1.0
    assert rows[("logprob", -1)]["max_abs_diff"] < 1e-4
    iso = {(x["op"], x["layer"]) for x in r["ops"] if x["path"] == "trainer" and x["kind"] == "isolated"}
    assert iso == set(op_order(r["n_layers"])) - {("embedding", -1)}
    dec = r["chains"]["trainer"]
    assert dec["links_sum_residual"] == 0.0 and dec["total"]["tokens"] > 0
    assert 0.0 <= dec["total"]["kl_k3"] < 1e-8
    assert [(x["from"], x["to"]) for x in dec["links"]] == [("mu", "vllm_batch"), ("vllm_batch", "vllm_alone"),
                                                            ("vllm_alone", "hf_alone"), ("hf_alone", "hf_batch")]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_probe_and_exact_capture_run_on_cpu_with_vllm(tmp_path, process_group, monkeypatch):
    """The GPU probe's engine checks (sanity/exact_probe.py: hooks on a prefill and a decode step, end to end) and the
    anatomy's exact-path pieces, run on a CPU: vLLM's CPU build, fp32, the torch reference kernels standing in for
    vLLM's CUDA ones. Not bitwise (other kernels), but every row lines up: each op agrees to fp32 rounding, which a
    wrong row, position or sequence mapping would not (their values differ by O(1))."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
    import exact as E
    import sanity.exact_probe as P
    from common.logprobs import PolicyModel, collate
    from common.vllm_sampler import VLLMSampler, _model_runner
    from conftest import make_char_tokenizer
    from sanity.mismatch_anatomy import ExactOps, VllmCapture, exact_capture, isolated, prefill_logprobs
    tok = make_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in lm.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    path = str(tmp_path / "m")
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    sampler = VLLMSampler(path, torch.float32, seed=0, max_model_len=512, gpu_memory_utilization=0.2, sleep_level=0)
    try:
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        model = PolicyModel(lm).eval()
        ex = E.ExactForward(E.TorchKernels(), E.rope_cache(64, 512, cfg.rope_parameters["rope_theta"], torch.float32))
        ex.install(lm)
        model.exact = ex
        monkeypatch.setattr(E, "VllmKernels", lambda plan: E.TorchKernels())
        monkeypatch.setattr(P, "PREFILL_LENS", [40, 12, 5, 7, 23, 8])
        monkeypatch.setattr(P, "E2E_PROMPT_LENS", [3, 17, 40])
        monkeypatch.setattr(P, "E2E_LIMITS", [20, 1, 9])
        rows = P.Rows(str(tmp_path / "rows.jsonl"), variant="cpu", model="tiny", precision="fp32")
        P.hook_probes(rows, sampler, model, ex, cfg.vocab_size)
        P.end_to_end(rows, sampler, model, ex, E.ExactPlan(head_dim=64, attention="TRITON_ATTN"), cfg.vocab_size)
        got = [json.loads(line) for line in open(tmp_path / "rows.jsonl")]
        probes = [r["probe"] for r in got]
        assert probes[0] == "steps recorded" and got[0]["equal"] is True
        for part in ("prefill attention", "decode attention", "decode log-prob", "end to end T=0.7"):
            assert any(p.startswith(part) for p in probes), part
        for r in got[1:]:
            assert not r["note"].startswith("error"), r
            assert r["max_abs_diff"] is not None and r["max_abs_diff"] < 1e-4, r  # fp32 rounding, not a wrong row
        # the anatomy's exact path: taps and the isolated ops line up with vLLM's hooked rows
        seq = torch.randint(2, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
        capture = VllmCapture(_model_runner(sampler.llm).model)
        capture.active = True
        prefill_logprobs(sampler.llm, [seq])
        capture.active = False
        capture.remove()
        v = capture.sequence(seq)
        pack = E.Pack(*collate([seq[:1]], [seq[1:]], 0, "cpu"))
        for got_ops in (exact_capture(model, ex, seq, 16),
                        isolated(ExactOps(ex, model), model, v, torch.arange(len(seq)), pack,
                                 torch.tensor(seq[1:]), 16)):
            for key, t in got_ops.items():
                if key in v and key != ("logprob", -1):
                    n = min(len(t), len(v[key]))
                    assert (t[:n] - v[key][:n]).abs().max() < 1e-4, key
    finally:
        sampler.shutdown()  # (it takes the process group down: conftest brings it back for the tests after this one)
