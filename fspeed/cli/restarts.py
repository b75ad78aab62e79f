"""Restarts of `fspeed-train` under torchrun's elastic agent (`--max_restarts N`): what a restarted
worker resumes from, and what it says about the failure it recovers from.

When a worker dies (kill -9, a crash), exits with an error, or a collective times out (a stopped
rank), the agent stops the whole worker group and starts it again with TORCHELASTIC_RESTART_COUNT
one higher. A restarted worker resumes from the newest complete checkpoint by itself (as
`checkpoint.resume=true` would; a first attempt is unchanged).

To say what failed, every rank of a run that may restart keeps a small record in the run
directory, `restarts/rank<k>.json`: the attempt, the last step it completed and the error it caught
(with the step it failed at). It is replaced atomically after every step, so a kill -9 leaves the
previous one whole. The agent adds what only it sees (`FSPEED_ATTEMPT_FAILURES`, see
`fspeed.launcher.agent`): each failed rank's exit code or signal and the message it left in
TORCHELASTIC_ERROR_FILE. A restarted rank 0 logs one line from both: which rank failed, how, at
which step, and how many steps the restart redoes (the failed attempt's last step minus the
checkpoint's). `restarts/run.json` (rank 0) keeps the first attempt's start and each restart's
cost, for the run's goodput (`goodput`).

Each record also holds the attempt's world size (WORLD_SIZE): after a node range lost a node
(`fspeed --nnodes MIN:MAX`) the restarted group is smaller, and its line says so (`world_change`:
"the world shrank from 2 to 1 rank (a node was lost)").
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..launcher.environment import FAILURES_ENV  # the agent's record of failed ranks, one JSON line per attempt

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"
RECORD_DIR = "restarts"
RUN_FILE = "run.json"


def restart_count() -> int:
    """Which restart this worker is (0: the first attempt, or not under torchrun)."""
    return int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)


def world_size() -> int:
    """This attempt's number of ranks (WORLD_SIZE; 1 outside a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def world_change(records: list[RankRecord], now: int) -> Optional[str]:
    """'the world shrank from N to M ranks' when the previous attempt's records say it ran on another
    world size than `now` (a node range that lost or regained nodes); None when it did not, or is unknown."""
    before = {r.world for r in records if r.world is not None}
    if len(before) != 1 or now in before:
        return None
    (previous,) = before
    how = "shrank" if now < previous else "grew"
    why = " (a node was lost)" if now < previous else ""
    return f"the world {how} from {previous} to {now} rank{'s' if now != 1 else ''}{why}"


def restarts_possible() -> bool:
    """Whether torchrun may restart this worker group (its --max-restarts is above 0)."""
    return int(os.environ.get(MAX_RESTARTS_ENV, "0") or 0) > 0


def write_json(path: Path, value: Any) -> None:
    """Replace `path` with `value` as JSON atomically: a reader (or a kill -9) sees the old or the new file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[Any]:
    """The JSON in `path`, or None when it is missing or unreadable (a record is best effort)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_error(error: BaseException, activity: str) -> str:
    """How a caught exception is recorded: what the rank was doing (`step 3`, `the save of step 2`),
    the exception's type and message; what a repeated failure is recognized by."""
    text = str(error).strip() or "(no message)"
    return f"{activity}: {type(error).__name__}: {text}"


@dataclass(frozen=True)
class RankRecord:
    """What one rank last wrote: its attempt, the last step it completed, the error it caught."""

    rank: int
    attempt: int
    step: int
    error: Optional[str]
    world: Optional[int] = None  # the attempt's WORLD_SIZE (None in a record written without it)


@dataclass(frozen=True)
class AgentFailure:
    """A failed rank as the agent saw it: its exit code or signal, and the message it left."""

    rank: int
    exitcode: int
    signal: Optional[str]
    message: Optional[str]
    stopped: bool = False  # the agent stopped it because another rank had failed

    def how(self) -> str:
        if self.signal:
            return f"was killed by {self.signal}"
        return f"exited with code {self.exitcode}" + (f" ({self.message})" if self.message else "")


class AttemptRecord:
    """This rank's record for one attempt (module docstring); writes nothing when restarts are off."""

    def __init__(self, out_dir: Path, rank: int, enabled: bool):
        self.directory, self.rank, self.enabled = out_dir / RECORD_DIR, rank, enabled
        self.attempt = restart_count()
        self.previous_error: Optional[str] = None  # this rank's error in the attempt before, if any
        if enabled:
            self.directory.mkdir(parents=True, exist_ok=True)
            mine = read_json(self.path)
            if isinstance(mine, dict) and mine.get("attempt") == self.attempt - 1:
                self.previous_error = mine.get("error")

    @property
    def path(self) -> Path:
        return self.directory / f"rank{self.rank}.json"

    def stepped(self, step: int, error: Optional[str] = None) -> None:
        """After a completed step (or, with `error`, a caught failure of the next one)."""
        if self.enabled:
            write_json(self.path, {"attempt": self.attempt, "step": step, "error": error, "world": world_size()})

    def previous_attempt(self) -> list[RankRecord]:
        """Every rank's record of the attempt before this one (ranks that wrote none are left out)."""
        records = []
        for path in sorted(self.directory.glob("rank*.json")):
            value = read_json(path)
            if isinstance(value, dict) and value.get("attempt") == self.attempt - 1:
                records.append(RankRecord(int(path.stem[4:]), value["attempt"], int(value["step"]), value["error"],
                                          value.get("world")))
        return records


def agent_failures(attempt: int) -> list[AgentFailure]:
    """The failed ranks the agent recorded for `attempt` (first observed first); [] without its record."""
    path = os.environ.get(FAILURES_ENV)
    if not path:
        return []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("attempt") == attempt:
            return [AgentFailure(f["rank"], f["exitcode"], f.get("signal"), f.get("message"), bool(f.get("stopped")))
                    for f in entry["failures"]]
    return []


def describe_failure(records: list[RankRecord], failures: list[AgentFailure]) -> str:
    """What failed in the previous attempt, in a few words: the first failed rank, how, and at which step."""
    by_rank = {r.rank: r for r in records}
    if failures:
        first = failures[0]
        record = by_rank.get(first.rank)
        where = "" if record is None or record.error or (first.message and "step" in first.message) \
            else f" during step {record.step + 1}"
        text = f"rank {first.rank} {first.how()}{where}"
        if record is not None and record.error and record.error not in (first.message or ""):
            text += f": {record.error}"
        hung = [f.rank for f in failures if f.stopped and f.signal == "SIGKILL"]
        if hung:  # stopped (SIGSTOP) or hung: what made the others' collectives time out
            names = ", ".join(map(str, hung))
            text = (f"rank{'s' if len(hung) > 1 else ''} {names} stopped responding (ignored SIGTERM, killed with "
                    f"SIGKILL); {text}")
        others = [f.rank for f in failures[1:] if f.rank not in hung]
        return text + (f" (then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else "")
    failed = [r for r in records if r.error]
    if failed:
        return f"rank {failed[0].rank} failed: {failed[0].error}"
    if records:
        behind = min(records, key=lambda r: r.step)
        return f"a rank stopped without an error (rank {behind.rank} last completed step {behind.step})"
    return "the workers failed before their first step"


def signal_name(exitcode: int) -> Optional[str]:
    """SIGKILL for -9, as torchrun reports a worker ended by a signal; None for a normal exit."""
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"
