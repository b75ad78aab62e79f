"""Wall-clock breakdown of a train step: DeepSpeed's `wall_clock_breakdown` timers.

    timers = StepTimers()
    step = make_train_step(model.loss, opt, grad_accum=4, timers=timers)
    state, metrics = step(state, batch)      # metrics["fwd_ms"], ["bwd_ms"], ... for this step

Phases (DeepSpeed's global timer names, summed over the step's micro-batches):

- `fwd`: the forward of every micro-batch (the loss included);
- `bwd_inner`: autograd's backward (gradients reach the runtime's sink, and buckets whose
  reduction is not overlapped are reduced there);
- `bwd_allreduce`: the reduction epilogue at the boundary (waiting for in-flight bucket
  reductions, the last buckets, ZeRO's partition hand-off);
- `bwd` = `bwd_inner + bwd_allreduce`;
- `step`: the rest of the boundary: overflow check and norm, clipping, the optimizer update, the
  write-back (and ZeRO-1/2's start of the parameter all-gather);
- `allgather` (not a phase of its own: it lies inside `fwd` and `bwd_inner`): the time the step
  waited for parameter all-gathers, ZeRO-3's per-unit gathers and ZeRO-1/2's in-flight gather of
  the last update, read from the comm log (which keeps these waits whether or not it logs).

A step's phases cover it up to the split of the batch and the runtime's set-up. Timers are
`time.perf_counter` around each phase; on CUDA each start and stop synchronises the device
first (otherwise the times would be of kernel launches). A step built without timers makes no
timer calls at all.
"""

from __future__ import annotations

import statistics
import time
from typing import Iterable, Mapping, Optional

import torch

PHASES = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
"""DeepSpeed's global timer names, in its log line's order."""

METRIC_KEYS = (*(f"{name}_ms" for name in PHASES), "allgather_ms")
"""The metrics of the breakdown (milliseconds in this step)."""

_MEASURED = ("fwd", "bwd_inner", "bwd_allreduce", "step")


def synced_clock() -> float:
    """`time.perf_counter()` once the CUDA work queued so far is done, where this process uses
    CUDA (a CPU run never initialises it)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


class StepTimers:
    """Per-phase wall-clock totals of the step in progress (see the module docstring).

    `sync_cuda`: synchronise CUDA at each start and stop; None decides at the first start (CUDA
    when it is initialised in this process by then, so a CPU run never touches it).
    """

    def __init__(self, sync_cuda: Optional[bool] = None):
        self.sync_cuda = sync_cuda
        self._totals = dict.fromkeys(_MEASURED, 0.0)
        self._started: dict[str, float] = {}
        self._comm_log = None
        self._gather_waited = 0.0

    def _synchronize(self) -> None:
        if self.sync_cuda is None:
            self.sync_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self.sync_cuda:
            torch.cuda.synchronize()

    def start(self, name: str) -> None:
        if name not in self._totals:
            raise KeyError(f"unknown timer {name!r}; timers are {list(_MEASURED)}")
        self._synchronize()
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        self._synchronize()
        self._totals[name] += time.perf_counter() - self._started.pop(name)

    def begin_step(self, comm_log=None) -> None:
        """A step starts: totals from zero (a step that raised leaves none behind), and the data
        axis' `comm_log` all-gather waits so far, which `end_step` subtracts."""
        self._totals = dict.fromkeys(_MEASURED, 0.0)
        self._started.clear()
        self._comm_log = comm_log
        self._gather_waited = _gather_wait(comm_log)

    def end_step(self) -> dict[str, float]:
        """The step's phases in milliseconds (`fwd_ms`, `bwd_ms`, ..., `allgather_ms`)."""
        ms = {name: seconds * 1e3 for name, seconds in self._totals.items()}
        ms["bwd"] = ms["bwd_inner"] + ms["bwd_allreduce"]
        out = {f"{name}_ms": ms[name] for name in PHASES}
        out["allgather_ms"] = (_gather_wait(self._comm_log) - self._gather_waited) * 1e3
        return out


def _gather_wait(comm_log) -> float:
    """Seconds blocked so far in parameter gathers: ZeRO-3's all-gathers, and the broadcasts from
    each piece's owner that ZeRO-1/2 gather with."""
    if comm_log is None:
        return 0.0
    return comm_log.blocked_by_op.get("all_gather", 0.0) + comm_log.blocked_by_op.get("broadcast", 0.0)


def breakdown_line(metrics: Mapping[str, float]) -> str:
    """DeepSpeed's log line: `time (ms) | fwd: 1.23 | bwd: ... | step: ...` (and the all-gather
    wait when there was one)."""
    line = "time (ms) | " + " | ".join(f"{name}: {metrics[f'{name}_ms']:.2f}" for name in PHASES)
    return line + (f" | allgather: {metrics['allgather_ms']:.2f}" if metrics.get("allgather_ms") else "")


def breakdown_summary(rows: Iterable[Mapping[str, float]], skip_first: int = 1) -> str:
    """A table of each phase's median and mean over steps (after `skip_first` warm-up steps) and
    its share of fwd + bwd + step (allgather lies within fwd and bwd)."""
    rows = [r for r in rows if "fwd_ms" in r]
    rows = rows[skip_first:] if len(rows) > skip_first else rows
    if not rows:
        return "wall-clock breakdown: no steps"
    total = statistics.fmean(r["fwd_ms"] + r["bwd_ms"] + r["step_ms"] for r in rows)
    lines = [f"wall-clock breakdown over {len(rows)} steps (ms per step)",
             f"{'phase':<15}{'median':>10}{'mean':>10}{'share':>8}"]
    for name in (*PHASES, "allgather"):
        values = [r.get(f"{name}_ms", 0.0) for r in rows]
        mean = statistics.fmean(values)
        lines.append(f"{name:<15}{statistics.median(values):>10.2f}{mean:>10.2f}{mean / total:>8.1%}")
    return "\n".join(lines)


__all__ = ["METRIC_KEYS", "PHASES", "StepTimers", "breakdown_line", "breakdown_summary"]
