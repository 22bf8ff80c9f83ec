"""Which problems a step trains on and how its sequences are cut into micro-batches: the same in every script."""
import numpy as np

from common.dist import reduce_stats
from common.logprobs import split_microbatches


def batch_problems(problems: list, step: int, num_prompts: int, rank: int, world_size: int, seed: int) -> list:
    """This rank's problems of step `step` (0-based): the step takes entries [step P, (step + 1) P) of the sequence of
    epochs, P = num_prompts, each epoch a permutation of the problems seeded by (seed, epoch) (the same on every
    rank), and rank r takes the r-th consecutive share of P / world_size of them."""
    per_rank = num_prompts // world_size
    first = step * num_prompts + rank * per_rank
    orders = {}
    out = []
    for j in range(first, first + per_rank):
        epoch, k = divmod(j, len(problems))
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(len(problems))
        out.append(problems[orders[epoch][k]])
    return out


def micro_batches(lengths: list[int], token_budget: int, device) -> list[list[int]]:
    """Collective. split_microbatches of the sequences' lengths within the token budget, in the same number of
    micro-batches on every rank (each forward/backward is a collective under FSDP)."""
    groups = split_microbatches(lengths, token_budget)
    n = int(reduce_stats({"n": len(groups)}, "max", device)["n"])
    return split_microbatches(lengths, token_budget, min_count=n)
