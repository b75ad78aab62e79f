"""No orphans: every worker dies with its torchrun agent, and every agent with the launcher.

torchrun starts each worker in a session of its own, so a worker outlives an agent that dies
(the OOM killer, kill -9) and keeps training and writing checkpoints. Two tethers close that:

- Worker to agent: the agent runs each worker as `python -u <this file> MODE TARGET ARGS...`,
  which asks Linux to SIGKILL this process when its parent (the agent) dies (`PR_SET_PDEATHSIG`,
  kept across exec), checks that the agent is still there, and then execs the real program in
  the same process: `script` runs `python -u TARGET ARGS`, `module` runs `python -u -m TARGET
  ARGS`, `exec` runs `TARGET ARGS` (torchrun's three modes). The node commands name it
  `--module fspeed.launcher.tether`; the agent runs this file by path instead (`agent.py`), so a
  worker imports nothing but the standard library before its exec (importing the fspeed package
  would cost every worker 2 s of torch import, twice). Hence no imports from fspeed here.
- Agent to launcher: the launcher holds the write end of each agent's stdin (a pipe locally,
  ssh's channel on other nodes) and never writes to it. When the launcher dies, however it dies,
  the agent reads end-of-file and sends itself SIGTERM, which torchrun turns into a shutdown of
  its workers (SIGTERM, then SIGKILL after its timeout).

A worker runs with Python's fault handler on (`PYTHONFAULTHANDLER=1` unless the user set it):
a rank that dies of SIGSEGV, SIGABRT, SIGBUS or SIGFPE prints every thread's Python stack to its
stderr, so the launcher's "killed by SIGABRT" comes with where it was.

Outside Linux there is no parent-death signal: the worker tether then only execs the program,
and the agent says so once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Optional

__all__ = ["AGENT_PID_ENV", "AGENT_TETHER_ENV", "MODES", "TETHER_MODULE", "die_with_parent",
           "exit_when_stdin_closes", "run_tether_by_path", "worker_argv", "main"]

AGENT_PID_ENV = "FSPEED_AGENT_PID"        # set by the agent: the parent a worker must still have
AGENT_TETHER_ENV = "FSPEED_AGENT_TETHER"  # "stdin": the agent stops when its stdin closes
MODES = ("script", "module", "exec")
TETHER_MODULE = "fspeed.launcher.tether"
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_when_stdin_closes(sig: int = signal.SIGTERM) -> threading.Thread:
    """Send `sig` to this process once stdin reaches end-of-file (its writer is gone)."""
    def watch() -> None:
        try:
            while os.read(0, 1 << 16):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), sig)

    thread = threading.Thread(target=watch, name="fspeed-launcher-tether", daemon=True)
    thread.start()
    return thread


def worker_argv(mode: str, target: str, args: list[str], python: str = sys.executable) -> list[str]:
    """The program a tethered worker execs for torchrun's mode (`script`, `module` or `exec`)."""
    if mode == "script":
        return [python, "-u", target, *args]
    if mode == "module":
        return [python, "-u", "-m", target, *args]
    if mode == "exec":
        return [target, *args]
    raise ValueError(f"tether mode {mode!r}; allowed: {', '.join(MODES)}")


def run_tether_by_path(torchrun_args: list[str]) -> list[str]:
    """torchrun arguments with `--module fspeed.launcher.tether` replaced by this file's path."""
    for i in range(len(torchrun_args) - 1):
        if torchrun_args[i] == "--module" and torchrun_args[i + 1] == TETHER_MODULE:
            return [*torchrun_args[:i], os.path.abspath(__file__), *torchrun_args[i + 2:]]
    return list(torchrun_args)


def main(argv: Optional[list[str]] = None) -> None:
    """`python tether.py MODE TARGET ARGS...`: tether to the agent, then exec."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] not in MODES:
        sys.exit(f"usage: python {__file__} {{{'|'.join(MODES)}}} TARGET [ARGS...]")
    agent = os.environ.pop(AGENT_PID_ENV, None)
    if die_with_parent() and agent is not None and os.getppid() != int(agent):
        sys.exit(f"fspeed: worker not started: its torchrun agent (pid {agent}) is gone")
    program = worker_argv(argv[0], argv[1], argv[2:])
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")  # a rank killed by a signal prints its Python stacks
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(program[0], program)
    except OSError as e:
        sys.exit(f"fspeed: cannot start {program[0]!r}: {e.strerror or e}")


if __name__ == "__main__":
    main()
