"""What fspeed-train shows of a run: its monitors (CSV, TensorBoard, W&B), the wall-clock
breakdown's timers, and the progress output, built from the run's config.

Monitors are rank 0's alone. A monitor whose package is missing is a `ConfigError` naming the
key and the extra to install, raised before training starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any, Optional

from ..config import ConfigError, Problem
from ..config.schema import RunConfig
from ..monitor import TRAIN_COLUMNS, CSVMonitor, MissingExtraError, Monitors, TensorBoardMonitor, WandbMonitor
from ..timers import METRIC_KEYS, StepTimers

THROUGHPUT_COLUMNS = ("tflops", "mfu")


def step_timers(run: RunConfig) -> Optional[StepTimers]:
    """Timers when the breakdown is on (DeepSpeed: `wall_clock_breakdown`, or the flops profiler,
    whose TFLOPS need the step's time); None otherwise, so the step makes no timer calls."""
    return StepTimers() if run.wall_clock_breakdown or run.flops_profiler.enabled else None


def metric_columns(run: RunConfig) -> tuple[str, ...]:
    """metrics.csv's columns for this run: the usual ones, then the breakdown's and throughput's."""
    columns = TRAIN_COLUMNS
    if step_timers(run) is not None:
        columns += METRIC_KEYS
    if run.flops_profiler.enabled:
        columns += THROUGHPUT_COLUMNS
    return columns


def check_monitor_packages(run: RunConfig) -> None:
    """A ConfigError when a configured monitor's package is missing (every rank checks, so all stop)."""
    wanted = {"monitor.tensorboard": (run.monitor.tensorboard, "tensorboard"),
              "monitor.wandb": (run.monitor.wandb, "wandb")}
    problems = [Problem(key, f"needs the {package!r} package, which is not installed: pip install 'fspeed[monitor]'",
                        True) for key, (on, package) in wanted.items() if on and importlib.util.find_spec(package) is None]
    if problems:
        raise ConfigError(problems)


def open_monitors(run: RunConfig, out_dir: Path) -> Monitors:
    """The run's monitors (rank 0 calls this): metrics.csv, TensorBoard, W&B as configured."""
    m = run.monitor
    monitors = []
    try:
        if m.csv:
            monitors.append(CSVMonitor(Path(m.csv_dir or out_dir) / "metrics.csv", metric_columns(run)))
        if m.tensorboard:
            monitors.append(TensorBoardMonitor(m.tensorboard_dir or out_dir / "tensorboard"))
        if m.wandb:
            monitors.append(WandbMonitor(m.wandb_dir or out_dir, project=m.wandb_project, team=m.wandb_team,
                                         group=m.wandb_group, name=m.wandb_name, mode=m.wandb_mode,
                                         config=_plain(run)))
    except MissingExtraError as err:
        Monitors(monitors).close()
        raise ConfigError([Problem(err.key or "monitor", str(err), True)]) from None
    except BaseException:
        Monitors(monitors).close()
        raise
    return Monitors(monitors)


def metrics_csv_path(run: RunConfig, out_dir: Path) -> Optional[Path]:
    return Path(run.monitor.csv_dir or out_dir) / "metrics.csv" if run.monitor.csv else None


def _plain(run: RunConfig) -> dict[str, Any]:
    """The run's config as plain data for W&B's run config (the resolved batch triad left out)."""
    return {f.name: _to_plain(getattr(run, f.name)) for f in dataclasses.fields(run) if f.init}


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


__all__ = ["check_monitor_packages", "metric_columns", "metrics_csv_path", "open_monitors", "step_timers"]
