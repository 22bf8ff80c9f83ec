"""The step's wiring, which the loss and correction tests do not see: each test fails when a line of the loop that
connects two tested pieces is wrong (docs/tests.md lists which bug each one catches). Every algorithm script
(conftest.SCRIPTS) runs the first four and the collapse monitor's:
- the loss receives the correction's weights, its normalizers (N_seq and L_max, or N_tok) and train/loss is its mean
  over the mini-batches (tests/wiring.py record);
- the training forward runs at --temperature: with one mini-batch, the first update's ratio is 1;
- 1 rank and 2 ranks on the same global batch give the same gradient norm and loss (tests/wiring.py fixed);
- --old-logp mu (pg_is.py: --mismatch-from first-minibatch) measures the mismatch on the first mini-batch's forward,
  which with one mini-batch is pi_old's;
- a minimum keeps its sign through StepStats' reduction; the mismatch metrics on hand-computed log-ratios; the
  collapse monitor's state survives a resume; the offline analysis' relative error."""
import ast
import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from common.metrics import StepStats, mismatch
from sanity.scripts import algorithm_scripts
from conftest import SCRIPTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
SMALL = ["--num-steps", "2", "--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2", "--eval-every", "0",
         "--eval-max-problems", "8", "--save-every", "0", "--seed", "5"]
ONE_MINIBATCH = [*SMALL, "--num-steps", "1", "--num-minibatches", "1"]


def run(cmd, timeout=600):
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


def steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "train/accuracy" in r]


def fields(script: str) -> set:
    """The names of the script's Args fields (importing a script has no side effects)."""
    return {f.name for f in dataclasses.fields(importlib.import_module(script[:-len(".py")]).Args)}


