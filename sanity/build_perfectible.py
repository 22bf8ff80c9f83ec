"""Build a perfectible dataset: the problems the initial model solves sometimes, but not always.

The sanity test of the FP16 study ("Defeating the Training-Inference Mismatch via FP16", arXiv 2510.26788;
docs/algorithms.md): sample k responses per problem with the initial model (the study: 40 per MATH problem), keep the
problems whose success rate lies in [0.2, 0.8]. Each kept problem is solvable and not trivial, so a sound RL algorithm
drives training accuracy on them to >= 95%; sanity/run_sanity.py checks that.

    python sanity/build_perfectible.py                    # the built-in task: k = 40 on its 2,000 training problems
    python sanity/build_perfectible.py --model /path/to/DeepSeek-R1-Distill-Qwen-1.5B --dataset math_train.parquet \\
        --out-dir runs/perfectible_math --sampler vllm --precision bf16

Writes into --out-dir:
    results.jsonl      every problem measured: {index, problem, answer, success_rate, n_correct, k}, appended a chunk
                       of problems at a time (index: the row in --dataset)
    perfectible.jsonl  the kept problems {problem, answer, success_rate}, in dataset order (a --dataset for the
                       algorithm scripts)
    histogram.json     counts of success rates per bin, the problems at exactly 0 and 1, kept / total
    histogram.png      the same as a figure
    config.json        the settings that determine the measurement (checked on resume)
Resume: rerun the same command. Problems already in results.jsonl are skipped; band, bins and --max-problems may
change between runs (the selection is recomputed from results.jsonl), the measurement settings may not. With the
fallback sampler each chunk has its own random stream (seed, chunk), so an interrupted and resumed build gives the
same results as an uninterrupted one.
"""
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: threads that spin while waiting made
# CPU runs on 2 shared cores 3x slower (docs/results.md, "On a CPU")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python sanity/build_perfectible.py` from anywhere
    sys.path.insert(0, ROOT)

import numpy as np

from common import exits
from common.cli import config_changes, parse
from common.dist import print0


@dataclass
class Args:
    """Defaults are for a real model (--model); without --model the built-in task's preset BUILTIN (below) replaces
    some of them, under the command line; the run prints at start every value that differs from these."""
    out_dir: str = "runs/perfectible"
    """where results.jsonl, perfectible.jsonl, histogram.json/.png and config.json go"""
    model: str | None = None
    """local Hugging Face model directory (default: the built-in task's warm-started model)"""
    dataset: str | None = None
    """the problem pool: .jsonl/.json/.parquet with problem and answer fields (default: the built-in training set)"""
    k: int = 40
    """responses sampled per problem (the study: 40)"""
    band_low: float = 0.2
    """keep problems whose success rate is >= this"""
    band_high: float = 0.8
    """... and <= this"""
    num_bins: int = 10
    """bins of the success-rate histogram over [0, 1]"""
    max_problems: int = 0
    """measure at most this many problems, a random subset of the pool fixed by --seed (0: all)"""
    chunk_size: int = 64
    """problems per chunk: a chunk's k responses per problem are sampled together, then its results are appended"""
    seed: int = 1
    """seed of the subset order and of the sampling streams"""
    # --- as in the algorithm scripts (same names, same meaning; keep them equal to the training run's)
    prompt_template: str = "chat"
    """'chat' (the tokenizer's chat template with the R1-distill instruction), 'chat:<format>' (the chat template
    with <format> as the user turn) or a raw format string with {problem}"""
    reward: str = "math"
    """'math' (math-verify on the last \\boxed{}), 'exact' (the stripped response equals the answer), 'number' (its
    final number equals the answer's) or 'module:function' (a plug-in: fn(response, answer) -> float)"""
    max_prompt_len: int = 1024
    """prompts longer than this (tokens) are reported and skipped"""
    max_response_len: int = 8192
    """response length limit in tokens"""
    truncated_reward: float = 0.0
    """reward of a response cut at the length limit"""
    temperature: float = 1.0
    """sampling temperature (the training rollouts')"""
    top_p: float = 1.0
    """sampling top-p (the training rollouts': 1.0)"""
    precision: Literal["fp16", "bf16", "fp32"] = "fp16"
    """the sampler's weight precision"""
    sampler: Literal["auto", "vllm", "hf"] = "auto"
    """'vllm', 'hf' (the fallback sampler) or 'auto' (vllm when installed and a GPU is present)"""
    sampler_batch_size: int = 256
    """sequences decoded at once by the fallback sampler"""
    vllm_gpu_memory_utilization: float = 0.8
    """fraction of GPU memory vLLM may take (nothing else runs beside it here)"""
    vllm_kv_cache_gib: float = 0.0
    """GiB of KV cache per vLLM engine, fixed instead of sized by measuring free memory while the engine starts (0:
    measure), as in the algorithm scripts"""


# The built-in task's defaults, as in the algorithm scripts' BUILTIN.
BUILTIN = dict(prompt_template="{problem}", reward="exact", max_prompt_len=16, max_response_len=8, precision="fp32",
               sampler_batch_size=1024, chunk_size=256)
