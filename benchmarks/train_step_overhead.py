"""What does fspeed's functional train_step cost over a hand-written PyTorch loop?

The reference GPT (~10.8M params, seq 256), same data and same initial weights:
 - through fspeed: `make_train_step` (torch.func over flat buffers, fused flat AdamW);
 - as an nn.Module (`GPTModule`, same math) in a plain loop with `torch.optim.AdamW` (foreach,
   PyTorch's default) and, for reference, `fused=True`.

Each variant trains in its own process (a training job owns its process; sharing one would let
each variant's frees and allocations change the others' page-fault costs), for several rounds
whose order rotates (A B C, B C A, ...). The headline is the median over rounds of each round's
median step-time ratio, so slow drifts of this shared machine cancel. A second table times the
optimizer step alone on the same parameters, in this process.

    python benchmarks/train_step_overhead.py [--rounds 3] [--steps 4] [--batch 8] [--threads 2] [--system-malloc]

Every variant's process raises glibc's malloc thresholds as fspeed-train does
(`fs.retain_freed_host_memory`); --system-malloc keeps glibc's defaults for all of them.

A fourth variant is fspeed's step with the wall-clock breakdown on and every monitor (metrics.csv,
TensorBoard, an offline W&B run) writing each step's metrics (needs `pip install 'fspeed[monitor]'`).
Its headline, monitor_overhead, is measured interleaved: plain and monitored steps alternate in one
process, and the median over pairs of their ratio is taken (the separate-process ratio is printed too,
but on a shared machine its rounds drift by more than the monitors cost).

Last lines: monitor_overhead=<monitored / plain fspeed step time>, overhead_ratio=<fspeed step time /
plain PyTorch loop (AdamW foreach) step time>.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import fspeed as fs
from fspeed.models.gpt_module import GPTModule, params_from_module
from fspeed.timers import METRIC_KEYS

VARIANTS = {
    "fspeed": "fspeed train_step (flat fused AdamW)",
    "fspeed_monitored": "  + breakdown, CSV/TensorBoard/W&B monitors",
    "torch_foreach": "PyTorch loop, AdamW foreach (default)",
    "torch_fused": "PyTorch loop, AdamW fused=True",
}
CONFIG = fs.models.GPTConfig(vocab_size=256, seq_len=256, n_layer=6, n_head=6, d_model=384)
HPARAMS = dict(lr=3e-4, weight_decay=0.1)


MONITOR_COLUMNS = ("step", "loss", "lr", "grad_norm", "loss_scale", "skipped", *METRIC_KEYS)


def every_monitor(stack: contextlib.ExitStack) -> "fs.monitor.Monitors":
    """metrics.csv, TensorBoard event files and an offline W&B run in a temporary directory."""
    out = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    monitors = fs.monitor.Monitors([fs.monitor.CSVMonitor(out / "metrics.csv", MONITOR_COLUMNS),
                                    fs.monitor.TensorBoardMonitor(out / "tb"),
                                    fs.monitor.WandbMonitor(out, project="bench")])
    stack.callback(monitors.close)
    return monitors


def run_variant(name: str, steps: int, warmup: int, batch_size: int) -> dict:
    """Train `steps + warmup` steps with one variant; per-step wall times and minor page faults."""
    with contextlib.ExitStack() as stack:
        return _run_variant(name, steps, warmup, batch_size, stack)


def _run_variant(name: str, steps: int, warmup: int, batch_size: int, stack: contextlib.ExitStack) -> dict:
    torch.manual_seed(0)
    module = GPTModule(CONFIG)
    data = torch.randint(0, 256, (batch_size, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(1))
    batch = {"inputs": data[:, :-1], "targets": data[:, 1:]}
    writes: list[float] = []  # the monitors' share of each monitored step
    if name.startswith("fspeed"):
        model = fs.models.gpt(CONFIG)
        opt = fs.optim.adamw(**HPARAMS)
        state = fs.init_train_state(params_from_module(module), opt)
        monitored = name == "fspeed_monitored"
        train_step = fs.make_train_step(model.loss, opt, timers=fs.StepTimers() if monitored else None)
        monitors = every_monitor(stack) if monitored else fs.monitor.Monitors()

        def step() -> float:
            nonlocal state
            state, metrics = train_step(state, batch)
            t0 = time.perf_counter()
            monitors.write({k: v for k, v in metrics.items() if k in MONITOR_COLUMNS})
            writes.append(time.perf_counter() - t0)
            return metrics["loss"]
    else:
        optimizer = torch.optim.AdamW(module.parameters(), foreach=name == "torch_foreach",
                                      fused=name == "torch_fused", **HPARAMS)

        def step() -> float:
            optimizer.zero_grad(set_to_none=True)
            loss = module.loss(batch)
            loss.backward()
            optimizer.step()
            return loss.item()

    times, faults, losses = [], [], []
    for i in range(warmup + steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        losses.append(step())
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"times": times, "faults": faults, "first_loss": losses[0], "last_loss": losses[-1],
            "monitor_write_s": statistics.median(writes[warmup:]) if writes[warmup:] else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--system-malloc", action="store_true",
                        help="keep glibc's default malloc thresholds (fspeed-train raises them: fspeed/host_memory.py)")
    parser.add_argument("--monitor-pairs", type=int, default=12, help="interleaved step pairs for monitor_overhead")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.system_malloc:
        fs.retain_freed_host_memory()  # for every engine of the process alike
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.steps, args.warmup, args.batch)))
        return

    n_params = fs.models.count_params(params_from_module(GPTModule(CONFIG)))
    print(f"GPT {n_params / 1e6:.1f}M params, batch {args.batch} x seq {CONFIG.seq_len}, {args.threads} threads; "
          f"{args.rounds} rounds x {len(VARIANTS)} processes, {args.warmup} warmup + {args.steps} timed steps each")
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            cmd = [sys.executable, __file__, "--variant", name, "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--batch", str(args.batch), "--threads", str(args.threads)]
            cmd += ["--system-malloc"] if args.system_malloc else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"  round {r + 1}: {name:<14} {statistics.median(results[name][-1]['times']) * 1e3:8.1f} ms/step",
                  flush=True)

    first = [res[0]["first_loss"] for res in results.values()]
    spread = max(first) - min(first)
    tokens = args.batch * CONFIG.seq_len
    base = [statistics.median(res["times"]) for res in results["torch_foreach"]]
    print(f"\nfirst-step loss agrees across variants: max difference {spread:.2e}")
    print(f"\n{'variant':<40} {'median ms':>10} {'min ms':>8} {'tokens/s':>9} {'faults/step':>12} {'ratio':>7}")
    ratios = {}
    for name, runs in results.items():
        all_times = [t for res in runs for t in res["times"]]
        faults = statistics.median(f for res in runs for f in res["faults"])
        ratios[name] = statistics.median(statistics.median(res["times"]) / b for res, b in zip(runs, base))
        median = statistics.median(all_times)
        print(f"{VARIANTS[name]:<40} {median * 1e3:>10.1f} {min(all_times) * 1e3:>8.1f} {tokens / median:>9.0f} "
              f"{faults:>12.0f} {ratios[name]:>6.3f}x")

    optimizer_table(args.threads)
    print(f"\nfirst_step_loss_spread={spread:.3e}")
    print(f"fused_torch_loop_ratio={ratios['torch_fused']:.3f}")
    monitor = statistics.median(statistics.median(m["times"]) / statistics.median(f["times"])
                                for m, f in zip(results["fspeed_monitored"], results["fspeed"]))
    write_ms = statistics.median(r["monitor_write_s"] for r in results["fspeed_monitored"]) * 1e3
    print(f"\nmonitors' write per step (CSV + TensorBoard + W&B offline): {write_ms:.2f} ms; separate processes: "
          f"monitored / plain fspeed {monitor:.3f}")
    interleaved = monitor_overhead_interleaved(args.batch, args.monitor_pairs)
    print(f"monitor_write_ms={write_ms:.2f}")
    print(f"monitor_overhead={interleaved:.3f}")
    print(f"overhead_ratio={ratios['fspeed']:.3f}")


def monitor_overhead_interleaved(batch_size: int, pairs: int, warmup: int = 2) -> float:
    """Plain and monitored fspeed steps alternating in one process (same weights and data, the
    order flipped every pair): the median over pairs of monitored / plain step time. Both steps see
    the same moment of a shared machine, so its drift cancels pair by pair."""
    model, opt = fs.models.gpt(CONFIG), fs.optim.adamw(**HPARAMS)
    params = params_from_module(GPTModule(CONFIG))
    data = torch.randint(0, 256, (batch_size, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(1))
    batch = {"inputs": data[:, :-1], "targets": data[:, 1:]}
    with contextlib.ExitStack() as stack:
        monitors = every_monitor(stack)
        runs = {"plain": [fs.init_train_state(params, opt), fs.make_train_step(model.loss, opt)],
                "monitored": [fs.init_train_state(params, opt),
                              fs.make_train_step(model.loss, opt, timers=fs.StepTimers())]}

        writes: list[float] = []

        def timed(name: str) -> float:
            state, step = runs[name]
            t0 = time.perf_counter()
            runs[name][0], metrics = step(state, batch)
            if name == "monitored":
                t1 = time.perf_counter()
                monitors.write({k: v for k, v in metrics.items() if k in MONITOR_COLUMNS})
                writes.append(time.perf_counter() - t1)
            return time.perf_counter() - t0

        ratios, plain = [], []
        for i in range(warmup + pairs):
            order = ("plain", "monitored") if i % 2 else ("monitored", "plain")
            took = {name: timed(name) for name in order}
            if i >= warmup:
                ratios.append(took["monitored"] / took["plain"])
                plain.append(took["plain"])
    print(f"the monitors' own write: median {statistics.median(writes[warmup:]) * 1e3:.2f} ms per step, "
          f"{1 + statistics.median(writes[warmup:]) / statistics.median(plain):.4f}x of the plain step's median")
    print(f"interleaved in one process, {pairs} pairs: monitored / plain fspeed step, median "
          f"{statistics.median(ratios):.3f} (quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-"
          f"{statistics.quantiles(ratios, n=4)[2]:.3f})")
    return statistics.median(ratios)


def optimizer_table(threads: int, repeats: int = 7) -> None:
    """The optimizer step alone on the same parameters: fspeed's flat fused apply vs torch.optim."""
    flat = fs.Flat.from_tree(params_from_module(GPTModule(CONFIG)))
    grads = fs.tree_map(torch.randn_like, flat)
    opt = fs.optim.adamw(**HPARAMS)
    opt_state = opt.init(flat)
    leaves = [p.clone().requires_grad_() for p in flat.segments()]
    for p, g in zip(leaves, grads.segments()):
        p.grad = g.clone()
    torch_opts = {
        "torch.optim.AdamW foreach": torch.optim.AdamW(leaves, foreach=True, **HPARAMS),
        "torch.optim.AdamW fused": torch.optim.AdamW(leaves, fused=True, **HPARAMS),
    }

    def fspeed_apply():
        nonlocal flat, opt_state
        flat, opt_state = opt.apply(grads, opt_state, flat)

    variants = {"fspeed adamw apply (one flat buffer)": fspeed_apply}
    variants.update({name: o.step for name, o in torch_opts.items()})
    times = {name: [] for name in variants}
    for i in range(repeats + 2):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    print(f"\noptimizer step alone ({flat.numel / 1e6:.1f}M params, {len(leaves)} tensors, {threads} threads)")
    print(f"{'variant':<40} {'ms':>8} {'Gparam/s':>9}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<40} {median * 1e3:>8.2f} {flat.numel / median / 1e9:>9.2f}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/train_step_overhead.json

    with recorded("train_step_overhead"):
        main()
