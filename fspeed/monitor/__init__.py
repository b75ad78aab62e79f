"""Metric monitors: CSV (`metrics.csv`), TensorBoard event files and W&B runs.

A monitor has `write(row)` (one step's metrics by column name, with `step`) and `close()`; the
event monitors also take `write_scalars(values_by_tag, step)` (the comm log's summary).
`Monitors` fans a row out to several. TensorBoard and W&B are optional dependencies
(`pip install 'fspeed[monitor]'`); a missing one is a `MissingExtraError` naming the extra.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .csv_file import TRAIN_COLUMNS, CSVMonitor
from .tags import TAGS, MissingExtraError, comm_scalars, scalars
from .tensorboard_events import TensorBoardMonitor
from .wandb_run import WANDB_MODES, WandbMonitor


class Monitors:
    """Several monitors as one: each row goes to all of them; `close` closes all (even if one fails)."""

    def __init__(self, monitors: Sequence[Any] = ()):
        self.monitors = list(monitors)

    def __bool__(self) -> bool:
        return bool(self.monitors)

    def write(self, row: Mapping[str, Any]) -> None:
        for monitor in self.monitors:
            monitor.write(row)

    def write_scalars(self, values: Mapping[str, float], step: int) -> None:
        """Tagged values at `step` to the monitors that take them (not the CSV file's fixed columns)."""
        for monitor in self.monitors:
            if hasattr(monitor, "write_scalars"):
                monitor.write_scalars(values, step)

    def close(self) -> None:
        errors = []
        for monitor in self.monitors:
            try:
                monitor.close()
            except Exception as err:  # close the others first
                errors.append(err)
        if errors:
            raise errors[0]


__all__ = ["CSVMonitor", "MissingExtraError", "Monitors", "TAGS", "TRAIN_COLUMNS", "TensorBoardMonitor",
           "WANDB_MODES", "WandbMonitor", "comm_scalars", "scalars"]
