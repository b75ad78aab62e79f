"""ZeRO-Offload on this machine: the host-side cost of one offloaded optimizer step, and the
memory estimator's per-rank device / CPU bytes for a 1B-parameter model.

Part 1, the offloaded partition update (bf16 training, AdamW), per partition size P: what
`ZeroRuntime` does at the boundary once the gradient is reduced, timed piece by piece:

    download            reduced bf16 gradient partition -> host buffer (a memcpy here; PCIe on a GPU)
    update, numba       fspeed's CPU Adam single pass: bf16 grads in, fp32 master/m/v updated,
                        bf16 staging written in the same pass            (optimizer backend "numba")
    update, torch       the same step the torch way: grads upcast to fp32, torch fused AdamW,
                        then the bf16 cast into staging                  (optimizer backend "torch")
    upload              bf16 staging -> the rank's slice of the device params (memcpy here)

Both updates go through fspeed's optimizer (`optimizer_step(..., cast_to=staging)`), i.e. the
exact code the offloaded step runs. Timing: round-robin medians (benchmarks/cpu_adam.py).

Part 2, `fs.estimate_memory` for a 1B-parameter GPT-shaped tree (24 layers, d_model 2048) on
8 data ranks in bf16 with Adam, every stage with and without offload.

What this machine cannot show: there is no GPU, so the device-memory savings are computed
(part 2), not measured, and download/upload are host memcpys, not PCIe transfers overlapped
on CUDA streams. Shared 2-core machine: timings move by +-30% between runs.

    python benchmarks/zero_offload.py [--sizes 10000000 30000000] [--reps 5]

Last lines: offload_update_speedup (torch upcast + fused + cast time / numba single pass time,
geometric mean over sizes), offload_step_ms_<P> (download + numba update + upload), and the
1B model's per-rank GiB: device and CPU for stage 2 with offload, device for stage 2 without.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_adam import interleaved_medians  # noqa: E402  (the shared timing helper)

import fspeed as fs  # noqa: E402
from fspeed.flat import Flat  # noqa: E402
from fspeed.optim.base import optimizer_step  # noqa: E402
from fspeed.parallel.layout import labelled_layout  # noqa: E402


def update_variants(n: int) -> dict[str, callable]:
    layout = labelled_layout(["partition"], [(n,)])  # one rank's ZeRO slice, as one piece
    g_device = torch.randn(n).to(torch.bfloat16)  # the reduced gradient partition, on the "device"
    params_slice = torch.zeros(n, dtype=torch.bfloat16)  # this rank's slice of the compute params
    host_grads = torch.empty(n, dtype=torch.bfloat16)
    staging = torch.empty(n, dtype=torch.bfloat16)

    def setup(backend: str):
        opt = fs.optim.adamw(1e-3, weight_decay=0.01, backend=backend)
        master = Flat(torch.randn(n), layout)
        state = [opt.init(master), master]

        def step():
            master_now, state[0] = optimizer_step(opt, Flat(host_grads, layout), state[0], state[1],
                                                  cast_to=Flat(staging, layout))
            state[1] = master_now
        return step

    return {
        "download": lambda: host_grads.copy_(g_device),
        "update, numba": setup("numba"),
        "update, torch": setup("torch"),
        "upload": lambda: params_slice.copy_(staging),
    }


def memory_table(data: int) -> tuple[list[str], dict[str, fs.MemoryEstimate]]:
    cfg = fs.models.GPTConfig(vocab_size=50304, seq_len=2048, n_layer=24, d_model=2048, n_head=16)
    model = fs.models.gpt(cfg)
    with torch.device("meta"):  # shapes only: no memory
        params = model.init(torch.Generator())
    precision = fs.precision.bf16(grad_accum_dtype="bf16")
    rows, found = [], {}
    configs = [("stage 0", fs.zero(0)), ("stage 1", fs.zero(1)), ("stage 1 + offload", fs.zero(1, offload_optimizer="cpu")),
               ("stage 2", fs.zero(2)), ("stage 2 + offload", fs.zero(2, offload_optimizer="cpu")),
               ("stage 3", fs.zero(3)), ("stage 3 + offload", fs.zero(3, offload_optimizer="cpu")),
               ("stage 3 + offload + params", fs.zero(3, offload_optimizer="cpu", offload_param="cpu"))]
    gib = lambda b: f"{b / 2**30:8.2f}"  # noqa: E731
    rows.append(f"{'config':<28}{'device GiB':>11}{'CPU GiB':>10}{'paper dev':>11}{'paper CPU':>11}  device parts")
    for name, plan in configs:
        est = fs.estimate_memory(params, plan, {"data": data}, precision, logical_axes=model.logical_axes)
        found[name] = est
        parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in est.device.items() if v)
        rows.append(f"{name:<28}{gib(est.device_total):>11}{gib(est.cpu_total):>10}{gib(est.paper_device):>11}"
                    f"{gib(est.paper_cpu):>11}  {parts}")
    total = next(iter(found.values())).parameters
    rows.insert(0, f"1.3B GPT (24 layers x 2048, vocab 50304): {total:,} parameters, {data} data ranks, bf16, Adam")
    return rows, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 30_000_000])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--data", type=int, default=8)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CUDA available: {torch.cuda.is_available()}")
    print("\n== offloaded partition update (bf16 training, AdamW), ms per step ==")
    print(f"{'partition P':>12}{'download':>10}{'numba upd':>11}{'torch upd':>11}{'upload':>9}{'speedup':>9}")
    speedups, step_ms = [], {}
    for n in args.sizes:
        t = interleaved_medians(update_variants(n), args.reps)
        ms = {k: v * 1e3 for k, v in t.items()}
        speedup = t["update, torch"] / t["update, numba"]
        speedups.append(speedup)
        step_ms[n] = ms["download"] + ms["update, numba"] + ms["upload"]
        print(f"{n:>12,}{ms['download']:>10.1f}{ms['update, numba']:>11.1f}{ms['update, torch']:>11.1f}"
              f"{ms['upload']:>9.1f}{speedup:>8.2f}x")
    print("\n== estimated model-state memory per rank ==")
    rows, est = memory_table(args.data)
    print("\n".join(rows))
    print("\nno GPU here: device bytes are the estimator's (tested equal to the buffers fspeed really holds),\n"
          "download/upload are host memcpys, not PCIe transfers on CUDA streams.")
    print(f"offload_update_speedup={math.exp(sum(map(math.log, speedups)) / len(speedups)):.3f}")
    for n, ms in step_ms.items():
        print(f"offload_step_ms_{n}={ms:.1f}")
    print(f"device_gib_1b_stage2={est['stage 2'].device_total / 2**30:.3f}")
    print(f"cpu_gib_1b_stage2_offload={est['stage 2 + offload'].cpu_total / 2**30:.3f}")
    print(f"device_gib_1b_stage2_offload={est['stage 2 + offload'].device_total / 2**30:.3f}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/zero_offload.json

    with recorded("zero_offload"):
        main()