# The settings that determine what results.jsonl holds; a resume must not change them.
MEASUREMENT = ("model", "dataset", "k", "seed", "chunk_size", "prompt_template", "reward", "max_prompt_len",
               "max_response_len", "truncated_reward", "temperature", "top_p", "precision")


# ----------------------------------------------------------------------------------------------------------------
# Pure functions: the band, the histogram, the results file.

def in_band(n_correct: int, k: int, low: float, high: float) -> bool:
    """low <= n_correct / k <= high, with the bounds themselves included despite float rounding (8/40 is 0.2)."""
    return low * k - 1e-9 <= n_correct <= high * k + 1e-9


def rate_histogram(rates: list[float], num_bins: int) -> dict:
    """Counts of success rates in num_bins equal bins over [0, 1] (the last bin includes 1), and the problems at
    exactly 0 (never solved) and exactly 1 (always solved)."""
    counts, edges = np.histogram(np.asarray(rates, dtype=float), bins=num_bins, range=(0.0, 1.0))
    return {"edges": [round(float(e), 6) for e in edges], "counts": [int(c) for c in counts],
            "at_0": int(sum(r == 0 for r in rates)), "at_1": int(sum(r == 1 for r in rates))}


def read_results(path: str) -> dict[int, dict]:
    """index -> result, from results.jsonl. A last line cut by an interruption (no newline) is dropped from the
    file, so that appending continues on a clean line."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    done = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}: line {lineno}: invalid JSON; delete the file to start over") from None
            done.setdefault(row["index"], row)
    return done


def check_config(out_dir: str, config: dict) -> None:
    """Write config.json, or check that the one there describes the same measurement."""
    path = os.path.join(out_dir, "config.json")
    if os.path.exists(os.path.join(out_dir, "results.jsonl")) and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        changed = [f"{key}: {old.get(key)!r} -> {config[key]!r}" for key in MEASUREMENT if old.get(key) != config[key]]
        if changed:
            raise ValueError(f"{out_dir} holds results measured with other settings ({'; '.join(changed)}): "
                             "use another --out-dir, or delete results.jsonl to start over")
    with open(path, "w") as f:
        json.dump(config, f, indent=1)


def write_outputs(out_dir: str, results: list[dict], args: Args) -> dict:
    """perfectible.jsonl, histogram.json and histogram.png from the results; returns the histogram dict."""
    from sanity.report import plot_histogram
    results = sorted(results, key=lambda r: r["index"])
    kept = [r for r in results if in_band(r["n_correct"], r["k"], args.band_low, args.band_high)]
    tmp = os.path.join(out_dir, "perfectible.jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in kept:
            row = {"problem": r["problem"], "answer": r["answer"], "success_rate": r["success_rate"]}
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, os.path.join(out_dir, "perfectible.jsonl"))
    rates = [r["success_rate"] for r in results]
    hist = {**rate_histogram(rates, args.num_bins), "k": args.k, "band": [args.band_low, args.band_high],
            "total": len(results), "kept": len(kept), "mean_rate": float(np.mean(rates)) if rates else float("nan"),
            "mean_rate_kept": float(np.mean([r["success_rate"] for r in kept])) if kept else float("nan")}
    with open(os.path.join(out_dir, "histogram.json"), "w") as f:
        json.dump(hist, f, indent=1)
    plot_histogram(hist, os.path.join(out_dir, "histogram.png"))
    return hist


def histogram_lines(hist: dict) -> list[str]:
    width = max(hist["counts"]) or 1
    lines = [f"success rate over k={hist['k']} samples, {hist['total']} problems "
             f"(never solved: {hist['at_0']}, always solved: {hist['at_1']})"]
    for lo, hi, c in zip(hist["edges"], hist["edges"][1:], hist["counts"]):
        lines.append(f"  [{lo:.2f}, {hi:.2f}{']' if hi == 1 else ')'} {c:6d} {'#' * round(40 * c / width)}")
    lines.append(f"kept {hist['kept']} of {hist['total']} problems with rate in [{hist['band'][0]}, {hist['band'][1]}]")
    return lines


# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> Args:
    """The command line over Args' defaults; when it names no --model, over the built-in task's preset BUILTIN."""
    return parse(Args, BUILTIN, argv)


def validate(args: Args) -> None:
    if args.k < 1:
        raise ValueError(f"--k must be >= 1, got {args.k}")
    if not 0 <= args.band_low <= args.band_high <= 1:
        raise ValueError(f"the band must satisfy 0 <= --band-low <= --band-high <= 1, "
                         f"got [{args.band_low}, {args.band_high}]")
    if args.num_bins < 1 or args.chunk_size < 1 or args.max_problems < 0:
        raise ValueError("--num-bins and --chunk-size must be >= 1, --max-problems >= 0")
    if args.temperature <= 0:
        raise ValueError("--temperature must be > 0: a success rate needs sampling")
    if args.model is not None:
        from common.preflight import check_model_dir
        check_model_dir(args.model)
    if args.dataset is not None and not os.path.isfile(args.dataset):
        raise FileNotFoundError(f"dataset {args.dataset!r}: no such file")
    from common.sampler import resolve_sampler
    resolve_sampler(args.sampler)
    from tasks.rewards import check_reward
    check_reward(args.reward)


def main(args: Args) -> dict:
    validate(args)
    print0(config_changes(args, Args(), BUILTIN if args.model is None else {},
                          f"BUILTIN in {os.path.basename(__file__)} (no --model)"))
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from tasks.data import encode_problems, load_problems
    from common.dist import setup_distributed
    from tasks.rewards import score_responses
    from common.precision import DTYPES
    from common.sampler import make_sampler, resolve_sampler

    _, _, device = setup_distributed()  # a group of one (the vLLM sampler runs over it)
    model_path, dataset = args.model, args.dataset
    if model_path is None or dataset is None:
        from tasks.builtin import ensure_builtin_task
        task = ensure_builtin_task()
        model_path, dataset = model_path or task["model"], dataset or task["train"]
    os.makedirs(args.out_dir, exist_ok=True)
    config = {**dataclasses.asdict(args), "model": args.model or "built-in", "dataset": args.dataset or "built-in"}
    check_config(args.out_dir, config)

    # --- the pool: every problem of the file (index = its row), encoded; a random subset with --max-problems
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    raw = [{**p, "index": j} for j, p in enumerate(load_problems(dataset))]
    encoded = encode_problems(tokenizer, raw, args.prompt_template, args.max_prompt_len, dataset)  # keeps "index"
    order = np.random.default_rng(args.seed).permutation(len(encoded))
    pool = [encoded[i] for i in (order[:args.max_problems] if args.max_problems else order)]

    results_path = os.path.join(args.out_dir, "results.jsonl")
    done = read_results(results_path)
    for p in pool:
        if p["index"] in done and done[p["index"]]["problem"] != p["problem"]:
            raise ValueError(f"{results_path}: row {p['index']} holds another problem than {dataset}: "
                             "use another --out-dir, or delete results.jsonl to start over")
    todo_chunks = []  # chunk c: pool positions [c * chunk_size, (c + 1) * chunk_size), whatever was done before
    for c in range(math.ceil(len(pool) / args.chunk_size)):
        todo = [p for p in pool[c * args.chunk_size:(c + 1) * args.chunk_size] if p["index"] not in done]
        if todo:
            todo_chunks.append((c, todo))
    n_todo = sum(len(t) for _, t in todo_chunks)
    print0(f"[build] {len(pool)} problems in the pool, {len(pool) - n_todo} measured before, {n_todo} to go; "
           f"k = {args.k}, {args.precision} sampler")

    if todo_chunks:
        kind, why = resolve_sampler(args.sampler)
        print0(f"[sampler] {kind} ({why})")
        sampler = make_sampler(args, model_path, DTYPES[args.precision], device, args.seed, 0,
                               args.max_prompt_len + args.max_response_len)
        t0 = time.perf_counter()
        bar = tqdm(total=n_todo, desc="build", unit="problem", dynamic_ncols=True)
        with open(results_path, "a", encoding="utf-8") as f:
            for c, todo in todo_chunks:
                if hasattr(sampler, "generator"):  # the chunk's own stream: a resumed build samples the same
                    sampler.generator.manual_seed(int(np.random.SeedSequence([args.seed, c]).generate_state(1)[0]))
                out = sampler.generate([p["prompt_ids"] for p in todo], args.k, args.max_response_len,
                                       args.temperature, args.top_p)
                texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
                answers = [p["answer"] for p in todo for _ in range(args.k)]
                rewards = score_responses(texts, answers, out.finished, args.reward, args.truncated_reward)
                lines = []
                for j, p in enumerate(todo):
                    n_correct = int(sum(r == 1.0 for r in rewards[j * args.k:(j + 1) * args.k]))
                    row = {"index": p["index"], "problem": p["problem"], "answer": p["answer"],
                           "success_rate": n_correct / args.k, "n_correct": n_correct, "k": args.k}
                    done[p["index"]] = row
                    lines.append(json.dumps(row) + "\n")
                f.write("".join(lines))  # one write per chunk: an interruption loses at most this chunk
                f.flush()
                kept = sum(in_band(r["n_correct"], r["k"], args.band_low, args.band_high) for r in done.values())
                bar.set_postfix(kept=kept, refresh=False)
                bar.update(len(todo))
        bar.close()
        sampler.shutdown()
        print0(f"[build] sampled {n_todo * args.k} responses in {time.perf_counter() - t0:.1f} s")

    in_pool = {p["index"] for p in pool}
    hist = write_outputs(args.out_dir, [r for i, r in done.items() if i in in_pool], args)
    print0("\n".join(histogram_lines(hist)))
    print0(f"[build] wrote {os.path.join(args.out_dir, 'perfectible.jsonl')}, histogram.json, histogram.png")
    return hist


if __name__ == "__main__":
    exits.run(lambda: main(parse_args()), __file__, steps=False)
