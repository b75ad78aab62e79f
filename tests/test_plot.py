"""Plots: fspeed-plot's PNGs of a run, the LR range test's pick and its curve at the end of fspeed-train."""

import math
import shutil
import subprocess
import sys

import pytest

from fspeed.monitor import CSVMonitor
from fspeed.plot import lr_range_test_pick, plot_lr_range_test, plot_run
from tests.test_cli import fspeed_train

pytest.importorskip("matplotlib", reason="pip install 'fspeed[monitor]' (the test extra has it)")
PNG = b"\x89PNG\r\n\x1a\n"


def range_test_curve(n=120):
    """A loss falling fastest (per log lr) at lr = 1e-3, then diverging above 1e-2."""
    lrs = [10 ** (-5 + 4 * i / (n - 1)) for i in range(n)]
    losses = [5 - 2 * math.tanh(2 * (math.log10(lr) + 3)) + (50 * (lr - 1e-2) if lr > 1e-2 else 0) for lr in lrs]
    return lrs, losses


def test_lr_range_test_picks_the_steepest_descent_before_divergence():
    lrs, losses = range_test_curve()
    lr, index = lr_range_test_pick(lrs, losses, smoothing=0.0)
    assert lr == pytest.approx(1e-3, rel=0.1) and losses[index] < losses[0]
    smoothed_lr, _ = lr_range_test_pick(lrs, losses)  # the default smoothing lags, never past divergence
    assert 1e-3 <= smoothed_lr < 1e-2
    with pytest.raises(ValueError, match="at least 3"):
        lr_range_test_pick([1e-3], [1.0])
    with pytest.raises(ValueError, match="diverged within the first steps"):
        lr_range_test_pick([1e-4, 1e-3, 1e-2, 1e-1], [1.0, float("nan"), 1.0, 1.0])


def test_plots_are_png_files(tmp_path):
    lrs, losses = range_test_curve(40)
    assert plot_lr_range_test(lrs, losses, tmp_path / "lr.png") == lr_range_test_pick(lrs, losses)[0]
    assert (tmp_path / "lr.png").read_bytes().startswith(PNG)
    with CSVMonitor(tmp_path / "run" / "metrics.csv") as csv_file:
        for step in range(1, 6):
            csv_file.write({"step": step, "loss": 5.0 / step, "lr": 1e-3, "samples_per_s": 10.0 + step})
    written = plot_run(tmp_path / "run")
    assert sorted(p.name for p in written) == ["loss.png", "lr.png", "throughput.png"]  # no breakdown columns
    assert all(p.read_bytes().startswith(PNG) for p in written)
    with pytest.raises(FileNotFoundError, match="no metrics.csv"):
        plot_run(tmp_path / "nothing")


def test_fspeed_plot_writes_pngs_of_a_short_run_and_the_lr_range_test_its_curve(tmp_path):
    run_dir = tmp_path / "run"
    proc = fspeed_train("train.steps=12", "train.eval_every=6", "data.max_bytes=200000", "model.n_layer=1",
                        "model.d_model=32", "model.seq_len=32", "train.micro_batch_size=4", "wall_clock_breakdown=true",
                        "scheduler=lr_range_test", "scheduler.lr_range_test_step_size=1",
                        f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LR range test: suggested lr" in proc.stdout and (run_dir / "lr_range_test.png").read_bytes().startswith(PNG)
    exe = shutil.which("fspeed-plot")
    cmd = [exe] if exe else [sys.executable, "-m", "fspeed.cli.plot"]
    plot = subprocess.run([*cmd, str(run_dir)], capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    names = {line.rsplit("/", 1)[-1] for line in plot.stdout.split()}
    assert names == {"loss.png", "lr.png", "throughput.png", "breakdown.png"}
    for name in names:
        png = (run_dir / "plots" / name).read_bytes()
        assert png.startswith(PNG) and len(png) > 5000
    missing = subprocess.run([*cmd, str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no metrics.csv" in missing.stderr
