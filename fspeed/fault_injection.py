"""Fault injection against `fspeed-train`, run as a user runs it: kill -9 a rank at a random moment
of training or saving, kill the torchrun agent or the launcher, fill the disk, SIGSTOP a rank;
then check what a user would: `latest` resumes and the run ends bit-identical to one that never
failed, no worker is left running, errors name what failed.

Each `*_trial` function runs one trial in a fresh directory and returns a `Trial`;
`tests/test_faults.py` runs a few, `benchmarks/fault_injection.py` many. `healing_trial` injects
faults into a run with `--max_restarts` that must heal itself (`tests/test_restarts.py`,
`benchmarks/goodput.py`). Processes are found
through /proc (Linux): a rank is a descendant of the job whose environment has RANK (from
torchrun), the agent the descendant running `fspeed.launcher.agent`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .checkpoint import CheckpointError, latest_tag, read_meta
from .checkpoint.tensor_file import open_tensor_file
from .launcher.processes import alive, descendants, proc_table

TINY_RUN = ("model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=32", "data.max_bytes=40000",
            "train.micro_batch_size=4", "train.eval_every=0", "train.eval_batches=1", "train.log_every=1000",
            "monitor.progress_bar=false", "monitor.csv=false")
"""A training job small enough to start, save and resume in seconds on 2 CPU cores."""

ZERO3_TWO_RANKS = ("zero.stage=3", "zero.param_persistence_threshold=0", "parallel.data=2")


@dataclass
class Trial:
    """The outcome of one fault-injection trial."""

    case: str
    ok: bool                       # the property the case checks held
    detail: str = ""               # what happened, for the report
    orphans: int = 0               # worker processes still running after the job was expected to end
    seconds: float = 0.0           # from the fault to the end of the job
    numbers: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------- processes

def train_command(overrides: Sequence[str], *, launch: bool = False) -> list[str]:
    return [sys.executable, "-m", "fspeed.cli.train", *(["--launch"] if launch else []), *overrides]


def start(command: Sequence[str], *, cwd: Path, log: Path, preexec: Optional[Callable[[], None]] = None,
          env: Optional[dict] = None) -> subprocess.Popen:
    """Start `command` in a session of its own (so a leftover can be found and cleaned up), output to `log`."""
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    environ.update(env or {})
    with open(log, "ab") as out:
        return subprocess.Popen(list(command), cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=environ,
                                start_new_session=True, preexec_fn=preexec)


def run(command: Sequence[str], *, cwd: Path, log: Path, timeout_s: float = 600,
        preexec: Optional[Callable[[], None]] = None) -> tuple[int, str]:
    """Run `command` to its end; (exit code, its output)."""
    process = start(command, cwd=cwd, log=log, preexec=preexec)
    try:
        code = process.wait(timeout=timeout_s)
    finally:
        stop_session(process)
    return code, log.read_text(errors="replace")


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def rank_pids(root: int) -> dict[int, int]:
    """rank -> pid of the workers below `root` (started by torchrun: RANK in their environment)."""
    ranks = {}
    for pid in descendants(root):
        env = _environ(pid)
        if "TORCHELASTIC_RUN_ID" in env and "RANK" in env and "fspeed.launcher.agent" not in _cmdline(pid):
            ranks[int(env["RANK"])] = pid
    return ranks


def _cmdline(pid: int) -> str:
    entry = proc_table().get(pid)
    return entry[1] if entry else ""


def agent_pid(root: int) -> Optional[int]:
    return next((pid for pid in descendants(root) if "fspeed.launcher.agent" in _cmdline(pid)), None)


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


def stop_session(process: subprocess.Popen, also: Sequence[int] = ()) -> None:
    """Kill whatever is left of a job (cleanup after a trial, whatever it found): the process, its
    descendants, and `also` (workers seen earlier, which a dead parent no longer leads to). The tree
    is frozen first (SIGSTOP, again until no new process appears), so that a process starting
    while it is found (a launcher spawning its agent, an agent its workers) is not left behind."""
    frozen: list[int] = []
    found = [process.pid, *alive(list(also))]
    while found:
        for pid in found:
            _signal(pid, signal.SIGSTOP)
        frozen += found
        found = [pid for pid in descendants(process.pid) if pid not in frozen]
    for pid in frozen:
        _signal(pid, signal.SIGKILL)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------- checkpoints

def checkpoint_tensors(directory: Path, tag: Optional[str] = None) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint `tag` (default: latest), all rank files together, keyed by file and name."""
    tag = tag or latest_tag(directory)
    meta = read_meta(directory, tag)
    out = {}
    for name in sorted(meta["files"]):
        reader = open_tensor_file(directory / tag / name)
        for key in reader.keys():
            out[f"{name}:{key}"] = reader.get_tensor(key)
    return out


