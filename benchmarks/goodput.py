"""Goodput under injected faults: a 2-rank fspeed-train run that heals itself, against the same run
without faults.

    python benchmarks/goodput.py [--steps 3000] [--faults 3] [--save-every 20] [--seed 0] [--workdir DIR]
    python benchmarks/goodput.py --quick      # a tiny model and 60 steps: a smoke test of the harness

Both runs are `fspeed-train --launch --max_restarts <faults>` (ZeRO-3, 2 data ranks, checkpoints
every --save-every steps). The faulted one has a random rank killed with SIGKILL at a random moment
`--faults` times (`fspeed.fault_injection.healing_trial`: each kill waits until the restarted group
trains again). A table compares the two (wall time, useful step time, goodput, restarts, steps
redone, seconds lost, final validation loss), then the figures:

- goodput_under_faults: the faulted run's goodput (useful step time over wall time since its first
  attempt started), goal >= 0.85
- faulted_final_loss_over_clean: final validation loss, faulted over clean, goal within 0.99-1.01
  (the restarts resume bit for bit, so 1.0)
- restarts_completed: the restarts the faulted run made, goal = the faults injected
- restart_seconds: mean time from a kill to the restarted group training again
- async_save_stall_over_step: the extra time a background save (`blocking=False`) costs the steps
  it overlaps, over one step (goal <= 0.10), with blocking_save_stall_over_step (a blocking save's
  time over one step) beside it: a GPT of ~7M parameters, ZeRO-3 on 2 gloo ranks, in one process
  pair (`--stall-rounds` rounds, medians). On a CPU the background thread's copy and checksum share
  the cores with the step; on a GPU the step does not need them.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

import fspeed as fs
from fspeed import fault_injection as fi
from fspeed.testing import GlooWorld

RUN = ("model.n_layer=2", "model.n_head=4", "model.d_model=128", "model.seq_len=128", "data.max_bytes=400000",
       "train.micro_batch_size=8", "train.eval_every=0", "train.eval_batches=8", "train.log_every=100",
       "monitor.progress_bar=false", "monitor.csv=false", "scheduler=constant")
"""The benchmark's model and data: a small character GPT (~0.4M parameters) on the packaged corpus."""


def job(quick: bool, steps: int) -> fi.Job:
    base = fi.TINY_RUN if quick else RUN
    return fi.Job("goodput", base + fi.ZERO3_TWO_RANKS + ("parallel.timeout_s=60",), steps=steps, launch=True)


def summary_of(output: str) -> dict[str, Optional[float]]:
    """What a run's summary says: goodput, useful and wall seconds, restarts, steps redone, seconds lost,
    final validation loss (None where the output lacks it)."""
    out: dict[str, Optional[float]] = {"goodput": fi.goodput_in(output)}
    found = re.findall(r"^goodput [\d.]+: ([\d.]+)s in useful training steps of ([\d.]+)s", output, re.MULTILINE)
    out["useful_s"], out["wall_s"] = (float(found[-1][0]), float(found[-1][1])) if found else (None, None)
    lost = re.findall(r"lost to failures: (\d+) restarts?, (\d+) steps? redone, ([\d.]+)s", output)
    out["restarts"], out["steps_redone"], out["seconds_lost"] = \
        (int(lost[-1][0]), int(lost[-1][1]), float(lost[-1][2])) if lost else (0, 0, 0.0)
    loss = re.findall(r"^val loss [\d.]+ -> ([\d.]+)", output, re.MULTILINE)
    out["val_loss"] = float(loss[-1]) if loss else None
    return out


def measure_save_stalls(root: str, rounds: int, overlap_steps: int) -> dict:
    """On each rank: the median step time, a blocking save's time, and the extra time of
    `overlap_steps` steps that overlap a background save (waited for at their end), per round."""
    mesh = fs.Mesh(data=-1)
    model = fs.models.gpt(fs.models.GPTConfig(vocab_size=8192, seq_len=256, n_layer=4, n_head=8, d_model=256))
    opt = fs.optim.adamw(1e-4)
    plan = fs.zero(3)
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt, plan=plan, mesh=mesh,
                                model=model)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    tokens = torch.randint(0, 8192, (4, 257), generator=torch.Generator().manual_seed(mesh.rank))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    holder = {"state": state}

    def steps(n: int) -> None:
        for _ in range(n):
            holder["state"], _ = step(holder["state"], batch)

    def timed(fn) -> float:  # the slowest rank's wall time
        mesh.all_gather_objects(None, "start")
        t0 = time.perf_counter()
        fn()
        return max(mesh.all_gather_objects(time.perf_counter() - t0, "time"))

    steps(2)
    out: dict[str, list[float]] = {"step": [], "blocking": [], "overlapped": [], "write": []}
    for r in range(rounds):
        out["step"].append(timed(lambda: steps(overlap_steps)) / overlap_steps)
        out["blocking"].append(timed(lambda: fs.checkpoint.save_checkpoint(Path(root) / f"b{r}", holder["state"],
                                                                           mesh=mesh)))
        pending = []

        def overlapped() -> None:
            pending.append(fs.checkpoint.save_checkpoint(Path(root) / f"a{r}", holder["state"], mesh=mesh,
                                                         blocking=False))
            steps(overlap_steps)
            pending[0].wait()
        out["overlapped"].append(timed(overlapped))
        out["write"].append(max(mesh.all_gather_objects(pending[0].seconds, "write")))
    return out


