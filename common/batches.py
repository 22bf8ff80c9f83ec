"""A step's batch: its problems (batch_problems), the samplers' output (Rollout), its mini- and micro-batches."""
from dataclasses import dataclass, field

import numpy as np
import torch

from common.dist import reduce_stats
from common.logprobs import collate, pad_float, split_microbatches, to_device


@dataclass
class Rollout:
    """Per response: its prompt's token ids (each prompt repeated n times), its token ids, the sampler's own fp32
    log-prob of each sampled token (mu_logp) and whether it ended with end-of-sequence (not cut at the length limit)."""
    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)

    def response_lens(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    def seq_lens(self) -> list[int]:
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]

    def mask(self) -> torch.Tensor:
        """B x T bool, True on each response's tokens (left-aligned; T = the longest response, at least 1)."""
        lens = torch.tensor(self.response_lens())
        return torch.arange(max(1, int(lens.max())))[None] < lens[:, None]

    def padded(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """B x T fp32 on the CPU from one 1-D tensor per response (mu_logp, old_logp), the layout of mask()."""
        return pad_float(rows, max(1, max(self.response_lens())), "cpu")

    def rows(self, idx: list[int], pad_id: int, device):
        """The right-padded prompt+response rows idx: input_ids_BL, attention_mask_BL, response_mask_BT (collate)."""
        return collate([self.prompt_ids[i] for i in idx], [self.response_ids[i] for i in idx], pad_id, device)

    def log(self, stats) -> None:
        """The lengths, truncated fraction and tokens of perf/sample_tok_s and train_tok_s into stats (StepStats)."""
        lens = self.response_lens()
        stats.add("train/response_len_mean", float(sum(lens)), len(lens))
        stats.max("train/response_len_max", float(max(lens)))
        stats.add("train/truncated_frac", float(sum(not f for f in self.finished)), len(lens))
        stats.rate("perf/sample_tok_s", float(sum(lens)), "sample")
        stats.rate("perf/train_tok_s", float(sum(self.seq_lens())), "train")


def on_device(device, idx: list[int], T: int, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Rows idx (and first T columns) of each CPU tensor on `device`, without waiting for the GPU; None stays None."""
    return [None if t is None else to_device(t[idx, :T] if t.dim() > 1 else t[idx], device) for t in tensors]


def batch_problems(problems: list, step: int, num_prompts: int, rank: int, world_size: int, seed: int) -> list:
    """This rank's problems of step `step` (0-based): entries [step P, (step + 1) P) of a sequence of epochs (P =
    num_prompts), each a permutation seeded by (seed, epoch); rank r takes the r-th share of P / world_size of them."""
    per_rank, n = num_prompts // world_size, len(problems)
    js = range(step * num_prompts + rank * per_rank, step * num_prompts + (rank + 1) * per_rank)
    orders = {e: np.random.default_rng([seed, e]).permutation(n) for e in {j // n for j in js}}
    return [problems[orders[j // n][j % n]] for j in js]


def micro_batches(lengths: list[int], token_budget: int, device) -> list[list[int]]:
    """Collective. split_microbatches, as many on every rank (under FSDP each forward and backward is a collective)."""
    n = int(reduce_stats({"n": len(split_microbatches(lengths, token_budget))}, "max", device)["n"])
    return split_microbatches(lengths, token_budget, min_count=n)


def minibatches(seq_lens: list[int], num_minibatches: int, token_budget: int, device) -> list[list[list[int]]]:
    """Collective. The step's optimizer steps: num_minibatches consecutive shares of the sequences (whole groups, as
    the sampler returns them), each a list of micro-batches of sequence indices."""
    m = len(seq_lens) // num_minibatches
    return [[[k * m + j for j in micro] for micro in micro_batches(seq_lens[k * m:(k + 1) * m], token_budget, device)]
            for k in range(num_minibatches)]


def minibatch_tokens(minibatches: list[list[list[int]]], response_lens: list[int], device) -> list[float]:
    """Collective. Each mini-batch's response tokens over all ranks (one all-reduce): the N_tok of a loss that is a
    mean over tokens (cispo.py's, ppo.py's value loss), so that micro-batches and ranks leave it unchanged."""
    counts = {k: float(sum(response_lens[i] for idx in mb for i in idx)) for k, mb in enumerate(minibatches)}
    return [n for _, n in sorted(reduce_stats(counts, "sum", device).items())]  # in mini-batch order
