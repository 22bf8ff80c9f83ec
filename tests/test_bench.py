"""bench/benchmark.py end to end on a CPU with the tiny shape (about 45 s in all): every section writes its rows to
the JSON and the Markdown table, the trainer runs under torchrun with 2 processes, grpo.py runs for the rl_step
section, and results of several runs render into one table. The GPU-only figures (memory, vLLM) are skipped with a
note."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "benchmark.py")


def run(args, tmp_path, launcher=None):
    os.makedirs(tmp_path / "tmp", exist_ok=True)  # (its own temporary directory: the runs' folders are looked for)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "TMPDIR": str(tmp_path / "tmp")}
    cmd = (launcher or [sys.executable]) + [BENCH, "--shape", "tiny", "--out-dir", str(tmp_path / "out"),
                                            "--model-dir", str(tmp_path / "model"), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def load(tmp_path, name):
    with open(tmp_path / "out" / f"{name}.json") as f:
        data = json.load(f)
    with open(tmp_path / "out" / f"{name}.md") as f:
        return data, f.read()


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    """One fp32 run of every section (fp32: CPU 16-bit kernels are slow), grpo.py with the fallback sampler."""
    tmp_path = tmp_path_factory.mktemp("bench")
    run(["--only", "matmul,trainer,logprob_memory,sampler,sync,rl_step", "--precisions", "fp32",
         "--sampler-precision", "fp32", "--sampler-variants", "hf,hf_generate",
         "--rl-sampler", "hf", "--rl-runs", "base:--num-minibatches 2",
         "other:--num-minibatches 2 --lr 1e-5", "--rl-nproc", "1", "2"], tmp_path)  # (4 prompts: 2 a rank)
    return tmp_path


def test_every_section_writes_rows_and_a_table(bench_dir):
    data, md = load(bench_dir, "tiny")
    assert data["meta"]["shape"] == "tiny" and data["meta"]["params"] > 0 and data["meta"]["torch"]
    assert {r["dtype"] for r in data["matmul"]} == {"fp16", "bf16"} and all(r["tflops"] > 0 for r in data["matmul"])
    tr = data["trainer"]
    assert [(r["precision"], r["response"]) for r in tr] == [("fp32", 32), ("fp32", 64)]
    for r in tr:
        assert r["train_tok_s"] > 0 and r["recompute_tok_s"] > 0 and r["tokens"] == 4 * (16 + r["response"])
    assert tr[1]["micro_batches"] == 2  # 4 rows of 80 tokens in a budget of 256: 3 + 1
    lp = data["logprob_memory"]
    assert {(r["method"], r["mode"]) for r in lp} == {(m, mode) for m in ("chunked", "full logits")
                                                      for mode in ("forward+backward", "no-grad forward with entropy")}
    samplers = {(r["sampler"], r["batch"]): r for r in data["sampler"]}
    assert set(samplers) == {(s, b) for s in ("HFSampler", "transformers generate") for b in (4, 8)}
    assert all(r["tokens"] > 0 and r["tok_s"] > 0 and r["vs_hf_generate"] > 0 for r in data["sampler"])
    assert samplers[("HFSampler", 4)]["path"] == "DynamicCache"
    assert data["sync"][0]["sampler"] == "HFSampler" and data["sync"][0]["s"] > 0
    checks = data["sync_check"]
    assert len(checks) == 2 and all(r["kl_k3"] < 1e-6 for r in checks)  # fp32: the sync moved the new weights in
    runs = data["rl_step"]["runs"]  # each run on 1 process, then 2 (torchrun): the same global batch
    assert [(r["label"], r["nproc"]) for r in runs] == [("base x1", 1), ("base x2", 2), ("other x1", 1),
                                                        ("other x2", 2)]
    assert runs[2]["command"].endswith("--lr 1e-5") and "--nproc_per_node=2" in runs[3]["command"]
    for r in runs:
        steps = r["steps"]
        assert [s["step"] for s in steps] == [1, 2] and r["recompiles"] == []  # (no torch.compile on a CPU)
        assert all(s["time/sample"] > 0 and s["time/train"] > 0 and s["time/sync"] > 0 for s in steps)
        stem = bench_dir / "out" / ("tiny_rl_" + r["label"].replace(" ", "_"))  # its whole output and metrics
        with open(f"{stem}_metrics.jsonl") as f:
            assert [json.loads(line)["step"] for line in f if "time/step" in line] == [1, 2]
        with open(f"{stem}.log") as f:
            assert any(line.startswith("step 2 |") for line in f)
    # each run was stopped once its last step was logged (its final checkpoint is no part of a step), which is no
    # failure; its folder (checkpoints) is gone, its metrics and log are kept (above)
    assert all(r["stopped"].startswith("after step 2:") for r in runs)
    assert not any("exited" in n for n in data["notes"])
    assert not [d for d in os.listdir(bench_dir / "tmp") if d.startswith("rl-bench-step-")]
    assert any("no CUDA" in n for n in data["notes"])
    for header in ("## Matmul peak", "## Trainer (per GPU)", "MFU train (6N)", "## Log-prob head memory",
                   "## Samplers", "## Weight sync", "## A whole RL step", "| 16 + 64 |", "time/sample",
                   "### other x2", "| speed-up over base x1 |", "| GPUs |",
                   "stopped after step 2: its final checkpoint was not written)"):
        assert header in md, header


def test_rl_final_save_lets_the_run_end(tmp_path, bench_dir):
    """With --rl-final-save the run is not stopped after its last step: it writes its final checkpoint and ends. On
    --rl-model alone (every section asked for runs on it) no random model is built, and the page is titled by it."""
    run(["--only", "rl_step", "--precisions", "fp32", "--rl-sampler", "hf", "--rl-final-save", "--name", "save",
         "--rl-model", str(bench_dir / "model")], tmp_path)
    data, md = load(tmp_path, "save")
    assert not (tmp_path / "model").exists() and data["meta"]["shape"] is None
    assert md.startswith("# Benchmark: model (") and "random weights" not in md
    (r,) = data["rl_step"]["runs"]
    assert [s["step"] for s in r["steps"]] == [1, 2] and "stopped" not in r
    assert not any("exited" in n for n in data["notes"])
    with open(tmp_path / "out" / "save_rl_grpo.log") as f:
        assert any(line.startswith("[checkpoint] ") for line in f)
    assert "with start-up and the final checkpoint" in md


def test_trainer_fp16_and_bf16_and_their_ratio(tmp_path):
    run(["--only", "trainer", "--precisions", "fp16,bf16", "--response-lens", "8", "--num-seqs", "2", "--iters", "1",
         "--name", "prec", "--profile"], tmp_path)
    data, md = load(tmp_path, "prec")
    for precision in ("fp16", "bf16"):  # --profile: one more step under torch.profiler, its operator tables
        with open(tmp_path / "out" / f"prec_profile_trainer_{precision}_8.txt") as f:
            table = f.read()
        assert table.startswith(f"trainer step {precision}") and "aten::mm" in table
    assert [r["precision"] for r in data["trainer"]] == ["fp16", "bf16"]
    assert data["trainer"][0]["loss_scale"] == 2.0**16 and data["trainer"][1]["loss_scale"] == 1.0
    assert all(r["mfu_train"] > 0 for r in data["trainer"])  # the matmul peaks were measured for the MFU
    assert data["trainer_ratio"][0]["response"] == 8 and data["trainer_ratio"][0]["fp16_over_bf16"] > 0
    assert "fp16 / bf16" in md


def test_trainer_under_torchrun_and_render(tmp_path, bench_dir):
    run(["--only", "trainer", "--precisions", "fp32", "--response-lens", "16", "--num-seqs", "2", "--iters", "1"],
        tmp_path, launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])
    data, _ = load(tmp_path, "tiny_2gpu")
    assert data["meta"]["ranks"] == 2 and [r["ranks"] for r in data["trainer"]] == [2]
    # one table from the single-process run and the two-rank run
    p = subprocess.run([sys.executable, BENCH, "--render", str(bench_dir / "out" / "tiny.json"),
                        str(tmp_path / "out" / "tiny_2gpu.json"), "--name", "both", "--out-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    md = (tmp_path / "both.md").read_text()
    assert md.count("| fp32 | 16 + ") == 3 and "## Samplers" in md  # 2 one-rank rows and 1 two-rank row


def test_trainer_step_runs_grpos_own_loss(tmp_path, process_group, monkeypatch):
    """The trainer section times the scripts' own code: grpo.py's step 3 (recompute_logprobs, the function grpo.py
    calls), policy_loss once per micro-batch and drgrpo_advantages (a change of either is benchmarked as it runs)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import benchmark
    import grpo

    from common.fsdp import load_policy
    _, _, device = process_group
    calls = {"loss": 0, "adv": 0, "recompute": 0}

    def counting(fn, key):
        def wrapped(*a, **kw):
            calls[key] += 1
            return fn(*a, **kw)
        return wrapped
    monkeypatch.setattr(grpo, "policy_loss", counting(grpo.policy_loss, "loss"))
    monkeypatch.setattr(grpo, "drgrpo_advantages", counting(grpo.drgrpo_advantages, "adv"))
    assert benchmark.recompute_logprobs is grpo.logprobs.recompute_logprobs
    monkeypatch.setattr(benchmark, "recompute_logprobs", counting(grpo.logprobs.recompute_logprobs, "recompute"))
    model_dir = benchmark.build_model_dir("tiny", str(tmp_path / "model"), 0)
    args = benchmark.parse_args(["--shape", "tiny", "--num-minibatches", "2"])
    model = load_policy(model_dir, torch.float32, device, gradient_checkpointing=False)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    prompts, responses = benchmark.random_prompts(4, 16, 1000, 0), benchmark.random_prompts(4, 8, 1000, 1)
    t_rec, t_train, _, _ = benchmark.trainer_step(model, params, optimizer, benchmark.LossScaler(enabled=False),
                                                  prompts, responses, args, 999, device, 1)
    assert t_rec > 0 and t_train > 0
    assert calls == {"loss": 2, "adv": 1, "recompute": 1}  # 2 mini-batches of 2 rows x 24 tokens, each one
    # micro-batch (budget 256)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_generate_on_grpo_batches(tmp_path):
    """The standalone engine on grpo.py's first batches: one row per batch, both timings, the right sequence count;
    the sampler section's VLLMSampler (another subprocess): tokens/s per batch size and the weight sync; and with
    --profile, batch 1 once more under torch.profiler, its figures in the results and its operator tables in a file
    (no GPU here: no busy time)."""
    run(["--only", "sampler,vllm_generate", "--sampler-variants", "vllm", "--sampler-precision", "fp32",
         "--precisions", "fp32", "--rl-steps", "2", "--rl-max-response-len", "8", "--name", "gen", "--profile"],
        tmp_path)
    data, md = load(tmp_path, "gen")
    assert [(r["sampler"], r["batch"]) for r in data["sampler"]] == [("VLLMSampler", 4), ("VLLMSampler", 8)]
    assert all(r["tok_s"] > 0 for r in data["sampler"]) and data["sync"][0]["sampler"] == "VLLMSampler"
    rows = data["vllm_generate"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["sequences"] == 4 * 2 for r in rows)
    assert all(r["llm_generate_tokens"] > 0 and r["sampler_generate_tok_s"] > 0 for r in rows)
    assert "## The same vLLM engine standalone" in md
    prof = data["vllm_generate_profile"]
    assert prof["sequences"] == 8 and prof["tokens"] > 0 and 1 <= prof["decode_steps"] <= 8
    assert prof["profiled_s"] > 0 and prof["gpu_busy_s"] is None
    with open(tmp_path / "out" / "gen_profile_vllm_generate.txt") as f:
        table = f.read()
    assert "By self CPU time:" in table and "Self CPU" in table
    assert "under torch.profiler" in md


