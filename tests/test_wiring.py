"""The step's wiring, which the loss and correction tests do not see: each test fails when a line of the loop that
connects two tested pieces is wrong (docs/tests.md lists which bug each one catches).
- the loss receives the correction's weights, the normalizers N_seq and L_max, and train/loss is its mean over the
  mini-batches (tests/wiring.py record);
- the training forward runs at --temperature: with one mini-batch, the first update's ratio is 1;
- 1 rank and 2 ranks on the same global batch give the same gradient norm and loss (tests/wiring.py fixed);
- --old-logp mu measures the mismatch on the first mini-batch's forward, which with one mini-batch is pi_old's;
- the mismatch metrics on hand-computed log-ratios; the collapse monitor's state survives a resume; the offline
  analysis' relative error."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from common.metrics import StepStats, mismatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
SMALL = ["--num-steps", "2", "--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2", "--eval-every", "0",
         "--eval-max-problems", "8", "--save-every", "0", "--seed", "5"]


def run(cmd, timeout=600):
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


def steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "train/accuracy" in r]


def test_the_loss_receives_the_weights_and_normalizers_and_train_loss_is_its_mean(tmp_path):
    out, run_dir = str(tmp_path / "calls.json"), str(tmp_path / "run")
    run([sys.executable, "tests/wiring.py", "record", out, "--run-dir", run_dir, *SMALL,
         "--is-correction", "token-tis", "--is-threshold", "1.5"])
    with open(out) as f:
        calls = json.load(f)
    rows = steps(run_dir)
    per_step = len(calls["loss"]) // len(rows)
    for s, row in enumerate(rows):
        losses = calls["loss"][s * per_step:(s + 1) * per_step]
        computed = calls["weights"][s]
        # every response token once a step, with the weight the correction computed for it (not 1: mu is perturbed)
        assert sum(c["tokens"] for c in losses) == computed["tokens"]
        assert computed["weight_sum"] != pytest.approx(computed["tokens"], rel=1e-3)
        assert sum(c["weight_sum"] for c in losses) == pytest.approx(computed["weight_sum"], rel=1e-6)
        # N_seq: the mini-batch's sequences over all ranks (8 x 4 / 2 mini-batches); L_max: --max-response-len
        assert all(c["num_seqs"] == 16 and c["max_response_len"] == 8 for c in losses)
        assert row["train/loss"] == pytest.approx(sum(c["loss"] for c in losses) / 2, rel=1e-6, abs=1e-9)


def test_the_training_forward_runs_at_the_sampling_temperature(tmp_path):
    """One mini-batch: the first (only) update's ratio pi_theta/pi_old is exactly 1 when the training forward divides
    its logits by the same --temperature as the recompute: approx_kl is 0 up to rounding and nothing is clipped."""
    run_dir = str(tmp_path / "run")
    run([sys.executable, "grpo.py", "--run-dir", run_dir, *SMALL, "--num-minibatches", "1", "--temperature", "0.7"])
    for row in steps(run_dir):
        assert row["policy/clip_frac"] == 0 and abs(row["policy/approx_kl"]) < 1e-10


@pytest.mark.parametrize("script_flags", [[], ["--is-correction", "seq-tis"]], ids=["plain", "seq-tis"])
def test_one_rank_and_two_give_the_same_gradient_norm_on_the_same_batch(tmp_path, script_flags):
    """The normalizer counts the sequences of all ranks and each rank's loss is multiplied by the world size (FSDP
    averages gradients): drop either and 2 ranks give half the gradient of 1. The fixed sampler gives both the same
    global batch, and one mini-batch the same optimizer step (with two, each rank's first mini-batch holds its own
    first prompts: another split of the batch); fp32 summation orders differ, so rel 1e-4."""
    rows = {}
    for n in (1, 2):
        run_dir = str(tmp_path / f"ranks{n}")
        run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "tests/wiring.py",
             "fixed", "--run-dir", run_dir, *SMALL, "--num-steps", "1", "--num-minibatches", "1", *script_flags])
        rows[n] = steps(run_dir)[0]
    for key in ("optim/grad_norm", "train/loss", "train/accuracy", "mismatch/kl_k3", "is/weight_mean"):
        assert rows[2][key] == pytest.approx(rows[1][key], rel=1e-4, abs=1e-9), key
    assert rows[1]["optim/grad_norm"] > 0


def test_old_logp_mu_measures_the_mismatch_on_the_first_mini_batch(tmp_path):
    """With one mini-batch the first mini-batch's forward is pi_old's: --old-logp mu must log the mismatch (and the
    entropy) that a recompute gives, from the training forward instead of an extra one."""
    rows = {}
    for mode in ("recompute", "mu"):
        run_dir = str(tmp_path / mode)
        run([sys.executable, "tests/wiring.py", "record", str(tmp_path / f"{mode}.json"), "--run-dir", run_dir,
             *SMALL, "--num-minibatches", "1", "--num-steps", "1", "--old-logp", mode])
        rows[mode] = steps(run_dir)[0]
    for key in ("mismatch/kl_k1", "mismatch/kl_k2", "mismatch/kl_k3", "mismatch/prob_abs_diff_mean",
                "mismatch/prob_abs_diff_max", "mismatch/seq_log_ratio_mean", "mismatch/seq_log_ratio_min",
                "mismatch/seq_log_ratio_max", "is/token_clip_frac", "is/ratio_mean", "train/entropy"):
        assert rows["mu"][key] == pytest.approx(rows["recompute"][key], rel=1e-5, abs=1e-7), key
    assert rows["recompute"]["mismatch/kl_k3"] > 1e-3  # (mu is perturbed: a mismatch to measure)


def test_mismatch_metrics_hand_computed():
    """log-ratios d = log pi_old - log mu of ln 2, 0, -ln 2 (row 0) and ln 3 (row 1, one token)."""
    ln2, ln3 = math.log(2), math.log(3)
    mu = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, 0.0, 0.0]])
    old = mu + torch.tensor([[ln2, 0.0, -ln2], [ln3, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    stats = StepStats(torch.device("cpu"))
    mismatch(stats, old, mu, mask)
    m = stats.reduce(all_ranks=False)
    d = [ln2, 0.0, -ln2, ln3]
    assert m["mismatch/kl_k1"] == pytest.approx(-sum(d) / 4)  # mean of log mu - log pi_old
    assert m["mismatch/kl_k2"] == pytest.approx(sum(0.5 * x * x for x in d) / 4)  # with its 1/2
    assert m["mismatch/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4)  # KL(mu || pi_old)'s
    assert m["mismatch/kl_k3"] != pytest.approx(sum(math.exp(-x) - 1 + x for x in d) / 4)  # not KL(pi_old || mu)'s
    assert m["mismatch/seq_log_ratio_mean"] == pytest.approx(ln3 / 2)  # rows: 0 and ln 3
    assert (m["mismatch/seq_log_ratio_min"], m["mismatch/seq_log_ratio_max"]) == pytest.approx((0.0, ln3))
    mu_t = [-1.0, -2.0, -0.5, -1.5]
    probs = [abs(math.exp(a) - math.exp(a + x)) for a, x in zip(mu_t, d)]
    assert m["mismatch/prob_abs_diff_mean"] == pytest.approx(sum(probs) / 4)
    assert m["mismatch/prob_abs_diff_max"] == pytest.approx(max(probs))


def test_the_collapse_monitor_survives_a_resume(tmp_path):
    """--kl-baseline-steps 1: kl_growth is logged from step 2 on; a run resumed at step 2 logs at step 3 what the
    uninterrupted run logs (the monitor's baseline and window come back from the checkpoint)."""
    flags = [*SMALL, "--num-steps", "3", "--kl-baseline-steps", "1", "--save-every", "1"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run([sys.executable, "grpo.py", "--run-dir", a, *flags])
    run([sys.executable, "grpo.py", "--run-dir", b, *flags, "--num-steps", "2"])
    run([sys.executable, "grpo.py", "--run-dir", b, *flags, "--resume", "latest"])
    ra, rb = steps(a), steps(b)
    assert "mismatch/kl_growth" in ra[2] and rb[2]["step"] == 3
    assert rb[2]["mismatch/kl_growth"] == ra[2]["mismatch/kl_growth"]


def test_offline_analysis_relative_error_is_over_the_mean():
    from sanity.mismatch_analysis import relative_error
    ref = [torch.tensor([-1.0, -3.0]), torch.tensor([-2.0])]
    lp = [torch.tensor([-1.5, -3.0]), torch.tensor([-1.0])]
    r = relative_error(lp, ref)
    assert r["mean_abs_diff"] == pytest.approx(0.5) and r["max_abs_diff"] == pytest.approx(1.0)
    assert r["rel_err_token"] == pytest.approx(0.5 / 2.0)  # mean |diff| over mean |ref|, not over max |ref| (3)
    assert r["rel_err_seq"] == pytest.approx(((4.5 - 4.0) + 1.0) / 2 / ((4.0 + 2.0) / 2))
