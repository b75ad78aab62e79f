"""`python -m fspeed.launcher.agent <torchrun arguments>`: torchrun, plus a failure report for the launcher.

This is `torch.distributed.run.main` (torchrun's elastic agent: rendezvous, spawning, monitoring,
per-rank logs, signal forwarding) unchanged, with one addition: when a worker fails, the agent's
`ChildFailedError` (global rank, local rank, exit code or signal of every failed worker) is also
written as JSON to the file named by `FSPEED_AGENT_REPORT` (with torchrun's root cause, its first
observed failure), so `fspeed` can say which rank failed instead of only which node, and exit with
that rank's code. The variable is removed before the workers start.

It also holds the tethers (`tether.py`): workers learn the agent's pid (`FSPEED_AGENT_PID`) to die
with it, and with `FSPEED_AGENT_TETHER=stdin` (set by the launcher) the agent stops its workers
and exits when its stdin closes, i.e. when the launcher is gone.

Unless `FSPEED_DEBUG=1` (`fspeed --debug`), a failure is not torchrun's traceback: a worker's
failure exits with torchrun's code 1 after the report (the launcher prints one summary: the rank,
its exit code and its message, which a worker leaves in torchrun's TORCHELASTIC_ERROR_FILE), and a
stop by a signal exits with 128 + the signal's number; torchrun's log lines about stopping the
other workers are left out as well. An agent without a report file (a remote node) prints the
summary lines itself.

And torchrun's `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (how long a worker gets between SIGTERM and
SIGKILL) also applies when a worker fails and torchrun stops the others: torchrun itself waits a
fixed 30 s there, so a rank that hangs (stopped, or stuck in a kernel) held the whole job 30 s
after another rank had failed; the same holds when the group is stopped to be restarted.

With `--max-restarts` above 0, every failed attempt is appended as one JSON line (the attempt; each
failed rank's exit code or signal and message) to a file named in the workers' environment as
`FSPEED_ATTEMPT_FAILURES`: a restarted worker reads what failed before it (`fspeed.cli.restarts`).
A failure that repeats (the first failed rank, whichever it is, leaving the same message, which names
the step, as the attempt before) is a bug and not a fault: the agent restarts no more, and the job fails with
that error.

A restarted group also gets a store of its own: torchrun's static rendezvous keeps one TCPStore
for the whole job, and the workers' process group reads its peers' addresses from it, so a
restarted rank would find the failed attempt's (stale) addresses and fail to connect. On every
restart the agent of node 0 serves a fresh store on a free port, which the other nodes' agents
learn through the job's store; the restarted workers connect to it (MASTER_PORT).

Under the c10d rendezvous (`--rdzv_backend c10d`, `--nnodes MIN:MAX`) the same holds: torchrun
hands the workers one store, created at the first rendezvous and kept for the agent's life, so
every round (the first included) gets a fresh store published in the round's own part of the
rendezvous store. Two more things make a round after a lost node safe for workers that resume
from checkpoints:

- The attempt number is the group's: the agents of a round take the highest of theirs, so an
  agent that joined later (its own count still 0) restarts its workers as the others do
  (TORCHELASTIC_RESTART_COUNT): they resume instead of starting from step 0.
- torchrun restarts a healthy group when a node waits to join (a scale-up, not counted as a
  restart): the workers would start again from step 0 with the same restart count. Here a waiting
  node joins at the group's next restart instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
from dataclasses import asdict
from typing import Optional

from .environment import DEBUG_ENV, FAILURES_ENV, REPORT_ENV
from .run import RankFailure
from .tether import AGENT_PID_ENV, AGENT_TETHER_ENV, exit_when_stdin_closes, run_tether_by_path

_NOISY_LOGGERS = (  # what they say on a failure, the launcher's summary says once
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch.distributed.elastic.agent.server.api",
)

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> None:
    """Run torchrun with `argv`; on worker failure write the report, then fail exactly as torchrun does."""
    report_path = os.environ.pop(REPORT_ENV, None)
    if os.environ.pop(AGENT_TETHER_ENV, None) == "stdin":
        exit_when_stdin_closes()
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    if not sys.platform.startswith("linux"):
        print(f"fspeed: on {sys.platform} workers cannot be tied to their agent (no parent-death signal): "
              "if this agent is killed, stop its workers yourself", file=sys.stderr)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _stop_failed_groups_within_the_shutdown_timeout()
    debug = os.environ.get(DEBUG_ENV) == "1"
    if not debug:
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)

    failures_file = _record_failed_attempts()
    _fresh_worker_store_on_restart()
    try:
        torchrun.main(run_tether_by_path(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as error:
        failures = [RankFailure(rank, failure.local_rank, failure.exitcode,
                                failure.signal_name() if failure.exitcode < 0 else None, _worker_message(failure))
                    for rank, failure in sorted(error.failures.items())]
        root_rank, _ = error.get_first_failure()
        if report_path:
            with open(report_path, "w") as file:
                json.dump({"failures": [asdict(f) for f in failures], "root_cause_rank": root_rank}, file)
        if debug:
            raise
        if not report_path:
            for failure in sorted(failures, key=lambda f: f.rank != root_rank):
                print(f"fspeed: {failure.describe()}" + (f": {failure.message}" if failure.message else ""),
                      file=sys.stderr, flush=True)
        sys.exit(1)  # torchrun's own exit code for a failed worker group
    except SignalException as error:
        if debug:
            raise
        if not report_path:
            print(f"fspeed: this node's agent was stopped by {error.sigval.name}; so were its workers",
                  file=sys.stderr, flush=True)
        sys.exit(128 + int(error.sigval))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(failures_file)


def _worker_message(failure) -> Optional[str]:
    """The message a failed worker left in its TORCHELASTIC_ERROR_FILE (torchrun's `@record` writes the
    exception; fspeed-train its one-line error), or None: torchrun's placeholder is not one."""
    if not failure.error_file or not os.path.isfile(failure.error_file):
        return None
    message = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
    return str(message).strip() or None if message is not None else None