def test_union_length():
    """The GPU's busy time: overlapping kernels (two streams) count once, gaps not at all."""
    from bench.benchmark import union_length
    assert union_length([]) == 0.0
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0
    assert union_length([(5, 6), (0, 10)]) == 10.0


def test_forced_length_runs_a_script_with_every_response_to_its_limit(monkeypatch):
    """bench/forced_length.py (the step's worst case for --rl-force-len): the vLLM sampler asks the engine to ignore
    EOS, the fallback sampler is refused before training, and the script runs as __main__ with its own arguments."""
    import common.sampler
    from bench import forced_length
    from common.vllm_sampler import VLLMSampler
    monkeypatch.setattr(VLLMSampler, "ignore_eos", False)
    monkeypatch.setattr(common.sampler, "make_sampler", lambda *a, **k: object())
    assert VLLMSampler.sampling_params(2, 5, 1.0).ignore_eos is False  # the default: stop at EOS
    forced_length.force_full_length()
    assert VLLMSampler.ignore_eos is True
    seen = []

    class Engine:
        def generate(self, prompts, params, use_tqdm):
            seen.append(params)
            raise StopIteration
    sampler = object.__new__(VLLMSampler)
    sampler.tp_group, sampler.llm = None, Engine()
    with pytest.raises(StopIteration):
        sampler.generate([[3, 4]], 2, 7, 1.0)
    assert seen[0].ignore_eos and seen[0].max_tokens == 7
    with pytest.raises(SystemExit, match="vLLM sampler only"):
        common.sampler.make_sampler()  # the fallback (here: anything but a VLLMSampler)

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "bench/forced_length.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 1 and "usage" in p.stderr
    p = subprocess.run([sys.executable, "bench/forced_length.py", "grpo.py", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "--max-response-len" in p.stdout, p.stderr[-2000:]


def test_recompilations_are_read_from_the_log_with_their_guards():
    """rl_step reads torch.compile's recompilations (TORCH_LOGS=recompiles) from grpo.py's output: the step, the
    line, and the guard failures indented under it, and nothing of the lines after them."""
    from bench.benchmark import recompile
    log = ["[step 1] ...", "V1127 torch/_dynamo/guards.py] [0/1] [__recompiles] Recompiling function forward in "
           "modeling_qwen2.py:250", "    triggered by the following guard failure(s):",
           "    - 0/0: tensor 'hidden_states' size mismatch at index 1. expected 380, actual 412",
           "[step 2] ...", "  not a guard: the recompilation's lines ended"]
    found, following = [], False
    for i, line in enumerate(log):
        following = recompile(found, line, 2 if i else 1, following)
    assert len(found) == 1 and found[0]["step"] == 2 and len(found[0]["lines"]) == 3
    assert found[0]["lines"][2].endswith("expected 380, actual 412")
    prefix = "[rank0]:V1128 07:03:14.819000 7479 torch/_dynamo/guards.py:4760] [1/5] [__recompiles]"  # (a process group)
    found, following = [], False
    for line in [f"{prefix} Recompiling function forward in modeling_qwen2.py:269",
                 f"{prefix}     triggered by the following guard failure(s):",
                 f"{prefix}     - 1/4: expected type of 'attention_mask' to be a tensor type, ' but found NoneType",
                 "[rank0]:[W1128 07:03:15] not a recompilation's line"]:
        following = recompile(found, line, 3, following)
    assert found == [{"step": 3, "lines": ["Recompiling function forward in modeling_qwen2.py:269",
                                           "triggered by the following guard failure(s):",
                                           "- 1/4: expected type of 'attention_mask' to be a tensor type, ' but found "
                                           "NoneType"]}]


def test_vllm_kv_cache_facts_are_read_from_the_log():
    """The KV cache's size and the concurrency vLLM logs at start (the first engine's), shown with the run."""
    from bench.benchmark import render_markdown, vllm_facts
    entry = {"label": "default", "steps": []}
    for line in ["INFO 11-27 17:30:03 [kv_cache_utils.py:2146] GPU KV cache size: 896,112 tokens",
                 "INFO 11-27 17:30:03 [kv_cache_utils.py:2147] Maximum concurrency for 4,096 tokens per request: "
                 "218.78x", "(another rank) GPU KV cache size: 5 tokens", "[step 1/3] ..."]:
        vllm_facts(entry, line)
    assert entry["kv_cache_tokens"] == 896112 and entry["max_concurrency"] == {"tokens": 4096, "x": 218.78}
    md = render_markdown({"rl_step": {"runs": [entry]}})
    assert "vLLM's KV cache: 896,112 tokens, 218.78 requests of 4,096 tokens at once" in md


def test_header_names_the_rl_step_runs_ranks():
    """The page's ranks are the benchmark's own; rl_step runs launched on other rank counts are named beside them."""
    from bench.benchmark import render_markdown
    runs = [{"label": "scale", "nproc": n, "steps": []} for n in (4, 1, 2)]
    md = render_markdown({"meta": {"ranks": 1}, "rl_step": {"runs": runs}})
    assert "| ranks: 1 (rl_step runs: 1, 2, 4) |" in md
    md = render_markdown({"meta": {"ranks": 1}, "rl_step": {"runs": runs[1:2]}})
    assert "| ranks: 1 |" in md


def test_force_len_needs_vllm(tmp_path):
    p = subprocess.run([sys.executable, BENCH, "--shape", "tiny", "--only", "rl_step", "--rl-sampler", "hf",
                        "--rl-force-len", "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "--rl-force-len" in p.stderr and "--rl-sampler vllm" in p.stderr
