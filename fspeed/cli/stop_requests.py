"""Stopping a run at a step boundary: SIGTERM or SIGINT ends training after the current step.

A scheduler's SIGTERM (or torchrun forwarding one when the launcher goes) must not kill a rank
halfway through a step: the handler only records the signal, and the training loop asks
`agreed(mesh)` after each step. With several ranks that is a max-all-reduce of the flag, so every
rank stops after the same step and the final checkpoint (a collective) can be saved. A second
signal of the same kind acts at once (the default action: SIGINT raises KeyboardInterrupt).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Optional

HANDLED = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(Exception):
    """Training stopped after a completed step because of a signal (every rank at the same step)."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")


class StopRequests:
    """A context that turns SIGTERM/SIGINT into a request the training loop reads between steps."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}

    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        self.signum = self.signum or signum
        previous = self._previous.get(signum)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)  # a second one acts at once

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def agreed(self, mesh=None) -> Optional[int]:
        """The signal any rank received (the same answer on every rank), or None."""
        flag = float(self.signum or 0)
        if mesh is not None:
            flag = mesh.all_reduce_scalar(flag, "max")
        return int(flag) or None
