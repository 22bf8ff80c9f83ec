"""Shared helpers of sanity/: reading metrics.jsonl, the pass criterion, Markdown tables, and the figures
(matplotlib with the Agg backend: PNG files, no display)."""
import json
import math
import os

# keys drawn on a log scale by default (non-negative, spanning decades); values <= 0 are left out of such a panel
LOG_KEYS = ("mismatch/kl_k2", "mismatch/kl_k3", "policy/approx_kl", "mismatch/prob_abs_diff_mean")


def read_metrics(run_dir: str, key: str = "train/accuracy") -> list[dict]:
    """The training rows (those with `key`) of <run_dir>/metrics.jsonl, one per step (the last one logged for a
    step, as after a resume), in step order. A line being written (no newline yet) is ignored."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    by_step = {}
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if key in row:
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def trailing_mean(values: list[float], window: int) -> list[float]:
    """out[j] = mean(values[j : j + window]): the mean over the `window` steps ending at step j + window - 1."""
    return [sum(values[j:j + window]) / window for j in range(len(values) - window + 1)]


def pass_check(rows: list[dict], threshold: float, window: int) -> dict:
    """The sanity criterion on one run's training rows: training accuracy averaged over `window` consecutive steps
    reaches `threshold`. Returns passed, best (the best such average), steps_to_pass (the step that ends the first
    window at or above the threshold; None if none), steps_run, final_kl_k3 (mismatch/kl_k3 of the last step)."""
    acc = [r["train/accuracy"] for r in rows]
    means = trailing_mean(acc, window)
    first = next((j for j, m in enumerate(means) if m >= threshold - 1e-9), None)  # 0.95 * 3 / 3 < 0.95 in floats
    return {"passed": first is not None,
            "best": max(means) if means else float("nan"),
            "steps_to_pass": rows[first + window - 1]["step"] if first is not None else None,
            "steps_run": rows[-1]["step"] if rows else 0,
            "final_kl_k3": rows[-1].get("mismatch/kl_k3", float("nan")) if rows else float("nan")}


def fmt(x, spec: str = ".3g") -> str:
    """A number for a table; None and NaN are n/a."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float) and spec == ".3g" and x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
        return f"{x:.2e}"
    return format(x, spec)


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Figures

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_curves(series: list[tuple[str, list[dict]]], keys: list[str], out: str, log_keys=LOG_KEYS, smooth: int = 1,
                styles: dict | None = None, hlines: dict | None = None, title: str | None = None) -> None:
    """One panel per key, one line per (label, rows) series, x = step. smooth > 1 draws the trailing mean over that
    many steps (from the first full window on; evaluation keys, logged every few steps, are drawn raw). Up to 4
    panels a row. A series keeps its color in every panel, also where another series has no such key (the colors
    follow the order of `series`). styles: label -> matplotlib line kwargs; hlines: key -> y of a dashed reference
    line."""
    plt = _plt()
    ncols = min(4, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4 * nrows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        drawn = False
        window = 1 if key.startswith("eval/") else smooth
        for i, (label, rows) in enumerate(series):
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if window > 1:
                ys = trailing_mean([y for _, y in pts], window)
                pts = [(s, y) for (s, _), y in zip(pts[window - 1:], ys)]
            if key in log_keys:
                pts = [(s, y) for s, y in pts if y > 0 and math.isfinite(y)]
            if pts:
                ax.plot([s for s, _ in pts], [y for _, y in pts], label=label,
                        **{"color": f"C{i % 10}", **(styles or {}).get(label, {})})
                drawn = True
        if key in log_keys and drawn:
            ax.set_yscale("log")
        if hlines and key in hlines:
            ax.axhline(hlines[key], color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("step")
        ax.set_title(key + (f" (mean over {window} steps)" if window > 1 else ""), fontsize=10)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_histogram(hist: dict, out: str) -> None:
    """The success-rate histogram of build_perfectible.py, the kept band shaded."""
    plt = _plt()
    edges, counts = hist["edges"], hist["counts"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.bar(edges[:-1], counts, width=[b - a for a, b in zip(edges, edges[1:])], align="edge", edgecolor="black",
           color="tab:blue")
    ax.axvspan(hist["band"][0], hist["band"][1], color="tab:green", alpha=0.15, label="kept band", zorder=0)
    ax.set_xlabel(f"success rate over k={hist['k']} samples")
    ax.set_ylabel("problems")
    ax.set_title(f"kept {hist['kept']} of {hist['total']} problems", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
