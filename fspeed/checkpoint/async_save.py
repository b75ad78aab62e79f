"""Saving a checkpoint in the background: the state is copied to host memory at the step boundary,
then a thread writes, checksums and publishes it while training goes on.

    pending = save_checkpoint(directory, state, blocking=False)   # returns once the copy is made
    state, metrics = step(state, batch)                            # `state` may be donated meanwhile
    path = pending.wait()                                          # the published path, or the save's error

The files are those of a blocking save, byte for byte, published by the same atomic protocol
(`directory`): a crash or a kill -9 at any moment leaves `latest` naming a complete checkpoint.
The ranks of a sharded state agree on the outcome over a group kept for the background thread
(`Mesh.background_gather`), so its collectives never interleave with training's. The copy holds
this rank's state bytes in host memory while the save is in flight (pinned when the state lives
on a GPU, so the copy is a DMA the step boundary waits for). Start the next save of a directory
only after `wait()` on the previous one: fspeed-train keeps at most one save in flight. The
thread is not a daemon: the interpreter waits for a save in flight before it exits. It runs at the
lowest scheduling priority, so that where the cores also train (a CPU run) it takes what the steps
leave idle.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..flat import Flat
from ..pytree import tree_map


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory that later changes to `tensor` do not reach."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.clone()
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    return copy.copy_(tensor, non_blocking=True)


def host_copy(tree: Any) -> Any:
    """`tree` (a TrainState, a client_state) with every tensor and Flat buffer copied to host memory;
    the device copies are complete when it returns."""
    copied = tree_map(lambda leaf: Flat(_host(leaf.buffer), leaf.layout) if isinstance(leaf, Flat)
                      else _host(leaf) if isinstance(leaf, torch.Tensor) else leaf,
                      tree, is_leaf=lambda x: isinstance(x, Flat))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return copied


def _yield_to_training() -> None:
    """Lower this thread's scheduling priority (Linux: nice is per thread) so that its checksum and
    copies take the cores when training leaves them idle, not while a step computes on them."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: the save runs at normal priority
        pass


class AsyncSave:
    """A checkpoint save running in a background thread (`save_checkpoint(..., blocking=False)`)."""

    def __init__(self, save: Callable[[], Path], path: Path):
        self.path = path  # where the checkpoint is published when the save succeeds
        self.started = time.perf_counter()
        self.seconds: Optional[float] = None  # how long the background write took, once done
        self._result: Optional[Path] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(save,), name=f"fspeed-save {path.name}")
        self._thread.start()

    def _run(self, save: Callable[[], Path]) -> None:
        _yield_to_training()
        try:
            self._result = save()
        except BaseException as e:  # handed to whoever waits
            self._error = e
        finally:
            self.seconds = time.perf_counter() - self.started

    def done(self) -> bool:
        """Whether the save has finished (published or failed)."""
        return not self._thread.is_alive()

    def failed(self) -> bool:
        """Whether the save has finished with an error (`wait()` raises it)."""
        return self.done() and self._error is not None

    def wait(self, timeout: Optional[float] = None) -> Path:
        """Block until the save finishes; the published path, or the save's error raised here
        (a CheckpointError naming the path and the cause; `latest` then still names the previous
        checkpoint). TimeoutError when `timeout` seconds pass first."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the background save of {self.path} has not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def __repr__(self) -> str:
        status = "failed" if self.failed() else "done" if self.done() else "in flight"
        return f"AsyncSave({str(self.path)!r}, {status})"
