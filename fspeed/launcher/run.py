"""Run the per-node torchrun agents and turn their outcomes into one exit code and a message.

Every node command starts at once (local ones directly, remote ones through their ssh argv); the
launcher waits for all of them. When one node fails, the others get `grace_s` seconds to fail
or finish on their own (peers of a dead rank usually error out quickly), then SIGTERM, which
torchrun forwards to its workers. A SIGINT/SIGTERM to the launcher is forwarded the same way (a
local agent runs in a process group of its own: a terminal's Ctrl-C reaches the launcher alone).
The exit code is 0 if every node succeeded; else, for the first node seen failing, the exit code
of its root-cause rank when its agent reported one (a local node, see `agent.py`), or the
node's own exit code (128+N for signal N). `LaunchResult.summary` names that rank, its exit code
and the message it left; for remote nodes it names the node and its ranks, and the agent's own
summary lines arrive through ssh on stderr.

Each agent's stdin is a pipe this process holds open: if the launcher dies (even by SIGKILL) the
agents read end-of-file and stop their workers (`tether.py`); workers die with their agent.

With a node range (`min_nodes`, `fspeed --nnodes MIN:MAX`, see `elastic.py`) a node that fails
while at least `min_nodes` others are still running (or done) is lost, not fatal: the others are
left alone (their agents re-rendezvous without it and restart their workers) and the job succeeds
if they do. Only when fewer than `min_nodes` remain are the others stopped, as above.

A node whose workers all succeeded waits in torchrun's exit barrier for the other nodes (up to
300 s, in a C++ store wait that does not react to SIGTERM). A local agent with no child process
left is in that state, so it is killed at once rather than after `kill_after_s`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .commands import NodeCommand, node_log_dir
from .environment import REPORT_ENV
from .processes import alive, children, descendants
from .tether import AGENT_TETHER_ENV

__all__ = ["LaunchError", "RankFailure", "NodeOutcome", "LaunchResult", "run_node_commands", "rank_log_files"]


class LaunchError(RuntimeError):
    """A node command could not be started (e.g. `ssh` or the Python interpreter is missing)."""


@dataclass(frozen=True)
class RankFailure:
    rank: int
    local_rank: int
    exitcode: int
    signal: Optional[str] = None
    message: Optional[str] = None  # what the worker left in TORCHELASTIC_ERROR_FILE (see agent.py)

    def describe(self) -> str:
        how = f"was killed by {self.signal}" if self.signal else f"exited with code {self.exitcode}"
        return f"rank {self.rank} (local rank {self.local_rank}) {how}"


@dataclass(frozen=True)
class NodeOutcome:
    command: NodeCommand
    returncode: int
    failures: tuple[RankFailure, ...] = ()
    stopped: bool = False                 # terminated by the launcher after another node failed
    lost: bool = False                    # failed while enough nodes remained: the run went on without it
    root_cause_rank: Optional[int] = None  # torchrun's first observed failure on this node

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass(frozen=True)
class LaunchResult:
    outcomes: tuple[NodeOutcome, ...]     # in node order
    failure_order: tuple[int, ...] = ()   # node ranks, in the order their failures were observed
    min_nodes: Optional[int] = None       # with a node range: the nodes the run needs to go on

    @property
    def ok(self) -> bool:
        return all(outcome.ok or outcome.lost for outcome in self.outcomes) and not all(
            outcome.lost for outcome in self.outcomes)

    @property
    def lost(self) -> tuple[NodeOutcome, ...]:
        """The nodes the run went on without (a node range), in node order."""
        return tuple(outcome for outcome in self.outcomes if outcome.lost)

    @property
    def exit_code(self) -> int:
        if self.ok:
            return 0
        root = self.root_cause()
        code = root.exitcode if root is not None else self._first_failed().returncode
        return 128 - code if code < 0 else code

    def _first_failed(self) -> NodeOutcome:
        """The first node seen failing that the run could not go on without (else the first lost one)."""
        fatal = [rank for rank in self.failure_order if not self.outcomes[rank].lost]
        order = fatal or list(self.failure_order)
        return self.outcomes[order[0]] if order else next(o for o in self.outcomes if not o.ok)

    def root_cause(self) -> Optional[RankFailure]:
        """The failed rank the job's exit code comes from (torchrun's first failure on the first node
        seen failing), when a local agent reported it."""
        if self.ok:
            return None
        first = self._first_failed()
        return next((f for f in first.failures if f.rank == first.root_cause_rank), None)

    def summary(self) -> str:
        """The failure in a few lines: the root-cause rank, its exit code and its message, then each node."""
        root = self.root_cause()
        head = f"the job failed: {root.describe()}" if root else f"the job failed (exit code {self.exit_code})"
        if root is not None and root.message:
            head += ":" + (f" {root.message}" if "\n" not in root.message else "\n" + _indent(root.message))
        if self.min_nodes is not None and any(o.stopped for o in self.outcomes):
            gone = sum(1 for o in self.outcomes if not o.ok and not o.stopped)
            head += (f"\nfewer than the {self.min_nodes} node{'s' if self.min_nodes > 1 else ''} the run needs "
                     f"(--nnodes) remained after {gone} failed: the others were stopped")
        return head + "\n" + _indent(self.failure_message())

    def lost_message(self) -> str:
        """One line per node the run went on without: the node and how it ended."""
        return "\n".join(f"{o.command.describe()} was lost ({_status(o.returncode)}); the run went on without it"
                         for o in self.lost)

    def failure_message(self) -> str:
        """One line per failed node, naming the node, its ranks and (when known) the failed ranks."""
        lines = []
        for outcome in self.outcomes:
            if outcome.ok:
                continue
            status = _status(outcome.returncode)
            node = outcome.command.describe()
            if outcome.lost:
                lines.append(f"{node} was lost ({status}); the run went on without it")
            elif outcome.stopped:
                lines.append(f"{node} was stopped after another node failed")
            elif outcome.failures:
                ranks = "; ".join(f.describe() + (" (its first failure)" if f.rank == outcome.root_cause_rank else "")
                                  for f in outcome.failures)
                first = " (the first node seen failing)" if self.failure_order[:1] == (outcome.command.node_rank,) else ""
                lines.append(f"{node} {status}{first}: {ranks}")
            else:
                lines.append(f"{node} {status} (see its torchrun output above for the failed rank)")
        return "\n".join(lines)


def _status(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"failed with exit code {code}"


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def _read_report(path: Path) -> tuple[tuple[RankFailure, ...], Optional[int]]:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return (), None
    failures = tuple(RankFailure(f["rank"], f["local_rank"], f["exitcode"], f.get("signal"), f.get("message"))
                     for f in report.get("failures", ()))
    return failures, report.get("root_cause_rank")


class _Interrupted(Exception):
    pass


def _raise_interrupted(signum: int, frame: object) -> None:
    raise _Interrupted(signum)


def run_node_commands(commands: Sequence[NodeCommand], *, environ: Optional[Mapping[str, str]] = None,
                      grace_s: float = 5.0, kill_after_s: float = 45.0, poll_s: float = 0.05,
                      min_nodes: Optional[int] = None) -> LaunchResult:
    """Start every node command, wait for all, and report (see the module docstring); `min_nodes`:
    a node range's minimum, the nodes the job goes on with after losing others."""
    base_env = dict(os.environ if environ is None else environ)
    in_main_thread = threading.current_thread() is threading.main_thread()
    with tempfile.TemporaryDirectory(prefix="fspeed-launch-") as report_dir:
        reports = {c.node_rank: Path(report_dir) / f"node{c.node_rank}.json" for c in commands}
        processes: dict[int, subprocess.Popen] = {}
        previous = signal.signal(signal.SIGTERM, _raise_interrupted) if in_main_thread else None
        try:
            for command in commands:
                env = {**base_env, **command.env}
                if not command.remote:
                    env[REPORT_ENV] = str(reports[command.node_rank])
                    env[AGENT_TETHER_ENV] = "stdin"
                try:  # the agent's stdin stays open while this process lives: the tether (tether.py); a local
                    # agent has a process group of its own, so a Ctrl-C reaches this process alone, which stops it
                    processes[command.node_rank] = subprocess.Popen(
                        list(command.argv), env=env, stdin=subprocess.PIPE,
                        process_group=None if command.remote else 0)
                except OSError as error:
                    _stop(processes.values(), kill_after_s)
                    raise LaunchError(f"cannot start {command.describe()}: {command.argv[0]}: {error}") from None
            failure_order, stopped, lost = _wait(processes, grace_s, kill_after_s, poll_s, min_nodes)
        except (KeyboardInterrupt, _Interrupted):
            _stop(processes.values(), kill_after_s)
            raise KeyboardInterrupt from None
        finally:
            if in_main_thread and previous is not None:
                signal.signal(signal.SIGTERM, previous)
        outcomes = []
        for command in commands:
            failures, root = ((), None) if command.remote else _read_report(reports[command.node_rank])
            outcomes.append(NodeOutcome(command, processes[command.node_rank].returncode, failures,
                                        command.node_rank in stopped, command.node_rank in lost, root))
    return LaunchResult(tuple(outcomes), tuple(failure_order), min_nodes)


