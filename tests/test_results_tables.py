"""sanity/results_tables.py: the generated tables of docs/results.md and of the results folders' pages agree with the
committed data, a hand edit inside a generated block is caught, a table without a block on any page is refused, and
the tables' numbers are computed right on tiny synthetic runs and benchmark results."""
import json
import os

import pytest

from early_exit import early_exits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "results.md")
CONTROL = os.path.join(ROOT, "sanity", "results", "control_1.5b", "README.md")  # the other page with a block


ROW = "| now | 8.46 | 0.964 | 3.93 | 0.189 | 13.7 (1.39x) |"  # bench_real_step's block


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """{name: (page written, result)}: the command lines of sanity/results_tables.py that the tests below read, in one
    process (tests/early_exit.py; starting it imports torch, about 10 s here, for each of six processes before).
    'default': --check on the default pages; 'page', 'control': --check on docs/results.md, on the control's page
    alone; 'block': --check on a copy of docs/results.md with a number of a generated block edited, 'prose' with a
    sentence outside the blocks edited; 'rewrite': no --check, on a copy with the block edited."""
    tmp = tmp_path_factory.mktemp("results_tables")
    page = open(PAGE, encoding="utf-8").read()
    assert page.count(ROW) == 1
    edits = {"block": page.replace(ROW, ROW.replace("8.46", "8.47")),
             "prose": page.replace("About 0.3 s per step", "About 0.4 s per step"),
             "rewrite": page.replace(ROW, ROW.replace("8.46", "8.47"))}
    for name, text in edits.items():
        (tmp / f"{name}.md").write_text(text, encoding="utf-8")
    check = ["--check", "--pages"]
    cases = {"default": ["--check"], "page": [*check, PAGE], "control": [*check, CONTROL],
             "block": [*check, str(tmp / "block.md"), CONTROL], "prose": [*check, str(tmp / "prose.md"), CONTROL],
             "rewrite": ["--pages", str(tmp / "rewrite.md")]}
    results = early_exits([("sanity/results_tables.py", args) for args in cases.values()], str(tmp), dict(os.environ))
    return {name: (tmp / f"{name}.md", res) for name, res in zip(cases, results)}


def test_pages_match_committed_data(cli):
    _, res = cli["default"]  # the default pages
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_table_needs_a_block_on_some_page(cli):
    _, res = cli["page"]  # the control's table has its block on the other page too, but not only there: fine
    assert res.returncode == 0, res.stdout + res.stderr
    _, res = cli["control"]  # the other page alone lacks the rest
    assert res.returncode != 0 and "no generated block for analysis_135m" in res.stderr


def test_hand_edit_inside_a_block_is_caught(cli):
    _, res = cli["block"]
    assert res.returncode == 1 and "block bench_real_step differs" in res.stdout and res.stdout.count("differs") == 1
    # the prose around the blocks is the page's own: an edit there is not the generator's business
    assert cli["prose"][1].returncode == 0, cli["prose"][1].stdout
    # without --check the block is rewritten from the data and the page is whole again
    edited, res = cli["rewrite"]
    assert res.returncode == 0, res.stdout + res.stderr
    assert edited.read_text(encoding="utf-8") == open(PAGE, encoding="utf-8").read()


