"""Preference pairs from a policy's own samples, judged by a rule reward: the data of a reward model
(tasks/reward_model.py trains one from them; docs/reward-models.md).

For each problem, k responses sampled at the temperature of training; those cut at the length limit are dropped (in
RL they get --truncated-reward, the reward model never scores them); each pair is two distinct responses of the same
problem that the rule scores differently, the higher one chosen. With a 0/1 rule: a right and a wrong answer.

    python -m tasks.reward_pairs --model ~/.cache/rl-mismatch/smollm2-135m-instruct \\
        --dataset ~/.cache/rl-mismatch/word-problems-v1/train.jsonl --out runs/rm_pairs/train.jsonl \\
        --prompt-template "chat:{problem}" --reward number --max-response-len 128 --sampler vllm

Writes --out: one pair a line, {prompt, chosen, rejected, problem, answer}; `prompt` is the text of the prompt as
--prompt-template writes it (the user turn for a chat template: the reward model adds its own template around it).
"""
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Literal

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (docs/results.md, "On a CPU")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import tyro

from common import exits


@dataclass
class Args:
    model: str
    """the policy: a local Hugging Face causal LM directory"""
    dataset: str
    """problems: .jsonl/.json/.parquet with problem (or prompt/question) and answer (or solution) fields"""
    out: str
    """the pairs file to write (.jsonl)"""
    prompt_template: str = "chat"
    """as the scripts' --prompt-template (keep it the RL run's): 'chat', 'chat:<format>' or a raw format string"""
    reward: str = "math"
    """the rule that judges: math, exact, number or module:function (as the scripts' --reward)"""
    k: int = 8
    """responses sampled per problem"""
    pairs_per_problem: int = 4
    """at most this many pairs per problem (distinct responses, drawn at random among those the rule tells apart)"""
    max_problems: int = 0
    """sample at most this many problems, a random subset fixed by --seed (0: all)"""
    max_prompt_len: int = 1024
    """prompts longer than this (tokens) are skipped"""
    max_response_len: int = 1024
    """response length limit in tokens (responses cut there are dropped)"""
    temperature: float = 1.0
    """sampling temperature (keep it the RL run's: the pairs should look like what the reward model will score)"""
    chunk_size: int = 256
    """problems whose k responses are sampled together"""
    seed: int = 1
    """seed of the subset, the sampling stream and the pairing"""
    sampler: Literal["auto", "vllm", "hf"] = "auto"
    """'vllm', 'hf' (transformers) or 'auto' (vllm when installed and a GPU is present)"""
    precision: Literal["fp16", "bf16", "fp32"] = "bf16"
    """the sampler's weight dtype"""
    sampler_batch_size: int = 256
    """sequences decoded at once by the fallback sampler"""
    vllm_gpu_memory_utilization: float = 0.85
    """fraction of GPU memory vLLM may take"""
    vllm_kv_cache_gib: float = 0.0
    """GiB of KV cache for vLLM (0: measured at start)"""


def pairs_of(texts: list[str], verdicts: list[float], limit: int, rng: random.Random) -> list[tuple[str, str]]:
    """Up to `limit` (chosen, rejected) pairs of distinct texts whose verdicts differ, the higher chosen, drawn
    uniformly among all such pairs."""
    best = {}
    for text, v in zip(texts, verdicts):
        best[text] = max(v, best.get(text, v))  # (a rule's verdict of one text is one value; a plug-in's may vary)
    items = sorted(best.items())
    candidates = [(a, b) for a, va in items for b, vb in items if va > vb]
    return rng.sample(candidates, min(limit, len(candidates)))