def test_the_scripts_list_is_read_from_the_tree(tmp_path):
    """conftest.SCRIPTS (sanity/scripts.py): the top-level files that define main() and parse_args(), not the other
    modules."""
    assert "grpo.py" in SCRIPTS and "corrections.py" not in SCRIPTS and len(SCRIPTS) >= 5
    (tmp_path / "new_algo.py").write_text("def parse_args(argv=None):\n    pass\n\n\ndef main(args):\n    pass\n")
    (tmp_path / "helper.py").write_text("def main():\n    pass\n")
    assert algorithm_scripts(str(tmp_path)) == ["new_algo.py"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """{(script, kind): (its run directory, what tests/wiring.py recorded)}: every run through tests/wiring.py record
    that the tests of this module read, all in one process (wiring.py records; a start of torch for each took about
    as long as its run), each with its own --run-dir. kind 'loss': SMALL, token-tis where the script has the
    corrections; 'recompute' and 'first': one_minibatch's."""
    tmp, runs = tmp_path_factory.mktemp("recorded"), []
    for script in SCRIPTS:
        corrected = "corrections" in fields(script)
        first = ["--old-logp", "mu"] if "old_logp" in fields(script) else ["--mismatch-from", "first-minibatch"]
        for kind, flags in (
                ("loss", [*SMALL, *(["--is-correction", "token-tis", "--is-threshold", "1.5"] if corrected else [])]),
                ("recompute", [*ONE_MINIBATCH, "--temperature", "0.7"]),
                ("first", [*ONE_MINIBATCH, "--temperature", "0.7", *first])):
            d = tmp / f"{script[:-3]}_{kind}"
            runs.append(((script, kind), d, [str(d / "calls.json"), script, "--run-dir", str(d / "run"), *flags]))
    with open(tmp / "runs.json", "w") as f:
        json.dump([cmd for _, _, cmd in runs], f)
    run([sys.executable, "tests/wiring.py", "records", str(tmp / "runs.json")])
    out = {}
    for key, d, _ in runs:
        with open(d / "calls.json") as f:
            out[key] = str(d / "run"), json.load(f)
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_loss_receives_the_weights_and_normalizers_and_train_loss_is_its_mean(recorded, script):
    """The scripts with the rollout corrections: token-tis with mu perturbed, so that the weights are not 1."""
    corrected = "corrections" in fields(script)
    run_dir, calls = recorded[script, "loss"]
    rows = steps(run_dir)
    per_step = len(calls["loss"]) // len(rows)
    assert per_step >= 2 and len(calls["weights"]) == (len(rows) if corrected else 0)
    for s, row in enumerate(rows):
        losses = calls["loss"][s * per_step:(s + 1) * per_step]
        if corrected:
            computed = calls["weights"][s]
            # every response token once a step, with the weight the correction computed for it (not 1: mu perturbed)
            assert sum(c["tokens"] for c in losses) == computed["tokens"]
            assert computed["weight_sum"] != pytest.approx(computed["tokens"], rel=1e-3)
            assert sum(c["weight_sum"] for c in losses) == pytest.approx(computed["weight_sum"], rel=1e-6)
        # N_seq: the mini-batch's sequences over all ranks (8 x 4 / 2 mini-batches); L_max: --max-response-len;
        # N_tok: the mini-batch's response tokens over all ranks, so each mini-batch's calls' tokens add up to it
        assert {"num_seqs", "num_tokens"} & set(losses[0]), losses[0]
        assert all(c.get("num_seqs", 16) == 16 and c.get("max_response_len", 8) == 8 for c in losses)
        if "num_tokens" in losses[0]:
            assert sum(c["tokens"] / c["num_tokens"] for c in losses) == pytest.approx(2)  # 2 mini-batches
        assert row["train/loss"] == pytest.approx(sum(c["loss"] for c in losses) / 2, rel=1e-6, abs=1e-9)


@pytest.fixture(scope="module")
def one_minibatch(recorded):
    """rows(script, mode): the step of a one-mini-batch run at --temperature 0.7 through tests/wiring.py record (mu
    perturbed), pi_old recomputed (mode 'recompute') or from the first mini-batch's forward ('first'); each run once
    (recorded) for the tests that read it. rows.calls(script, mode): what tests/wiring.py recorded in that run."""
    def rows(script, mode):
        return steps(recorded[script, mode][0])[0]
    rows.calls = lambda script, mode: recorded[script, mode][1]
    return rows


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_default_run_imports_no_optional_feature(one_minibatch, script):
    """exact.py and reward_model.py are imported by the scripts only when --exact / --reward-model asks: a run
    without those flags (setup, a step, the end) leaves both out of sys.modules (common/ imports neither)."""
    assert one_minibatch.calls(script, "recompute")["imported"] == []


def common_imports(root: str) -> dict[str, set[str]]:
    """{module of common/: the project modules it imports (anywhere in its file, at the top or inside a function;
    importlib.import_module with a constant name too)}; a project module is one under the checkout's root."""
    def project(name: str) -> str | None:
        top = name.split(".")[0]
        return name if os.path.exists(os.path.join(root, top + ".py")) or os.path.isdir(os.path.join(root, top)) \
            else None
    graph = {}
    for file in sorted(os.listdir(os.path.join(root, "common"))):
        if not file.endswith(".py"):
            continue
        with open(os.path.join(root, "common", file), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)  # and `from common import x`: the module common.x when x is one
                names.update(f"{node.module}.{a.name}" for a in node.names
                             if os.path.isfile(os.path.join(root, *node.module.split("."), a.name + ".py")))
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) \
                    == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
        graph[f"common.{file[:-3]}"] = {n for n in map(project, names) if n and n != "common"} - {"common.__init__"}
    return graph


