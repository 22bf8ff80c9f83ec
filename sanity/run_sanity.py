"""The perfectible-dataset sanity test (docs/algorithms.md): build the perfectible set, train every algorithm at every
precision on it, and check that training accuracy reaches 95%; then the offline mismatch analysis and a report.

A perfectible set holds only problems the initial model solves sometimes (success rate in [0.2, 0.8] over k
samples), so a sound algorithm drives training accuracy on it to >= 95% (the FP16 study's FP16 runs reach ~97-99%);
failing that is strong evidence of a defect. A configuration passes when train/accuracy averaged over --window
consecutive steps reaches --threshold within --num-steps steps. With --stop-early (the default) a run is stopped at
its first pass to save time, so its final kl_k3 is the one of that step; --no-stop-early runs every budget to the end.

    python sanity/run_sanity.py                            # the built-in task, no downloads (make sanity)
    python sanity/run_sanity.py --precisions fp32 --must-pass-precisions fp32    # the same on a CPU (~10 min)
    python sanity/run_sanity.py --algorithms grpo --precisions fp32 --k 8 --max-problems 80
    python sanity/run_sanity.py --model /path/to/DeepSeek-R1-Distill-Qwen-1.5B --dataset math_train.parquet \\
        --common-args="--sampler vllm" --nproc-per-node 8 --num-steps 300 --out-dir runs/sanity_r1

Steps, each a subprocess whose command is printed (run it alone to redo one part):
  1. sanity/build_perfectible.py -> <out>/perfectible/ (resumes where it stopped)
  2. <algo>.py --dataset <out>/perfectible/perfectible.jsonl --precision <p>, per configuration and precision
     -> <out>/runs/<config>_<p>/ (metrics.jsonl, train.log); watched through metrics.jsonl while it runs;
     --parallel N runs N at once (and the analysis beside them)
  3. sanity/mismatch_analysis.py on the kept problems' prompts -> <out>/analysis/
  4. <out>/report.md with the table, the histogram, the curves (curves.png) and the analysis; results.json
Exit status: 1 if a configuration of --must-pass-precisions fails (or a step crashes), else 0. A failing
precision outside that list (bf16, say) is a finding, reported, not a defect.
"""
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: threads that spin while waiting made
# CPU runs on 2 shared cores 3x slower (docs/results.md, "On a CPU")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python sanity/run_sanity.py` from anywhere
    sys.path.insert(0, ROOT)


from common import exits
from common.cli import config_changes, parse
from sanity.scripts import algorithm_scripts
from sanity.report import fmt, md_table, pass_check, plot_curves, read_metrics

# a configuration other than a script's defaults -> (its script, the flags that make it): the study's grid has three
# GRPO modes
CONFIGS = {"grpo_token_tis": ("grpo", ["--is-correction", "token-tis"]),
           "grpo_seq_mis": ("grpo", ["--is-correction", "seq-mis"]),
           "grpo_exact": ("grpo", ["--exact"])}  # the zero-mismatch control (docs/exact.md; a GPU with vLLM)


def configurations(root: str = ROOT) -> list[str]:
    """What --algorithms takes: every algorithm script of the checkout by its name without .py (sanity/scripts.py:
    a fork is one of them once its file exists), then the CONFIGS."""
    return [s.removesuffix(".py") for s in algorithm_scripts(root)] + list(CONFIGS)


Precision = Literal["fp16", "bf16", "fp32"]