def write_run(path, accs, kls, seq_mins, evals, warnings=()):
    os.makedirs(path)
    rows = [{"step": s, "eval/eval/accuracy": a} for s, a in evals.items()]
    rows += [{"step": i + 1, "train/accuracy": a, "mismatch/kl_k3": k, "mismatch/seq_log_ratio_min": m,
              "mismatch/collapse_warning": float(i + 1 in warnings)}
             for i, (a, k, m) in enumerate(zip(accs, kls, seq_mins))]
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def test_runs_table_on_synthetic_metrics(tmp_path):
    from sanity.results_tables import load_run, runs_table
    a = write_run(tmp_path / "a", accs=[0.5, 0.7, 0.9, 1.0], kls=[1e-4, 3e-4, 2e-5, 4e-5],
                  seq_mins=[-0.1, -0.3, -0.2, -0.6], evals={0: 0.25, 2: 0.5, 4: 0.625}, warnings=(3,))
    b = write_run(tmp_path / "b", accs=[0.25, 0.25, 0.5, 0.75], kls=[2e-6, 2e-6, 1e-6, 1e-6], seq_mins=[0.0] * 4,
                  evals={0: 0.125, 4: 0.875})
    rows, evals = load_run(a)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and evals == {0: 0.25, 2: 0.5, 4: 0.625}
    table = runs_table([("A", *load_run(a)), ("B", *load_run(b))], acc_windows=[(1, 2), (3, 4)],
                       kl_windows=[(1, 2), (3, 4)], eval_steps=[0, 4], acc_decimals=3)
    # the means by hand: A's accuracy (0.5 + 0.7) / 2, (0.9 + 1.0) / 2; kl_k3 (1e-4 + 3e-4) / 2, (2e-5 + 4e-5) / 2;
    # seq log-ratio (-0.1 - 0.3 - 0.2 - 0.6) / 4 = -0.3
    assert table.split("\n") == [
        "|  | A | B |",
        "|---|---|---|",
        "| training accuracy, steps 1-2 / 3-4 | 0.600 / 0.950 | 0.250 / 0.625 |",
        "| held-out accuracy, step 0 -> 4 | 0.25 -> 0.62 | 0.12 -> 0.88 |",  # 0.625 and 0.125: round half to even
        "| kl_k3, steps 1-2 -> 3-4 | 2.0e-4 -> 3.0e-5 | 2.0e-6 -> 1.0e-6 |",
        "| most negative sequence log-ratio (mean over steps) | -0.30 | 0.00 |",
        "| collapse warnings | 1 | 0 |"]
    with pytest.raises(ValueError, match="3 of steps 1-4"):  # a window the run did not log in full
        runs_table([("A", rows[:3], evals)], [(1, 4)], [(1, 2)], [0], 2)
    with pytest.raises(ValueError, match="step 3"):
        runs_table([("A", rows, evals)], [(1, 2)], [(1, 2)], [0, 3], 2)


def test_eval_table_on_synthetic_metrics(tmp_path):
    from sanity.results_tables import eval_table, load_run
    a = write_run(tmp_path / "a", accs=[0.5] * 4, kls=[1e-4] * 4, seq_mins=[0.0] * 4, evals={0: 0.25, 2: 0.5, 4: 0.875})
    b = write_run(tmp_path / "b", accs=[0.5] * 4, kls=[1e-4] * 4, seq_mins=[0.0] * 4, evals={0: 0.125, 4: 0.6})
    assert eval_table([("A", *load_run(a)), ("B", *load_run(b))], [0, 4], corner="command",
                      step_label="step {}").split("\n") == [
        "| command | step 0 | step 4 |",
        "|---|---|---|",
        "| A | 0.25 | 0.88 |",  # 0.875: round half to even gives 0.88
        "| B | 0.12 | 0.60 |"]
    with pytest.raises(ValueError, match="B: no held-out accuracy at step 2"):
        eval_table([("B", *load_run(b))], [0, 2], corner="step")


