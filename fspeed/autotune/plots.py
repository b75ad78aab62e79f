"""Plots of a tuning from its results.json: predicted against measured step time, and throughput per layout.

    fspeed-plot autotune/          # autotune_step_time.png, autotune_throughput.png in autotune/plots

The first shows how well the cost model ranked the layouts that ran (a point per trial, the line
where prediction equals measurement); the second each trial's measured samples per second next to
the model's prediction (the global batch over the predicted step time).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from ..plot import _pyplot


def measured_rows(results_json: Path) -> list[dict]:
    """The rows of a tuning's results.json that ran successfully, with both predicted and measured times."""
    rows = json.loads(Path(results_json).read_text())
    return [r for r in rows if r.get("status") == "ok" and r.get("measured_step_s") and r.get("predicted_step_s")]


def plot_tuning(directory: str | os.PathLike, out_dir: Optional[str | os.PathLike] = None) -> list[Path]:
    """PNGs of the tuning in `directory` (its results.json); the files written (in `out_dir`, default
    `<directory>/plots`). ValueError when no trial ran successfully."""
    directory = Path(directory)
    source = directory / "results.json" if directory.is_dir() else directory
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no results.json (fspeed-autotune writes it in autotune.dir)")
    rows = measured_rows(source)
    if not rows:
        raise ValueError(f"{source}: no trial ran successfully, nothing to plot")
    out = Path(out_dir) if out_dir is not None else source.parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    predicted = [r["predicted_step_s"] for r in rows]
    measured = [r["measured_step_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 5))
    ax.scatter(predicted, measured)
    for r in rows:
        ax.annotate(r["configuration"], (r["predicted_step_s"], r["measured_step_s"]), fontsize=6)
    top = max(predicted + measured) * 1.1
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, label="predicted = measured")
    ax.set(title="step time per layout", xlabel="predicted s", ylabel="measured s", xlim=(0, top), ylim=(0, top))
    ax.legend()
    written = [out / "autotune_step_time.png"]
    fig.savefig(written[0], dpi=120, bbox_inches="tight")
    plt.close(fig)
    ordered = sorted(rows, key=lambda r: -r["samples_per_s"])
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(rows) + 1.5))
    positions = range(len(ordered))
    ax.barh([p + 0.2 for p in positions], [r["samples_per_s"] for r in ordered], height=0.4, label="measured")
    ax.barh([p - 0.2 for p in positions],
            [r["samples_per_s"] * r["measured_step_s"] / r["predicted_step_s"] for r in ordered], height=0.4,
            label="predicted")
    ax.set_yticks(list(positions), [r["configuration"] for r in ordered], fontsize=7)
    ax.invert_yaxis()
    ax.set(title="throughput per layout", xlabel="samples/s")
    ax.legend()
    written.append(out / "autotune_throughput.png")
    fig.savefig(written[1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return written


__all__ = ["measured_rows", "plot_tuning"]
