"""Model TFLOPS and MFU (model flops utilisation) of training steps, from the profiled forward flops.

A step of `grad_accum` micro-batches does `(3 + recompute_fwd_factor) x forward flops` per
micro-batch (DeepSpeed's count: backward is twice the forward); TFLOPS is that over the step's
time, per rank; MFU is TFLOPS over the rank's peak (given, or measured with a large matmul).
"""

from __future__ import annotations

import time

import torch


def step_tflops(fwd_flops: int, grad_accum: int, step_seconds: float, recompute_fwd_factor: float = 0.0) -> float:
    """Achieved model TFLOPS per rank of one step (`fwd_flops`: one micro-batch's forward)."""
    return (3 + recompute_fwd_factor) * fwd_flops * grad_accum / step_seconds / 1e12


def measure_peak_tflops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, size: int = 1024,
                        repeats: int = 5) -> float:
    """A practical peak: the best TFLOPS of `repeats` square matmuls of `size` on `device`."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


__all__ = ["measure_peak_tflops", "step_tflops"]
