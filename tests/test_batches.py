"""common/batches.py and the shared step statistics (common/metrics.py StepStats, Rollout.log, Reward, the loss
scaler's log), which every script uses the same way."""
import math

import torch

from common.batches import Rollout, batch_problems, minibatch_tokens, minibatches
from common.metrics import StepStats
from common.precision import LossScaler
from tasks.rewards import Reward


def test_ranks_split_each_step_and_every_epoch_is_a_permutation():
    problems = list(range(10))
    steps = [[batch_problems(problems, s, 4, r, 2, seed=1) for r in range(2)] for s in range(5)]  # 20 = 2 epochs
    assert all(len(share) == 2 for step in steps for share in step)
    flat = [p for step in steps for share in step for p in share]
    assert sorted(flat[:10]) == problems and sorted(flat[10:]) == problems  # each epoch sees every problem once
    assert flat[:10] != flat[10:]  # a new order per epoch
    assert steps == [[batch_problems(problems, s, 4, r, 2, seed=1) for r in range(2)] for s in range(5)]  # no state
    assert batch_problems(problems, 0, 4, 0, 1, seed=1) == steps[0][0] + steps[0][1]  # one rank: both shares


class Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(map(str, r)) for r in ids]


def test_step_statistics():
    """The train/ keys of a rollout of 2 groups of 2 (rewards 1, 1 | 0, 1; one response cut at the length limit)."""
    rollout = Rollout(prompt_ids=[[9], [9], [8], [8]], response_ids=[[1, 1, 1], [1, 1, 1, 1, 1], [2, 2], [2, 2, 2, 2]],
                      logprobs=[torch.zeros(n) for n in (3, 5, 2, 4)], finished=[True, False, True, True])
    stats = StepStats(torch.device("cpu"))
    with stats.phase("sample"):
        pass
    with stats.phase("train"):
        pass
    rollout.log(stats)
    problems = [{"problem": "1+1+1", "answer": "111"}, {"problem": "2+2", "answer": "2222"}]
    rewards_B = Reward("exact", 1.0, Tok(), torch.device("cpu"), progress=False)(1, rollout, problems, stats)
    assert rewards_B.tolist() == [1.0, 1.0, 0.0, 1.0]  # the cut response gets --truncated-reward (here 1)
    m = stats.reduce(all_ranks=False)
    assert m["train/all_correct_frac"] == 0.5 and m["train/all_wrong_frac"] == 0.0
    assert m["train/truncated_frac"] == 0.25 and m["train/response_len_max"] == 5
    assert m["train/response_len_mean"] == 3.5 and m["train/accuracy"] == 0.75 and m["train/reward_failures"] == 0
    assert m["perf/sample_tok_s"] == 14 / m["time/sample"] and m["perf/train_tok_s"] == 18 / m["time/train"]


def test_means_sums_maxima_and_minima_add_up_over_micro_batches():
    stats = StepStats(torch.device("cpu"))
    stats.add("a", torch.tensor(1.0), 2)
    stats.update({"a": (torch.tensor(2.0), 1), "b": (3.0, 0)})  # a count of 0: a mean over nothing is NaN
    stats.add("s", 1.5)
    stats.add("s", 2.0)
    stats.max("x", torch.tensor(-1.0))
    stats.max("x", -3.0)
    stats.min("y", 4.0)
    stats.min("y", torch.tensor(2.0))
    stats.set("v", 7.0)
    stats.max("none", float("-inf"))  # a maximum and a minimum of nothing: NaN too
    stats.min("nothing", float("inf"))
    m = stats.reduce(all_ranks=False)
    assert (m["a"], m["s"], m["x"], m["y"], m["v"]) == (1.0, 3.5, -1.0, 2.0, 7.0)
    assert math.isnan(m["b"]) and math.isnan(m["none"]) and math.isnan(m["nothing"])


def test_grad_norm_is_the_mean_of_the_finite_ones():
    s = LossScaler(enabled=False)
    s.norms = [1.0, math.inf, 3.0]
    assert s.log()["optim/grad_norm"] == 2.0 and s.norms == []
    s.norms = [math.inf]
    assert math.isnan(s.log("critic")["critic/grad_norm"])


def test_minibatches_are_consecutive_shares_cut_into_micro_batches(process_group):
    _, _, device = process_group
    mbs = minibatches([5, 5, 3, 3, 9, 1], 2, 10, device)
    assert [sorted(i for micro in mb for i in micro) for mb in mbs] == [[0, 1, 2], [3, 4, 5]]
    assert minibatch_tokens(mbs, [1, 2, 3, 4, 5, 6], device) == [6.0, 15.0]


def test_memory_peaks_leave_a_sleeping_engines_pool_out(monkeypatch):
    """vLLM's sleep mode releases its pool's GPU memory, but PyTorch still counts the pool's tensors as allocated: the
    mem/*_peak_gib keys leave out what was released while it was. One step as grpo.py runs it (the sample phase's
    memory read before the sampler sleeps), with a 40 GiB pool of which 3 GiB are weights, and a trainer that holds
    18 GiB between phases and peaks at 22, 30 and 24 GiB in the recompute, training and sync."""
    from common import metrics
    G = 2**30
    mem = {"now": 58 * G, "peak": 58 * G}  # PyTorch's allocation and its peak: the trainer's, and the whole pool

    def allocate(n):
        mem["now"] = n
        mem["peak"] = max(mem["peak"], n)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: mem.update(peak=mem["now"]))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem["peak"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * G, 80 * G))
    monkeypatch.setattr(metrics, "_pool", {"released": 40 * G, "peak": 0})  # the step before slept
    stats = StepStats(torch.device("cuda"))
    with stats.phase("sample"):
        metrics.set_released(0)  # awake
        allocate(60 * G)  # sampling's own 2 GiB on top of the trainer's 18
        allocate(58 * G)
        stats.memory("sample")
        metrics.set_released(40 * G)  # asleep
    for phase, peak, end in (("recompute", 62, 58), ("train", 70, 58), ("sync", 61, 58)):
        with stats.phase(phase):
            if phase == "sync":
                metrics.set_released(37 * G)  # the weights woken to be loaded
            allocate(peak * G)
            allocate(end * G)
    v = stats.values
    assert [v[f"mem/{p}_peak_gib"] for p in ("sample", "recompute", "train", "sync")] == [60, 22, 30, 24]
    assert v["mem/train_used_gib"] == 60  # the device's use, as it is
