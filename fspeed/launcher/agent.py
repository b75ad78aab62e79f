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

And torchrun's `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (how long a worker gets between SIGTERM and
SIGKILL) also applies when a worker fails and torchrun stops the others: torchrun itself waits a
fixed 30 s there, so a rank that hangs (stopped, or stuck in a kernel) held the whole job 30 s
after another rank had failed.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from .environment import REPORT_ENV
from .tether import AGENT_PID_ENV, AGENT_TETHER_ENV, exit_when_stdin_closes, run_tether_by_path

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
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _stop_failed_groups_within_the_shutdown_timeout()

    try:
        torchrun.main(run_tether_by_path(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as error:
        if report_path:
            failures = [
                {"rank": rank, "local_rank": failure.local_rank, "exitcode": failure.exitcode,
                 "signal": failure.signal_name() if failure.exitcode < 0 else None}
                for rank, failure in sorted(error.failures.items())
            ]
            root_rank, _ = error.get_first_failure()
            with open(report_path, "w") as file:
                json.dump({"failures": failures, "root_cause_rank": root_rank}, file)
        raise


def _stop_failed_groups_within_the_shutdown_timeout() -> None:
    """A worker process context closed with no timeout (torchrun's own close when a worker fails)
    gives its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds, when set, instead of a fixed 30."""
    raw = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if not raw:
        return
    seconds = int(raw)  # as torchrun reads it (a bad value fails there, at start, too)
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = PContext.close

    def close_within_the_shutdown_timeout(self, death_sig=None, timeout=None):
        return close(self, death_sig, seconds if timeout is None else timeout)
    PContext.close = close_within_the_shutdown_timeout


if __name__ == "__main__":
    main(sys.argv[1:])