@dataclass
class Args:
    """Defaults are for a real model (--model); without --model the built-in task's preset BUILTIN (below) replaces
    some of them, under the command line; the run prints at start every value that differs from these."""
    out_dir: str = "runs/sanity"
    """where perfectible/, runs/, analysis/, report.md, curves.png and results.json go"""
    model: str | None = None
    """local Hugging Face model directory (default: the built-in task's warm-started model), for every step"""
    dataset: str | None = None
    """the problem pool of the perfectible set (default: the built-in training set)"""
    algorithms: tuple[str, ...] = ("grpo", "pg_is", "gspo", "ppo")
    """the configurations to run: any algorithm script of the repository by its name (a top-level .py that defines
    main and parse_args: grpo, pg_is, gspo, ppo, cispo, a fork), or grpo_token_tis / grpo_seq_mis (grpo.py with
    --is-correction token-tis / seq-mis), e.g. the study's grid: grpo grpo_token_tis grpo_seq_mis pg_is gspo ppo"""
    precisions: tuple[Precision, ...] = ("fp32", "fp16", "bf16")
    """the precisions to run each algorithm at (--precision of the scripts: both sides)"""
    must_pass_precisions: tuple[Precision, ...] = ("fp32", "fp16")
    """precisions whose failure is a defect (exit status 1); the others' failures are reported as findings"""
    num_steps: int = 300
    """the step budget of a run"""
    threshold: float = 0.95
    """pass threshold on training accuracy (averaged over --window steps)"""
    window: int = 5
    """steps the training accuracy is averaged over"""
    stop_early: bool = True
    """stop a run at its first pass (its final kl_k3 is then that step's)"""
    seed: int = 1
    """seed of the builder, the runs and the analysis"""
    nproc_per_node: int = 1
    """ranks per run (torchrun when > 1); the builder and the analysis are single processes"""
    parallel: int = 1
    """runs at once (a small model leaves most of a GPU idle: several runs, each with its own sampler, share it);
    with more than 1 the mismatch analysis runs beside them. Give each a share of the GPU with
    --common-args="--vllm-gpu-memory-utilization X" (X about 0.9 / parallel runs, less the trainers' share)"""
    gpu_each: bool = False
    """one GPU per run at once: the run in slot i of --parallel gets CUDA_VISIBLE_DEVICES=i (needs --parallel GPUs
    and --nproc-per-node 1); e.g. the zero-mismatch control's four arms, one per GPU of a four-GPU machine"""
    stagger_s: float = 20.0
    """seconds between the starts of parallel runs (vLLM measures free memory while its engine starts)"""
    # --- the perfectible set
    k: int = 40
    """responses sampled per problem by the builder"""
    band_low: float = 0.2
    """keep problems whose success rate is >= this"""
    band_high: float = 0.8
    """... and <= this"""
    max_problems: int = 0
    """build from at most this many problems of the pool (0: all)"""
    perfectible_from: str | None = None
    """a perfectible set measured before (a directory with config.json and results.jsonl or results.jsonl.gz, e.g.
    sanity/results/cot_1.5b/perfectible): its measurements are copied into <out-dir>/perfectible under this run's
    model and dataset, so the builder only measures what they lack (the builder refuses them if its measurement
    settings differ, or a row holds another problem than the dataset's)"""
    # --- pass-through arguments: quoted strings, split like a shell; write them as --script-args="--lr 1e-3" (with
    # "=": a value that starts with "--" would otherwise be taken for a flag)
    common_args: str = ""
    """arguments for the builder, every script and the analysis alike, to keep the model's settings equal on all
    sides: --prompt-template, --max-prompt-len, --max-response-len, --temperature, --sampler, --sampler-batch-size,
    --vllm-gpu-memory-utilization (a --reward goes into --builder-args and --script-args)"""
    builder_args: str = ""
    """arguments for sanity/build_perfectible.py only, e.g. --builder-args="--precision bf16 --chunk-size 128\""""
    script_args: str = ""
    """arguments for every algorithm script, e.g. --script-args="--lr 1e-3"; they come after (and so override)
    the ones run_sanity sets: --dataset --precision --run-dir --exp-name --seed --num-steps --eval-every 0
    --save-every 0"""
    algo_args: tuple[str, ...] = ()
    """arguments for one script, as ALGO=ARGS, after --script-args: e.g. "ppo=--critic-lr 1e-3\""""
    analysis: bool = True
    """run the offline mismatch analysis (sanity/mismatch_analysis.py) on the kept problems' prompts"""
    analysis_args: str = ""
    """arguments for sanity/mismatch_analysis.py only, e.g. --analysis-args="--num-prompts 256 --samples 8\""""


# The built-in task's defaults. A 0.4M-parameter model sharpens on a few hundred problems much sooner than on all of
# them: on the 1,767 problems kept from the whole pool only ppo reached 0.95 within 300 steps (at step 221; grpo 0.946,
# pg_is 0.931, gspo 0.915), while on the 236 kept from 256 all four pass (fp32, CPU: grpo at step 125, pg_is 112,
# gspo 160, ppo 88). 4 optimizer steps per rollout batch instead of the scripts' 2 make it sharpen faster per step.
# The fallback sampler, also where vLLM is installed: for a model this small a vLLM engine's start (about a minute
# on a GPU, once per run) would cost more than all its sampling.
BUILTIN = dict(max_problems=256, script_args="--num-minibatches 4", common_args="--sampler hf")


def split(s: str) -> list[str]:
    return shlex.split(s)