def _record_failed_attempts() -> str:
    """Record each failed attempt for the restarted workers and stop restarting a repeated failure
    (module docstring); returns the record's path (the caller removes it)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    handle, path = tempfile.mkstemp(prefix="fspeed-attempts-", suffix=".jsonl")
    os.close(handle)
    os.environ[FAILURES_ENV] = path
    monitor, close = LocalElasticAgent._monitor_workers, SubprocessContext.close
    previous: dict[str, object] = {}

    def close_noting_who_still_ran(self, *args, **kwargs):  # those the agent stops, because another failed
        if not hasattr(self, "_fspeed_stopped"):
            self._fspeed_stopped = set(getattr(self, "_running_local_ranks", ()))
        return close(self, *args, **kwargs)

    def monitor_and_record(self, worker_group):
        result = monitor(self, worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY) or not result.failures:
            return result
        spec = worker_group.spec
        attempt = spec.max_restarts - self._remaining_restarts
        stopped = getattr(self._pcontext, "_fspeed_stopped", set())
        failed = [{"rank": rank, "exitcode": f.exitcode, "signal": f.signal_name() if f.exitcode < 0 else None,
                   "message": _worker_message(f), "time": f.timestamp, "stopped": f.local_rank in stopped}
                  for rank, f in result.failures.items()]
        failed.sort(key=_first_cause)
        with open(path, "a") as file:
            file.write(json.dumps({"attempt": attempt, "failures": failed}) + "\n")
        # a repeat: the first cause's message (it names the step) again, whichever rank got there first
        # (a bug fails every rank at the same step, in any order)
        rank, message = failed[0]["rank"], failed[0]["message"]
        if self._remaining_restarts > 0 and message and previous.get("message") == message:
            print(f"fspeed: rank {rank} failed again with the same error in attempt {attempt} as in attempt "
                  f"{attempt - 1}: a repeatable failure, not restarting", file=sys.stderr, flush=True)
            self._remaining_restarts = 0
        previous["message"] = message
        return result
    LocalElasticAgent._monitor_workers = monitor_and_record
    SubprocessContext.close = close_noting_who_still_ran
    return path


def _first_cause(failure: dict) -> tuple:
    """Sort key of a recorded failure: the likely cause first. Last come the workers this agent
    stopped because another had failed; before them a peer's error about a failed collective (a
    consequence); a worker ended by a signal nobody here sent (kill -9, a crash) comes first."""
    consequence = "CommError" in (failure["message"] or "")
    return failure["stopped"], failure["signal"] is None, consequence, failure["time"], failure["rank"]


def _fresh_worker_store_on_restart() -> None:
    """After a restart's rendezvous (under c10d, after every rendezvous), point the workers at a store of
    this attempt, with the group's attempt number (module docstring)."""
    import datetime

    from torch.distributed import TCPStore
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    rendezvous = LocalElasticAgent._rendezvous

    def rendezvous_with_a_fresh_store(self, worker_group):
        rendezvous(self, worker_group)
        spec = worker_group.spec
        elastic = spec.rdzv_handler.get_backend() != "static"
        if elastic:
            _take_the_group_attempt(self, worker_group)
        attempt = spec.max_restarts - self._remaining_restarts
        if attempt == 0 and not elastic:
            return
        key = f"fspeed/worker_store_port/{attempt}"  # under c10d, in this round's part of the store
        if worker_group.group_rank == 0:
            self._fspeed_worker_store = TCPStore(worker_group.master_addr, 0, None, True,
                                                 datetime.timedelta(seconds=300), wait_for_workers=False)
            worker_group.store.set(key, str(self._fspeed_worker_store.port))
        worker_group.master_port = int(worker_group.store.get(key).decode())
    LocalElasticAgent._rendezvous = rendezvous_with_a_fresh_store
    DynamicRendezvousHandler.num_nodes_waiting = lambda self: 0  # a waiting node joins at the next restart


def _take_the_group_attempt(agent, worker_group) -> None:
    """Under c10d: every agent of the round uses the highest attempt number among them (a node that
    joined later has counted no restart of the group's)."""
    spec, store = worker_group.spec, worker_group.store
    store.set(f"fspeed/attempt/{worker_group.group_rank}", str(spec.max_restarts - agent._remaining_restarts))
    group_attempt = max(int(store.get(f"fspeed/attempt/{rank}").decode())
                        for rank in range(worker_group.group_world_size))
    agent._remaining_restarts = min(agent._remaining_restarts, spec.max_restarts - group_attempt)


def _stop_failed_groups_within_the_shutdown_timeout() -> None:
    """A worker process context closed with no timeout (torchrun's own close when a worker fails)
    gives its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds, when set, instead of a fixed 30."""
    raw = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if not raw:
        return
    seconds = int(raw)  # as torchrun reads it (a bad value fails there, at start, too)
    from torch.distributed.elastic.multiprocessing.api import PContext

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    close, shutdown = PContext.close, LocalElasticAgent._shutdown

    def close_within_the_shutdown_timeout(self, death_sig=None, timeout=None):
        return close(self, death_sig, seconds if timeout is None else timeout)

    def stop_within_the_shutdown_timeout(self, death_sig=signal.SIGTERM, timeout=None):  # a restart's stop
        return shutdown(self, death_sig, seconds if timeout is None else timeout)
    PContext.close = close_within_the_shutdown_timeout
    LocalElasticAgent._shutdown = stop_within_the_shutdown_timeout


if __name__ == "__main__":
    main(sys.argv[1:])