def save_stalls(rounds: int, overlap_steps: int) -> tuple[float, float]:
    """(async save stall over one step, blocking save time over one step), medians over rounds."""
    with tempfile.TemporaryDirectory(prefix="fspeed-save-stall-") as root, GlooWorld(2, timeout_s=900) as world:
        out = world.run(measure_save_stalls, root, rounds, overlap_steps)[0]
    step = statistics.median(out["step"])
    extra = statistics.median(o - overlap_steps * s for o, s in zip(out["overlapped"], out["step"]))
    blocking = statistics.median(out["blocking"])
    print(f"save stalls (GPT ~7M, ZeRO-3, 2 ranks, {rounds} rounds): step {step * 1e3:.0f} ms; blocking save "
          f"{blocking * 1e3:.0f} ms; background save written in {statistics.median(out['write']) * 1e3:.0f} ms, "
          f"{overlap_steps} steps overlapping it took {extra * 1e3:+.0f} ms more than without")
    return max(extra, 0.0) / step, blocking / step


def _cell(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--faults", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a tiny model for 60 steps (a smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--stall-rounds", type=int, default=5)
    parser.add_argument("--overlap-steps", type=int, default=4, help="steps overlapping each background save")
    args = parser.parse_args()
    async_stall, blocking_stall = save_stalls(2 if args.quick else args.stall_rounds, args.overlap_steps)
    steps, save_every = (60, 5) if args.quick else (args.steps, args.save_every)
    bench = job(args.quick, steps)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="fspeed-goodput-"))
    restarts_flag, save = f"--max_restarts={args.faults}", f"checkpoint.save_every={save_every}"
    started = time.monotonic()

    clean_dir = root / "clean"
    clean_dir.mkdir(parents=True, exist_ok=True)
    code, clean_output = fi.run(bench.command(clean_dir / "run", clean_dir / "ck", save, restarts_flag),
                                cwd=clean_dir, log=clean_dir / "log.txt", timeout_s=3600)
    if code != 0:
        raise SystemExit(f"the clean run failed (exit {code}):\n{clean_output[-3000:]}")
    clean = summary_of(clean_output)
    window = (clean["useful_s"] or 1.0) / (args.faults + 1)  # kills spread over the run
    trial = fi.healing_trial(bench, root / "faulted", clean_dir / "ck", random.Random(args.seed), faults=args.faults,
                             window_s=window, extra=(save,), shutdown_s=5)
    faulted = summary_of(trial.numbers.get("output", ""))
    print(f"\n{'run':<8} {'wall s':>8} {'useful s':>9} {'goodput':>8} {'restarts':>9} {'redone':>7} "
          f"{'lost s':>7} {'val loss':>9}")
    for name, row in (("clean", clean), ("faulted", faulted)):
        print(f"{name:<8} {_cell(row['wall_s'], '8.1f')} {_cell(row['useful_s'], '9.1f')} "
              f"{_cell(row['goodput'], '8.3f')} {row['restarts']:>9} {row['steps_redone']:>7} "
              f"{_cell(row['seconds_lost'], '7.1f')} {_cell(row['val_loss'], '9.4f')}")
    print(f"(faulted run: {trial.detail.splitlines()[0]}; {steps} steps, checkpoints every {save_every}; "
          f"work directory {root}; {time.monotonic() - started:.0f} s)\n")
    if not trial.ok:
        print("     " + trial.detail.replace("\n", "\n     "), flush=True)
        raise SystemExit(1)
    print(f"goodput_under_faults={faulted['goodput']:.3f}")
    print(f"goodput_clean={clean['goodput']:.3f}")
    print(f"faulted_final_loss_over_clean={faulted['val_loss'] / clean['val_loss']:.4f}")
    print(f"restarts_completed={trial.numbers['restarts']}  # faults injected: {args.faults}")
    print(f"restart_seconds={trial.numbers['restart_seconds']:.1f}")
    print(f"async_save_stall_over_step={async_stall:.3f}")
    print(f"blocking_save_stall_over_step={blocking_stall:.3f}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/goodput.json

    with recorded("goodput"):
        main()