def sample_pairs(sampler, tokenizer, problems: list[dict], template: str, rule: str, k: int, max_response_len: int,
                 temperature: float, pairs_per_problem: int, seed: int, chunk_size: int = 256,
                 progress: bool = True) -> tuple[list[dict], dict]:
    """Pairs ({prompt, chosen, rejected, problem, answer}) from `sampler`'s responses to `problems` (encoded: with
    prompt_ids), judged by `rule`. Returns (pairs, counts of what was sampled)."""
    from tasks.data import prompt_text
    from tasks.rewards import score_responses
    rng = random.Random(seed)
    pairs, n_resp, n_cut, n_right, n_with_pairs = [], 0, 0, 0.0, 0
    t0 = time.perf_counter()
    for c in range(0, len(problems), chunk_size):
        chunk = problems[c:c + chunk_size]
        out = sampler.generate([p["prompt_ids"] for p in chunk], k, max_response_len, temperature, 1.0)
        texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        answers = [p["answer"] for p in chunk for _ in range(k)]
        verdicts = score_responses(texts, answers, out.finished, rule)
        n_resp += len(texts)
        n_cut += sum(not f for f in out.finished)
        n_right += sum(verdicts)
        for j, p in enumerate(chunk):
            rows = [(texts[i], verdicts[i]) for i in range(j * k, (j + 1) * k) if out.finished[i]]
            found = pairs_of([t for t, _ in rows], [v for _, v in rows], pairs_per_problem, rng)
            n_with_pairs += bool(found)
            pairs += [{"prompt": prompt_text(p["problem"], template), "chosen": a, "rejected": b,
                       "problem": p["problem"], "answer": p["answer"]} for a, b in found]
        if progress:
            print(f"[pairs] {min(c + chunk_size, len(problems))} of {len(problems)} problems, {len(pairs)} pairs "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    counts = {"problems": len(problems), "responses": n_resp, "truncated": n_cut,
              "mean_reward": n_right / max(n_resp, 1), "problems_with_pairs": n_with_pairs, "pairs": len(pairs)}
    return pairs, counts


def write_jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)  # a killed run leaves no half-written pairs file


def main(args: Args) -> dict:
    from common.preflight import check_model_dir
    from tasks.rewards import check_reward
    from common.sampler import make_sampler, resolve_sampler
    check_model_dir(args.model)
    if not os.path.isfile(args.dataset):
        raise FileNotFoundError(f"dataset {args.dataset!r}: no such file")
    for name in ("k", "pairs_per_problem", "chunk_size", "max_prompt_len", "max_response_len", "sampler_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.k < 2:
        raise ValueError("--k must be at least 2: a pair needs two responses to a problem")
    if args.max_problems < 0 or not args.temperature > 0:
        raise ValueError("--max-problems must be >= 0 and --temperature > 0")
    check_reward(args.reward)
    resolve_sampler(args.sampler)  # vLLM asked for where it is not installed: an error now

    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from tasks.data import encode_problems, load_problems
    from common.dist import setup_distributed
    from common.precision import DTYPES
    _, _, device = setup_distributed()  # a group of one (the vLLM sampler runs over it)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    problems = encode_problems(tokenizer, load_problems(args.dataset), args.prompt_template, args.max_prompt_len,
                               args.dataset)
    order = np.random.default_rng(args.seed).permutation(len(problems))
    problems = [problems[i] for i in (order[:args.max_problems] if args.max_problems else order)]
    torch.manual_seed(args.seed)
    sampler = make_sampler(args, args.model, DTYPES[args.precision], device, args.seed, 0,
                           args.max_prompt_len + args.max_response_len)  # (prints which sampler and why)
    pairs, counts = sample_pairs(sampler, tokenizer, problems, args.prompt_template, args.reward, args.k,
                                 args.max_response_len, args.temperature, args.pairs_per_problem, args.seed,
                                 args.chunk_size)
    sampler.shutdown()
    if not pairs:
        raise ValueError(f"no pairs: the rule told no two responses of a problem apart ({counts}); sample more (--k) "
                         "or other problems")
    write_jsonl(args.out, pairs)
    print(f"[pairs] {json.dumps(counts)}; wrote {args.out}", file=sys.stderr, flush=True)
    return counts


if __name__ == "__main__":
    exits.run(lambda: main(tyro.cli(Args)), __file__, steps=False)
