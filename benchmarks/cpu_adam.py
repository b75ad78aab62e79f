"""fspeed's Numba CPU Adam against torch's AdamW, DeepSpeedCPUAdam and the memory roofline.

One AdamW step (lr 1e-3, wd 0.01) on one flat fp32 buffer of N params, for N = 10M and 100M and
1 and 2 threads (`torch.set_num_threads`; the Numba kernel follows it):

    axpy probe              a += s*b in place (torch): 3 streams, no write-allocate, like Adam:
                            the realistic roofline of a single-pass update (12 B/element)
    fspeed cpu_adam         fspeed.kernels.cpu_adam, fp32 grads                  (28 B/param)
    torch AdamW fused       torch.optim.AdamW(fused=True)                         (28 B/param)
    torch AdamW foreach     torch.optim.AdamW(foreach=True), torch's default      (multi-pass)
    DeepSpeedCPUAdam        only when `deepspeed` is importable (it JIT-builds its op, ~60 s)
  mixed precision (bf16 params for the model, fp32 masters):
    fspeed single pass      bf16 grads in, fp32 p/m/v updated, bf16 params out   (28 B/param)
    torch fused + cast      fp32 grads, fused AdamW, then p16.copy_(p)        (28 + 6 B/param)
    torch upcast+fused+cast the same when the grads arrive in bf16: + g.float() (+ 6 B/param)

Timing: 2 warm-ups each, then rounds of one step of every variant (round-robin, so a load spike
hits all alike); the median over --reps rounds, all in this process. GB/s counts the bytes above
(Adam at 28 B/param however many passes it makes). Also the first-call cost of the kernel
(Numba compilation) in fresh processes: cold (empty cache) and warm (`cache=True` hit).

    python benchmarks/cpu_adam.py [--sizes 10000000 100000000] [--threads 1 2] [--reps 5]

The last three lines are geometric means over the (size, threads) configurations:
cpu_adam_vs_best (fspeed / best of torch fused and DeepSpeedCPUAdam, fp32; goal >= 1.0),
fraction_of_bandwidth (fspeed GB/s at 28 B/param / axpy GB/s; goal >= 0.9) and
mixed_precision_update_speedup (torch fused + cast time / fspeed single pass time; goal >= 1.3).
This machine is shared: numbers move by +-30% between runs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

import torch

from fspeed.kernels import cpu_adam

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
ADAM_BYTES, AXPY_BYTES = 28, 12


def interleaved_medians(variants: dict[str, Callable[[], object]], reps: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each variant, timed round-robin (one call of each per round) so
    that load spikes on this shared machine hit every variant alike."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def deepspeed_adam() -> Optional[type]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return None
    return DeepSpeedCPUAdam


def torch_optimizer(p: torch.Tensor, g: torch.Tensor, **flags) -> Callable[[], None]:
    param = torch.nn.Parameter(p)  # shares p's memory
    param.grad = g
    opt = torch.optim.AdamW([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], **flags)
    return opt.step


def measure(n: int, reps: int) -> dict[str, Optional[float]]:
    """Seconds per step of every variant (None: not available)."""
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    g16, p16 = g.to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    m, v = torch.zeros(n), torch.zeros(n)
    count = iter(range(1, 10**9))
    fspeed = lambda grads, out: cpu_adam.adam_step(p, grads, m, v, step=next(count), adam_w_mode=True,  # noqa: E731
                                                    cast_out=out, **HP)
    fused = torch_optimizer(p, g, fused=True)
    grads32 = torch.empty(n)  # what bf16 grads are widened into for torch
    fused_upcast = torch_optimizer(p, grads32, fused=True)
    variants: dict[str, Callable[[], object]] = {
        "axpy probe": lambda: p.add_(g, alpha=1e-9),
        "fspeed cpu_adam": lambda: fspeed(g, None),
        "torch AdamW fused": fused,
        "torch AdamW foreach": torch_optimizer(p, g, foreach=True),
        "fspeed single pass bf16": lambda: fspeed(g16, p16),
        "torch fused + cast": lambda: (fused(), p16.copy_(p)),
        "torch upcast+fused+cast": lambda: (grads32.copy_(g16), fused_upcast(), p16.copy_(p)),
    }
    ds = deepspeed_adam()
    if ds is not None:
        param = torch.nn.Parameter(p)
        param.grad = g
        variants["DeepSpeedCPUAdam"] = ds([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                                          weight_decay=HP["weight_decay"], adamw_mode=True).step
    times: dict[str, Optional[float]] = dict(interleaved_medians(variants, reps))
    times.setdefault("DeepSpeedCPUAdam", None)
    return times


FIRST_CALL = """
import time, torch
start = time.perf_counter()
from fspeed.kernels import cpu_adam
imported = time.perf_counter()
x = torch.zeros(1000)
cpu_adam.adam_step(x, x.clone(), x.clone(), x.clone(), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                   weight_decay=0.0, step=1, adam_w_mode=True)
first = time.perf_counter()
cpu_adam.adam_step(x, x.clone().bfloat16(), x.clone(), x.clone(), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                   weight_decay=0.0, step=1, adam_w_mode=True, cast_out=x.bfloat16())
second = time.perf_counter()
print(f"{imported - start:.2f} {first - imported:.2f} {second - first:.2f}")
"""


def first_call_costs() -> list[tuple[str, str]]:
    """(label, 'import s, fp32 variant s, bf16 variant s') for a cold and a warm Numba cache."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for label in ("cold cache", "warm cache"):
            out = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True, check=True)
            rows.append((label, out.stdout.strip()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 100_000_000])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()

    print("first call of the kernel in a fresh process (seconds: import, fp32 variant, bf16 variant):")
    for label, seconds in first_call_costs():
        print(f"  {label:<11} {seconds}")

    ratios: dict[str, list[float]] = {"vs_best": [], "bandwidth": [], "mixed": []}
    for n in args.sizes:
        for threads in args.threads:
            torch.set_num_threads(threads)
            times = measure(n, args.reps)
            axpy_gbs = AXPY_BYTES * n / times["axpy probe"] / 1e9
            print(f"\nN = {n / 1e6:g}M params, {threads} thread(s)")
            print(f"  {'variant':<26} {'ms':>8} {'Gparams/s':>10} {'GB/s':>7}")
            for name, seconds in times.items():
                if seconds is None:
                    print(f"  {name:<26} {'not installed':>27}")
                    continue
                per_param = AXPY_BYTES if name == "axpy probe" else ADAM_BYTES
                if "cast" in name and "fspeed" not in name:
                    per_param += 6 + (6 if "upcast" in name else 0)
                print(f"  {name:<26} {seconds * 1e3:8.1f} {n / seconds / 1e9:10.2f} {per_param * n / seconds / 1e9:7.1f}")
            best = min(t for k, t in times.items() if k in ("torch AdamW fused", "DeepSpeedCPUAdam") and t)
            ratios["vs_best"].append(best / times["fspeed cpu_adam"])
            ratios["bandwidth"].append(ADAM_BYTES * n / times["fspeed cpu_adam"] / 1e9 / axpy_gbs)
            ratios["mixed"].append(times["torch fused + cast"] / times["fspeed single pass bf16"])
            print(f"  vs best fp32 {ratios['vs_best'][-1]:.2f}, fraction of axpy bandwidth "
                  f"{ratios['bandwidth'][-1]:.2f}, mixed-precision speedup {ratios['mixed'][-1]:.2f} "
                  f"(vs upcast+fused+cast {times['torch upcast+fused+cast'] / times['fspeed single pass bf16']:.2f})")

    geomean = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    print()
    print(f"cpu_adam_vs_best={geomean(ratios['vs_best']):.3f}")
    print(f"fraction_of_bandwidth={geomean(ratios['bandwidth']):.3f}")
    print(f"mixed_precision_update_speedup={geomean(ratios['mixed']):.3f}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/cpu_adam.json

    with recorded("cpu_adam"):
        main()
