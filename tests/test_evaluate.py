"""tasks/rewards.py's evaluate: every rank calls the sampler's generate, also with an empty share of an evaluation
file (a vLLM engine sharded over a tensor-parallel group gathers its prompts in generate: a rank that skipped the call
hung the others). grpo.py under torchrun with --vllm-tp 2 and a 1-problem evaluation is in tests/test_vllm.py."""
from common.batches import Rollout
from common.cli import Infra
from tasks.rewards import evaluate


class RecordingSampler:
    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, max_new_tokens, temperature, top_p=1.0):
        self.calls.append(len(prompts))
        out = Rollout()
        for p in prompts:
            for _ in range(n):
                out.prompt_ids.append(p)
                out.response_ids.append([4])
                out.logprobs.append(None)
                out.finished.append(True)
        return out


class CharTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["2" for _ in ids]


def test_rank_with_an_empty_share_still_calls_generate(process_group):
    _, _, device = process_group
    problems = {"aime": [{"prompt_ids": [5, 6], "answer": "2"}]}  # 1 problem, 2 ranks: rank 1 gets none
    for rank, expected_calls in ((0, [1]), (1, [0])):
        sampler = RecordingSampler()
        metrics = evaluate(sampler, CharTokenizer(), problems, Infra(eval_k=2, eval_temperature=1.0, eval_top_p=1.0), 8,
                           "exact", rank, 2, device)
        assert sampler.calls == expected_calls  # rank 1: called with [] (the collective is entered)
        # a group of one here: rank 1's counts alone (0 of 0) give 0, rank 0's 2 of 2 give 1
        assert metrics["eval/aime/accuracy"] == (1.0 if rank == 0 else 0.0)
