"""The TensorBoard monitor: event files written with `torch.utils.tensorboard.SummaryWriter`.

    tensorboard --logdir outputs/          # reads every run's `tensorboard/` directory

Needs the `tensorboard` package (`pip install 'fspeed[monitor]'`); without it, building the
monitor is a `MissingExtraError`.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from .tags import MissingExtraError, scalars


class TensorBoardMonitor:
    """`write(row)` adds each of the row's scalars at `row["step"]` and flushes (DeepSpeed flushes
    after each event batch too, so a crash loses nothing written)."""

    def __init__(self, log_dir: str | os.PathLike):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise MissingExtraError("the TensorBoard monitor (monitor.tensorboard)", "tensorboard",
                                    "monitor.tensorboard") from None
        self.log_dir = str(log_dir)
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def write(self, row: Mapping[str, Any]) -> None:
        self.write_scalars(scalars(row), int(row["step"]))

    def write_scalars(self, values: Mapping[str, float], step: int) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
