"""Evaluation: avg@k accuracy on each --eval-dataset file, with its own sampling settings. Each rank samples its share
of the problems; counts are summed over ranks. Every rank calls `generate`, also with an empty share: with
--vllm-tp > 1 it is a collective of the tensor-parallel group."""
import os

from common.dist import reduce_stats
from common.rewards import score_rollout


def evaluate(sampler, tokenizer, eval_sets: dict[str, list[dict]], k: int, temperature: float, top_p: float,
             max_new_tokens: int, reward: str, rank: int, world_size: int, device) -> dict:
    """eval_sets: name -> encoded problems (prompt_ids, answer). Returns {eval/<name>/accuracy: mean reward,
    eval/<name>/reward_failures: reward checks that raised or timed out (scored 0), all ranks}."""
    metrics = {}
    for name, problems in eval_sets.items():
        mine = problems[rank::world_size]
        out = sampler.generate([p["prompt_ids"] for p in mine], k, max_new_tokens, temperature, top_p)  # even if []
        texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True) if mine else []
        answers = [p["answer"] for p in mine for _ in range(k)]
        scores, failed = score_rollout(texts, answers, out.finished, reward, progress=rank == 0) if mine else ([], 0)
        s = reduce_stats({"correct": float(sum(scores)), "failed": failed, "n": len(mine) * k}, "sum", device)
        metrics[f"eval/{name}/accuracy"] = s["correct"] / max(s["n"], 1.0)
        metrics[f"eval/{name}/reward_failures"] = s["failed"]
    return metrics


def eval_name(path: str) -> str:
    """eval/<name>/accuracy uses the file name without its extension."""
    return os.path.splitext(os.path.basename(path))[0]