def algo_args(args: Args) -> dict[str, list[str]]:
    out, known = {}, configurations()
    for item in args.algo_args:
        algo, sep, rest = item.partition("=")
        if not sep or algo not in known:
            raise ValueError(f"--algo-args {item!r}: expected ALGO=ARGS with ALGO one of {', '.join(known)}")
        out[algo] = out.get(algo, []) + split(rest)
    return out


def seed_perfectible(src: str, set_dir: str, model: str | None, dataset: str | None) -> None:
    """--perfectible-from: src's measurements (results.jsonl, or the .gz a results folder keeps) and config.json into
    set_dir, the model and dataset paths replaced by this run's (as build_perfectible records them), unless set_dir
    holds measurements already."""
    import gzip
    if os.path.exists(os.path.join(set_dir, "results.jsonl")):
        print(f"[sanity] {set_dir} holds measurements already: --perfectible-from {src} not copied", flush=True)
        return
    plain, packed = os.path.join(src, "results.jsonl"), os.path.join(src, "results.jsonl.gz")
    if not os.path.exists(os.path.join(src, "config.json")) or not (os.path.exists(plain) or os.path.exists(packed)):
        raise FileNotFoundError(f"--perfectible-from {src}: expected config.json and results.jsonl(.gz) there")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(out_dir=set_dir, model=os.path.abspath(model) if model else "built-in",
                  dataset=os.path.abspath(dataset) if dataset else "built-in")
    os.makedirs(set_dir, exist_ok=True)
    with (open(plain, "rb") if os.path.exists(plain) else gzip.open(packed, "rb")) as f, \
            open(os.path.join(set_dir, "results.jsonl"), "wb") as out:
        shutil.copyfileobj(f, out)
    with open(os.path.join(set_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(f"[sanity] the perfectible set's measurements from {src}", flush=True)


def run_step(cmd: list[str], what: str) -> None:
    """The builder subprocess, its output on our terminal; a failure ends the sanity run (status 1)."""
    print(f"[sanity] {what}: {shlex.join(cmd)}", flush=True)
    p = subprocess.run(cmd)
    if p.returncode != 0:
        raise SystemExit(f"[sanity] {what} failed (exit status {p.returncode}); see its output above")


class TrainRun:
    """One algorithm script as a subprocess, watched through its metrics.jsonl and stopped at its first pass with
    --stop-early. poll() returns True once it is over; result() gives pass_check's dict plus status ('pass', 'fail'
    or 'error') and seconds."""

    def __init__(self, cmd: list[str], run_dir: str, label: str, args: Args, gpu: int | None = None):
        from tqdm import tqdm
        self.run_dir, self.label, self.args, self.gpu = run_dir, label, args, gpu
        shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl is appended to: start clean
        os.makedirs(run_dir)
        env = dict(os.environ) if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        print(f"[sanity] {label}: {'' if gpu is None else f'CUDA_VISIBLE_DEVICES={gpu} '}{shlex.join(cmd)}",
              flush=True)
        self.t0 = time.perf_counter()
        self.log = open(os.path.join(run_dir, "train.log"), "w")
        # its own process group, so that stopping it stops torchrun's workers too
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.bar = tqdm(total=args.num_steps, desc=label, unit="step", dynamic_ncols=True,
                        mininterval=1 if sys.stderr.isatty() else 30)  # in a log file: a line every 30 s at most
        self.code, self.stopped, self.res = None, False, None

    def poll(self) -> bool:
        self.code = self.proc.poll()
        self.res = pass_check(read_metrics(self.run_dir), self.args.threshold, self.args.window)
        if self.res["steps_run"] > self.bar.n:
            self.bar.set_postfix_str(f"best {self.args.window}-step acc {fmt(self.res['best'])}", refresh=False)
            self.bar.update(self.res["steps_run"] - self.bar.n)
        if self.code is not None:
            return True
        if self.res["passed"] and self.args.stop_early:
            self.stopped = True
            return True
        return False

    def stop(self) -> None:
        """Passed with --stop-early, or we are interrupted (Ctrl-C does not reach its process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.bar.close()
        self.log.close()

    def result(self) -> dict:
        res = dict(self.res)
        res["seconds"] = round(time.perf_counter() - self.t0, 1)
        res["stopped_early"] = self.stopped
        if res["passed"]:
            res["status"] = "pass"
        elif self.code != 0 or not res["steps_run"]:
            res["status"] = "error"
            with open(os.path.join(self.run_dir, "train.log")) as f:
                tail = f.read()[-2000:]
            print(f"[sanity] {self.label} exited with status {self.code}; the end of {self.run_dir}/train.log:\n"
                  f"{tail}", flush=True)
        else:
            res["status"] = "fail"
        print(f"[sanity] {self.label}: {res['status']}, best {self.args.window}-step accuracy {fmt(res['best'])}, "
              f"steps to pass {fmt(res['steps_to_pass'])}, kl_k3 {fmt(res['final_kl_k3'])} ({res['seconds']} s)",
              flush=True)
        return res


def run_all(jobs: list[tuple[dict, list[str], str, str]], args: Args) -> list:
    """Run the (info, cmd, run_dir, label) jobs, --parallel at a time, their starts --stagger-s apart. Returns
    info + result per job, in the jobs' order."""
    results, running, todo = [None] * len(jobs), {}, list(enumerate(jobs))
    last_start = -1e9
    try:
        while todo or running:
            if todo and len(running) < args.parallel and time.perf_counter() - last_start >= (
                    args.stagger_s if args.parallel > 1 else 0):
                i, (info, cmd, run_dir, label) = todo.pop(0)
                gpu = min(set(range(args.parallel)) - {r.gpu for r in running.values()}) if args.gpu_each else None
                running[i] = TrainRun(cmd, run_dir, label, args, gpu)
                last_start = time.perf_counter()
            for i, run in list(running.items()):
                if run.poll():
                    run.stop()
                    results[i] = {**jobs[i][0], "run_dir": jobs[i][2], **run.result()}
                    del running[i]
            time.sleep(1.0)
    finally:
        for run in running.values():
            run.stop()
    return results


def get_verdict(results: list[dict], must_pass_precisions, analysis_ok: bool = True) -> str:
    """'PASS' or 'FAIL (...)': FAIL when a run at a must-pass precision did not pass or the analysis failed. Runs
    at other precisions that did not pass are listed as findings either way."""
    bad = [r for r in results if r["precision"] in must_pass_precisions and r["status"] != "pass"]
    findings = [r for r in results if r["precision"] not in must_pass_precisions and r["status"] != "pass"]
    verdict = "PASS" if not bad and analysis_ok else "FAIL"
    if bad:
        verdict += " (" + ", ".join(f"{r['algorithm']} {r['precision']}: {r['status']}" for r in bad) + ")"
    if not analysis_ok:
        verdict += " (the mismatch analysis failed)"
    if findings:
        verdict += "; not required, did not pass: " + ", ".join(f"{r['algorithm']} {r['precision']}" for r in findings)
    return verdict


def curve_colors(algorithms: list[str]) -> dict[str, str]:
    """A color per configuration in the curves: the study's own, and for any other (a fork) the next unused one."""
    colors = {"grpo": "tab:blue", "grpo_token_tis": "tab:purple", "grpo_seq_mis": "tab:brown", "pg_is": "tab:orange",
              "gspo": "tab:green", "ppo": "tab:red", "cispo": "tab:cyan"}
    others = ["tab:pink", "tab:olive", "tab:gray", "black"]
    for i, algo in enumerate(a for a in dict.fromkeys(algorithms) if a not in colors):
        colors[algo] = others[i % len(others)]
    return colors


def write_report(args: Args, argv: list[str], results: list[dict], hist: dict, verdict: str, out: str) -> None:
    """report.md (with curves.png) in the output directory."""
    from sanity.mismatch_analysis import analysis_markdown
    colors = curve_colors([r["algorithm"] for r in results])
    dashes = {"fp32": ":", "fp16": "-", "bf16": "--"}
    series, styles = [], {}
    for r in results:
        label = f"{r['algorithm']} {r['precision']}"
        series.append((label, read_metrics(r["run_dir"])))
        styles[label] = {"color": colors[r["algorithm"]], "linestyle": dashes[r["precision"]]}
    plot_curves(series, ["train/accuracy", "mismatch/kl_k3"], os.path.join(out, "curves.png"), smooth=args.window,
                styles=styles, hlines={"train/accuracy": args.threshold})

    rows = [[r["algorithm"], r["precision"], "yes" if r["precision"] in args.must_pass_precisions else "no",
             r["status"].upper(), fmt(r["best"]), fmt(r["steps_to_pass"]), r["steps_run"], fmt(r["final_kl_k3"]),
             r["seconds"]] for r in results]
    hist_rows = [[f"[{lo:.2f}, {hi:.2f}{']' if hi == 1 else ')'}", c]
                 for lo, hi, c in zip(hist["edges"], hist["edges"][1:], hist["counts"])]
    text = [
        "# Perfectible-dataset sanity test", "",
        f"Model: {args.model or 'the built-in task'}; pool: {args.dataset or 'the built-in training set'}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}.", "",
        f"Command: `python sanity/run_sanity.py {shlex.join(argv)}`", "",
        f"**Verdict: {verdict}**", "",
        "## The perfectible set", "",
        f"k = {hist['k']} responses per problem from the initial model at temperature 1; kept the {hist['kept']} of "
        f"{hist['total']} problems whose success rate lies in [{hist['band'][0]}, {hist['band'][1]}] (their mean rate "
        f"{fmt(hist['mean_rate_kept'])}; never solved: {hist['at_0']}, always solved: {hist['at_1']}). "
        "Files: `perfectible/perfectible.jsonl`, `perfectible/results.jsonl` (every problem's rate).", "",
        "![success-rate histogram](perfectible/histogram.png)", "",
        md_table(["success rate", "problems"], hist_rows), "",
        "## Training on it", "",
        f"Pass: train/accuracy averaged over {args.window} consecutive steps reaches {args.threshold} within "
        f"{args.num_steps} steps. 'steps to pass' is the last step of the first such window; 'best' the best "
        f"{args.window}-step average; 'final kl_k3' the mismatch/kl_k3 of the last step run"
        + (" (runs stop at their first pass)." if args.stop_early else ".") + " Required: a failure there is a "
        "defect (exit status 1); elsewhere a finding. Runs: `runs/<algorithm>_<precision>/` "
        "(metrics.jsonl, train.log).", "",
        md_table(["algorithm", "precision", "required", "result", f"best {args.window}-step accuracy",
                  "steps to pass", "steps run", "final kl_k3", "seconds"], rows), "",
        f"![training accuracy ({args.window}-step mean) and kl_k3](curves.png)", "",
        "Colors: algorithms; line styles: precisions (fp32 dotted, fp16 solid, bf16 dashed). Redraw any runs with "
        "`python sanity/plot_runs.py RUN_DIR ... --keys train/accuracy mismatch/kl_k3 --out curves.png`.", "",
    ]
    analysis_json = os.path.join(out, "analysis", "analysis.json")
    if args.analysis and os.path.exists(analysis_json):
        with open(analysis_json) as f:
            text += ["## Offline mismatch analysis", "",
                     "The initial model on the kept problems' prompts (`analysis/`).", "",
                     analysis_markdown(json.load(f), "analysis/")]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(text))


# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> Args:
    """The command line over Args' defaults; when it names no --model, over the built-in task's preset BUILTIN."""
    return parse(Args, BUILTIN, argv)


def validate(args: Args) -> None:
    if not args.algorithms or not args.precisions:
        raise ValueError("give at least one algorithm and one precision")
    known = configurations()
    unknown = [a for a in args.algorithms if a not in known]
    if unknown:
        raise ValueError(f"--algorithms {' '.join(unknown)}: no such algorithm script (a top-level .py defining main "
                         f"and parse_args) or configuration; there are {', '.join(known)}")
    if args.num_steps < args.window or args.window < 1:
        raise ValueError(f"need 1 <= --window <= --num-steps, got window {args.window}, num-steps {args.num_steps}")
    if not 0 < args.threshold <= 1:
        raise ValueError(f"--threshold must be in (0, 1], got {args.threshold}")
    if args.nproc_per_node < 1 or args.parallel < 1:
        raise ValueError("--nproc-per-node and --parallel must be >= 1")
    if args.gpu_each and args.nproc_per_node != 1:
        raise ValueError("--gpu-each gives each run one GPU: it goes with --nproc-per-node 1")
    for path, what in ((args.model, "--model"), (args.dataset, "--dataset"),
                       (args.perfectible_from, "--perfectible-from")):
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"{what} {path!r}: no such file or directory")
    algo_args(args)
    for s in (args.common_args, args.builder_args, args.script_args, args.analysis_args):
        split(s)  # an unbalanced quote fails here, before anything runs


