"""Testing helpers: a reusable world of gloo processes, to check parallel layouts against one process.

    with GlooWorld(4) as world:
        results = world.run(my_module.train_and_gather, stage=3)   # one result per rank

Spawning and initializing a world costs seconds, so a `GlooWorld` starts its processes once and
runs many functions on them. Functions must be importable by module path (defined at the top
level of a module) and their arguments and results picklable. A function that raises on any rank
raises `WorkerError` here with that rank's traceback; a rank that dies or hangs past `timeout_s`
fails the call instead of hanging the test run: the error holds the Python stack of each rank that
did not answer. The next call on a world that lost a rank starts a fresh one, so one failure
fails one test, not every later test that shares the world. `collective_timeout_s` (default
`timeout_s`) is the process group's timeout: a collective waiting longer raises
`fspeed.CommError` on its rank.

The ranks are started with multiprocessing's spawn method, which imports the main script again in
every new process: a script must create its world (or call `assert_trains_like_one_process`) under
`if __name__ == "__main__":`. Without it, the ranks stop at once and the world raises one error
saying so.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional


class WorkerError(RuntimeError):
    """A function raised on a worker rank (the message holds the rank's traceback)."""


# a rank's exit code when it found itself creating a world while importing its parent's main script
_UNGUARDED_MAIN_EXIT = 86

_UNGUARDED_MAIN = (
    "{script} creates a GlooWorld when it is imported: the world's ranks are started with multiprocessing's "
    "spawn method, which imports the main script again in every new process, so each rank tried to start a "
    "world of its own. Put the code that creates the world or calls assert_trains_like_one_process under "
    "`if __name__ == \"__main__\":`")


def _bootstrapping() -> bool:
    """Whether this process is a spawned child still importing its parent's main script (the state
    in which multiprocessing refuses to start processes)."""
    return bool(getattr(mp.current_process(), "_inheriting", False))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a rendezvous (torchrun's --master_port, MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results, threads: int, timeout_s: float,
            stack_file: str) -> None:
    dump = open(stack_file, "w")  # noqa: SIM115 - open for the process's life: faulthandler writes here
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(threads))
    import torch

    torch.set_num_threads(threads)
    from fspeed.parallel.mesh import init_distributed

    init_distributed("gloo", timeout_s=timeout_s)
    while True:
        task = tasks.get()
        if task is None:
            break
        try:
            fn, args, kwargs = pickle.loads(task)
            results.put((rank, True, pickle.dumps(fn(*args, **kwargs))))
        except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
            results.put((rank, False, traceback.format_exc()))
    import torch.distributed as dist

    dist.destroy_process_group()
    # The world is over and every result has been delivered: end the rank without the interpreter's
    # teardown (seconds of freeing torch's modules, paid by every rank of every world on close).
    for stream in (sys.stdout, sys.stderr, dump):
        if stream is not None:
            stream.flush()
    results.close()
    results.join_thread()
    os._exit(0)


class GlooWorld:
    """`world_size` processes joined in a gloo process group, running submitted functions."""

    def __init__(self, world_size: int, *, threads_per_rank: int = 1, timeout_s: float = 120.0,
                 collective_timeout_s: Optional[float] = None):
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if _bootstrapping():  # a rank importing an unguarded script: stop quietly, the parent says why
            raise SystemExit(_UNGUARDED_MAIN_EXIT)
        self.world_size, self.timeout_s = world_size, timeout_s
        self.threads_per_rank, self.collective_timeout_s = threads_per_rank, collective_timeout_s or timeout_s
        self.stack_dir = tempfile.mkdtemp(prefix="fspeed-world-")
        self.procs: list = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        for r in range(self.world_size):  # a rank's file appears once it runs: no file, not started
            if os.path.exists(self._stack_file(r)):
                os.remove(self._stack_file(r))
        self.procs = [ctx.Process(target=_worker, args=(r, self.world_size, port, self.tasks[r], self.results,
                                                        self.threads_per_rank, self.collective_timeout_s,
                                                        self._stack_file(r)), daemon=True)
                      for r in range(self.world_size)]
        for p in self.procs:
            p.start()

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self.stack_dir, f"rank{rank}.txt")

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; the results in rank order. `fn`, its arguments
        and its results travel as plain pickles, tensors by value: no shared memory or passed file
        descriptors, whose limits differ from machine to machine. A lambda or a local function is a
        TypeError here, and an unpicklable result an error from its rank, not a silent timeout."""
        try:
            task = pickle.dumps((fn, args, kwargs))
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            raise TypeError(f"GlooWorld.run: {getattr(fn, '__name__', fn)!r} or its arguments cannot be sent to the "
                            f"ranks ({err}); use module-level functions and picklable values") from None
        if not self.alive():  # an earlier call lost a rank: its group is gone, so start a new world
            self._stop()
            self._start()
        for q in self.tasks:
            q.put(task)
        out: dict[int, Any] = {}
        failures: list[tuple[int, str]] = []
        waited, deadline = 0.0, self.timeout_s
        while len(out) + len(failures) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                answered = set(out) | {r for r, _ in failures}
                for r, p in enumerate(self.procs):
                    if r not in answered and not p.is_alive():
                        failures.append((r, f"rank {r} died (exit code {p.exitcode})"))
                if waited >= deadline and len(out) + len(failures) < self.world_size:
                    silent = sorted(set(range(self.world_size)) - set(out) - {r for r, _ in failures})
                    stacks = self._stacks(silent)
                    self._stop()
                    raise WorkerError(f"{fn.__name__}: no answer within {self.timeout_s:.0f}s from ranks {silent}; "
                                      f"where they were:\n{stacks}")
                continue
            if ok:
                out[rank] = pickle.loads(value)
            else:
                failures.append((rank, value))
        if any(self.procs[r].exitcode == _UNGUARDED_MAIN_EXIT for r, _ in failures):
            self._stop()
            main = getattr(sys.modules.get("__main__"), "__file__", None)
            raise RuntimeError(_UNGUARDED_MAIN.format(script=main or "the main script"))
        if failures:
            rank, tb = min(failures)
            details = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(failures))
            raise WorkerError(f"{fn.__name__} failed on {len(failures)} rank(s):\n{details}")
        return [out[r] for r in range(self.world_size)]

    def _stacks(self, ranks: list[int]) -> str:
        """The Python stacks of `ranks`, dumped by each rank's faulthandler on SIGUSR1."""
        started = [r for r in ranks if os.path.exists(self._stack_file(r)) and self.procs[r].is_alive()]
        before = {r: os.path.getsize(self._stack_file(r)) for r in started}
        for r in started:
            os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        parts = []
        for r in ranks:
            stack = "(no stack: the rank had not started)"
            if r in started:
                with open(self._stack_file(r)) as f:
                    f.seek(before[r])
                    stack = f.read().strip() or "(no stack: the rank did not answer the signal)"
            parts.append(f"--- rank {r}:\n{stack}")
        return "\n".join(parts)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        """Stop the ranks and remove their stack files."""
        self._stop()
        shutil.rmtree(self.stack_dir, ignore_errors=True)

    def _stop(self) -> None:
        """Stop the ranks (killing any that do not stop) and let go of their queues."""
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for q in [*self.tasks, self.results]:
            q.cancel_join_thread()  # a dead rank never reads its queue: exiting must not wait to flush it
            q.close()

    def __enter__(self) -> "GlooWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