def test_control_table_on_synthetic_metrics(tmp_path):
    from sanity.results_tables import control_table, load_run
    runs = []
    for name, unequal, kl in (("a", [3.0, 0.0, 5.0], [2e-6, 4e-6, 6e-6]), ("b", [0.0] * 3, [0.0] * 3)):
        os.makedirs(tmp_path / name)
        rows = [{"step": 0, "eval/eval/accuracy": 0.25}, {"step": 3, "eval/eval/accuracy": 0.5}]
        rows += [{"step": s, "train/accuracy": 0.5 + 0.1 * s, "train/entropy": 0.2, "mismatch/kl_k3": kl[s - 1],
                  "mismatch/unequal_tokens": unequal[s - 1], "optim/grad_norm": 0.05 * s,
                  "train/response_len_mean": 1000.0 * s, "policy/clip_frac": 1e-4} for s in (1, 2, 3)]
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        runs.append((name.upper(), *load_run(str(tmp_path / name))))
    # means over steps 2-3 by hand: accuracy (0.7 + 0.8) / 2, kl_k3 (4e-6 + 6e-6) / 2 and 0, unequal (0 + 5) / 2,
    # gradient norm (0.1 + 0.15) / 2, length (2000 + 3000) / 2; the steps with any unequal token count all three
    assert control_table(runs, 2, 3, [0, 3]).split("\n") == [
        "|  | A | B |",
        "|---|---|---|",
        "| training accuracy, mean over steps 2-3 | 0.750 | 0.750 |",
        "| entropy (nats per token), mean over steps 2-3 | 0.200 | 0.200 |",
        "| kl_k3, mean over steps 2-3 | 5.0e-6 | 0 |",
        "| unequal tokens a step, mean over steps 2-3 | 2 | 0 |",  # 2.5: round half to even
        "| gradient norm, mean over steps 2-3 | 0.125 | 0.125 |",
        "| response length (tokens), mean over steps 2-3 | 2,500 | 2,500 |",
        "| clip fraction, mean over steps 2-3 | 1.0e-4 | 1.0e-4 |",
        "| steps with any unequal token | 2 of 3 | 0 of 3 |",
        "| held-out accuracy, step 0 -> 3 | 0.25 -> 0.50 | 0.25 -> 0.50 |"]
    with pytest.raises(ValueError, match="no held-out accuracy at step 2"):
        control_table(runs, 2, 3, [0, 2])


def test_bench_tables_on_synthetic_results():
    from sanity.results_tables import rl_step_phases_table, rl_step_runs_table
    step = lambda s, t: {"step": s, "time/sample": t, "time/recompute": 1.0, "time/train": 2.0, "time/sync": 0.5,
                         "time/step": t + 3.5, **{f"mem/{ph}_{k}_gib": float(s) for ph in ("sample", "recompute",
                                                                                              "train", "sync")
                                                   for k in ("peak", "used")}}
    # step 1 carries the one-time costs and is left out: the means are over steps 2-3
    runs = [{"label": "before", "steps": [step(1, 100.0), step(2, 6.0), step(3, 8.0)]},
            {"label": "after", "steps": [step(1, 100.0), step(2, 2.0), step(3, 3.0)]}]
    assert rl_step_runs_table({"rl_step": {"runs": runs}}).split("\n")[2:] == [
        "| before | 7.00 | 1.00 | 2.00 | 0.500 | 10.5 |",
        "| now | 2.50 | 1.00 | 2.00 | 0.500 | 6.00 (1.75x) |"]  # 10.5 / 6.0
    assert rl_step_phases_table({"rl_step": runs[0]}).split("\n")[2:] == [
        "| sampling (vLLM awake) | 7.00 | 2.5 | 2.5 |",  # memory: the mean of 2.0 and 3.0
        "| recompute | 1.00 | 2.5 | 2.5 |",
        "| training (4 optimizer steps) | 2.00 | 2.5 | 2.5 |",
        "| weight sync | 0.500 | 2.5 | 2.5 |",
        "| whole step | 10.5 |  |  |"]