def test_common_imports_nothing_above_it_and_has_no_cycle(tmp_path):
    """common/ is infrastructure: it imports no script, feature module (exact.py, reward_model.py, corrections.py) or
    task (tasks/), and no two of its modules import each other, directly or round a longer loop."""
    graph = common_imports(ROOT)
    assert "common.fsdp" in graph and graph["common.rundir"] >= {"common.checkpoint", "common.config"}  # (it reads)
    up = {m: sorted(n for n in names if not n.startswith("common.")) for m, names in graph.items()}
    assert not any(up.values()), {m: names for m, names in up.items() if names}

    def cycle_from(node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if found := cycle_from(nxt, path + [nxt]):
                return found
        return None
    assert not any(cycle_from(m, [m]) for m in graph), [cycle_from(m, [m]) for m in graph if cycle_from(m, [m])][0]
    # the check sees what it checks: a copy of common/ with one arrow up and one loop is caught on both counts
    fake = tmp_path / "checkout"
    (fake / "common").mkdir(parents=True)
    (fake / "tasks").mkdir()
    (fake / "grpo.py").write_text("")
    (fake / "common" / "a.py").write_text("def f():\n    from common import b\n    import grpo\n")
    (fake / "common" / "b.py").write_text("import importlib\nimportlib.import_module('common.a')\nimport torch\n")
    fake_graph = common_imports(str(fake))
    assert fake_graph == {"common.a": {"common.b", "grpo"}, "common.b": {"common.a"}}


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_training_forward_runs_at_the_sampling_temperature(one_minibatch, script):
    """One mini-batch: the first (only) update's ratio pi_theta/pi_old is exactly 1 when the training forward divides
    its logits by the same --temperature as the recompute: approx_kl is 0 up to rounding and nothing is clipped."""
    row = one_minibatch(script, "recompute")
    assert abs(row["policy/approx_kl"]) < 1e-10, row["policy/approx_kl"]
    assert row.get("policy/clip_frac", 0) == 0  # (pg_is.py has no clip)


RANK_RUNS = [(s, []) for s in SCRIPTS] + [("grpo.py", ["--is-correction", "seq-tis"])]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """{(script, flags): run directory}: the one-rank side of each RANK_RUNS, tests/wiring.py fixed on a group of one
    (as torchrun --nproc_per_node=1 makes it), all in one process (wiring.py fixed-each)."""
    tmp, dirs = tmp_path_factory.mktemp("one_rank"), {}
    for i, (script, flags) in enumerate(RANK_RUNS):
        dirs[script, tuple(flags)] = str(tmp / f"run{i}")
    with open(tmp / "runs.json", "w") as f:
        json.dump([[script, "--run-dir", d, *ONE_MINIBATCH, *flags] for (script, flags), d in dirs.items()], f)
    run([sys.executable, "tests/wiring.py", "fixed-each", str(tmp / "runs.json")])
    return dirs


@pytest.mark.parametrize("script, script_flags", RANK_RUNS, ids=[s[:-3] for s in SCRIPTS] + ["grpo-seq-tis"])
def test_one_rank_and_two_give_the_same_gradient_norm_on_the_same_batch(one_rank, tmp_path, script, script_flags):
    """The normalizer counts the sequences (or tokens) of all ranks and each rank's loss is multiplied by the world
    size (FSDP averages gradients): drop either and 2 ranks give half the gradient of 1. The fixed sampler gives both
    the same global batch, and one mini-batch the same optimizer step (with two, each rank's first mini-batch holds
    its own first prompts: another split of the batch); fp32 summation orders differ, so rel 1e-4 (and abs 1e-7:
    gspo.py's loss at its first update is 0 up to rounding, its ratios 1 and its advantages summing to 0 in each
    group). ppo.py's critic too."""
    run_dir = str(tmp_path / "ranks2")
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/wiring.py",
         "fixed", script, "--run-dir", run_dir, *ONE_MINIBATCH, *script_flags])
    rows = {1: steps(one_rank[script, tuple(script_flags)])[0], 2: steps(run_dir)[0]}
    keys = [k for k in ("optim/grad_norm", "train/loss", "train/accuracy", "mismatch/kl_k3", "is/weight_mean",
                        "critic/grad_norm", "critic/value_loss") if k in rows[1]]
    assert {"optim/grad_norm", "train/loss", "mismatch/kl_k3"} <= set(keys)
    for key in keys:
        assert rows[2][key] == pytest.approx(rows[1][key], rel=1e-4, abs=1e-7), key
    assert rows[1]["optim/grad_norm"] > 0


@pytest.mark.parametrize("script", SCRIPTS)
def test_old_logp_mu_measures_the_mismatch_on_the_first_mini_batch(one_minibatch, script):
    """With one mini-batch the first mini-batch's forward is pi_old's: --old-logp mu (pg_is.py: --mismatch-from
    first-minibatch) must log the mismatch (and the entropy) that a recompute gives, from the training forward
    instead of an extra one."""
    rows = {mode: one_minibatch(script, mode) for mode in ("recompute", "first")}
    keys = [k for k in ("mismatch/kl_k1", "mismatch/kl_k2", "mismatch/kl_k3", "mismatch/prob_abs_diff_mean",
                        "mismatch/prob_abs_diff_max", "mismatch/seq_log_ratio_mean", "mismatch/seq_log_ratio_min",
                        "mismatch/seq_log_ratio_max", "is/token_clip_frac", "is/ratio_mean", "train/entropy")
            if k in rows["recompute"]]
    assert {"mismatch/kl_k3", "mismatch/seq_log_ratio_min", "train/entropy"} <= set(keys)
    for key in keys:
        assert rows["first"][key] == pytest.approx(rows["recompute"][key], rel=1e-5, abs=1e-7), key
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


