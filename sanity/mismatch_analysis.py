"""Offline training-inference mismatch analysis, as in the FP16 study ("Defeating the Training-Inference Mismatch via
FP16", arXiv 2510.26788): the same model on both sides, no training.

For each precision p (fp32 is always measured: it is the reference of (d)):
  sample `--samples` responses per prompt with the sampler in p, recording mu_logp (the sampler's own fp32
  log-prob of each sampled token), and recompute their log-probs with the trainer in p (the FSDP2 policy with
  param_dtype p, fp32 log_softmax over chunks, as grpo.py's step 3: the pi_old of a training step). Then
  (a) token probabilities pi against mu (scatter.png),
  (b) the sequence log-ratio sum_t (log pi - log mu) against the response length, with its least-squares line
      (slope reported per 1K tokens; the study: about -1.0 in BF16 and -0.07 in FP16; log_ratio_vs_length.png),
  (c) KL(mu || pi) over the response tokens: k1 = mean(log mu - log pi), k2 = mean 0.5 (log mu - log pi)^2,
      k3 = mean(exp(d) - 1 - d) with d = log pi - log mu (docs/algorithms.md's mismatch/kl_*),
  (d) for the sequences sampled in fp32, the trainer's log-probs in fp16 and bf16 against its fp32 ones:
      mean and max |lp_p - lp_32| over tokens, the relative error mean|lp_p - lp_32| / mean|lp_32| over tokens, and
      the same relative error of the sequence log-probs sum_t lp.

    python sanity/mismatch_analysis.py                       # the built-in model on built-in training problems
    python sanity/mismatch_analysis.py --model /path/to/DeepSeek-R1-Distill-Qwen-1.5B --dataset math500.jsonl \\
        --num-prompts 128 --samples 4 --sampler vllm --out-dir runs/mismatch_r1

Writes analysis.json, analysis.md, scatter.png and log_ratio_vs_length.png into --out-dir.
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
if ROOT not in sys.path:  # `python sanity/mismatch_analysis.py` from anywhere
    sys.path.insert(0, ROOT)

import numpy as np
import torch

from common import exits
from common.cli import config_changes, parse
from common.dist import print0

Precision = Literal["fp16", "bf16", "fp32"]


@dataclass
class Args:
    """Defaults are for a real model (--model); without --model the built-in task's preset BUILTIN (below) replaces
    some of them, under the command line; the run prints at start every value that differs from these."""
    out_dir: str = "runs/mismatch"
    """where analysis.json, analysis.md, scatter.png and log_ratio_vs_length.png go"""
    model: str | None = None
    """local Hugging Face model directory (default: the built-in task's warm-started model)"""
    dataset: str | None = None
    """prompts: .jsonl/.json/.parquet with a problem field (default: the built-in training set)"""
    num_prompts: int = 64
    """prompts taken from the dataset (a random subset fixed by --seed; 0: all)"""
    samples: int = 4
    """responses sampled per prompt and precision"""
    precisions: tuple[Precision, ...] = ("fp32", "fp16", "bf16")
    """precisions measured, each on both sides (fp32 is always measured: the reference of (d))"""
    seed: int = 1
    """seed of the prompt subset and of the sampler"""
    scatter_points: int = 5000
    """tokens drawn in the scatter plot per precision (a random subsample)"""
    # --- as in the algorithm scripts (same names, same meaning)
    prompt_template: str = "chat"
    """'chat' (the tokenizer's chat template with the R1-distill instruction), 'chat:<format>' (the chat template
    with <format> as the user turn) or a raw format string with {problem}"""
    max_prompt_len: int = 1024
    """prompts longer than this (tokens) are skipped"""
    max_response_len: int = 8192
    """response length limit in tokens"""
    temperature: float = 1.0
    """sampling temperature; the trainer divides its logits by it too"""
    sampler: Literal["auto", "vllm", "hf"] = "auto"
    """'vllm', 'hf' (the fallback sampler) or 'auto' (vllm when installed and a GPU is present)"""
    sampler_batch_size: int = 256
    """sequences decoded at once by the fallback sampler"""
    vllm_gpu_memory_utilization: float = 0.5
    """fraction of GPU memory vLLM may take (the trainer loads after the sampler is shut down)"""
    vllm_kv_cache_gib: float = 0.0
    """GiB of KV cache per vLLM engine, fixed instead of sized by measuring free memory while the engine starts (0:
    measure), as in the algorithm scripts"""
    micro_batch_tokens: int = 32768
    """token budget of a trainer forward pass (rows x longest row)"""
    logprob_chunk: int = 2048
    """tokens per chunk of the trainer's fp32 log-prob head"""


BUILTIN = dict(prompt_template="{problem}", max_prompt_len=16, max_response_len=8, sampler_batch_size=1024,
               micro_batch_tokens=4096)


# ----------------------------------------------------------------------------------------------------------------
# Pure functions

def fit_slope(lengths, values) -> tuple[float, float, float]:
    """Least-squares line values ~ intercept + slope * length. Returns (slope, intercept, standard error of the
    slope); NaN where it cannot be computed (lengths that do not vary; the error needs 3 points or more)."""
    x, y = np.asarray(lengths, dtype=float), np.asarray(values, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        return float("nan"), float("nan"), float("nan")
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (intercept + slope * x)
    se = math.sqrt((resid ** 2).sum() / (len(x) - 2) / ((x - x.mean()) ** 2).sum()) if len(x) > 2 else float("nan")
    return float(slope), float(intercept), se


def kl_estimates(pi_logp: list[torch.Tensor], mu_logp: list[torch.Tensor]) -> dict:
    """KL(mu || pi) over all tokens, from samples of mu (docs/algorithms.md): k1, k2, k3, and mean |pi - mu| in
    probability space. The inputs are per-sequence fp32 log-probs of the sampled tokens."""
    from common.logprobs import pad_float
    from common.metrics import StepStats, mismatch
    T = max(1, max(len(x) for x in pi_logp))
    lens = torch.tensor([len(x) for x in pi_logp])
    mask = torch.arange(T)[None] < lens[:, None]
    stats = StepStats(torch.device("cpu"))  # the scripts' mismatch/* keys, in this process alone
    mismatch(stats, pad_float(pi_logp, T, "cpu"), pad_float(mu_logp, T, "cpu"), mask)
    m = stats.reduce(all_ranks=False)
    return {"kl_k1": m["mismatch/kl_k1"], "kl_k2": m["mismatch/kl_k2"], "kl_k3": m["mismatch/kl_k3"],
            "prob_abs_diff_mean": m["mismatch/prob_abs_diff_mean"],
            "prob_abs_diff_max": m["mismatch/prob_abs_diff_max"]}


def relative_error(lp: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """The log-probs `lp` against the reference `ref` (the same tokens): mean and max |lp - ref| over tokens,
    mean|lp - ref| / mean|ref| over tokens, and mean_i |sum_t lp - sum_t ref| / mean_i |sum_t ref| over sequences."""
    a, b = torch.cat(lp).double(), torch.cat(ref).double()
    sa, sb = torch.stack([x.double().sum() for x in lp]), torch.stack([x.double().sum() for x in ref])
    return {"mean_abs_diff": float((a - b).abs().mean()), "max_abs_diff": float((a - b).abs().max()),
            "rel_err_token": float((a - b).abs().mean() / b.abs().mean().clamp(min=1e-30)),
            "rel_err_seq": float((sa - sb).abs().mean() / sb.abs().mean().clamp(min=1e-30))}


@torch.no_grad()
def recompute_logp(model, prompt_ids, response_ids, pad_id: int, temperature: float, micro_batch_tokens: int,
                   chunk: int, device) -> list[torch.Tensor]:
    """The trainer's fp32 log-prob of every response token, as grpo.py's step 3 computes old_logp."""
    from common.logprobs import collate, split_microbatches
    out = [None] * len(response_ids)
    for mb in split_microbatches([len(p) + len(r) for p, r in zip(prompt_ids, response_ids)], micro_batch_tokens):
        ids, attn, rmask = collate([prompt_ids[i] for i in mb], [response_ids[i] for i in mb], pad_id, device)
        logp_BT, _ = model(ids, attn, rmask, temperature, chunk)
        logp_BT = logp_BT.float().cpu()
        for row, i in enumerate(mb):
            out[i] = logp_BT[row, :len(response_ids[i])]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Report

def analysis_markdown(res: dict, image_dir: str = "") -> str:
    """The analysis as Markdown (tables and figures); image_dir prefixes the figure paths."""
    from sanity.report import fmt, md_table
    c = res["config"]
    rows = [[p, r["n_seqs"], r["n_tokens"], fmt(r["resp_len_mean"]), fmt(r["kl_k1"]), fmt(r["kl_k2"]),
             fmt(r["kl_k3"]), fmt(r["prob_abs_diff_mean"]), fmt(r["seq_log_ratio_mean"]),
             f"{fmt(r['slope_per_1k'])} ± {fmt(r['slope_se_per_1k'], '.2g')}"] for p, r in res["precisions"].items()]
    text = [f"{c['n_prompts']} prompts x {c['samples']} responses per precision, temperature {c['temperature']}, "
            f"responses up to {c['max_response_len']} tokens; {c['sampler']} sampler against the FSDP2 trainer, "
            "both in the precision of the row. KL(mu||pi) over the response tokens (k1, k2, k3 as the "
            "mismatch/kl_* metrics); the slope is the least-squares slope of sum_t (log pi - log mu) against the "
            "response length, per 1,000 tokens, ± its standard error (a linear extrapolation when the responses are "
            "much shorter than 1,000 tokens).", "",
            md_table(["precision", "sequences", "tokens", "mean length", "KL k1", "KL k2", "KL k3", "mean abs(pi - mu)",
                      "mean seq log-ratio", "slope per 1K tokens"], rows), ""]
    if res["rel_err"]:
        rows = [[p, fmt(r["mean_abs_diff"]), fmt(r["max_abs_diff"]), fmt(r["rel_err_token"]), fmt(r["rel_err_seq"])]
                for p, r in res["rel_err"].items()]
        text += ["The trainer's log-probs in fp16 and bf16 against its fp32 log-probs, on the sequences sampled in "
                 "fp32: dlogp = lp_p - lp_fp32 per token; relative error = mean abs(dlogp) / mean abs(lp_fp32) over "
                 "tokens, and for the sequence log-probs sum_t lp over sequences.", "",
                 md_table(["precision", "mean abs dlogp", "max abs dlogp", "relative error (tokens)",
                           "relative error (sequences)"], rows), ""]
    text += [f"![pi against mu]({image_dir}scatter.png)", "",
             f"![sequence log-ratio against response length]({image_dir}log_ratio_vs_length.png)", ""]
    return "\n".join(text)


def plot_scatter(points: dict, out: str) -> None:
    """Per precision: pi against mu (top) and log pi - log mu against mu (bottom), on a subsample of tokens."""
    from sanity.report import _plt
    plt = _plt()
    fig, axes = plt.subplots(2, len(points), figsize=(4.2 * len(points), 7.5), squeeze=False)
    for j, (p, (mu, pi)) in enumerate(points.items()):
        mu, pi = np.asarray(mu), np.asarray(pi)
        ax = axes[0, j]
        ax.scatter(mu, pi, s=3, alpha=0.3)
        ax.plot([0, 1], [0, 1], color="gray", linewidth=0.8)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="mu (sampler)", ylabel="pi (trainer)", title=f"{p}: token probability")
        ax = axes[1, j]
        ax.scatter(mu, np.log(np.maximum(pi, 1e-38)) - np.log(np.maximum(mu, 1e-38)), s=3, alpha=0.3)
        ax.axhline(0, color="gray", linewidth=0.8)
        ax.set(xlim=(0, 1), xlabel="mu (sampler)", ylabel="log pi - log mu", title=f"{p}: log-ratio per token")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_log_ratio(series: dict, out: str) -> None:
    """Per precision: the sequence log-ratio against the response length, with the fitted line."""
    from sanity.report import _plt
    plt = _plt()
    fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.8), squeeze=False)
    for ax, (p, (lengths, ratios, slope, intercept)) in zip(axes[0], series.items()):
        ax.scatter(lengths, ratios, s=6, alpha=0.4)
        if math.isfinite(slope):
            xs = np.array([min(lengths), max(lengths)])
            ax.plot(xs, intercept + slope * xs, color="tab:red", label=f"{slope * 1000:.3g} per 1K tokens")
            ax.legend(fontsize=8)
        ax.axhline(0, color="gray", linewidth=0.8)
        ax.set(xlabel="response length (tokens)", ylabel="sum_t (log pi - log mu)", title=p)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> Args:
    """The command line over Args' defaults; when it names no --model, over the built-in task's preset BUILTIN."""
    return parse(Args, BUILTIN, argv)


