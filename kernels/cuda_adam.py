"""Fused Adam/AdamW on CUDA with numba-cuda: one grid-stride launch per flat buffer.

DeepSpeed FusedAdam's update (reference section 5.1), with DeepSpeedCPUAdam's arrangement of the
same math (section 3.2): per element, in fp32,

    L2 mode    (adam_w_mode=False): g += wd * p
    m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
    AdamW mode (adam_w_mode=True):  p -= lr * wd * p
    p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

DeepSpeed's `multi_tensor_apply` launches once per chunk list over many tensors; a flat buffer
makes that one launch over one array. A grid of at most `max_blocks` blocks strides over the
buffer, so any size (tails included) is covered by a fixed grid. The scalars are passed as
float32 so the kernel does fp32 arithmetic (a Python float would make it fp64).

Gradients in bf16/fp16 are widened with one torch op before the launch, and `cast_out` is written
with one torch cast after it; both run on the same (torch's current) stream, so they are ordered
with the kernel. (The single-pass mixed-precision variant is the CPU kernel's; on a GPU the
update is a small share of the step.)
"""

from __future__ import annotations

import math

import torch
from numba import cuda

from . import cuda_interop
from .cpu_adam import adam_scalars
from .cuda_interop import CudaKernelsUnavailable, is_available, require  # noqa: F401 (the kernel protocol)

THREADS = 256
MAX_BLOCKS = 4096  # x 256 threads: enough to fill any current GPU; larger buffers loop


@cuda.jit
def adam_kernel(p, g, m, v, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
                l2_decay, decoupled_keep, step_size, inv_sqrt_bc2):
    """One Adam step over flat fp32 arrays; weight decay is branch-free as in cpu_adam."""
    for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
        param = p[i]
        grad = g[i] + l2_decay * param
        mi = beta1 * m[i] + one_minus_beta1 * grad
        vi = beta2 * v[i] + one_minus_beta2 * grad * grad
        m[i] = mi
        v[i] = vi
        p[i] = param * decoupled_keep - step_size * mi / (math.sqrt(vi) * inv_sqrt_bc2 + eps)


ARRAY = "float32[::1]"
SIGNATURE = f"void({', '.join([ARRAY] * 4 + ['float32'] * 9)})"  # for compile_ptx


def adam_step(
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adam_w_mode: bool,
    bias_correction: bool = True,
    cast_out: torch.Tensor | None = None,
    max_blocks: int = MAX_BLOCKS,
) -> None:
    """One in-place Adam/AdamW step over contiguous CUDA buffers (CPU under the simulator).

    Same contract as `fspeed.kernels.cpu_adam.adam_step`; `max_blocks` caps the grid.
    """
    require()
    if grads.dtype in (torch.bfloat16, torch.float16):
        grads = grads.float()
    cuda_interop.check_buffers(
        "cuda adam_step", {"params": params, "grads": grads, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
        params.numel(),
    )
    scalars = adam_scalars("cuda adam_step", lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction)
    if not isinstance(max_blocks, int) or max_blocks < 1:
        raise ValueError(f"cuda adam_step: max_blocks={max_blocks!r} must be a positive integer")
    n = params.numel()
    if n:
        blocks = min(max_blocks, (n + THREADS - 1) // THREADS)
        arrays = [cuda_interop.device_array(t) for t in (params, grads, exp_avg, exp_avg_sq)]
        adam_kernel[blocks, THREADS, cuda_interop.launch_stream(params)](*arrays, *scalars)
    if cast_out is not None:
        cast_out.copy_(params)


def supports(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
             cast_out: torch.Tensor | None = None) -> bool:
    """Whether `adam_step` takes these buffers (fp32 state, fp32/bf16/fp16 grads, one device)."""
    tensors = (params, grads, exp_avg, exp_avg_sq)
    return (
        all(t.is_contiguous() and t.numel() == params.numel() and t.device == params.device for t in tensors)
        and all(t.dtype == torch.float32 for t in (params, exp_avg, exp_avg_sq))
        and grads.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and (cast_out is None or cast_out.numel() == params.numel())
    )