def _wait(processes: Mapping[int, subprocess.Popen], grace_s: float, kill_after_s: float, poll_s: float,
          min_nodes: Optional[int] = None) -> tuple[list[int], set[int], set[int]]:
    """(node ranks in the order they failed, those stopped here, those lost while enough remained)."""
    failure_order: list[int] = []
    stopped: set[int] = set()
    lost: set[int] = set()
    deadline: Optional[float] = None
    while True:
        _poll_holding_signals(processes.values())
        running = {rank: p for rank, p in processes.items() if p.returncode is None}
        for rank, process in processes.items():
            if process.returncode not in (None, 0) and rank not in failure_order and rank not in stopped:
                failure_order.append(rank)
                remaining = sum(1 for p in processes.values() if p.returncode in (None, 0))
                if min_nodes is not None and deadline is None and remaining >= min_nodes:
                    lost.add(rank)
        if not running:
            return failure_order, stopped, lost
        if deadline is None and any(rank not in lost for rank in failure_order):
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() >= deadline:
            stopped.update(running)
            _stop(running.values(), kill_after_s)
            continue
        time.sleep(poll_s)


def _poll_holding_signals(processes) -> None:
    """`poll()` each process with SIGINT and SIGTERM held back until it returns (in the main thread).
    A KeyboardInterrupt raised inside `Popen.poll` can leave its waitpid lock taken (the handler may
    run right after the lock is acquired), and the stop that follows would then wait on that lock
    forever; held back, the signal arrives between polls instead."""
    held = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        for process in processes:
            process.poll()
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        for process in processes:
            process.poll()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _stop(processes, kill_after_s: float, reap_s: float = 10.0) -> None:
    """SIGTERM (torchrun forwards it to its workers), then SIGKILL what is still alive after `kill_after_s`.

    An agent without child processes has no workers left to stop (it waits in the exit barrier,
    deaf to SIGTERM), so it is killed at once. No worker outlives this: whatever was below an
    agent and still runs once the agent is gone is killed.
    """
    running = [p for p in processes if p.poll() is None]
    workers = [pid for p in running for pid in descendants(p.pid)]
    for process in running:
        if children(process.pid) == set():
            process.kill()
        else:
            process.terminate()
    end = time.monotonic() + kill_after_s
    for process in running:
        try:
            process.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            try:
                process.wait(timeout=reap_s)
            except subprocess.TimeoutExpired:  # not reaped (its waitpid lock taken): its workers go below regardless
                pass
    for pid in alive(workers):  # an agent killed before it stopped its workers leaves them running
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rank_log_files(log_dir: str, commands: Sequence[NodeCommand]) -> dict[int, list[Path]]:
    """Global rank -> its log files, for the local nodes of a finished run.

    torchrun writes `<node dir>/<run id>_<random>/attempt_<n>/<local rank>/{stdout,stderr}.log`;
    the node dir is `<log_dir>/node<k>` (remote nodes: the same path on that host). The newest
    run directory of each node is the one reported.
    """
    files: dict[int, list[Path]] = {}
    for command in commands:
        if command.remote:
            continue
        root = Path(node_log_dir(log_dir, command.node_rank))
        runs = sorted((d for d in root.glob("*") if d.is_dir()), key=lambda d: d.stat().st_mtime)
        if not runs:
            continue
        for local_rank, rank in enumerate(command.ranks):
            found = sorted(runs[-1].glob(f"attempt_*/{local_rank}/*.log"))
            if found:
                files[rank] = found
    return files
