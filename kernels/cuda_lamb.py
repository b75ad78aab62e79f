"""Fused LAMB on CUDA with numba-cuda: per-tensor norms by a reduction pass, then the update.

DeepSpeed FusedLamb (reference section 5.2), per parameter tensor (a segment of the flat buffer):

    m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2      (raw moments)
    u = m / denom + wd * p,  denom = sqrt(v + eps) if eps_inside_sqrt else sqrt(v) + eps
    trust = clamp(||p|| / ||u||, min_coeff, max_coeff), or 1 when either norm is 0
    p -= lr * sqrt(bc2) / bc1 * trust * u        (lr alone without bias correction)

Three launches over the flat buffer, whatever the number of tensors:

1. moments + norms: each block owns one chunk of one segment (a block never straddles two
   tensors), updates m and v, and writes its partial sums of p^2 and u^2 (shared-memory tree);
2. trust: one block per segment sums its blocks' partials in a fixed order and writes the
   clamped trust ratio. Partials instead of atomics keep the result bitwise reproducible;
3. update: each block recomputes u from the new m, v and the untouched p (the same bytes as
   storing u and reading it back) and applies the step.

The block -> segment map comes from the segment offsets (built on the host from the sizes and
copied once per call). Launched on torch's current stream (see cuda_interop).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import cuda, float32

from . import cuda_interop
from .cuda_interop import CudaKernelsUnavailable, is_available, require  # noqa: F401 (the kernel protocol)

THREADS = 256  # a power of two: the tree reductions halve it
CHUNK = 4096  # elements per block in passes 1 and 3 (16 per thread)


# The helpers below are written out inside each kernel rather than called as device functions:
# numba-cuda 0.30 compiles a called device function for the *current* device, which makes
# `compile_ptx` need a GPU. The two copies of `u` (passes 1 and 3) must stay identical.


@cuda.jit
def moments_and_norms_kernel(p, g, m, v, block_segment, segment_offsets, segment_first_block, chunk,
                             partial_p, partial_u, beta1, one_minus_beta1, beta2, one_minus_beta2,
                             eps, weight_decay, eps_inside_sqrt):
    shared = cuda.shared.array(0, float32)  # 2 * blockDim: sums of p^2, then sums of u^2
    t, b, threads = cuda.threadIdx.x, cuda.blockIdx.x, cuda.blockDim.x
    s = block_segment[b]
    start = segment_offsets[s] + (b - segment_first_block[s]) * chunk
    stop = min(start + chunk, segment_offsets[s + 1])
    sum_p = float32(0.0)
    sum_u = float32(0.0)
    for i in range(start + t, stop, threads):
        grad = g[i]
        mi = beta1 * m[i] + one_minus_beta1 * grad
        vi = beta2 * v[i] + one_minus_beta2 * grad * grad
        m[i] = mi
        v[i] = vi
        param = p[i]
        u = mi / (math.sqrt(vi + eps) if eps_inside_sqrt else math.sqrt(vi) + eps) + weight_decay * param
        sum_p += param * param
        sum_u += u * u
    shared[t] = sum_p
    shared[threads + t] = sum_u
    cuda.syncthreads()
    half = threads // 2
    while half > 0:  # tree reduction; blockDim is a power of two
        if t < half:
            shared[t] += shared[t + half]
            shared[threads + t] += shared[threads + t + half]
        cuda.syncthreads()
        half //= 2
    if t == 0:
        partial_p[b] = shared[0]
        partial_u[b] = shared[threads]


@cuda.jit
def trust_kernel(segment_first_block, partial_p, partial_u, trust, min_coeff, max_coeff):
    shared = cuda.shared.array(0, float32)  # 2 * blockDim, as above
    t, s, threads = cuda.threadIdx.x, cuda.blockIdx.x, cuda.blockDim.x
    sum_p = float32(0.0)
    sum_u = float32(0.0)
    for b in range(segment_first_block[s] + t, segment_first_block[s + 1], threads):
        sum_p += partial_p[b]
        sum_u += partial_u[b]
    shared[t] = sum_p
    shared[threads + t] = sum_u
    cuda.syncthreads()
    half = threads // 2
    while half > 0:
        if t < half:
            shared[t] += shared[t + half]
            shared[threads + t] += shared[threads + t + half]
        cuda.syncthreads()
        half //= 2
    if t == 0:
        p_norm = math.sqrt(shared[0])
        u_norm = math.sqrt(shared[threads])
        ratio = float32(1.0)
        if p_norm > 0 and u_norm > 0:
            ratio = min(max(p_norm / u_norm, min_coeff), max_coeff)
        trust[s] = ratio


@cuda.jit
def update_kernel(p, m, v, block_segment, segment_offsets, segment_first_block, chunk, trust, step_size,
                  eps, weight_decay, eps_inside_sqrt):
    b = cuda.blockIdx.x
    s = block_segment[b]
    start = segment_offsets[s] + (b - segment_first_block[s]) * chunk
    stop = min(start + chunk, segment_offsets[s + 1])
    scale = step_size * trust[s]
    for i in range(start + cuda.threadIdx.x, stop, cuda.blockDim.x):
        param = p[i]
        vi = v[i]
        u = m[i] / (math.sqrt(vi + eps) if eps_inside_sqrt else math.sqrt(vi) + eps) + weight_decay * param
        p[i] = param - scale * u


_F32, _I64 = "float32[::1]", "int64[::1]"
SIGNATURES = {  # for compile_ptx
    "moments_and_norms_kernel": f"void({', '.join([_F32] * 4 + [_I64] * 3)}, int64, {_F32}, {_F32}, "
                                f"{', '.join(['float32'] * 6)}, boolean)",
    "trust_kernel": f"void({_I64}, {_F32}, {_F32}, {_F32}, float32, float32)",
    "update_kernel": f"void({', '.join([_F32] * 3 + [_I64] * 3)}, int64, {_F32}, float32, float32, float32, boolean)",
}


def segment_blocks(sizes: list[int] | tuple[int, ...], chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block_segment, segment_offsets, segment_first_block) for segments of `sizes` cut in `chunk`s."""
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    if sizes_arr.ndim != 1 or (sizes_arr < 0).any():
        raise ValueError(f"segment sizes must be a 1-D list of non-negative integers, got {list(sizes)[:8]}")
    segment_offsets = np.concatenate([[0], np.cumsum(sizes_arr)]).astype(np.int64)
    blocks_per_segment = (sizes_arr + chunk - 1) // chunk
    segment_first_block = np.concatenate([[0], np.cumsum(blocks_per_segment)]).astype(np.int64)
    block_segment = np.repeat(np.arange(len(sizes_arr), dtype=np.int64), blocks_per_segment)
    return block_segment, segment_offsets, segment_first_block