def validate(args: Args) -> None:
    if args.samples < 1 or args.num_prompts < 0:
        raise ValueError("--samples must be >= 1 and --num-prompts >= 0")
    if args.temperature <= 0:
        raise ValueError("--temperature must be > 0: the analysis compares sampled distributions")
    if args.model is not None:
        from common.preflight import check_model_dir
        check_model_dir(args.model)
    if args.dataset is not None and not os.path.isfile(args.dataset):
        raise FileNotFoundError(f"dataset {args.dataset!r}: no such file")
    from common.sampler import resolve_sampler
    resolve_sampler(args.sampler)


def main(args: Args) -> dict:
    validate(args)
    print0(config_changes(args, Args(), BUILTIN if args.model is None else {},
                          f"BUILTIN in {os.path.basename(__file__)} (no --model)"))
    from transformers import AutoTokenizer

    from tasks.data import encode_problems, load_problems
    from common.dist import setup_distributed
    from common.fsdp import load_policy
    from common.precision import DTYPES
    from common.sampler import make_sampler, resolve_sampler

    _, _, device = setup_distributed()
    model_path, dataset = args.model, args.dataset
    if model_path is None or dataset is None:
        from tasks.builtin import ensure_builtin_task
        task = ensure_builtin_task()
        model_path, dataset = model_path or task["model"], dataset or task["train"]
    os.makedirs(args.out_dir, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    problems = encode_problems(tokenizer, load_problems(dataset), args.prompt_template, args.max_prompt_len, dataset)
    order = np.random.default_rng(args.seed).permutation(len(problems))
    prompts = [problems[i]["prompt_ids"] for i in (order[:args.num_prompts] if args.num_prompts else order)]
    kind, why = resolve_sampler(args.sampler)
    print0(f"[analysis] {len(prompts)} prompts x {args.samples} responses; sampler {kind} ({why})")

    precisions = ["fp32"] + [p for p in dict.fromkeys(args.precisions) if p != "fp32"]
    res = {"config": {**dataclasses.asdict(args), "model": args.model or "built-in", "sampler": kind,
                      "dataset": args.dataset or "built-in", "n_prompts": len(prompts)},
           "precisions": {}, "rel_err": {}}
    points, series, ref = {}, {}, None
    for p in precisions:
        t0 = time.perf_counter()
        # the sampler in p: responses and mu_logp (shut down before the trainer loads, to share the memory)
        sampler = make_sampler(args, model_path, DTYPES[p], device, args.seed, 0,
                               args.max_prompt_len + args.max_response_len)
        out = sampler.generate(prompts, args.samples, args.max_response_len, args.temperature, 1.0)
        sampler.shutdown()
        del sampler
        if not torch.distributed.is_initialized():  # vLLM's shutdown takes the process group down; FSDP2 needs one
            setup_distributed()
        # the trainer in p: pi of the same tokens; in fp32 these sequences are also the reference of (d)
        model = load_policy(model_path, DTYPES[p], device, gradient_checkpointing=False)
        model.eval()
        recompute = lambda o: recompute_logp(model, o.prompt_ids, o.response_ids, pad_id, args.temperature,
                                             args.micro_batch_tokens, args.logprob_chunk, device)
        pi = recompute(out)
        if p == "fp32":
            ref = (out, pi)
        else:
            res["rel_err"][p] = relative_error(recompute(ref[0]), ref[1])
        del model

        lengths = [len(r) for r in out.response_ids]
        ratios = [float((a - b).double().sum()) for a, b in zip(pi, out.logprobs)]
        slope, intercept, slope_se = fit_slope(lengths, ratios)
        res["precisions"][p] = {"n_seqs": len(lengths), "n_tokens": int(sum(lengths)),
                                "resp_len_mean": float(np.mean(lengths)), **kl_estimates(pi, out.logprobs),
                                "seq_log_ratio_mean": float(np.mean(ratios)), "seq_log_ratio_min": float(min(ratios)),
                                "seq_log_ratio_max": float(max(ratios)), "slope_per_1k": slope * 1000,
                                "slope_se_per_1k": slope_se * 1000, "intercept": intercept,
                                "seconds": round(time.perf_counter() - t0, 2)}
        mu_all, pi_all = torch.cat(out.logprobs).exp().numpy(), torch.cat(pi).exp().numpy()
        pick = np.random.default_rng(args.seed).permutation(len(mu_all))[:args.scatter_points]
        points[p] = (mu_all[pick].tolist(), pi_all[pick].tolist())
        series[p] = (lengths, ratios, slope, intercept)
        r = res["precisions"][p]
        print0(f"[analysis] {p}: kl_k3 {r['kl_k3']:.3g}, k1 {r['kl_k1']:.3g}, slope {r['slope_per_1k']:.3g} per 1K "
               f"tokens" + (f", relative error vs fp32 {res['rel_err'][p]['rel_err_token']:.3g}" if p != "fp32" else "")
               + f" ({r['seconds']:.1f} s)")

    plot_scatter(points, os.path.join(args.out_dir, "scatter.png"))
    plot_log_ratio(series, os.path.join(args.out_dir, "log_ratio_vs_length.png"))
    with open(os.path.join(args.out_dir, "analysis.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out_dir, "analysis.md"), "w") as f:
        f.write("# Offline mismatch analysis\n\n" + analysis_markdown(res))
    print0(f"[analysis] wrote {args.out_dir}/analysis.md, analysis.json, scatter.png, log_ratio_vs_length.png")
    return res


if __name__ == "__main__":
    exits.run(lambda: main(parse_args()), __file__, steps=False)