def test_length_and_study_cost_tables_on_synthetic_results(tmp_path, monkeypatch):
    """The length table's means leave step 1 out, and subtract the sleeping pool its log tells of; the projection
    speeds each phase up per doubling by its measured 1 -> 2 gain, at most 2x, and leaves the rest of the step."""
    from sanity import results_tables as rt
    monkeypatch.setattr(rt, "ROOT", str(tmp_path))
    os.makedirs(tmp_path / "f" / "bench")
    os.makedirs(tmp_path / "f" / "logs")
    step = lambda s, t: {"step": s, "time/sample": t, "time/recompute": 10.0, "time/train": 20.0, "time/sync": 1.0,
                         "time/step": t + 36.0, "train/response_len_mean": 100.0, "mem/train_peak_gib": 50.0 + s,
                         "mem/sample_used_gib": 70.0}
    steps = [step(1, 500.0), step(2, 60.0), step(3, 68.0)]
    with open(tmp_path / "f" / "bench" / "r.json", "w") as f:
        json.dump({"rl_step": {"runs": [{"steps": steps, "command": "grpo.py --num-prompts 64 --group-size 8"}]}}, f)
    with open(tmp_path / "f" / "logs" / "r.log", "w") as f:
        f.write("INFO x [cumem.py:271] CuMemAllocator: sleep freed 40.00 GiB memory in total, of which ...\n"
                "INFO y CuMemAllocator: sleep freed 1.00 GiB\n")
    row = rt.length_table("f", [("run", "r")], pool_counted=True).split("\n")[2]
    # means of steps 2-3: 64 s sampling, a 100 s step; 51,200 tokens; training peak 52.5 - 40
    assert row == "| run | 2 | 64.0 | 10.0 | 20.0 | 100 (96.0-104) | 51,200 | 512 | 64% | 12.5 | 70.0 |"
    def ph(step, sample, recompute, train):
        return {"step": step, "time/sample": sample, "time/recompute": recompute, "time/train": train,
                "time/sync": 1.0}
    # the gains come from each phase's mean over steps 3-4 (steps 2 and 5 left out): training 9 / 3, sampling 6 / 4
    scale = ([ph(2, 60.0, 9.0, 1.0), ph(3, 6.0, 4.0, 8.0), ph(4, 6.0, 4.0, 10.0), ph(5, 60.0, 9.0, 1.0)],
             [ph(2, 1.0, 9.0, 9.0), ph(3, 4.0, 2.0, 2.0), ph(4, 4.0, 2.0, 4.0), ph(5, 1.0, 9.0, 9.0)])
    factors, _, projection = rt.study_cost_table(steps, scale, (3, 4), (4,), (1000,)).partition("\n\n")
    assert "| train | 20.0 | 3.00x | 2.00x |" in factors and "| rest of the step | 5.00 | - |" in factors
    # 4 GPUs, two doublings: 64 / 1.5^2 + 10 / 2^2 + 20 / 2^2 + 1 + 5 = 41.9 s; linear: 100 / 4
    assert projection.split("\n")[2:] == ["| 1 | measured | 100 | 27.8 | 28 |",
                                           "| 4 | per phase | 41.9 | 11.7 | 47 |",
                                           "| 4 | linear bound | 25.0 | 6.9 | 28 |"]
    with pytest.raises(ValueError, match="steps 3-6 wanted"):
        rt.study_cost_table(steps, scale, (3, 6), (4,), (1000,))