def main(args: Args, argv: list[str]) -> int:
    validate(args)
    print(config_changes(args, Args(), BUILTIN if args.model is None else {},
                         f"BUILTIN in {os.path.basename(__file__)} (no --model)"))
    out = args.out_dir
    os.makedirs(out, exist_ok=True)
    common = split(args.common_args) + (["--model", os.path.abspath(args.model)] if args.model else [])
    py = sys.executable
    t0 = time.perf_counter()

    # --- 1. the perfectible set
    set_dir = os.path.join(out, "perfectible")
    if args.perfectible_from:
        seed_perfectible(args.perfectible_from, set_dir, args.model, args.dataset)
    build = [py, os.path.join(ROOT, "sanity", "build_perfectible.py"), "--out-dir", set_dir, "--k", str(args.k),
             "--band-low", str(args.band_low), "--band-high", str(args.band_high), "--seed", str(args.seed),
             "--max-problems", str(args.max_problems), *common, *split(args.builder_args)]
    if args.dataset:
        build += ["--dataset", os.path.abspath(args.dataset)]
    run_step(build, "build the perfectible set")
    kept = os.path.abspath(os.path.join(set_dir, "perfectible.jsonl"))
    with open(os.path.join(set_dir, "histogram.json")) as f:
        hist = json.load(f)
    if hist["kept"] == 0:
        raise SystemExit(f"[sanity] no problem has a success rate in [{args.band_low}, {args.band_high}]: nothing to "
                         "train on (see perfectible/histogram.json)")

    # --- 2. every configuration at every precision (with --parallel > 1 the analysis runs beside them)
    per_algo = algo_args(args)
    launcher = ([py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc_per_node}"]
                if args.nproc_per_node > 1 else [py])
    jobs = []
    for algo in args.algorithms:
        script, flags = CONFIGS.get(algo, (algo, []))
        for prec in args.precisions:
            run_dir = os.path.join(out, "runs", f"{algo}_{prec}")
            cmd = launcher + [os.path.join(ROOT, f"{script}.py"), *flags, "--dataset", kept, "--precision", prec,
                              "--run-dir", run_dir, "--exp-name", f"sanity_{algo}_{prec}", "--seed", str(args.seed),
                              "--num-steps", str(args.num_steps), "--eval-every", "0", "--save-every", "0",
                              *common, *split(args.script_args), *per_algo.get(algo, [])]
            jobs.append(({"algorithm": algo, "precision": prec}, cmd, run_dir, f"{algo} {prec}"))
    analysis_cmd = [py, os.path.join(ROOT, "sanity", "mismatch_analysis.py"), "--dataset", kept, "--out-dir",
                    os.path.join(out, "analysis"), "--seed", str(args.seed), *common, *split(args.analysis_args)]
    analysis = None
    if args.analysis and args.parallel > 1:
        print(f"[sanity] mismatch analysis, beside the runs: {shlex.join(analysis_cmd)}", flush=True)
        os.makedirs(os.path.join(out, "analysis"), exist_ok=True)
        with open(os.path.join(out, "analysis", "analysis.log"), "w") as log:  # the child keeps its own copy
            analysis = subprocess.Popen(analysis_cmd, stdout=log, stderr=subprocess.STDOUT)
    results = run_all(jobs, args)

    # --- 3. the offline mismatch analysis on the kept problems' prompts
    analysis_ok = True
    if analysis is not None:
        analysis_ok = analysis.wait() == 0
    elif args.analysis:
        print(f"[sanity] mismatch analysis: {shlex.join(analysis_cmd)}", flush=True)
        analysis_ok = subprocess.run(analysis_cmd).returncode == 0
    if not analysis_ok:
        print("[sanity] the mismatch analysis failed; see its output" + (" in analysis/analysis.log" if analysis
                                                                         else " above"), flush=True)

    # --- 4. verdict and report
    verdict = get_verdict(results, args.must_pass_precisions, analysis_ok)
    write_report(args, argv, results, hist, verdict, out)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"verdict": verdict, "args": dataclasses.asdict(args), "perfectible": hist, "runs": results}, f,
                  indent=1)
    print(md_table(["algorithm", "precision", "result", f"best {args.window}-step acc", "steps to pass",
                    "final kl_k3"], [[r["algorithm"], r["precision"], r["status"].upper(), fmt(r["best"]),
                                      fmt(r["steps_to_pass"]), fmt(r["final_kl_k3"])] for r in results]))
    print(f"[sanity] {verdict} in {time.perf_counter() - t0:.0f} s; report: {os.path.join(out, 'report.md')}",
          flush=True)
    return 0 if verdict.startswith("PASS") else 1


if __name__ == "__main__":
    sys.exit(exits.run(lambda: main(parse_args(), sys.argv[1:]), __file__, steps=False))