def test_a_minimum_keeps_its_sign():
    """StepStats reduces a minimum as the maximum of its negation: the rows' log-ratios sum to -0.5 and 0.25, so
    mismatch/seq_log_ratio_min is -0.5, below the max (with the sign dropped on the way back it was +0.5)."""
    mu = torch.full((2, 2), -1.0)
    old = mu + torch.tensor([[-0.25, -0.25], [0.25, 0.0]])
    stats = StepStats(torch.device("cpu"))
    mismatch(stats, old, mu, torch.ones(2, 2, dtype=torch.bool))
    stats.min("test/min", torch.tensor(2.0))
    stats.min("test/min", -3.0)
    stats.max("test/max", -1.5)
    m = stats.reduce(all_ranks=False)
    assert m["mismatch/seq_log_ratio_min"] == pytest.approx(-0.5)
    assert m["mismatch/seq_log_ratio_max"] == pytest.approx(0.25)
    assert (m["test/min"], m["test/max"]) == (-3.0, -1.5)


@pytest.fixture(scope="module")
def collapse_runs(tmp_path_factory):
    """{script: (run a, run b)}: a, 3 steps with --kl-baseline-steps 1 and a checkpoint each step; b, resumed from a's
    step 2. Every script's run a in one process, then every run b in another (wiring.py plain-each: each as `python
    SCRIPT`), so that the monitor's state can reach b only through the checkpoint."""
    flags = [*SMALL, "--num-steps", "3", "--kl-baseline-steps", "1", "--save-every", "1", "--keep-last", "0"]
    tmp = tmp_path_factory.mktemp("collapse")
    dirs = {script: (str(tmp / f"{script[:-3]}_a"), str(tmp / f"{script[:-3]}_b")) for script in SCRIPTS}
    resume = {script: ["--resume", os.path.join(a, "checkpoints", "step_000002")] for script, (a, _) in dirs.items()}
    for side, runs in (("a", [[script, "--run-dir", a, *flags] for script, (a, _) in dirs.items()]),
                       ("b", [[script, "--run-dir", b, *flags, *resume[script]] for script, (_, b) in dirs.items()])):
        with open(tmp / f"runs_{side}.json", "w") as f:
            json.dump(runs, f)
        run([sys.executable, "tests/wiring.py", "plain-each", str(tmp / f"runs_{side}.json")])
    return dirs


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_collapse_monitor_survives_a_resume(collapse_runs, script):
    """--kl-baseline-steps 1: kl_growth is logged from step 2 on; a run resumed from step 2's checkpoint logs at step
    3 what the uninterrupted run logs (the monitor's baseline and window come back from the checkpoint)."""
    a, b = collapse_runs[script]
    ra, rb = steps(a), steps(b)
    assert "mismatch/kl_growth" in ra[2] and [r["step"] for r in rb] == [3]
    assert rb[0]["mismatch/kl_growth"] == ra[2]["mismatch/kl_growth"]


def test_offline_analysis_relative_error_is_over_the_mean():
    from sanity.mismatch_analysis import relative_error
    ref = [torch.tensor([-1.0, -3.0]), torch.tensor([-2.0])]
    lp = [torch.tensor([-1.5, -3.0]), torch.tensor([-1.0])]
    r = relative_error(lp, ref)
    assert r["mean_abs_diff"] == pytest.approx(0.5) and r["max_abs_diff"] == pytest.approx(1.0)
    assert r["rel_err_token"] == pytest.approx(0.5 / 2.0)  # mean |diff| over mean |ref|, not over max |ref| (3)
    assert r["rel_err_seq"] == pytest.approx(((4.5 - 4.0) + 1.0) / 2 / ((4.0 + 2.0) / 2))
