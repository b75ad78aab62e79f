"""Block-sparse attention on CPU: fspeed against dense SDPA (with and without the equivalent mask)
and compiled FlexAttention with the same block mask.

B=1, H=8, D=64, block 64, fp32, S from 1k to 16k, bidirectional (no causal mask), layouts at about
10% density: bigbird (window 3, 1 global block, random blocks chosen per S for ~10%) and fixed
(one global block per window, the window size closest to 10%; fixed cannot go below 2/sqrt(blocks),
so it is denser than 10% at short S, and its density is printed).

Each (method, S) runs in its own process: time is the median of a few forward+backward (and
forward-only) calls after a warm-up, and memory is the peak resident memory above the process's
level before one more call, sampled every 0.5 ms by a thread (after `malloc_trim`), so it covers
every allocation the call makes (timed calls run without the sampler, which would take CPU). Methods:

  sdpa          dense scaled_dot_product_attention, no mask (full attention: more work, O(S) memory)
  sdpa_mask     dense SDPA with the layout expanded to a [S, S] bool mask (the same function)
  fspeed        fs.sparse.attention with a prebuilt plan (backend "auto" = gather + bmm + in-place softmax)
  flex          torch.compile(flex_attention) with the same BlockMask; forward only, because torch 2.13
                has no FlexAttention backward on CPU
  fspeed_flash / fspeed_numba   fspeed's other CPU backends, at S=4096 only
  fspeed_flex   fspeed's "flex" backend (the CUDA default) in its CPU form: compiled flex_attention forward
                over the BlockMask built from the layout, fspeed's bmm backward; at S=4096 and 8192

The longest sequence within MEMORY_BUDGET (forward+backward) is extrapolated per method from a
least-squares fit of peak memory = a + b S + c S^2 over the measured S.

    python benchmarks/sparse_attention.py [--threads 2] [--max-seq 16384] [--reps 3]

Last lines: sparse_speedup_at_10pct_density (dense SDPA / fspeed, bigbird, S=8192, forward+backward),
sparse_vs_flex (compiled flex / fspeed, bigbird, S=8192, forward only: see above) and
max_seq_ratio_vs_dense (fspeed's longest sequence / dense SDPA-with-mask's, same budget).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F

import fspeed.sparse as sp

B, H, D, BLOCK = 1, 8, 64, 64
MEMORY_BUDGET = 4 * 2**30  # bytes, forward + backward working memory
FIGURE_SEQ = 8192


def bigbird_config(nb: int) -> sp.BigBirdConfig:
    random_blocks = max(0, round(0.10 * nb) - 5)  # window 3 + global row/column ~ 5 blocks a row
    return sp.BigBirdConfig(num_heads=H, block=BLOCK, num_random_blocks=random_blocks, num_sliding_window_blocks=3,
                            num_global_blocks=1)


def fixed_config(nb: int) -> sp.FixedConfig:
    windows = [w for w in (2, 4, 8, 16, 32, 64) if w <= nb]
    best = min(windows, key=lambda w: abs(sp.density(sp.layout(sp.FixedConfig(num_heads=1, block=1, num_local_blocks=w),
                                                               nb)) - 0.10))
    return sp.FixedConfig(num_heads=H, block=BLOCK, num_local_blocks=best, num_global_blocks=1)


def make_layout(name: str, S: int) -> torch.Tensor:
    nb = S // BLOCK
    return sp.layout(bigbird_config(nb) if name == "bigbird" else fixed_config(nb), S, seed=0)


# ------------------------------------------------------------------------- one measurement


class PeakRSS:
    """Peak resident memory above the level at start, sampled by a thread."""

    def __init__(self):
        self.page = 4096
        self.libc = ctypes.CDLL("libc.so.6")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        self.libc.malloc_trim(0)
        self.base = self.peak = self.rss()
        self.running = True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def measure(method: str, layout_name: str, S: int, reps: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    layout = make_layout(layout_name, S)
    result = {"density": sp.density(layout)}
    if method == "sdpa":
        fn = lambda a, b, c: F.scaled_dot_product_attention(a, b, c)  # noqa: E731
    elif method == "sdpa_mask":
        mask = sp.expand_layout(layout, BLOCK)[None]  # [1, H, S, S] bool
        fn = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask)  # noqa: E731
    elif method.startswith("fspeed"):
        backend = {"fspeed": "auto", "fspeed_bmm": "bmm", "fspeed_numba": "numba", "fspeed_flash": "flash",
                   "fspeed_flex": "flex"}[method]
        plan = sp.make_plan(layout, BLOCK)
        fn = lambda a, b, c: sp.attention(a, b, c, plan, backend=backend)  # noqa: E731
    elif method == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        dense = layout.bool()
        block_mask = create_block_mask(lambda b, h, qi, ki: dense[h, qi // BLOCK, ki // BLOCK], B=None, H=H,
                                       Q_LEN=S, KV_LEN=S, BLOCK_SIZE=BLOCK, device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)
        fn = lambda a, b, c: compiled(a, b, c, block_mask=block_mask)  # noqa: E731
    else:
        raise ValueError(method)

    def forward():
        with torch.no_grad():
            return fn(q, k, v)

    def train():
        a, b, c = (x.detach().requires_grad_() for x in (q, k, v))
        out = fn(a, b, c)
        out.backward(torch.ones_like(out))

    kinds = {"fwd": forward} if method == "flex" else {"fwd": forward, "fwdbwd": train}
    for kind, call in kinds.items():
        call()  # warm-up: compiles, JITs, faults pages in
        times = []
        for _ in range(reps):  # timed without the memory sampler: its thread would take CPU from the call
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        with PeakRSS() as mem:
            call()
        result[kind] = {"ms": 1e3 * statistics.median(times), "peak_mb": mem.extra / 2**20}
    return result


def run_one(method: str, layout_name: str, S: int, reps: int, threads: int, timeout: int = 900) -> dict | None:
    cmd = [sys.executable, __file__, "--one", method, layout_name, str(S), "--reps", str(reps),
           "--threads", str(threads)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout}s"}
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:120]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------- the table


def predicted_bytes(method: str, S: int, layout: torch.Tensor | None = None) -> float:
    """Rough lower bound of working memory, to skip runs that cannot fit the budget."""
    if method == "sdpa_mask":
        return H * S * S * (1 + 4 + 4)  # bool mask + fp32 scores + fp32 grads (math path)
    return 0.0


def longest_within_budget(points: dict[int, float]) -> float:
    """Largest S with a + b S + c S^2 <= MEMORY_BUDGET (least squares over the measured points)."""
    if len(points) < 2:
        return float("nan")
    S = np.array(sorted(points), dtype=float)
    y = np.array([points[s] for s in sorted(points)], dtype=float)
    basis = np.stack([np.ones_like(S), S, S * S], 1) if len(S) >= 3 else np.stack([np.ones_like(S), S], 1)
    coef = np.linalg.lstsq(basis, y, rcond=None)[0]
    a, b, c = (list(coef) + [0.0])[:3]
    c = max(c, 0.0)
    if c == 0.0:
        return (MEMORY_BUDGET - a) / b if b > 0 else float("inf")
    return (-b + (b * b + 4 * c * (MEMORY_BUDGET - a)) ** 0.5) / (2 * c)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-seq", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "LAYOUT", "S"))
    args = parser.parse_args()
    if args.one:
        method, layout_name, S = args.one
        print(json.dumps(measure(method, layout_name, int(S), args.reps, args.threads)))
        return

    seqs = [s for s in (1024, 2048, 4096, 8192, 16384) if s <= args.max_seq]
    print(f"torch {torch.__version__}, {args.threads} threads, B={B} H={H} D={D} block={BLOCK} fp32, "
          f"memory budget {MEMORY_BUDGET / 2**30:.0f} GiB; times are medians of {args.reps} "
          "(dense SDPA above S=8192: one call)")
    print("FlexAttention on CPU: forward runs (compiled); backward is not implemented in torch 2.13 "
          "(NotImplementedError), so flex has forward numbers only.\n")
    results: dict[tuple[str, str, int], dict] = {}
    header = (f"{'layout':8} {'S':>6} {'density':>7} {'method':>12} {'fwd ms':>9} {'fwd MB':>8} "
              f"{'f+b ms':>9} {'f+b MB':>8}")
    print(header)
    print("-" * len(header))
    for layout_name in ("bigbird", "fixed"):
        for S in seqs:
            methods = ["sdpa", "sdpa_mask", "fspeed", "flex"]
            if S == 4096:
                methods += ["fspeed_flash", "fspeed_numba"]
            if S in (4096, 8192):
                methods += ["fspeed_flex"]
            for method in methods:
                if method == "sdpa" and layout_name == "fixed":
                    results[(layout_name, method, S)] = results[("bigbird", method, S)]  # layout-independent
                elif predicted_bytes(method, S) > MEMORY_BUDGET:
                    results[(layout_name, method, S)] = {"error": "over the memory budget (skipped)"}
                else:
                    reps = args.reps if S <= 8192 or method not in ("sdpa", "sdpa_mask") else 1
                    results[(layout_name, method, S)] = run_one(method, layout_name, S, reps, args.threads)
                r = results[(layout_name, method, S)]
                if "error" in r:
                    print(f"{layout_name:8} {S:>6} {'':>7} {method:>12}  {r['error']}")
                    continue
                fb = r.get("fwdbwd")
                print(f"{layout_name:8} {S:>6} {r['density']:>7.3f} {method:>12} {r['fwd']['ms']:>9.1f} "
                      f"{r['fwd']['peak_mb']:>8.0f} " + (f"{fb['ms']:>9.1f} {fb['peak_mb']:>8.0f}" if fb else
                                                        f"{'n/a':>9} {'n/a':>8}"), flush=True)

    print(f"\nLongest sequence within {MEMORY_BUDGET / 2**30:.0f} GiB (forward+backward; flex: forward), "
          "extrapolated from the measured peaks:")
    longest = {}
    for layout_name in ("bigbird", "fixed"):
        for method in ("sdpa", "sdpa_mask", "fspeed", "flex"):
            kind = "fwd" if method == "flex" else "fwdbwd"
            points = {S: results[(layout_name, method, S)][kind]["peak_mb"] * 2**20 for S in seqs
                      if "error" not in results[(layout_name, method, S)]}
            longest[(layout_name, method)] = longest_within_budget(points)
            print(f"  {layout_name:8} {method:>10}: {longest[(layout_name, method)]:>12,.0f} tokens")

    def ms(method, kind, layout_name="bigbird", S=FIGURE_SEQ):
        r = results.get((layout_name, method, S), {"error": "not run"})
        return float("nan") if "error" in r else r[kind]["ms"]

    speedup = ms("sdpa", "fwdbwd") / ms("fspeed", "fwdbwd")
    fwd_ratio = ms("sdpa", "fwd") / ms("fspeed", "fwd")
    print(f"\nAt S={FIGURE_SEQ}, bigbird: dense SDPA / fspeed = {fwd_ratio:.2f}x forward, "
          f"{speedup:.2f}x forward+backward; at S=4096 masked SDPA / fspeed = "
          f"{ms('sdpa_mask', 'fwdbwd', S=4096) / ms('fspeed', 'fwdbwd', S=4096):.2f}x forward+backward")
    print("Note: dense SDPA without a mask uses torch's flash kernel (O(S) memory), so its longest sequence is "
          "bounded by time, not memory; the memory ratio below is against dense SDPA with the equivalent mask, "
          "the dense way to compute the same attention.")
    print(f"sparse_speedup_at_10pct_density={speedup:.2f}")
    print(f"sparse_vs_flex={ms('flex', 'fwd') / ms('fspeed', 'fwd'):.2f}")
    print(f"flex_backend_vs_default_cpu={ms('fspeed', 'fwdbwd') / ms('fspeed_flex', 'fwdbwd'):.2f}  "
          "# forward+backward, bigbird S=8192: > 1 means backend 'flex' is faster than the CPU default")
    print(f"max_seq_ratio_vs_dense={longest[('bigbird', 'fspeed')] / longest[('bigbird', 'sdpa_mask')]:.1f}")


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: the figures to benchmarks/results/sparse_attention.json

    with recorded("sparse_attention"):
        main()