def same_checkpoint(a: Path, b: Path) -> bool:
    """Whether the latest checkpoints of two directories hold the same step and bit-identical tensors."""
    if read_meta(a)["scalars"] != read_meta(b)["scalars"]:
        return False
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def leftovers(directory: Path) -> list[str]:
    """Temporary entries of crashed saves left in a checkpoint directory."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------- trials

@dataclass(frozen=True)
class Job:
    """A training configuration to inject faults into: extra overrides, steps, ranks."""

    name: str
    overrides: tuple[str, ...] = TINY_RUN
    steps: int = 30
    launch: bool = False

    def command(self, directory: Path, checkpoints: Path, *extra: str) -> list[str]:
        return train_command([*self.overrides, f"train.steps={self.steps}", "checkpoint.save_every=1",
                              f"checkpoint.dir={checkpoints}", f"hydra.run.dir={directory}", *extra],
                             launch=self.launch)


ONE_PROCESS = Job("one_process")
ZERO3 = Job("zero3", TINY_RUN + ZERO3_TWO_RANKS + ("parallel.timeout_s=60",), launch=True)
# a stopped rank is found after parallel.timeout_s: short, but not so short that a loaded machine trips it
ZERO3_SHORT_TIMEOUT = Job("zero3_short_timeout", TINY_RUN + ZERO3_TWO_RANKS + ("parallel.timeout_s=10",), launch=True)


def _latest_is(checkpoints: Path, tag: str) -> bool:
    try:
        return latest_tag(checkpoints) == tag
    except CheckpointError:  # caught between writing and renaming: not yet
        return False


def reference_run(job: Job, workdir: Path) -> tuple[Path, float]:
    """The run without faults: (its checkpoint directory, seconds from its first checkpoint to its
    last, the window of training and saving in which faults are injected)."""
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoints = workdir / "ck"
    process = start(job.command(workdir / "run", checkpoints), cwd=workdir, log=workdir / "log.txt")
    try:
        wait_until(lambda: (checkpoints / "latest").exists() or process.poll() is not None, 300)
        first_checkpoint = time.monotonic()
        wait_until(lambda: _latest_is(checkpoints, f"global_step{job.steps}") or process.poll() is not None, 600,
                   poll_s=0.01)
        window = time.monotonic() - first_checkpoint
        code = process.wait(timeout=600)
    finally:
        stop_session(process)
    if code != 0:
        output = (workdir / "log.txt").read_text(errors="replace")
        raise RuntimeError(f"the reference run of {job.name} failed (exit {code}):\n{output[-3000:]}")
    return checkpoints, window


def _resume(job: Job, workdir: Path, checkpoints: Path) -> tuple[int, str]:
    return run(job.command(workdir / "resumed", checkpoints, "checkpoint.resume=true"), cwd=workdir,
               log=workdir / "resume.txt")


def kill9_trial(job: Job, workdir: Path, reference: Optional[Path], window_s: float, rng: random.Random) -> Trial:
    """kill -9 a random rank at a random moment of the `window_s` seconds after the first checkpoint
    (steps save every time, so the moment falls in training or in saving); then resume to the end:
    it must succeed and (given a `reference` run) end bit-identical to it, with no leftovers of
    crashed saves and no worker left running. A kill that lands after the last save (or after the
    end) is not counted (`numbers["counted"] == 0`): draw again."""
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoints = workdir / "ck"
    process = start(job.command(workdir / "run", checkpoints), cwd=workdir, log=workdir / "log.txt")
    workers: list[int] = []
    try:
        if not wait_until(lambda: (checkpoints / "latest").exists() or process.poll() is not None, 120):
            return Trial("kill9", False, "no first checkpoint within 120 s")
        time.sleep(rng.uniform(0, window_s))
        ranks = rank_pids(process.pid) if job.launch else {0: process.pid}
        if process.poll() is not None or not ranks:
            return Trial("kill9", True, "the run ended before the kill (not counted)", numbers={"counted": 0})
        victim = rng.choice(sorted(ranks))
        workers = list(ranks.values())
        os.kill(ranks[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        process.wait(timeout=120)
        seconds = time.monotonic() - killed_at
        wait_until(lambda: not alive(workers), 10)
        orphans = len(alive(workers))
    finally:
        stop_session(process, also=workers)
    try:
        step = read_meta(checkpoints)["step"]
    except CheckpointError as e:
        return Trial("kill9", False, f"rank {victim} killed; latest does not load: {e}", orphans, seconds)
    if step == job.steps:  # the kill came after the last save: not a fault of training or saving
        return Trial("kill9", orphans == 0, f"rank {victim} killed after the last save (not counted)", orphans,
                     seconds, {"counted": 0})
    during_save = bool(leftovers(checkpoints))  # a save's temporary entries: the kill hit it mid-save
    code, output = _resume(job, workdir, checkpoints)
    same = code == 0 and (reference is None or same_checkpoint(checkpoints, reference))
    left = leftovers(checkpoints)
    ok = same and not left and orphans == 0
    return Trial("kill9", ok, f"rank {victim} killed {'while saving' if during_save else 'while training'}; latest "
                 f"was step {step}; resume exit {code}, bit-identical {same}, leftovers after resume {left}"
                 + ("" if code == 0 else f"\n{output[-2000:]}"), orphans, seconds,
                 {"counted": 1, "during_save": int(during_save)})


def orphan_trial(command: Sequence[str], workdir: Path, target: str, world_size: int, delay_s: float = 0.0) -> Trial:
    """Start a multi-rank job (`command`: the launcher, e.g. `fspeed-train --launch ...`), kill -9
    its torchrun agent (`target="agent"`) or the launcher itself (`"launcher"`) `delay_s` after its
    `world_size` workers started, and count the workers still running 10 seconds later."""
    workdir.mkdir(parents=True, exist_ok=True)
    process = start(command, cwd=workdir, log=workdir / "log.txt")
    workers: list[int] = []
    seen: dict[int, int] = {}

    def started() -> bool:  # the same `world_size` workers in two readings of /proc in a row
        nonlocal seen
        now = rank_pids(process.pid)
        stable, seen = len(now) == world_size and now == seen, now
        return stable or process.poll() is not None

    try:
        if not wait_until(started, 120):
            return Trial(f"{target}_kill", False, f"{world_size} workers did not start within 120 s")
        if process.poll() is not None:
            return Trial(f"{target}_kill", False, f"the launcher exited ({process.returncode}) before its workers "
                         f"started:\n{(workdir / 'log.txt').read_text(errors='replace')[-2000:]}")
        time.sleep(delay_s)
        workers = list(seen.values())
        victim = agent_pid(process.pid) if target == "agent" else process.pid
        if victim is None:
            return Trial(f"{target}_kill", False, f"no {target} process found below the launcher")
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        gone = wait_until(lambda: not alive(workers), 10)
        seconds = time.monotonic() - killed_at
        orphans = len(alive(workers))
    finally:
        stop_session(process, also=workers)
    return Trial(f"{target}_kill", gone and orphans == 0, f"{len(workers)} workers; {orphans} left after 10 s",
                 orphans, seconds)


def namespaces_available() -> bool:
    """Whether this machine lets an unprivileged user mount a tmpfs in a user namespace (unshare)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


