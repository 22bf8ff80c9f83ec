"""sanity/: the perfectible-set builder (band, histogram, resume), the pass criterion on synthetic metrics, the slope
fit, plot_runs, the offline mismatch analysis on a tiny model, and the reduced sanity run end to end on CPU (it must
pass the 0.95 threshold, and fail with an exit status of 1 when the budget cannot reach it)."""
import json
import math
import os
import subprocess
import sys

import pytest

from early_exit import early_exits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, **kw)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------------------------------------------
# the builder

def test_band_and_histogram():
    from sanity.build_perfectible import in_band, rate_histogram
    # the bounds are included although 0.2 * 40 and 0.8 * 40 are not exact in floating point
    assert [n for n in range(41) if in_band(n, 40, 0.2, 0.8)] == list(range(8, 33))
    assert [n for n in range(9) if in_band(n, 8, 0.3, 0.7)] == [3, 4, 5]
    h = rate_histogram([0.0, 0.0, 0.05, 0.2, 0.55, 0.999, 1.0], 4)
    assert h["edges"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert h["counts"] == [4, 0, 1, 2]  # 1.0 falls in the last bin
    assert h["at_0"] == 2 and h["at_1"] == 1


def test_builder_band_histogram_and_resume(tmp_path, process_group, monkeypatch):
    """An interrupted build (16 of 40 problems measured, then a half-written line) resumes without redoing a
    problem, and ends with the same results as an uninterrupted build; the outputs are consistent."""
    import common.sampler
    from tasks.builtin import ensure_builtin_task
    from tasks.data import load_problems
    from sanity.build_perfectible import in_band, main, parse_args
    pool = write_jsonl(tmp_path / "pool.jsonl", read_jsonl(ensure_builtin_task()["train"])[:40])
    sampled = []  # prompts sampled, per build

    def counting(*a, **kw):
        sampler = make_sampler(*a, **kw)
        generate = sampler.generate
        sampler.generate = lambda prompts, *g, **gk: (sampled.extend(prompts), generate(prompts, *g, **gk))[1]
        return sampler
    make_sampler = common.sampler.make_sampler
    monkeypatch.setattr(common.sampler, "make_sampler", counting)
    flags = ["--dataset", pool, "--k", "6", "--chunk-size", "8", "--band-low", "0.3", "--band-high", "0.7"]

    full = str(tmp_path / "full")
    hist = main(parse_args(["--out-dir", full, *flags]))
    assert len(sampled) == 40
    part = str(tmp_path / "part")
    main(parse_args(["--out-dir", part, *flags, "--max-problems", "16"]))
    assert len(sampled) == 40 + 16
    before = open(os.path.join(part, "results.jsonl")).read()
    assert len(before.splitlines()) == 16
    with open(os.path.join(part, "results.jsonl"), "a") as f:
        f.write('{"index": 3, "problem": "1+')  # killed while writing
    main(parse_args(["--out-dir", part, *flags]))
    assert len(sampled) == 40 + 16 + 24  # only the 24 problems not measured before
    after = open(os.path.join(part, "results.jsonl")).read()
    assert after.startswith(before)
    rows = read_jsonl(os.path.join(part, "results.jsonl"))
    assert sorted(r["index"] for r in rows) == list(range(40))
    by_index = lambda rs: {r["index"]: r for r in rs}
    assert by_index(rows) == by_index(read_jsonl(os.path.join(full, "results.jsonl")))  # same streams per chunk

    # the kept set: exactly the in-band problems, in dataset order, with their rate, readable as a --dataset
    kept = read_jsonl(os.path.join(part, "perfectible.jsonl"))
    expect = [r for r in sorted(rows, key=lambda r: r["index"]) if in_band(r["n_correct"], 6, 0.3, 0.7)]
    assert [(k["problem"], k["answer"], k["success_rate"]) for k in kept] == \
           [(r["problem"], r["answer"], r["n_correct"] / 6) for r in expect]
    assert 0 < len(kept) < 40 and all(0.3 <= k["success_rate"] <= 0.7 for k in kept)
    assert len(load_problems(os.path.join(part, "perfectible.jsonl"))) == len(kept)
    with open(os.path.join(part, "histogram.json")) as f:
        h = json.load(f)
    assert h == hist and h["total"] == 40 and h["kept"] == len(kept) and sum(h["counts"]) == 40
    assert open(os.path.join(part, "histogram.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    # a resume with other measurement settings is refused
    with pytest.raises(ValueError, match="other settings"):
        main(parse_args(["--out-dir", part, *flags, "--k", "5"]))

    # run_sanity --perfectible-from: a set kept as a results folder keeps it (results.jsonl.gz, paths of another
    # machine) seeds a new build, which then samples nothing and selects the same set
    import gzip
    from sanity.run_sanity import seed_perfectible
    kept_dir = tmp_path / "kept"
    kept_dir.mkdir()
    with open(os.path.join(full, "results.jsonl"), "rb") as f, gzip.open(kept_dir / "results.jsonl.gz", "wb") as g:
        g.write(f.read())
    config = {**json.load(open(os.path.join(full, "config.json"))), "dataset": "~/elsewhere/pool.jsonl"}
    json.dump(config, open(kept_dir / "config.json", "w"))
    seeded = str(tmp_path / "seeded")
    seed_perfectible(str(kept_dir), seeded, None, pool)
    n = len(sampled)
    main(parse_args(["--out-dir", seeded, *flags]))
    assert len(sampled) == n  # nothing measured again
    assert open(os.path.join(seeded, "perfectible.jsonl")).read() == open(os.path.join(full, "perfectible.jsonl")).read()
    seed_perfectible(str(kept_dir), part, None, pool)  # a set with measurements of its own is left as it is
    assert open(os.path.join(part, "results.jsonl")).read() == after
    with pytest.raises(ValueError, match="other settings"):  # measured with other settings: refused by the builder
        main(parse_args(["--out-dir", seeded, *flags, "--k", "5"]))


# ----------------------------------------------------------------------------------------------------------------
# the pass criterion, the verdict, the slope

def fake_run(path, accs, kl=1e-6):
    os.makedirs(path, exist_ok=True)
    rows = [{"step": i + 1, "train/accuracy": a, "mismatch/kl_k3": kl * (i + 1)} for i, a in enumerate(accs)]
    rows.insert(2, {"step": 2, "eval/eval/accuracy": 0.5})  # evaluation rows are ignored
    write_jsonl(os.path.join(path, "metrics.jsonl"), rows)
    return str(path)


def test_pass_check_on_synthetic_metrics(tmp_path):
    from sanity.report import fmt, pass_check, read_metrics
    run_dir = fake_run(tmp_path / "a", [0.5, 0.9, 0.99, 0.94, 0.96, 0.97, 0.2])
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 8, "train/accur')  # a line being written
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    res = pass_check(rows, threshold=0.95, window=3)
    # 3-step means: .797 .943 .963 .957 .71 -> first pass ends at step 5
    assert res["passed"] and res["steps_to_pass"] == 5 and res["steps_run"] == 7
    assert math.isclose(res["best"], (0.99 + 0.94 + 0.96) / 3)
    assert math.isclose(res["final_kl_k3"], 7e-6)
    res = pass_check(rows, threshold=0.97, window=3)
    assert not res["passed"] and res["steps_to_pass"] is None
    res = pass_check(rows, threshold=0.95, window=1)
    assert res["steps_to_pass"] == 3
    # a mean exactly at the threshold passes (whatever the rounding of the sum)
    exact = [{"step": i + 1, "train/accuracy": a} for i, a in enumerate([0.9, 0.95, 0.95, 0.95, 0.9])]
    assert pass_check(exact, threshold=0.95, window=3)["steps_to_pass"] == 4
    assert not pass_check(exact, threshold=0.951, window=3)["passed"]
    res = pass_check(rows[:2], threshold=0.5, window=3)  # fewer steps than the window
    assert not res["passed"] and math.isnan(res["best"]) and fmt(res["best"]) == "n/a"
    assert pass_check([], 0.9, 3)["steps_run"] == 0
    # a resumed run logs some steps twice: the last one counts
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write("\n" + json.dumps({"step": 7, "train/accuracy": 0.99}) + "\n")
    assert read_metrics(run_dir)[-1]["train/accuracy"] == 0.99 and len(read_metrics(run_dir)) == 7


def test_verdict():
    from sanity.run_sanity import get_verdict
    r = lambda a, p, s: {"algorithm": a, "precision": p, "status": s}
    assert get_verdict([r("grpo", "fp16", "pass"), r("ppo", "fp16", "pass")], ("fp16",)) == "PASS"
    v = get_verdict([r("grpo", "fp16", "pass"), r("grpo", "bf16", "fail")], ("fp16",))
    assert v.startswith("PASS") and "grpo bf16" in v  # a finding, not a defect
    v = get_verdict([r("grpo", "fp16", "error"), r("gspo", "fp16", "fail")], ("fp16",))
    assert v.startswith("FAIL") and "grpo fp16: error" in v and "gspo fp16: fail" in v
    assert get_verdict([r("grpo", "fp16", "pass")], ("fp16",), analysis_ok=False).startswith("FAIL")


def test_algorithms_are_the_scripts_of_the_tree(tmp_path):
    """--algorithms takes every algorithm script read from the tree (cispo.py too, and a fork once its file exists)
    and the CONFIGS; an unknown name is refused in one line that lists what exists."""
    from conftest import SCRIPTS
    from sanity.run_sanity import CONFIGS, configurations, parse_args, validate
    names = [s.removesuffix(".py") for s in SCRIPTS]
    assert "cispo" in names and configurations() == names + list(CONFIGS)
    validate(parse_args(["--algorithms", *configurations()]))
    with pytest.raises(ValueError) as e:
        validate(parse_args(["--algorithms", "grpo", "sac"]))
    message = str(e.value)
    assert message.startswith("--algorithms sac: no such algorithm script") and "\n" not in message
    assert all(name in message for name in configurations())
    (tmp_path / "my_algo.py").write_text("def parse_args(argv=None):\n    pass\n\n\ndef main(args):\n    pass\n")
    assert configurations(str(tmp_path)) == ["my_algo", *CONFIGS]


def test_curve_colors_for_any_configuration():
    from sanity.run_sanity import curve_colors
    colors = curve_colors(["grpo", "my_algo", "cispo", "other_algo", "my_algo"])
    assert colors["grpo"] == "tab:blue" and colors["cispo"] == "tab:cyan"
    assert colors["my_algo"] == "tab:pink" and colors["other_algo"] == "tab:olive"


def test_fit_slope():
    from sanity.mismatch_analysis import fit_slope
    lengths = [10, 200, 1000, 3000, 5000]
    slope, intercept, se = fit_slope(lengths, [0.3 - 0.001 * n for n in lengths])
    assert math.isclose(slope, -0.001, rel_tol=1e-9) and math.isclose(intercept, 0.3, rel_tol=1e-9) and se < 1e-12
    slope, _, se = fit_slope(lengths, [0.3 - 0.001 * n + (-1) ** i * 0.5 for i, n in enumerate(lengths)])
    assert abs(slope + 0.001) < 3e-4 and se > 0
    assert all(math.isnan(x) for x in fit_slope([4, 4, 4], [1.0, 2.0, 3.0]))  # no slope without varying lengths


# ----------------------------------------------------------------------------------------------------------------
# plots

def test_plot_runs_writes_a_png(tmp_path):
    a = fake_run(tmp_path / "a", [0.5, 0.6, 0.7, 0.8], kl=1e-6)
    b = fake_run(tmp_path / "b", [0.4, 0.5, 0.5, 0.9], kl=0.0)  # kl 0: nothing to draw on a log scale, no error
    out = str(tmp_path / "figs" / "curves.png")
    p = run([sys.executable, "sanity/plot_runs.py", a, b, "--keys", "train/accuracy", "mismatch/kl_k3",
             "eval/eval/accuracy", "--smooth", "2", "--out", out])
    assert p.returncode == 0, p.stderr[-2000:]
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(out) > 10_000
    p = run([sys.executable, "sanity/plot_runs.py", str(tmp_path / "missing"), "--out", out])
    assert p.returncode == 2 and "no metrics.jsonl" in p.stderr


def test_plot_curves_rows_of_four_and_raw_evaluations(tmp_path, monkeypatch):
    """Five keys make 2 rows of 4 panels (3 hidden); --smooth averages the training keys, not the evaluation keys
    (logged every few steps: a trailing mean over them would start late and blur the few points there are)."""
    from sanity import report
    plt, figs = report._plt(), []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figure to look at it
    rows = [{"step": s, "train/accuracy": s / 10, "eval/eval/accuracy": s / 10} for s in range(1, 7)]
    report.plot_curves([("run", rows)], ["train/accuracy", "eval/eval/accuracy", "a", "b", "c"],
                       str(tmp_path / "c.png"), smooth=3)
    (fig,) = figs
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(fig.axes) == 8 and len(visible) == 5
    assert list(visible[0].lines[0].get_xdata()) == [3, 4, 5, 6]  # from the first full window on
    assert list(visible[1].lines[0].get_xdata()) == [1, 2, 3, 4, 5, 6]



def test_plot_curves_keeps_a_runs_color_where_another_run_lacks_the_key(tmp_path, monkeypatch):
    """A run without a key (a baseline without kl_ref/*) leaves its color unused in that panel: the second run is
    drawn in the second color in both panels (with matplotlib's color cycle it took the first where it was alone)."""
    from sanity import report
    plt, figs = report._plt(), []
    monkeypatch.setattr(plt, "close", figs.append)
    a = [{"step": s, "train/accuracy": 0.5} for s in range(1, 4)]
    b = [{"step": s, "train/accuracy": 0.6, "kl_ref/kl_k3": 0.1} for s in range(1, 4)]
    report.plot_curves([("a", a), ("b", b)], ["train/accuracy", "kl_ref/kl_k3"], str(tmp_path / "c.png"))
    (fig,) = figs
    acc, kl = fig.axes[:2]
    assert [line.get_label() for line in kl.lines] == ["b"]
    assert kl.lines[0].get_color() == acc.lines[1].get_color() != acc.lines[0].get_color()


# ----------------------------------------------------------------------------------------------------------------
# the offline mismatch analysis

def test_mismatch_analysis_on_a_tiny_model(tiny_model_dir, process_group, tmp_path):
    from sanity.mismatch_analysis import Args, main
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"problem": f"{a}+{b}=", "answer": str(a + b)}
                                                 for a, b in [(1, 2), (13, 4), (7, 75), (21, 9), (5, 5), (66, 3)]])
    out = str(tmp_path / "analysis")
    res = main(Args(out_dir=out, model=tiny_model_dir, dataset=prompts, num_prompts=0, samples=4,
                    precisions=("fp16", "bf16"), prompt_template="{problem}", max_prompt_len=16, max_response_len=12,
                    sampler="hf", micro_batch_tokens=64))
    p = res["precisions"]
    assert list(p) == ["fp32", "fp16", "bf16"] and p["fp32"]["n_seqs"] == 24
    # fp32 on both sides: the same distribution up to kernel rounding
    assert p["fp32"]["kl_k3"] < 1e-9 and abs(p["fp32"]["kl_k1"]) < 1e-5
    for prec in ("fp16", "bf16"):
        assert p[prec]["kl_k3"] > 1e-9 and p[prec]["kl_k2"] > 0
        assert math.isfinite(p[prec]["slope_per_1k"])
    e = res["rel_err"]
    assert 0 < e["fp16"]["rel_err_token"] < e["bf16"]["rel_err_token"] < 0.1  # bf16: 3 fewer mantissa bits
    assert 0 < e["fp16"]["mean_abs_diff"] <= e["fp16"]["max_abs_diff"]
    for name in ("analysis.json", "analysis.md", "scatter.png", "log_ratio_vs_length.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    assert "| fp16 |" in open(os.path.join(out, "analysis.md")).read()


# ----------------------------------------------------------------------------------------------------------------
# the sanity run, reduced: GRPO at fp32 on a small perfectible set of the built-in task

REDUCED = ["--algorithms", "grpo", "--precisions", "fp32", "--must-pass-precisions", "fp32", "--k", "8",
           "--max-problems", "80"]


@pytest.mark.slow
def test_reduced_sanity_run_passes_and_can_fail(tmp_path):
    out = str(tmp_path / "sanity")
    p = run([sys.executable, "sanity/run_sanity.py", "--out-dir", out, *REDUCED, "--num-steps", "150",
             "--analysis-args=--precisions fp32 --num-prompts 16"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["verdict"] == "PASS"
    (r,) = res["runs"]
    assert r["status"] == "pass" and r["best"] >= 0.95 and r["steps_to_pass"] <= 150
    assert 20 < res["perfectible"]["kept"] < 80
    report = open(os.path.join(out, "report.md")).read()
    assert "**Verdict: PASS**" in report and "| grpo | fp32 | yes | PASS |" in report
    assert "## Offline mismatch analysis" in report
    for name in ("curves.png", "perfectible/histogram.png", "analysis/scatter.png", "analysis/log_ratio_vs_length.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0

    # the same set (the builder has nothing left to do), a budget too small to reach the threshold: exit status 1
    p = run([sys.executable, "sanity/run_sanity.py", "--out-dir", out, *REDUCED, "--num-steps", "6", "--no-analysis"])
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "0 to go" in p.stdout
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["verdict"].startswith("FAIL") and res["runs"][0]["status"] == "fail"
    assert res["runs"][0]["steps_run"] == 6


@pytest.mark.slow
def test_parallel_runs_of_grpo_variants_with_the_analysis_beside(tmp_path):
    """--parallel 2: grpo and grpo_token_tis (grpo.py --is-correction token-tis) side by side, the analysis beside
    them; every run gets its own directory, flags and result, in the order asked."""
    out = str(tmp_path / "sanity")
    p = run([sys.executable, "sanity/run_sanity.py", "--out-dir", out, "--algorithms", "grpo", "grpo_token_tis",
             "--precisions", "fp32", "--must-pass-precisions", "fp32", "--k", "8", "--max-problems", "80",
             "--num-steps", "3", "--window", "3", "--no-stop-early", "--parallel", "2", "--stagger-s", "1",
             "--analysis-args=--precisions fp32 --num-prompts 8"])
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # 3 steps cannot pass: a FAIL, not an error
    res = json.load(open(os.path.join(out, "results.json")))
    assert [(r["algorithm"], r["status"], r["steps_run"]) for r in res["runs"]] == [("grpo", "fail", 3),
                                                                                   ("grpo_token_tis", "fail", 3)]
    cfg = {a: json.load(open(os.path.join(out, "runs", f"{a}_fp32", "config.json")))
           for a in ("grpo", "grpo_token_tis")}
    assert cfg["grpo"]["is_correction"] == "none" and cfg["grpo_token_tis"]["is_correction"] == "token-tis"
    assert os.path.exists(os.path.join(out, "analysis", "analysis.json"))  # run beside, waited for
    assert "## Offline mismatch analysis" in open(os.path.join(out, "report.md")).read()


def test_gpu_each_gives_every_run_at_once_its_own_gpu(tmp_path):
    """--gpu-each: the runs at once get CUDA_VISIBLE_DEVICES 0.. --parallel-1, and a run started later gets the GPU
    that a finished one left (not one still in use). Ordered by files, not by time: run a waits for c's file, so c
    can only start in the slot b left."""
    from sanity.run_sanity import Args, run_all
    py = sys.executable
    gate = tmp_path / "c_started"

    def job(name, body):
        d = str(tmp_path / name)
        code = f"import os,pathlib,time\nopen({d!r}+'/gpu','w').write(os.environ['CUDA_VISIBLE_DEVICES'])\n{body}"
        return ({"algorithm": name, "precision": "fp32"}, [py, "-c", code], d, name)
    jobs = [job("a", f"t=time.time()\nwhile not os.path.exists({str(gate)!r}) and time.time()-t<120: time.sleep(0.1)"),
            job("b", ""), job("c", f"pathlib.Path({str(gate)!r}).touch()")]
    run_all(jobs, Args(parallel=2, gpu_each=True, stagger_s=0.0))
    assert [open(tmp_path / n / "gpu").read() for n in "abc"] == ["0", "1", "1"]
    assert gate.exists()


BAD_INPUT = [
    (["--gpu-each", "--nproc-per-node", "2"], "--gpu-each gives each run one GPU"),
    (["--algo-args", "sac=--lr 1"], "expected ALGO=ARGS"),
    (["--algorithms", "sac"], "--algorithms sac: no such algorithm script"),
    (["--parallel", "0"], "--parallel"),
    (["--window", "0"], "--window"),
    (["--dataset", "/nonexistent.jsonl"], "no such file"),
    (["--script-args", "'unbalanced"], "quotation"),
]


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """run_sanity.py on each of BAD_INPUT's command lines, in one process (tests/early_exit.py: it imports torch,
    about 10 s here, for each of the seven processes before)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return early_exits([("sanity/run_sanity.py", args) for args, _ in BAD_INPUT],
                       str(tmp_path_factory.mktemp("bad_input")), env)


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[" ".join(args) for args, _ in BAD_INPUT])
def test_run_sanity_bad_input(bad_input_runs, case):
    p, message = bad_input_runs[case], BAD_INPUT[case][1]
    assert p.returncode == 2 and message in p.stderr, p.stderr[-2000:]
