"""A measurement in a newly spawned Python process, for tests that read counters global to a process
(malloc's in-use bytes, the garbage collector's objects): what ran before it in the pytest process, or
on a gloo world shared by the session, then cannot move what it reads.

    kept = in_fresh_process(my_module.measure, 4, rows=8)   # a module-level function, picklable arguments
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Any, Callable

from fspeed.testing import WorkerError


def _child(fn: Callable[..., Any], args: tuple, kwargs: dict, threads: int, conn: Any) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        result = (True, fn(*args, **kwargs))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        result = (False, traceback.format_exc())
    conn.send(result)
    conn.close()
    os._exit(0)  # the result is delivered: skip the interpreter's teardown (seconds with torch loaded)


def in_fresh_process(fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a new process (spawned: nothing of this one's heap or objects is in it),
    with this process's torch thread count; its result, or WorkerError with the child's traceback."""
    import torch

    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, args, kwargs, torch.get_num_threads(), send), daemon=True)
    proc.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            raise WorkerError(f"{fn.__name__}: no answer within {timeout_s:.0f}s from its process")
        try:
            ok, value = receive.recv()
        except EOFError:
            proc.join(timeout=10)
            raise WorkerError(f"{fn.__name__}: its process died (exit code {proc.exitcode})") from None
    finally:
        receive.close()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    if not ok:
        raise WorkerError(f"{fn.__name__} failed in its process:\n{value}")
    return value
