"""Curves of any set of runs from their metrics.jsonl: one panel per metric key, one line per run.

    python sanity/plot_runs.py runs/grpo_1 runs/gspo_1 --keys train/accuracy mismatch/kl_k3 --out curves.png
    python sanity/plot_runs.py runs/sanity/runs/* --keys train/accuracy --smooth 5 --out acc.png

x is the step; the rows plotted are the training steps (those with train/accuracy; with an eval/ key, the
evaluation rows, drawn raw). Up to 4 panels a row. mismatch/kl_k2, mismatch/kl_k3, policy/approx_kl and
mismatch/prob_abs_diff_mean are drawn on a log scale (--log-keys), where values <= 0 are left out.
"""
import os
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python sanity/plot_runs.py` from anywhere
    sys.path.insert(0, ROOT)

import tyro

from common import exits
from sanity.report import LOG_KEYS, plot_curves, read_metrics


@dataclass
class Args:
    run_dirs: tyro.conf.Positional[tuple[str, ...]]
    """run directories, each with a metrics.jsonl"""
    keys: tuple[str, ...] = ("train/accuracy", "mismatch/kl_k3")
    """metric keys, one panel each"""
    out: str = "curves.png"
    """the PNG file to write"""
    smooth: int = 1
    """draw the trailing mean over this many logged points (1: the raw values); eval/ keys are always drawn raw"""
    log_keys: tuple[str, ...] = LOG_KEYS
    """keys drawn on a log scale"""
    labels: tuple[str, ...] = ()
    """a legend label per run (default: the run directory's name)"""


def main(args: Args) -> None:
    if not args.run_dirs:
        raise ValueError("give at least one run directory")
    if args.labels and len(args.labels) != len(args.run_dirs):
        raise ValueError(f"--labels: {len(args.labels)} labels for {len(args.run_dirs)} runs")
    if args.smooth < 1:
        raise ValueError("--smooth must be >= 1")
    labels = args.labels or [os.path.basename(os.path.normpath(d)) for d in args.run_dirs]
    series = []
    for label, run_dir in zip(labels, args.run_dirs):
        if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
            raise FileNotFoundError(f"{run_dir}: no metrics.jsonl there")
        evals = [k for k in args.keys if k.startswith("eval/")]
        rows = read_metrics(run_dir)
        if evals:  # evaluation rows are separate lines of metrics.jsonl: merge them in by step
            by_step = {r["step"]: dict(r) for r in rows}
            for r in read_metrics(run_dir, key=evals[0]):
                by_step.setdefault(r["step"], {"step": r["step"]}).update(r)
            rows = [by_step[s] for s in sorted(by_step)]
        missing = [k for k in args.keys if not any(k in r for r in rows)]
        if missing:
            print(f"[plot] {run_dir}: no {', '.join(missing)} in metrics.jsonl", file=sys.stderr)
        series.append((label, rows))
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    plot_curves(series, list(args.keys), args.out, log_keys=args.log_keys, smooth=args.smooth)
    print(f"[plot] {len(series)} runs x {len(args.keys)} keys -> {args.out}")


if __name__ == "__main__":
    exits.run(lambda: main(tyro.cli(Args)), __file__, steps=False)
