"""Fault injection at scale: many trials of each fault against real fspeed-train runs.

    python benchmarks/fault_injection.py [--kill9-one-process 20] [--kill9-zero3 6] [--agent-kills 5]
        [--launcher-kills 5] [--disk-full 3] [--sigstops 2] [--seed 0] [--workdir DIR]

The cases (`fspeed.fault_injection`, which tests/test_faults.py runs a few times):

- kill9: kill -9 the process of a one-process run, or a random rank of a 2-rank ZeRO-3 run, at
  a random moment after its first checkpoint (it saves every step, so the moment falls in
  training or in saving), then resume. Success: the resumed run ends bit-identical to the same
  run without the fault, no temporary directory is left, no worker outlived the fault.
- agent_kill / launcher_kill: kill -9 the torchrun agent, or the launcher, of a 2-rank ZeRO-3
  run at a random moment; count its workers still running 10 s later.
- disk_full: resume into a checkpoint directory with room for 2.5 checkpoints (a tmpfs in a user
  namespace where the machine allows, else RLIMIT_FSIZE): the failing save must stop the run with
  an error naming the path and the cause, and `latest` must resume to the end bit-identically.
- sigstop: SIGSTOP a rank; the job must fail naming the timed-out collective, leave no worker
  running, and keep a resumable `latest` (torchrun waits 30 s before killing a stopped worker).

Ends with name=value lines: kill9_resume_success_fraction (goal 1.0), orphan_workers_after_agent_kill
(goal 0), orphan_workers_after_launcher_kill, disk_full_success_fraction, sigstop_success_fraction,
and <case>_trials for each case.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from fspeed import fault_injection as fi



def long_zero3_launch(workdir: Path) -> list[str]:
    return fi.ZERO3.command(workdir / "run", workdir / "ck", "train.steps=100000")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill9-one-process", type=int, default=20)
    parser.add_argument("--kill9-zero3", type=int, default=6)
    parser.add_argument("--agent-kills", type=int, default=5)
    parser.add_argument("--launcher-kills", type=int, default=5)
    parser.add_argument("--disk-full", type=int, default=3)
    parser.add_argument("--sigstops", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="fspeed-faults-"))
    rng = random.Random(args.seed)
    trials: dict[str, list[fi.Trial]] = {}
    not_counted: dict[str, int] = {}  # kills drawn after a run's last save, drawn again

    def record(case: str, trial: fi.Trial) -> None:
        trials.setdefault(case, []).append(trial)
        mark = "ok  " if trial.ok else "FAIL"
        print(f"{mark} {case:<14} {trial.detail.splitlines()[0] if trial.detail else ''}", flush=True)
        if not trial.ok:
            print("     " + trial.detail.replace("\n", "\n     "), flush=True)

    started = time.monotonic()
    for job, count in ((fi.ONE_PROCESS, args.kill9_one_process), (fi.ZERO3, args.kill9_zero3)):
        if not count:
            continue
        reference, window = fi.reference_run(job, root / job.name / "reference")
        done, attempt = 0, 0
        while done < count:  # a kill drawn after the run's end is not a trial: draw again
            trial = fi.kill9_trial(job, root / job.name / f"attempt{attempt}", reference, window, rng)
            attempt += 1
            if trial.numbers.get("counted", 1):
                record(f"kill9_{job.name}", trial)
                done += 1
        not_counted[job.name] = attempt - done
    for target, count in (("agent", args.agent_kills), ("launcher", args.launcher_kills)):
        for i in range(count):
            workdir = root / f"{target}_kill" / f"trial{i}"
            record(f"{target}_kill", fi.orphan_trial(long_zero3_launch(workdir), workdir, target, 2,
                                                     delay_s=rng.uniform(0, 8)))
    if args.disk_full:
        reference, _ = fi.reference_run(fi.ONE_PROCESS, root / "disk_full" / "reference")
        for i in range(args.disk_full):
            record("disk_full", fi.disk_full_trial(fi.ONE_PROCESS, root / "disk_full" / f"trial{i}", reference))
    for i in range(args.sigstops):
        record("sigstop", fi.sigstop_trial(fi.ZERO3_SHORT_TIMEOUT, root / "sigstop" / f"trial{i}", rng))

    print(f"\n{'case':<16} {'trials':>6} {'ok':>4} {'orphans':>8} {'median s to end':>16}")
    for case, results in trials.items():
        seconds = statistics.median(t.seconds for t in results)
        print(f"{case:<16} {len(results):>6} {sum(t.ok for t in results):>4} {sum(t.orphans for t in results):>8} "
              f"{seconds:>16.1f}")
    print(f"(work directory {root}; {time.monotonic() - started:.0f} s)\n")

    kill9 = trials.get("kill9_one_process", []) + trials.get("kill9_zero3", [])
    for case, results in trials.items():
        print(f"{case}_trials={len(results)}")
    for name, count in not_counted.items():
        print(f"kill9_{name}_draws_after_the_last_save={count}")
    if kill9:
        print(f"kill9_trials_that_hit_a_save={sum(t.numbers.get('during_save', 0) for t in kill9)}")
        print(f"kill9_resume_success_fraction={sum(t.ok for t in kill9) / len(kill9):.3f}")
    for target in ("agent", "launcher"):
        if f"{target}_kill" in trials:
            print(f"orphan_workers_after_{target}_kill={sum(t.orphans for t in trials[f'{target}_kill'])}")
    if "disk_full" in trials:
        results = trials["disk_full"]
        print(f"disk_full_mode={results[0].numbers.get('mode')}")
        print(f"disk_full_success_fraction={sum(t.ok for t in results) / len(results):.3f}")
    if "sigstop" in trials:
        results = trials["sigstop"]
        print(f"sigstop_success_fraction={sum(t.ok for t in results) / len(results):.3f}")
        print(f"orphan_workers_after_sigstop={sum(t.orphans for t in results)}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/fault_injection.json

    with recorded("fault_injection"):
        main()
