"""Trials: real short runs of fspeed-train for a candidate, measured, and the results file they go to.

    result = run_trial(candidate, base_overrides, workdir / candidate_key(candidate), TrialSettings(timeout_s=120))
    results = ResultsFile(workdir / "results.jsonl", fingerprint=run_fingerprint(base_overrides, world=2))
    results.append(result)            # one JSON line, flushed: an interrupted tuning loses nothing finished
    done = results.load()             # key -> TrialResult: a resumed tuning skips these

A trial runs `python -m fspeed.cli.train --launch <base overrides> <candidate overrides>` (fspeed's
own launcher, torchrun underneath; no ssh) in a session of its own, for `warm_steps +
measured_steps` steps, its metrics in the trial directory's `metrics.csv`. The step time is the
median of the measured steps' wall times (consecutive `elapsed_s`), which include loading the
batch; throughput is the global batch over it (samples/s, and tokens/s where the run counts
tokens). Each rank's peak memory is its process's resident high-water mark (`VmHWM` in
/proc/<pid>/status, read while it runs); on CUDA (`train.device=cuda`) the peak its allocator
reserved, which fspeed-train records per rank in the run's `device_memory/` folder. A trial that
exits non-zero, is killed (out of memory: SIGKILL from the kernel, or an allocator's error) or
outlives `timeout_s` (a hang) is recorded with its reason and every process of its session is
killed; the search goes on.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from ..cli.observe import DEVICE_PEAKS_DIR
from ..fault_injection import alive, rank_pids, start, stop_session
from .space import Candidate

OK, FAILED, OUT_OF_MEMORY, TIMEOUT = "ok", "failed", "out_of_memory", "timeout"
STATUSES = (OK, FAILED, OUT_OF_MEMORY, TIMEOUT)

_OOM_PATTERNS = re.compile(r"out of memory|Cannot allocate memory|MemoryError|std::bad_alloc|OutOfMemoryError",
                           re.IGNORECASE)


@dataclass(frozen=True)
class TrialSettings:
    """How a trial runs: steps warmed up and measured, the time limit, how often memory is read, and
    the interpreter (the one running the tuner by default)."""

    warm_steps: int = 2
    measured_steps: int = 3
    timeout_s: float = 600.0
    poll_s: float = 0.1
    python: str = sys.executable

    def __post_init__(self) -> None:
        for name in ("warm_steps", "measured_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "warm_steps" else 1):
                raise ValueError(f"autotune.{name}={value!r}: must be an integer >= "
                                 f"{0 if name == 'warm_steps' else 1}")
        if not self.timeout_s > 0 or not self.poll_s > 0:
            raise ValueError(f"autotune.timeout_s={self.timeout_s!r} and poll_s={self.poll_s!r} must be positive")

    @property
    def steps(self) -> int:
        return self.warm_steps + self.measured_steps


@dataclass(frozen=True)
class TrialResult:
    """What one trial measured (or why it has no measurement: `status` and `reason`)."""

    key: str
    candidate: Candidate
    status: str
    reason: str = ""
    step_s: Optional[float] = None  # median wall seconds of a measured step, data loading included
    samples_per_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    peak_bytes: dict[int, int] = field(default_factory=dict)  # rank -> resident high-water mark (CUDA: reserved)
    wall_s: float = 0.0
    run_dir: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def max_peak_bytes(self) -> Optional[int]:
        return max(self.peak_bytes.values()) if self.peak_bytes else None

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["peak_bytes"] = {str(k): v for k, v in self.peak_bytes.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrialResult":
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["candidate"] = Candidate(**data["candidate"])
        values["peak_bytes"] = {int(k): int(v) for k, v in data.get("peak_bytes", {}).items()}
        return cls(**values)


def rank_threads(world: int) -> int:
    """torch's intra-op threads in each rank of a trial: OMP_NUM_THREADS when set, else torchrun's
    rule (1 with several ranks on the node, torch's default alone)."""
    import torch  # noqa: PLC0415

    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return 1 if world > 1 else torch.get_num_threads()


def candidate_key(candidate: Candidate) -> str:
    """A stable, file-name-safe key of a candidate: its label's words and a hash of its overrides."""
    digest = hashlib.sha1(" ".join(candidate.to_overrides()).encode()).hexdigest()[:10]
    words = re.sub(r"[^A-Za-z0-9.+-]+", "_", candidate.label())
    return f"{words}-{digest}"


def trial_overrides(candidate: Candidate, base_overrides: Sequence[str], run_dir: Path,
                    settings: TrialSettings) -> list[str]:
    """The full override list of a trial: the base, the candidate, then what makes it a short measured
    run writing into `run_dir` (its steps, metrics every step, no evaluation but the end's one batch,
    checkpoints in the run directory and no save on failure)."""
    return [*base_overrides, *candidate.to_overrides(),
            f"train.steps={settings.steps}", "train.eval_every=0", "train.eval_batches=1",
            f"train.log_every={max(settings.steps, 1)}", "monitor.progress_bar=false", "monitor.csv=true",
            f"monitor.csv_dir={run_dir}", f"checkpoint.dir={run_dir / 'checkpoints'}",
            "checkpoint.save_on_failure=false", "checkpoint.resume=false", f"hydra.run.dir={run_dir}"]


def read_peak_rss(pid: int) -> Optional[int]:
    """The resident high-water mark (VmHWM) of process `pid` in bytes, None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def step_measurements(metrics_csv: Path, warm_steps: int) -> tuple[list[float], Optional[float]]:
    """(the wall seconds of each step after the first `warm_steps`, tokens per sample or None) from a
    run's metrics.csv: step k's time is its `elapsed_s` minus step k-1's."""
    elapsed: dict[int, float] = {}
    tokens_per_sample = None
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("elapsed_s") and row.get("step"):
                elapsed[int(row["step"])] = float(row["elapsed_s"])
                if row.get("tokens_per_s") and row.get("samples_per_s") and float(row["samples_per_s"]) > 0:
                    tokens_per_sample = float(row["tokens_per_s"]) / float(row["samples_per_s"])
    steps = sorted(elapsed)
    times = [elapsed[s] - elapsed.get(s - 1, 0.0) for s in steps if s - 1 in elapsed or s == steps[0]]
    return times[warm_steps:], tokens_per_sample


def _failure(code: int, log_text: str) -> tuple[str, str]:
    """(status, reason) of a run that ended with exit code `code` and printed `log_text`: the last
    error line, with the problem lines that follow it (an fspeed-train configuration error's)."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    marks = [i for i, line in enumerate(lines) if re.search(r"error|exception|fspeed-train:|killed|signal", line, re.I)]
    if marks:
        first = marks[-1]
        while first > 0 and lines[first].startswith("- ") and first - 1 in marks:
            first -= 1
        details = [line for line in lines[first + 1:first + 4] if line.startswith("- ")]
        last = " ".join([lines[first], *details])[:400]
    else:
        last = lines[-1][:400] if lines else "no output"
    if _OOM_PATTERNS.search(log_text) or code in (-9, 137) or "SIGKILL" in log_text:
        return OUT_OF_MEMORY, f"out of memory (exit code {code}): {last}"
    return FAILED, f"exit code {code}: {last}"


def run_trial(candidate: Candidate, base_overrides: Sequence[str], run_dir: Path,
              settings: TrialSettings = TrialSettings(), key: Optional[str] = None,
              cwd: Optional[Path] = None) -> TrialResult:
    """Run one trial of `candidate` writing into `run_dir` (created; module docstring) and measure it.
    The command runs in `cwd` (default: this process's), where fspeed-train imports a user's
    `model._target_` and `data._target_` from."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    key = key or candidate_key(candidate)
    command = [settings.python, "-m", "fspeed.cli.train", "--launch",
               *trial_overrides(candidate, base_overrides, run_dir, settings)]
    log = run_dir / "trial.log"
    log.write_text("")
    begin = time.monotonic()
    process = start(command, cwd=Path(cwd or Path.cwd()), log=log, env={"PYTHONUNBUFFERED": "1"})
    peaks: dict[int, int] = {}
    ranks: dict[int, int] = {}
    timed_out, next_scan = False, 0.0
    try:
        while process.poll() is None:
            now = time.monotonic()
            if now - begin > settings.timeout_s:
                timed_out = True
                break
            if len(ranks) < candidate.world and now >= next_scan:  # find the ranks once they exist
                ranks.update(rank_pids(process.pid))
                next_scan = now + 0.5
            for rank, pid in ranks.items():
                rss = read_peak_rss(pid)
                if rss is not None:
                    peaks[rank] = max(peaks.get(rank, 0), rss)
            time.sleep(settings.poll_s)
    finally:
        stop_session(process, also=alive(list(ranks.values())))
    wall = time.monotonic() - begin
    common = dict(key=key, candidate=candidate, peak_bytes=peaks, wall_s=wall, run_dir=str(run_dir))
    if timed_out:
        return TrialResult(status=TIMEOUT, reason=f"no end within {settings.timeout_s:g} s (a hang, or too slow): "
                                                  "every process of the trial was killed", **common)
    text = log.read_text(errors="replace")
    if process.returncode != 0:
        status, reason = _failure(process.returncode, text)
        return TrialResult(status=status, reason=reason, **common)
    return _measured(candidate, run_dir, settings, common)


def _measured(candidate: Candidate, run_dir: Path, settings: TrialSettings, common: dict) -> TrialResult:
    metrics = run_dir / "metrics.csv"
    if not metrics.exists():
        return TrialResult(status=FAILED, reason=f"the run ended without writing {metrics}", **common)
    times, tokens_per_sample = step_measurements(metrics, settings.warm_steps)
    if not times:
        return TrialResult(status=FAILED, reason=f"{metrics} holds no measured step (after {settings.warm_steps} "
                                                 "warm-up steps)", **common)
    step_s = statistics.median(times)
    samples = candidate.global_batch / step_s
    tokens = samples * tokens_per_sample if tokens_per_sample else None
    common["peak_bytes"] = device_peaks(run_dir) or common["peak_bytes"]
    return TrialResult(status=OK, step_s=step_s, samples_per_s=samples, tokens_per_s=tokens, **common)


def device_peaks(run_dir: Path) -> dict[int, int]:
    """rank -> the CUDA allocator's peak reserved bytes that each rank of a run recorded (fspeed-train's
    `device_memory/rank<r>.json`); empty for a run on the CPU."""
    found = {}
    for path in sorted((Path(run_dir) / DEVICE_PEAKS_DIR).glob("rank*.json")):
        rank = path.stem[len("rank"):]
        if rank.isdigit():
            found[int(rank)] = int(json.loads(path.read_text())["max_reserved"])
    return found


def run_fingerprint(base_overrides: Sequence[str], world: int, settings: TrialSettings) -> str:
    """What makes results comparable: the base overrides, the world and the trial protocol."""
    text = json.dumps({"base": list(base_overrides), "world": world, "warm": settings.warm_steps,
                       "measured": settings.measured_steps})
    return hashlib.sha1(text.encode()).hexdigest()[:16]


class ResultsFile:
    """Trial results as JSON lines, one per finished trial, each flushed and fsynced as it is written.

    Every line carries the tuning's `fingerprint`; loading a file made for another base, world or
    protocol is an error (its numbers do not compare), and a last line cut short by an interruption
    is ignored (that trial runs again)."""

    def __init__(self, path: Path, fingerprint: str):
        self.path, self.fingerprint = Path(path), fingerprint

    def load(self) -> dict[str, TrialResult]:
        """key -> result of every trial recorded so far (empty when there is no file)."""
        if not self.path.exists():
            return {}
        found: dict[str, TrialResult] = {}
        lines = self.path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # an interrupted write: that trial runs again
                    break
                raise ValueError(f"{self.path}:{number} is not a JSON line; remove it or choose another "
                                 "autotune.results file") from None
            if record.get("fingerprint") != self.fingerprint:
                raise ValueError(f"{self.path} holds results of another tuning (other base overrides, world or "
                                 "trial steps); choose another autotune.results file or remove it")
            result = TrialResult.from_json(record["result"])
            found[result.key] = result
        return found

    def append(self, result: TrialResult) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"fingerprint": self.fingerprint, "result": result.to_json()})
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


__all__ = ["FAILED", "OK", "OUT_OF_MEMORY", "ResultsFile", "STATUSES", "TIMEOUT", "TrialResult", "TrialSettings",
           "candidate_key", "device_peaks", "rank_threads", "read_peak_rss", "run_fingerprint", "run_trial",
           "step_measurements", "trial_overrides"]
