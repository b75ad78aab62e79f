"""A run's goodput: the time spent in training steps whose results were kept, over the wall time
since the run's first attempt started (restarts included); and the work failures cost.

The wall time starts when the first attempt's process started. Useful time is the sum of the training steps' durations (fetching the batch and the step itself;
not setup, evaluation or saving). Steps a failure undid are not useful: the useful seconds up to a
checkpoint are saved in its client_state (`goodput`: with the run they belong to), and a restarted
attempt continues from the checkpoint's count, not from where the failed attempt got to. A
checkpoint of another run (a manual `checkpoint.resume=true`) starts the count at zero: goodput is
this run's. It is measured at the end of the last step, before the final checkpoint is written. Each
restart costs `steps_redone` (the failed attempt's last step minus the checkpoint's)
and `seconds_lost`: from the last moment the run was at the checkpoint's step (its save, or an
earlier restart's return to it) to the moment the restarted attempt trains again. With restarts
possible, rank 0 keeps the first attempt's start and the restarts in `restarts/run.json`
(`restarts`), so the last attempt reports for the whole run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from .restarts import RECORD_DIR, RUN_FILE, read_json, restart_count, write_json

CLIENT_STATE_KEY = "goodput"
COLUMNS = ("goodput", "steps_redone", "seconds_lost", "restarts")
"""metrics.csv's run-level columns, filled in the last step's row."""


@dataclass(frozen=True)
class Goodput:
    """The run's goodput at its end and what failures cost it."""

    wall_s: float
    useful_s: float
    restarts: int
    steps_redone: int
    seconds_lost: float

    @property
    def value(self) -> float:
        return min(self.useful_s / self.wall_s, 1.0) if self.wall_s > 0 else 0.0

    def line(self) -> str:
        """The summary's line."""
        lost = "no failures" if not self.restarts else (
            f"lost to failures: {self.restarts} restart{'s' if self.restarts > 1 else ''}, "
            f"{self.steps_redone} step{'s' if self.steps_redone != 1 else ''} redone, {self.seconds_lost:.1f}s")
        return (f"goodput {self.value:.3f}: {self.useful_s:.1f}s in useful training steps of {self.wall_s:.1f}s "
                f"since the first attempt started; {lost}")

    def row(self) -> dict[str, Any]:
        """The run-level metrics (metrics.csv's COLUMNS) the last step's row carries."""
        return {"goodput": self.value, "steps_redone": self.steps_redone,
                "seconds_lost": self.seconds_lost, "restarts": self.restarts}

    def scalars(self) -> dict[str, float]:
        """The event monitors' tags (TensorBoard, W&B)."""
        return {"Run/goodput": self.value, "Run/steps_redone": float(self.steps_redone),
                "Run/seconds_lost": self.seconds_lost, "Run/restarts": float(self.restarts)}


def process_start_time() -> float:
    """When this process started (time.time()'s clock), read from /proc on Linux; else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class GoodputLedger:
    """Counts one rank's useful step time and restarts (module docstring); rank 0's is reported.
    `persist`: keep `restarts/run.json` in `out_dir` (rank 0 of a run that may restart); `clock`: the
    wall clock (seconds since the epoch, the same on every process)."""

    def __init__(self, out_dir: Path, persist: bool, clock: Callable[[], float] = time.time):
        self.path, self.persist, self.clock = out_dir / RECORD_DIR / RUN_FILE, persist, clock
        self.attempt = restart_count()
        now = process_start_time()
        saved = read_json(self.path) if persist and self.attempt > 0 else None
        self.lost_start = saved is None and self.attempt > 0 and persist  # the first attempt's start is unknown
        saved = saved if isinstance(saved, dict) else {"started": now, "restarts": [], "ready": None}
        self.started: float = saved["started"]
        self.restarts: list[dict[str, Any]] = saved["restarts"]
        self.ready: Optional[list] = saved.get("ready")  # [step, time]: when training last (re)started
        self.useful_s = 0.0
        self.checkpoint_at: Optional[tuple[int, float]] = None  # (step, time) of the checkpoint resumed from
        self._pending: Optional[dict[str, Any]] = None
        self._save()

    def _save(self) -> None:
        if self.persist:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.path, {"started": self.started, "restarts": self.restarts, "ready": self.ready})

    def resumed(self, client_state: dict[str, Any], step: int) -> None:
        """Continue the useful-time count of a checkpoint of this run (resumed at `step`)."""
        saved = client_state.get(CLIENT_STATE_KEY)
        if isinstance(saved, dict) and saved.get("run_started") == self.started:
            self.useful_s = float(saved["useful_s"])
            self.checkpoint_at = (step, float(saved["time"]))

    def restarted(self, failure: str, resumed_step: int, last_step: int) -> dict[str, Any]:
        """Record this attempt's restart after `failure`; its seconds lost are known once it trains."""
        self._pending = {"attempt": self.attempt, "failure": failure, "resumed_step": resumed_step,
                         "steps_redone": max(last_step - resumed_step, 0), "seconds_lost": 0.0}
        self.restarts.append(self._pending)
        return self._pending

    def training_starts(self, step: int) -> None:
        """Training (re)starts at `step`: a pending restart's seconds lost end here."""
        now = self.clock()
        if self._pending is not None:
            self._pending["seconds_lost"] = now - self._last_time_at(self._pending["resumed_step"])
            self._pending = None
        self.ready = [step, now]
        self._save()

    def _last_time_at(self, step: int) -> float:
        """When the run was last at `step` before the failure: the checkpoint's save or a restart's return."""
        times = [self.started]
        if self.checkpoint_at is not None and self.checkpoint_at[0] == step:
            times.append(self.checkpoint_at[1])
        if self.ready is not None and self.ready[0] == step:
            times.append(self.ready[1])
        return max(times)

    def step_took(self, seconds: float) -> None:
        self.useful_s += seconds

    def client_state(self) -> dict[str, Any]:
        """What a checkpoint carries (CLIENT_STATE_KEY) for a restart to continue the count."""
        return {"run_started": self.started, "useful_s": self.useful_s, "time": self.clock()}

    def report(self) -> Goodput:
        return Goodput(self.clock() - self.started, self.useful_s, len(self.restarts),
                       sum(r["steps_redone"] for r in self.restarts), sum(r["seconds_lost"] for r in self.restarts))
