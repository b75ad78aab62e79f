"""What fspeed-train shows of a run: its monitors (CSV, TensorBoard, W&B), the wall-clock
breakdown's timers, and the progress output, built from the run's config.

Monitors are rank 0's alone. A monitor whose package is missing is a `ConfigError` naming the
key and the extra to install, raised before training starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from ..config import ConfigError, Problem
from ..config.schema import RunConfig
from ..micro_batches import on_device, split_micro_batches
from ..models import Model
from ..monitor import TRAIN_COLUMNS, CSVMonitor, MissingExtraError, Monitors, TensorBoardMonitor, WandbMonitor
from ..parallel import gather_params
from ..plot import lr_range_test_pick, plot_lr_range_test
from ..profile import FlopsProfile, flops, measure_peak_tflops, report, step_tflops
from ..remat_blocks import METRIC_KEYS as REMAT_METRIC_KEYS
from ..timers import METRIC_KEYS, StepTimers, breakdown_line

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
    if run.activation_checkpointing.profile:
        columns += REMAT_METRIC_KEYS
    return columns


def check_monitor_packages(run: RunConfig) -> None:
    """A ConfigError when a configured monitor's package is missing (every rank checks, so all stop)."""
    wanted = {"monitor.tensorboard": (run.monitor.tensorboard, "tensorboard"),
              "monitor.wandb": (run.monitor.wandb, "wandb")}
    missing = [(key, package) for key, (on, package) in wanted.items()
               if on and importlib.util.find_spec(package) is None]
    problems = [Problem(key, f"needs the {package!r} package, which is not installed: pip install 'fspeed[monitor]'",
                        True) for key, package in missing]
    if problems:
        raise ConfigError(problems)


def open_monitors(run: RunConfig, out_dir: Path, extra_columns: tuple[str, ...] = (),
                  resumed_at: Optional[int] = None) -> Monitors:
    """The run's monitors (rank 0 calls this): metrics.csv (with `extra_columns`, the data path's
    metrics; a run resumed at step `resumed_at` sets aside an earlier attempt's rows after it),
    TensorBoard, W&B as configured."""
    m = run.monitor
    monitors = []
    try:
        if m.csv:
            monitors.append(CSVMonitor(Path(m.csv_dir or out_dir) / "metrics.csv",
                                       metric_columns(run) + tuple(extra_columns), resumed_at))
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


class FlopsWatch:
    """The flops profiler in a run: at `flops_profiler.profile_step` rank 0 profiles one micro-batch's
    forward (every rank joins the parameter gather of a sharded state), prints DeepSpeed's report
    with that step's measured backward and optimizer latencies, and from then on adds each step's
    model TFLOPS and MFU (against `peak_tflops`, or a peak measured then) to the metrics."""

    def __init__(self, run: RunConfig, model: Model, mesh, lead: bool, grad_accum: int):
        self.cfg, self.model, self.mesh, self.lead, self.grad_accum = run.flops_profiler, model, mesh, lead, grad_accum
        if self.cfg.enabled and self.cfg.profile_step > run.train.steps:
            raise ConfigError([Problem("flops_profiler.profile_step", f"is after the last step (train.steps="
                                       f"{run.train.steps}): the profiler would never run", self.cfg.profile_step,
                                       f"1..{run.train.steps}")])
        self.profile: Optional[FlopsProfile] = None
        self.peak: Optional[float] = run.flops_profiler.peak_tflops
        self._report_pending = False

    def before_step(self, state, batch) -> None:
        if not self.cfg.enabled or state.step + 1 != self.cfg.profile_step:
            return
        params = state.params.tree() if state.layout.is_local else gather_params(state, self.mesh)
        if not self.lead:
            return
        micro = on_device(split_micro_batches(batch, self.grad_accum)[0], state.params.device)
        self.profile = flops(self.model, params, micro)
        if self.peak is None:
            leaf = state.params.buffer
            self.peak = measure_peak_tflops(leaf.device, leaf.dtype)
        self._report_pending = True

    def after_step(self, state, metrics: dict[str, Any], row: dict[str, Any]) -> None:
        """Add tflops / mfu to `row`; print the report after the profiled step."""
        if self.profile is None:
            return
        step_s = (metrics["fwd_ms"] + metrics["bwd_ms"] + metrics["step_ms"]) / 1e3
        row["tflops"] = step_tflops(self.profile.total_flops, self.grad_accum, step_s, self.cfg.recompute_fwd_factor)
        row["mfu"] = row["tflops"] / self.peak
        if not self._report_pending:
            return
        self._report_pending = False
        world = self.mesh.world_size if self.mesh is not None else 1
        text = report(self.profile, step=state.step, name=self.model.name, world_size=world,
                      data_parallel=self.mesh.size("data") if self.mesh is not None else 1,
                      model_parallel=self.mesh.size("model") if self.mesh is not None else 1,
                      bwd_latency_s=metrics["bwd_ms"] / 1e3 / self.grad_accum,
                      step_latency_s=metrics["step_ms"] / 1e3, recompute_fwd_factor=self.cfg.recompute_fwd_factor,
                      module_depth=self.cfg.module_depth, top_modules=self.cfg.top_modules,
                      detailed_profile=self.cfg.detailed)
        text += (f"\nmodel TFLOPS per rank at step {state.step}: {row['tflops']:.4g}, MFU {row['mfu']:.2%} of a "
                 f"{self.peak:.4g} TFLOPS peak ({'given' if self.cfg.peak_tflops else 'measured'})")
        if self.cfg.output_file:
            Path(self.cfg.output_file).parent.mkdir(parents=True, exist_ok=True)
            Path(self.cfg.output_file).write_text(text + "\n")
        else:
            print(text, flush=True)


