"""The W&B monitor: a Weights & Biases run, offline by default (no network; `wandb sync` uploads it).

The run lives in `<dir>/wandb/offline-run-<time>-<id>/`; project, team (W&B entity), group and
run name are DeepSpeed's `wandb` block's keys. W&B's system-statistics sampler is off (it polls
hardware and cloud metadata endpoints, which an offline run has no use for). Needs the `wandb`
package (`pip install 'fspeed[monitor]'`).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from .tags import MissingExtraError, scalars

WANDB_MODES = ("offline", "online")


class WandbMonitor:
    """`write(row)` logs the row's scalars at `row["step"]`; `close()` finishes the run."""

    def __init__(self, directory: str | os.PathLike, *, project: str, team: Optional[str] = None,
                 group: Optional[str] = None, name: Optional[str] = None, mode: str = "offline",
                 config: Optional[Mapping[str, Any]] = None):
        if mode not in WANDB_MODES:
            raise ValueError(f"wandb mode {mode!r}; allowed: {', '.join(WANDB_MODES)}")
        try:
            import wandb
        except ImportError:
            raise MissingExtraError("the W&B monitor (monitor.wandb)", "wandb", "monitor.wandb") from None
        os.makedirs(directory, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True)
        self._run = wandb.init(dir=str(directory), project=project, entity=team, group=group, name=name,
                               mode=mode, config=dict(config or {}), settings=settings, reinit="create_new")
        self.run_dir = self._run.dir and os.path.dirname(self._run.dir)

    def write(self, row: Mapping[str, Any]) -> None:
        self.write_scalars(scalars(row), int(row["step"]))

    def write_scalars(self, values: Mapping[str, float], step: int) -> None:
        if values:
            self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()