def lamb_step(
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    segment_sizes: list[int] | tuple[int, ...],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool = True,
    eps_inside_sqrt: bool = False,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    threads: int = THREADS,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """One in-place LAMB step over contiguous flat buffers made of tensors of `segment_sizes`.

    Returns the trust ratio of each segment (fp32, on the params' device). `threads` (a power of
    two) and `chunk` set the launch shape.
    """
    require()
    if grads.dtype in (torch.bfloat16, torch.float16):
        grads = grads.float()
    n = params.numel()
    cuda_interop.check_buffers(
        "cuda lamb_step", {"params": params, "grads": grads, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, n
    )
    if sum(segment_sizes) != n:
        raise ValueError(f"cuda lamb_step: segment sizes add up to {sum(segment_sizes)}, params has {n} elements")
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"cuda lamb_step: step={step!r} must be a positive integer (1 for the first update)")
    if not isinstance(threads, int) or threads < 1 or threads & (threads - 1) or threads > 1024:
        raise ValueError(f"cuda lamb_step: threads={threads!r} must be a power of two in [1, 1024]")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"cuda lamb_step: chunk={chunk!r} must be a positive integer")
    step_size = lr
    if bias_correction:
        step_size *= math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)

    device = params.device
    mapping = [torch.from_numpy(a).to(device) for a in segment_blocks(segment_sizes, chunk)]
    block_segment, segment_offsets, segment_first_block = mapping
    n_blocks, n_segments = block_segment.numel(), len(segment_sizes)
    partial_p = torch.empty(n_blocks, dtype=torch.float32, device=device)
    partial_u = torch.empty(n_blocks, dtype=torch.float32, device=device)
    trust = torch.empty(n_segments, dtype=torch.float32, device=device)
    if n_segments == 0:
        return trust

    f32 = np.float32
    arrays = cuda_interop.device_array
    p, g, m, v = (arrays(t) for t in (params, grads, exp_avg, exp_avg_sq))
    blocks = [arrays(t) for t in mapping]
    stream = cuda_interop.launch_stream(params)
    shared_bytes = 2 * threads * 4  # two float32 sums per thread
    direction = (f32(eps), f32(weight_decay), bool(eps_inside_sqrt))
    if n_blocks:
        moments_and_norms_kernel[n_blocks, threads, stream, shared_bytes](
            p, g, m, v, *blocks, chunk, arrays(partial_p), arrays(partial_u),
            f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2), *direction,
        )
    trust_kernel[n_segments, threads, stream, shared_bytes](
        blocks[2], arrays(partial_p), arrays(partial_u), arrays(trust), f32(min_coeff), f32(max_coeff)
    )
    if n_blocks:
        update_kernel[n_blocks, threads, stream](p, m, v, *blocks, chunk, arrays(trust), f32(step_size), *direction)
    return trust


def supports(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> bool:
    """Whether `lamb_step` takes these buffers (fp32 state, fp32/bf16/fp16 grads, one device)."""
    tensors = (params, grads, exp_avg, exp_avg_sq)
    return (
        all(t.is_contiguous() and t.numel() == params.numel() and t.device == params.device for t in tensors)
        and all(t.dtype == torch.float32 for t in (params, exp_avg, exp_avg_sq))
        and grads.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )
