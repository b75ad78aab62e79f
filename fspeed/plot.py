"""Plots of a run from its metrics.csv (matplotlib, PNG), and the LR range test's pick.

    fspeed-plot outputs/2026-12-03/16-47-51      # loss.png, lr.png, throughput.png, breakdown.png

The LR range test's pick is the usual one: smooth the loss (bias-corrected exponential moving
average), stop where it diverges (rises above `diverge` x its minimum so far), and take the lr
where it falls fastest per unit of log(lr) before that.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Optional, Sequence

from .monitor import MissingExtraError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MissingExtraError("plotting (fspeed-plot, the LR range test's curve)", "matplotlib") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def read_metrics(path: str | os.PathLike) -> dict[str, list[Optional[float]]]:
    """metrics.csv as columns of floats (None where a row left the cell blank)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path} has no rows")
    return {key: [float(r[key]) if r[key] not in ("", None) else None for r in rows] for key in rows[0]}


def _series(columns: dict, x: str, y: str) -> tuple[list[float], list[float]]:
    pairs = [(a, b) for a, b in zip(columns.get(x, []), columns.get(y, [])) if a is not None and b is not None]
    return [a for a, _ in pairs], [b for _, b in pairs]


def plot_run(run_dir: str | os.PathLike, out_dir: Optional[str | os.PathLike] = None) -> list[Path]:
    """PNGs of a run's metrics.csv: loss (and val loss), lr, throughput, and the wall-clock
    breakdown stacked per step when the run had it. Returns the files written (in `out_dir`,
    default `<run_dir>/plots`)."""
    run_dir = Path(run_dir)
    csv_path = run_dir / "metrics.csv" if run_dir.is_dir() else run_dir
    if not csv_path.is_file():
        raise FileNotFoundError(f"{csv_path}: no metrics.csv (fspeed-train writes it with monitor.csv=true)")
    columns = read_metrics(csv_path)
    out = Path(out_dir) if out_dir is not None else csv_path.parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    written = []

    def figure(name: str, title: str, curves: Sequence[tuple[str, str]], ylabel: str, log: bool = False) -> None:
        drawn = [(label, *_series(columns, "step", key)) for key, label in curves]
        drawn = [d for d in drawn if d[1]]
        if not drawn:
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, xs, ys in drawn:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if log and all(v > 0 for _, _, ys in drawn for v in ys):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)

    figure("loss.png", "loss", [("loss", "train loss"), ("val_loss", "val loss")], "loss")
    figure("lr.png", "learning rate", [("lr", "lr")], "lr")
    figure("throughput.png", "throughput", [("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s")],
           "per second", log=True)
    if "tflops" in columns:
        figure("tflops.png", "model TFLOPS per rank", [("tflops", "TFLOPS")], "TFLOPS")
    if "fwd_ms" in columns:
        steps, parts = _series(columns, "step", "fwd_ms")[0], []
        for key in ("fwd_ms", "bwd_inner_ms", "bwd_allreduce_ms", "step_ms"):
            parts.append(_series(columns, "step", key)[1])
        if steps:
            fig, ax = plt.subplots(figsize=(7, 4))
            ax.stackplot(steps, *parts, labels=["fwd", "bwd_inner", "bwd_allreduce", "step"])
            ax.set(title="wall-clock breakdown", xlabel="step", ylabel="ms per step")
            ax.legend(loc="upper right")
            fig.tight_layout()
            fig.savefig(out / "breakdown.png", dpi=100)
            plt.close(fig)
            written.append(out / "breakdown.png")
    return written


def lr_range_test_pick(lrs: Sequence[float], losses: Sequence[float], *, smoothing: float = 0.9,
                       diverge: float = 4.0) -> tuple[float, int]:
    """(suggested lr, its index): the steepest descent of the smoothed loss against log(lr),
    before the loss diverges (module docstring)."""
    if len(lrs) != len(losses) or len(lrs) < 3:
        raise ValueError(f"an LR range test needs at least 3 (lr, loss) points, got {len(lrs)}")
    smooth, avg, best = [], 0.0, math.inf
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            break
        avg = smoothing * avg + (1 - smoothing) * loss
        value = avg / (1 - smoothing ** (i + 1))
        if i > 0 and value > diverge * best:
            break
        best = min(best, value)
        smooth.append(value)
    if len(smooth) < 3:
        raise ValueError("the loss diverged within the first steps of the LR range test; lower its min lr")
    slopes = [(smooth[i + 1] - smooth[i - 1]) / (math.log(lrs[i + 1]) - math.log(lrs[i - 1]) or math.inf)
              for i in range(1, len(smooth) - 1)]
    index = 1 + min(range(len(slopes)), key=slopes.__getitem__)
    return lrs[index], index


def plot_lr_range_test(lrs: Sequence[float], losses: Sequence[float], path: str | os.PathLike) -> float:
    """The loss against lr (log scale) with the pick marked, as a PNG at `path`; returns the pick."""
    lr, index = lr_range_test_pick(lrs, losses)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(lrs, losses, label="loss")
    ax.axvline(lr, color="tab:red", linestyle="--", label=f"suggested lr {lr:.3g}")
    ax.plot([lr], [losses[index]], "o", color="tab:red")
    ax.set(title="LR range test", xlabel="lr", ylabel="loss", xscale="log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return lr


__all__ = ["lr_range_test_pick", "plot_lr_range_test", "plot_run", "read_metrics"]