def test_scale_table_on_synthetic_results():
    """Means over the steps asked for (not the first, nor past the last), the speed-up over the same label's first
    run, recompilations after step 1 by step; a run without every step asked for is an error."""
    from sanity.results_tables import scale_table
    step = lambda s, t: {"step": s, "time/sample": t, "time/reward": s / 4, "time/recompute": 1.0, "time/train": 2.0,
                         "time/sync": 0.5, "time/step": t + 3.5 + s / 4, "mem/train_peak_gib": 30.0 + s}
    one = {"label": "default", "nproc": 1, "steps": [step(s, t) for s, t in [(1, 90), (2, 50), (3, 6), (4, 8)]],
           "recompiles": [{"step": 1}, {"step": 1}]}
    two = {"label": "default", "nproc": 2, "steps": [step(s, t) for s, t in [(1, 90), (2, 50), (3, 2), (4, 3)]],
           "recompiles": [{"step": 1}, {"step": 4}, {"step": 2}, {"step": 4}]}
    rows = scale_table({"rl_step": {"runs": [one, two]}}, 3, 4).split("\n")[2:]
    assert rows == ["| default | 1 | 7.00 | 0.875 | 1.00 | 2.00 | 0.500 | 11.4 (10.2-12.5) | 1.00x | 33.5 | none |",
                    "| default | 2 | 2.50 | 0.875 | 1.00 | 2.00 | 0.500 | 6.88 (6.25-7.50) | 1.65x | 33.5 | 2, 4 |"]
    with pytest.raises(ValueError, match="steps 3-6 wanted"):
        scale_table({"rl_step": {"runs": [one]}}, 3, 6)

    rows = scale_table({"rl_step": {"runs": [two, {**one, "label": "other"}]}}, 3, 4, one_base=True).split("\n")[2:]
    assert [r.split(" | ")[8] for r in rows] == ["1.00x", "0.60x"]  # over the table's first run, whatever its label


def test_scale_runs_and_steps_table_on_synthetic_results(tmp_path, monkeypatch):
    """scale_runs joins the runs of several benchmarks in the order given, a third item relabelling a benchmark's
    runs; steps_table gives every step of each run in order, a column per key in its format."""
    from sanity import results_tables as rt
    monkeypatch.setattr(rt, "ROOT", str(tmp_path))
    for exp, name, labels in [("x", "a", ["p", "q"]), ("y", "b", ["r"])]:
        os.makedirs(tmp_path / "sanity" / "results" / exp / "bench", exist_ok=True)
        with open(tmp_path / "sanity" / "results" / exp / "bench" / f"{name}.json", "w") as f:
            json.dump({"rl_step": {"runs": [{"label": lab, "nproc": i + 1} for i, lab in enumerate(labels)]}}, f)
    runs = rt.scale_runs(("y", "b"), ("x", "a", "again"))["rl_step"]["runs"]
    assert [(r["label"], r["nproc"]) for r in runs] == [("r", 1), ("again", 1), ("again", 2)]

    row = lambda s: {"step": s, "train/loss": -1.5e-4 * s, "optim/grad_norm": 0.05 + s / 1000}
    (tmp_path / "sanity" / "results" / "x" / "u.jsonl").write_text("".join(json.dumps(row(s)) + "\n" for s in (1, 2)))
    (tmp_path / "sanity" / "results" / "y" / "v.jsonl").write_text(json.dumps(row(5)) + "\n")
    keys = [("train/loss", "loss", lambda x: rt.sci(x, 3)), ("optim/grad_norm", "norm", lambda x: rt.sig(x, 4))]
    rows = rt.steps_table([("U", "x/u.jsonl"), ("V", "y/v.jsonl")], keys).split("\n")
    assert rows[0] == "| run | step | loss | norm |"
    assert rows[2:] == ["| U | 1 | -1.50e-4 | 0.05100 |", "| U | 2 | -3.00e-4 | 0.05200 |",
                        "| V | 5 | -7.50e-4 | 0.05500 |"]


