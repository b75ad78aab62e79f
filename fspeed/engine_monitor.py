"""What `fs.initialize`'s engine shows of its run, as fspeed-train shows it: the monitors (CSV,
TensorBoard, W&B), the wall-clock breakdown's times and a progress line every `steps_per_print`
steps (`train.log_every`, 10, when unset: DeepSpeed's default), written on rank 0 at each
gradient-accumulation boundary (`engine.step()` / `train_batch`).

The parts are fspeed-train's own (`fspeed.cli.observe`): `open_monitors`, `metric_columns`,
`step_timers`, `progress_line`. Where the files go: DeepSpeed's csv_monitor and tensorboard
write in `<output_path>/<job_name>`, so with output_path unset in `./<job_name>`; the engine's run
directory is therefore `./DeepSpeedJobName` (DeepSpeed's default job name): `metrics.csv`,
`tensorboard/` and `wandb/` go there unless the config names a place (output_path, job_name, or
fspeed's monitor.csv_dir / tensorboard_dir / wandb_dir). The monitors are off unless the config
turns them on (DeepSpeed's defaults); the progress line goes to stdout, as DeepSpeed's does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from .monitor import comm_scalars

RUN_DIR = Path("DeepSpeedJobName")
"""The engine's run directory: DeepSpeed's `<output_path>/<job_name>` with both at their defaults."""


class EngineMonitor:
    """The monitors and the progress line of one engine (module docstring). `lead`: this rank
    writes (rank 0); `extra_columns`: the metrics the engine adds (curriculum, layer drop)."""

    def __init__(self, run, lead: bool, extra_columns: tuple[str, ...] = ()):
        from .cli.observe import check_monitor_packages, metric_columns, open_monitors  # noqa: PLC0415

        check_monitor_packages(run)  # every rank: all stop together when a package is missing
        self.lead = lead
        self.print_every = run.train.steps_per_print or run.train.log_every
        self.samples_per_step = run.batch.train_batch_size
        self.monitors = open_monitors(run, RUN_DIR, extra_columns) if lead else None
        self.columns = set(metric_columns(run)) | set(extra_columns)
        self.step = 0
        self._window_start: Optional[float] = None
        self._window_steps = 0
        self._started: Optional[float] = None

    def step_begins(self) -> None:
        """A step's first micro-batch is about to run (the clocks start at the first)."""
        if self._started is None:
            self._started = self._window_start = time.perf_counter()

    def step_done(self, state, metrics: dict[str, Any]) -> None:
        """The boundary's metrics: a monitor row, and every print_every steps the progress line."""
        from .cli.observe import progress_line  # noqa: PLC0415

        if not self.lead:
            return
        self.step_begins()
        now = time.perf_counter()
        self._window_steps += 1
        self.step = state.step
        row = {k: v for k, v in metrics.items() if k in self.columns}  # with the breakdown, curriculum, layer drop
        row.update(samples=state.samples, elapsed_s=now - self._started,
                   samples_per_s=self._window_steps * self.samples_per_step / max(now - self._window_start, 1e-9))
        if self.monitors:
            self.monitors.write(row)
        if state.step % self.print_every == 0:
            print(progress_line(row), flush=True)
            self._window_start, self._window_steps = time.perf_counter(), 0

    def close(self, mesh) -> None:
        """Write the comm log's totals (under a mesh) and close the monitors."""
        if self.monitors:
            if mesh is not None:
                self.monitors.write_scalars(comm_scalars(mesh.log), self.step)
            self.monitors.close()
        self.monitors = None

__all__ = ["EngineMonitor", "RUN_DIR"]