def progress_line(row: dict[str, Any]) -> str:
    """A step's progress line (every steps_per_print steps): step, loss, lr, grad norm, throughput,
    then what the run adds (curriculum, layer drop, loss scale, validation, TFLOPS, breakdown)."""
    parts = [f"step {row['step']}", f"loss {row['loss']:.4f}", f"lr {row['lr']:.3e}",
             f"grad_norm {row['grad_norm']:.3f}", f"{row['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in row
             else f"{row['samples_per_s']:,.1f} samples/s"]
    if "curriculum_seqlen" in row:
        parts.append(f"seqlen {row['curriculum_seqlen']}")
    if "curriculum_difficulty" in row:
        parts.append(f"difficulty {row['curriculum_difficulty']}")
    if "pld_theta" in row:
        parts.append(f"pld_theta {row['pld_theta']:.3f}")
    if row.get("loss_scale", 1.0) != 1.0:
        parts.append(f"loss_scale {row['loss_scale']:g}")
    if row.get("skipped"):
        parts.append("SKIPPED (overflow)")
    if "val_loss" in row:
        parts.append(f"val_loss {row['val_loss']:.4f}")
    if "tflops" in row:
        parts.append(f"{row['tflops']:.3g} TFLOPS (MFU {row['mfu']:.1%})")
    if "fwd_ms" in row:
        parts.append(breakdown_line(row))
    return " | ".join(parts)


def finish_lr_range_test(curve: list[tuple[float, float]], out_dir: Path) -> Optional[float]:
    """The LR range test's end: print the suggested lr and write `lr_range_test.png` (loss vs lr, the
    pick marked); without matplotlib the pick is still printed, with the extra to install."""
    try:
        lr, _ = lr_range_test_pick([c[0] for c in curve], [c[1] for c in curve])
    except ValueError as err:
        print(f"\nLR range test: no suggestion: {err}")
        return None
    try:
        plot_lr_range_test([c[0] for c in curve], [c[1] for c in curve], out_dir / "lr_range_test.png")
        where = f"curve: {out_dir / 'lr_range_test.png'}"
    except MissingExtraError as err:
        where = f"no curve: {err}"
    print(f"\nLR range test: suggested lr {lr:.3g} (steepest descent of the smoothed loss before it diverges); {where}")
    return lr


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


DEVICE_PEAKS_DIR = "device_memory"  # rank<r>.json: a CUDA rank's peak allocator bytes (fspeed-autotune reads them)


def record_device_peak(device: torch.device, out_dir: Path) -> int:
    """This rank's peak bytes reserved by the CUDA allocator, also written (with the peak allocated)
    to `out_dir`/device_memory/rank<RANK>.json; returns the reserved peak."""
    peaks = {"max_reserved": torch.cuda.max_memory_reserved(device),
             "max_allocated": torch.cuda.max_memory_allocated(device)}
    folder = Path(out_dir) / DEVICE_PEAKS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(peaks))
    return peaks["max_reserved"]


__all__ = ["DEVICE_PEAKS_DIR", "FlopsWatch", "check_monitor_packages", "finish_lr_range_test", "metric_columns",
           "metrics_csv_path", "open_monitors", "progress_line", "record_device_peak", "step_timers"]