def disk_full_trial(job: Job, workdir: Path, reference: Optional[Path]) -> Trial:
    """Resume a run (saving every step) into a checkpoint directory with room for two and a half
    checkpoints: a save fails for want of space. The run must stop with an error naming the path
    and the cause, `latest` must still name a complete checkpoint (the one the error names), and
    that checkpoint must resume to the end (bit-identical to a `reference` run, given one).

    A real full filesystem (a tmpfs in a user namespace) where the machine allows; else a real
    per-process file-size limit (RLIMIT_FSIZE, EFBIG) that fails the first save of the resumed run."""
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoints = workdir / "ck"
    first = Job(job.name, job.overrides, 1, job.launch)
    code, output = run(first.command(workdir / "first", checkpoints), cwd=workdir, log=workdir / "first.txt")
    if code != 0:
        return Trial("disk_full", False, f"the first run failed:\n{output[-2000:]}")
    size = sum(p.stat().st_size for p in (checkpoints / latest_tag(checkpoints)).iterdir())
    if namespaces_available():
        mode, full = "tmpfs", workdir / "full"
        full.mkdir()
        command = job.command(workdir / "run", full / "ck", "checkpoint.resume=true")
        script = (f"mount -t tmpfs -o size={int(size * 2.5)} tmpfs {full} && cp -a {checkpoints} {full}/ck && "
                  + " ".join(shlex.quote(a) for a in command) + f"; code=$?; cp -a {full}/ck {workdir}/after; exit $code")
        code, output = run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=workdir,
                           log=workdir / "log.txt")
        after, cause = workdir / "after", "No space left on device (ENOSPC)"
    else:
        mode, after, cause = "rlimit_fsize", checkpoints, "File too large (EFBIG)"
        command = job.command(workdir / "run", checkpoints, "checkpoint.resume=true")
        code, output = run(command, cwd=workdir, log=workdir / "log.txt", preexec=_file_size_limit(size // 2))
    kept = latest_tag(after)
    named = cause in output and f"'latest' still names {kept} (untouched)" in output
    resumed_code, _ = _resume(job, workdir, after)
    same = resumed_code == 0 and (reference is None or same_checkpoint(after, reference))
    ok = code == 2 and named and not leftovers(after) and same
    return Trial("disk_full", ok, f"{mode}: exit {code}, path and cause named {named}, latest {kept} resumed "
                 f"bit-identical {same}\n{_last_lines(output, 2)}", numbers={"mode": mode})


def sigstop_trial(job: Job, workdir: Path, rng: random.Random, resume: bool = True, shutdown_s: int = 30) -> Trial:
    """SIGSTOP one rank of a multi-rank job: the job must fail with an error naming the timed-out
    collective (after parallel.timeout_s), leave no worker running, and (`resume`) keep a latest
    that resumes. The agent gives the stopped worker `shutdown_s` after SIGTERM (torchrun's
    shutdown timeout, 30 s by default), which it cannot act on, before it SIGKILLs it."""
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoints = workdir / "ck"
    process = start(job.command(workdir / "run", checkpoints), cwd=workdir, log=workdir / "log.txt",
                    env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(shutdown_s)})
    ranks: dict[int, int] = {}
    try:
        if not wait_until(lambda: (checkpoints / "latest").exists() or process.poll() is not None, 120):
            return Trial("sigstop", False, "no first checkpoint within 120 s")
        ranks = rank_pids(process.pid)
        if process.poll() is not None or not ranks:
            return Trial("sigstop", False, "the job ended before the fault")
        victim = rng.choice(sorted(ranks))
        os.kill(ranks[victim], signal.SIGSTOP)
        stopped_at = time.monotonic()
        process.wait(timeout=300)
        seconds = time.monotonic() - stopped_at
        orphans = len(alive(list(ranks.values())))
    finally:
        stop_session(process, also=list(ranks.values()))
    output = (workdir / "log.txt").read_text(errors="replace")
    named = "CommError" in output and "failed after" in output
    code = _resume(job, workdir, checkpoints)[0] if resume else 0
    ok = process.returncode != 0 and named and orphans == 0 and code == 0
    return Trial("sigstop", ok, f"rank {victim} stopped; job exit {process.returncode} after {seconds:.0f} s; "
                 f"timeout error named {named}; resume exit {code}", orphans, seconds)


def goodput_in(output: str) -> Optional[float]:
    """The goodput a run's output ends with (its summary's `goodput 0.873: ...` line), or None."""
    found = re.findall(r"^goodput (\d+\.\d+):", output, re.MULTILINE)
    return float(found[-1]) if found else None


def _attempts(run_dir: Path) -> list[dict]:
    """Every rank's restart record (`fspeed.cli.restarts`) of a run directory: attempt, last step, error."""
    records = []
    for path in sorted((run_dir / "restarts").glob("rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # being replaced: read again at the next poll
            return []
    return records


def _training_in(run_dir: Path, attempt: int, world_size: int) -> bool:
    """Whether every rank of the run has completed a step in `attempt`."""
    records = _attempts(run_dir)
    return len(records) == world_size and all(r["attempt"] == attempt for r in records)


def restart_record(run_dir: Path) -> dict:
    """Rank 0's record of the run's start and restarts (`restarts/run.json`); {} without one."""
    try:
        return json.loads((run_dir / "restarts" / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def healing_trial(job: Job, workdir: Path, reference: Optional[Path], rng: random.Random, *, faults: int = 1,
                  fault: int = signal.SIGKILL, window_s: float = 1.0, world_size: int = 2, shutdown_s: int = 3,
                  extra: Sequence[str] = (), env: Optional[dict] = None) -> Trial:
    """Run a multi-rank `job` with `--max_restarts faults` and send `fault` (SIGKILL: a rank dies;
    SIGSTOP: a rank stops responding) to a random rank `faults` times, each a random moment up to
    `window_s` after the attempt's ranks all completed a step. The run must heal: exit 0, one
    restart per fault, the restart said in the log, no worker left, and (given the `reference` run's
    checkpoints) the final checkpoint bit-identical to it. numbers: goodput, restarts,
    restart_seconds (mean, from the fault to the restarted attempt training again), steps_redone."""
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir, checkpoints = workdir / "run", workdir / "ck"
    command = job.command(run_dir, checkpoints, *extra, f"--max_restarts={faults}")
    process = start(command, cwd=workdir, log=workdir / "log.txt",
                    env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(shutdown_s), **(env or {})})
    workers: list[int] = []
    back_after: list[float] = []
    try:
        for attempt in range(faults):
            if not wait_until(lambda: _training_in(run_dir, attempt, world_size) or process.poll() is not None, 300):
                return Trial("healing", False, f"attempt {attempt} did not train within 300 s")
            time.sleep(rng.uniform(0, window_s))
            ranks = rank_pids(process.pid)
            if process.poll() is not None or len(ranks) < world_size:
                return Trial("healing", False, f"the run ended before fault {attempt + 1}:\n"
                             + (workdir / "log.txt").read_text(errors="replace")[-3000:])
            workers += list(ranks.values())
            faulted_at = time.time()
            os.kill(ranks[rng.choice(sorted(ranks))], fault)
            ready = lambda: (restart_record(run_dir).get("ready") or [0, 0])[1] > faulted_at  # noqa: E731
            if not wait_until(lambda: ready() or process.poll() is not None, 300):
                return Trial("healing", False, f"no restart within 300 s of fault {attempt + 1}")
            back_after.append(restart_record(run_dir).get("ready", [0, faulted_at])[1] - faulted_at)
        code = process.wait(timeout=600)
        wait_until(lambda: not alive(workers), 10)
        orphans = len(alive(workers))
    finally:
        stop_session(process, also=workers)
    output = (workdir / "log.txt").read_text(errors="replace")
    restarts = restart_record(run_dir).get("restarts", [])
    same = reference is None or (code == 0 and same_checkpoint(checkpoints, reference))
    said = all(f"restart {n + 1} of {faults}: attempt {n} failed: rank" in output for n in range(faults))
    ok = code == 0 and len(restarts) == faults and said and orphans == 0 and same
    return Trial("healing", ok, f"{faults} x {signal.Signals(fault).name}: exit {code}, {len(restarts)} restarts, "
                 f"said in the log {said}, bit-identical {same}, {orphans} workers left"
                 + ("" if ok else f"\n{output[-4000:]}"), orphans, sum(back_after),
                 {"goodput": goodput_in(output), "restarts": len(restarts),
                  "restart_seconds": sum(back_after) / max(len(back_after), 1),
                  "steps_redone": sum(r["steps_redone"] for r in restarts), "output": output})


def _last_lines(text: str, n: int) -> str:
    return "\n".join(line for line in text.strip().splitlines()[-n:])


def _file_size_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply
