"""The mismatch as a count (common/metrics.py mismatch: mismatch/unequal_tokens, unequal_frac, logp_abs_diff_max):
tokens whose trainer log-prob differs from the sampler's at all, where kl_k3 reads 0; a metric over no tokens is NaN,
never 0; and --exact's skipped recompute (common/cli.py recompute_due) wired the same way in every script."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from common.metrics import StepStats, mismatch
from conftest import SCRIPTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_count_sees_differences_that_kl_k3_rounds_to_zero():
    mu = torch.tensor([[-1e-3, -2.0, -0.5], [-0.25, -3.0, 0.0]])
    old = mu.clone()
    old[0, 0] = torch.nextafter(mu[0, 0], torch.tensor(0.0))  # one fp32 ulp: exp(d) - 1 - d is exactly 0 in fp32
    old[1, 1] = -2.5  # half a nat
    old[1, 2] = -9.0  # off the mask: not counted
    mask = torch.tensor([[True, True, True], [True, True, False]])
    stats = StepStats(torch.device("cpu"))
    mismatch(stats, old, mu, mask)
    out = stats.reduce(all_ranks=False)
    assert out["mismatch/unequal_tokens"] == 2 and out["mismatch/unequal_frac"] == pytest.approx(2 / 5)
    assert out["mismatch/logp_abs_diff_max"] == pytest.approx(0.5)
    only_the_ulp = StepStats(torch.device("cpu"))
    mismatch(only_the_ulp, old[:1], mu[:1], mask[:1])
    ulp = only_the_ulp.reduce(all_ranks=False)
    assert ulp["mismatch/kl_k3"] == 0.0 and ulp["mismatch/unequal_tokens"] == 1  # the estimate can't see it
    assert 0 < ulp["mismatch/logp_abs_diff_max"] < 1e-9


def test_a_mismatch_over_no_tokens_is_nan_not_zero():
    stats = StepStats(torch.device("cpu"))
    mismatch(stats, torch.zeros(2, 3), torch.full((2, 3), -1.0), torch.zeros(2, 3, dtype=torch.bool))
    out = stats.reduce(all_ranks=False)
    for key in ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/unequal_frac", "mismatch/logp_abs_diff_max",
                "mismatch/prob_abs_diff_mean"):
        assert math.isnan(out[key]), key
    assert out["mismatch/unequal_tokens"] == 0  # a sum: no token is unequal


DRIVER = """
import importlib, json, sys
sys.path.insert(0, {root!r})
import common.cli, common.dist, common.logprobs
common.cli.recompute_due = lambda infra, step, first_step: step != 2  # as --exact skips it, on step 2
forwards, recompute = [], common.logprobs.recompute_logprobs
def counted(model, rollout, groups, *a, **k):
    forwards.append(len(groups))
    return recompute(model, rollout, groups, *a, **k)
common.logprobs.recompute_logprobs = counted
for name, *argv in json.loads(sys.argv[1]):  # one run after another in this process
    forwards.clear()
    module = importlib.import_module(name)
    module.main(module.parse_args(argv))
    common.dist.cleanup_distributed()
    print("FORWARDS " + name + " " + json.dumps(forwards), flush=True)
"""


@pytest.fixture(scope="module")
def skipped_recompute(tmp_path_factory):
    """{script: (its run directory, the recompute's micro-batches at each step)}: every script's run through DRIVER,
    all in one process (a start of torch for each took about as long as its three steps)."""
    tmp = tmp_path_factory.mktemp("skipped_recompute")
    runs = [[script[:-3], "--run-dir", str(tmp / script[:-3]), "--num-steps", "3", "--num-prompts", "8",
             "--group-size", "4", "--num-minibatches", "2", "--eval-every", "0", "--save-every", "0", "--seed", "3"]
            for script in SCRIPTS]
    p = subprocess.run([sys.executable, "-c", DRIVER.format(root=ROOT), json.dumps(runs)], cwd=ROOT,
                       capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    forwards = dict(line.split(" ", 2)[1:] for line in p.stdout.splitlines() if line.startswith("FORWARDS "))
    return {script: (tmp / script[:-3], json.loads(forwards[script[:-3]])) for script in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_skipped_recompute_takes_mu_and_measures_on_the_first_mini_batch(script, skipped_recompute):
    """Every script, its step 2's recompute skipped as --exact skips it: no recompute micro-batch runs that step, and
    the mismatch count and the entropy come from the first mini-batch's forward (a part of the batch's tokens, on a
    CPU where the fallback sampler's mu differs from the trainer's in most tokens); steps 1 and 3 recompute all."""
    run_dir, forwards = skipped_recompute[script]
    assert forwards[0] > 0 and forwards[1] == 0 and forwards[2] > 0, forwards
    rows = {r["step"]: r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "mismatch/kl_k3" in r}
    tokens = {s: r["train/response_len_mean"] * 32 for s, r in rows.items()}  # 8 prompts x 4 responses
    assert all("train/entropy" in r and r["mismatch/unequal_tokens"] > 0 for r in rows.values())
    measured = {s: r["mismatch/unequal_tokens"] / r["mismatch/unequal_frac"] for s, r in rows.items()}
    # all of the batch's tokens on the recomputed steps, those of the first of 2 mini-batches on the skipped one
    assert measured[1] == pytest.approx(tokens[1]) and measured[3] == pytest.approx(tokens[3])
    assert 0 < measured[2] < tokens[2] - 0.5
