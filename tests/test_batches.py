"""common/batches.py and the shared step statistics of common/metrics.py, which every script uses the same way."""
import math

import torch

from common.batches import batch_problems
from common.metrics import add_sums, mean_finite, rollout_sums


def test_ranks_split_each_step_and_every_epoch_is_a_permutation():
    problems = list(range(10))
    steps = [[batch_problems(problems, s, 4, r, 2, seed=1) for r in range(2)] for s in range(5)]  # 20 = 2 epochs
    assert all(len(share) == 2 for step in steps for share in step)
    flat = [p for step in steps for share in step for p in share]
    assert sorted(flat[:10]) == problems and sorted(flat[10:]) == problems  # each epoch sees every problem once
    assert flat[:10] != flat[10:]  # a new order per epoch
    assert steps == [[batch_problems(problems, s, 4, r, 2, seed=1) for r in range(2)] for s in range(5)]  # no state
    assert batch_problems(problems, 0, 4, 0, 1, seed=1) == steps[0][0] + steps[0][1]  # one rank: both shares


def test_step_statistics():
    sums, maxes = rollout_sums(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2, 1, [True, False, True, True], [3, 5, 2, 4],
                               [13, 15, 12, 14], 2.5)
    assert sums["all_correct"] == 1 and sums["all_wrong"] == 0 and sums["truncated"] == 1 and maxes["resp_len"] == 5
    total = {}
    add_sums(total, {"a": 1.0})
    add_sums(total, {"a": 2.0, "b": 1.0})
    assert total == {"a": 3.0, "b": 1.0}
    assert mean_finite([1.0, math.inf, 3.0]) == 2.0 and math.isnan(mean_finite([math.inf]))