def test_checkpoint_and_exact_count_tables_on_synthetic_runs(tmp_path):
    """The checkpoint's size and write time from the saving run's log, the read time and the step resumed from from
    the resumed run's, the next step of both runs side by side; --exact runs' unequal log-probs summed over steps;
    a log without its line, or a resumed run without the next step, is an error."""
    from sanity.results_tables import checkpoint_table, exact_count_table
    (tmp_path / "logs").mkdir(), (tmp_path / "runs").mkdir()
    (tmp_path / "logs" / "a.log").write_text("step 2 | x\n[checkpoint] /t/a/step_000002: 21.34 GB in 33.0 s\n")
    (tmp_path / "logs" / "b.log").write_text("[resume] from /t/a/step_000002 at step 2 (optimizer and state read in "
                                             "12.7 s)\nstep 3 | x\n")
    row = lambda s, acc, n: {"step": s, "train/accuracy": acc, "train/response_len_mean": 400.5 + s,
                             "train/loss": -1.5e-4 * s, "optim/grad_norm": 0.05 + s / 1000,
                             "mismatch/unequal_tokens": n, "time/step": 10.0 + s}
    (tmp_path / "runs" / "a.jsonl").write_text("".join(json.dumps(row(s, 0.25, 0)) + "\n" for s in (1, 2, 3)))
    (tmp_path / "runs" / "b.jsonl").write_text(json.dumps(row(3, 0.5, 2)) + "\n")
    rows = checkpoint_table(str(tmp_path), [("2 -> 1", "a", "b")]).split("\n")[2:]
    assert rows == ["| 2 -> 1 | 21.34 GB in 33.0 s | 12.7 s | 3 | 0.2500 / 0.5000 | 403.5 / 403.5 | -4.500e-4 / "
                    "-4.500e-4 | 0.053000 / 0.053000 |"]
    rows = exact_count_table(str(tmp_path), [("two", "a"), ("resumed", "b")], 10).split("\n")[2:]
    assert rows == ["| two | 1, 2, 3 | 12,075 | 0 | 11.0, 12.0, 13.0 |", "| resumed | 3 | 4,035 | 2 | 13.0 |"]
    (tmp_path / "runs" / "b.jsonl").write_text(json.dumps(row(4, 0.5, 0)) + "\n")
    with pytest.raises(ValueError, match="steps 3-3 wanted"):
        checkpoint_table(str(tmp_path), [("2 -> 1", "a", "b")])
    (tmp_path / "logs" / "b.log").write_text("step 3 | x\n")
    with pytest.raises(ValueError):
        checkpoint_table(str(tmp_path), [("2 -> 1", "a", "b")])


def test_fill_blocks():
    from sanity.results_tables import fill_blocks
    begin = "<!-- generated by python -m sanity.results_tables ({}): do not edit -->"
    end = "<!-- end generated -->"
    page = f"intro\n{begin.format('t')}\n| old |\n{end}\n- item\n  {begin.format('u')}\n  {end}\nafter\n"
    out, changed = fill_blocks(page, {"t": "| a |\n|---|", "u": "| b |"})
    assert out == (f"intro\n{begin.format('t')}\n| a |\n|---|\n{end}\n"
                   f"- item\n  {begin.format('u')}\n  | b |\n  {end}\nafter\n")  # the list item's table indented
    assert changed == ["t", "u"]
    assert fill_blocks(out, {"t": "| a |\n|---|", "u": "| b |"}) == (out, [])
    with pytest.raises(ValueError, match="'u', which is no table"):
        fill_blocks(page, {"t": "| a |"})
    assert fill_blocks(page, {"t": "| a |", "u": "| b |", "v": "| c |"})[0] == fill_blocks(page, {"t": "| a |",
                                                                                             "u": "| b |"})[0]


def test_hand_written_notes_name_the_missing_data():
    """Every table outside a generated block says that it is hand-copied."""
    lines = open(PAGE, encoding="utf-8").read().split("\n")
    inside, tables = False, []
    for i, line in enumerate(lines):
        if "<!-- generated by python -m sanity.results_tables" in line:
            inside = True
        elif "<!-- end generated -->" in line:
            inside = False
        elif not inside and line.lstrip().startswith("|---"):
            tables.append(i - 1)
    assert tables
    for i in tables:  # the paragraph just above the table is its note
        j = i - 1
        while not lines[j].strip():
            j -= 1
        while j > 0 and lines[j - 1].strip():
            j -= 1
        assert lines[j].startswith("*Hand-copied, not regenerated"), \
            f"docs/results.md line {i + 1}: a hand-written table without its note"

