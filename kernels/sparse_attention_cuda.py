"""Block-sparse attention on CUDA: fused flash-style Numba CUDA kernels, fp32 / fp16 / bf16 in, fp32 math.

Arrays only (no fspeed imports); they may be numba device arrays, objects with
`__cuda_array_interface__` (torch CUDA tensors), or numpy arrays under the CUDA simulator
(`NUMBA_ENABLE_CUDASIM=1`). Same layout tables and mask conventions as `sparse_attention_cpu`:
q, k, v, dout [B, H, S, D] as float32, float16, or bfloat16 passed as its int16 bit pattern;
`row_ptr`/`col_idx` (CSR) and `col_ptr`/`row_idx` (CSC) int32 with global offsets; key_bias
[Bk, S] and attn_bias [Bm, Hm, S, S] float32 (first dim 0 = none); out, lse, dq, dk, dv,
delta float32 (the caller casts outputs back).

One CUDA block per (query or key block, head, batch), one thread per row of that block
(`threads = block`), tiles of K, V, Q or dO staged in shared memory (fp32, up to TILE_ELEMS =
block * head_dim elements), per-thread scores and accumulators in local memory:

* `forward`: online softmax over the row's key blocks; writes out and the log-sum-exp.
* `backward_dq`: recompute P from lse, dS = P * (dO . V - delta), dQ = dS K scale.
* `backward_dkdv`: per key block over the CSC list of query blocks: dV = P^T dO, dK = dS^T Q scale.

bf16 is decoded with integer and float arithmetic (no bit-cast intrinsic), so one source runs
on the GPU and in the simulator. Limits: block <= MAX_BLOCK, head_dim <= MAX_HEAD_DIM,
block * head_dim <= TILE_ELEMS; `check_shapes` says which one a call breaks.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32

MAX_BLOCK = 128
MAX_HEAD_DIM = 128
TILE_ELEMS = 8192  # 32 KiB of fp32 shared memory per CUDA block

_POW2_M133 = 2.0 ** -133  # bf16 subnormal step


@cuda.jit(device=True, inline=True)
def _load_same(x):
    return float32(x)


@cuda.jit(device=True, inline=True)
def _load_bf16_bits(x):
    """bf16 bit pattern (in an int16) -> float32 value, exactly."""
    u = int32(x) & 0xFFFF
    sign = float32(-1.0) if (u >> 15) & 1 else float32(1.0)
    e = (u >> 7) & 0xFF
    mant = u & 0x7F
    if e == 0:
        return sign * float32(float64(mant) * _POW2_M133)
    if e == 255:
        if mant == 0:
            return sign * float32(math.inf)
        return float32(math.nan)
    return sign * float32(float64(128 + mant) * math.pow(2.0, float64(e - 134)))


def _make_kernels(load):
    """The three kernels for one input storage type, `load` turning an element into float32."""

    @cuda.jit(device=True, inline=True)
    def bias(key_bias, attn_bias, b, h, qi, kj):
        extra = float32(0.0)
        if key_bias.shape[0] > 0:
            extra += key_bias[b if key_bias.shape[0] > 1 else 0, kj]
        if attn_bias.shape[0] > 0:
            extra += attn_bias[b if attn_bias.shape[0] > 1 else 0, h if attn_bias.shape[1] > 1 else 0, qi, kj]
        return extra

    @cuda.jit(device=True, inline=True)
    def stage(tile, x, b, h, first, t, blk, D):
        """Copy rows first .. first + blk of x[b, h] into the shared tile as fp32, thread t taking
        every blk-th element; synchronised before (the tile's last readers are done) and after."""
        cuda.syncthreads()
        for e in range(t, blk * D, blk):
            tile[e] = load(x[b, h, first + e // D, e % D])
        cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def dot_row(row, tile, j, D):
        """row . (row j of the staged tile)."""
        acc = float32(0.0)
        for d in range(D):
            acc += row[d] * tile[j * D + d]
        return acc

    @cuda.jit(device=True, inline=True)
    def score(qrow, tile, j, D, key_bias, attn_bias, causal, b, h, r, c, i, blk):
        """Masked score of query row i of block r (qrow, pre-scaled) against key j of staged block c."""
        if causal and c == r and j > i:
            return float32(-math.inf)
        return dot_row(qrow, tile, j, D) + bias(key_bias, attn_bias, b, h, r * blk + i, c * blk + j)

    def forward(q, k, v, row_ptr, col_idx, key_bias, attn_bias, causal, scale, out, lse):
        r, h, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        i = cuda.threadIdx.x
        D = q.shape[3]
        blk = cuda.blockDim.x
        tile = cuda.shared.array(TILE_ELEMS, float32)
        qrow = cuda.local.array(MAX_HEAD_DIM, float32)
        acc = cuda.local.array(MAX_HEAD_DIM, float32)
        s = cuda.local.array(MAX_BLOCK, float32)
        qi = r * blk + i
        for d in range(D):
            qrow[d] = load(q[b, h, qi, d]) * scale
            acc[d] = 0.0
        m = float32(-math.inf)
        l = float32(0.0)
        for n in range(row_ptr[h, r], row_ptr[h, r + 1]):
            c = col_idx[n]
            stage(tile, k, b, h, c * blk, i, blk, D)
            row_max = m
            for j in range(blk):
                s[j] = score(qrow, tile, j, D, key_bias, attn_bias, causal, b, h, r, c, i, blk)
                row_max = max(row_max, s[j])
            stage(tile, v, b, h, c * blk, i, blk, D)
            if row_max > -math.inf:
                corr = math.exp(m - row_max)
                m = row_max
                l *= corr
                for d in range(D):
                    acc[d] *= corr
                for j in range(blk):
                    p = math.exp(s[j] - row_max)
                    l += p
                    for d in range(D):
                        acc[d] += p * tile[j * D + d]
        if l > 0:
            for d in range(D):
                out[b, h, qi, d] = acc[d] / l
            lse[b, h, qi] = m + math.log(l)
        else:
            for d in range(D):
                out[b, h, qi, d] = 0.0
            lse[b, h, qi] = math.inf

    def backward_dq(q, k, v, dout, lse, delta, row_ptr, col_idx, key_bias, attn_bias, causal, scale, dq):
        r, h, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        i = cuda.threadIdx.x
        D = q.shape[3]
        blk = cuda.blockDim.x
        tile = cuda.shared.array(TILE_ELEMS, float32)
        qrow = cuda.local.array(MAX_HEAD_DIM, float32)
        dorow = cuda.local.array(MAX_HEAD_DIM, float32)
        acc = cuda.local.array(MAX_HEAD_DIM, float32)
        ds = cuda.local.array(MAX_BLOCK, float32)
        qi = r * blk + i
        for d in range(D):
            qrow[d] = load(q[b, h, qi, d]) * scale
            dorow[d] = load(dout[b, h, qi, d])
            acc[d] = 0.0
        row_lse = lse[b, h, qi]
        row_delta = delta[b, h, qi]
        for n in range(row_ptr[h, r], row_ptr[h, r + 1]):
            c = col_idx[n]
            stage(tile, k, b, h, c * blk, i, blk, D)
            for j in range(blk):  # P, then dS = P * (dO . v - delta)
                ds[j] = math.exp(score(qrow, tile, j, D, key_bias, attn_bias, causal, b, h, r, c, i, blk) - row_lse)
            stage(tile, v, b, h, c * blk, i, blk, D)
            for j in range(blk):
                ds[j] = ds[j] * (dot_row(dorow, tile, j, D) - row_delta)
            stage(tile, k, b, h, c * blk, i, blk, D)
            for j in range(blk):
                g = ds[j]
                for d in range(D):
                    acc[d] += g * tile[j * D + d]
        for d in range(D):
            dq[b, h, qi, d] = acc[d] * scale

    def backward_dkdv(q, k, v, dout, lse, delta, col_ptr, row_idx, key_bias, attn_bias, causal, scale, dk, dv):
        c, h, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        j = cuda.threadIdx.x
        D = q.shape[3]
        blk = cuda.blockDim.x
        tile = cuda.shared.array(TILE_ELEMS, float32)
        krow = cuda.local.array(MAX_HEAD_DIM, float32)
        vrow = cuda.local.array(MAX_HEAD_DIM, float32)
        acc_k = cuda.local.array(MAX_HEAD_DIM, float32)
        acc_v = cuda.local.array(MAX_HEAD_DIM, float32)
        p = cuda.local.array(MAX_BLOCK, float32)
        ds = cuda.local.array(MAX_BLOCK, float32)
        kj = c * blk + j
        for d in range(D):
            krow[d] = load(k[b, h, kj, d])
            vrow[d] = load(v[b, h, kj, d])
            acc_k[d] = 0.0
            acc_v[d] = 0.0
        for n in range(col_ptr[h, c], col_ptr[h, c + 1]):
            r = row_idx[n]
            stage(tile, q, b, h, r * blk, j, blk, D)
            for i in range(blk):
                qi = r * blk + i
                dot = float32(-math.inf)
                if not (causal and c == r and j > i):
                    dot = dot_row(krow, tile, i, D) * scale + bias(key_bias, attn_bias, b, h, qi, kj)
                p[i] = math.exp(dot - lse[b, h, qi])
            stage(tile, dout, b, h, r * blk, j, blk, D)
            for i in range(blk):
                dp = float32(0.0)
                for d in range(D):
                    g = tile[i * D + d]
                    dp += g * vrow[d]
                    acc_v[d] += p[i] * g
                ds[i] = p[i] * (dp - delta[b, h, r * blk + i])
            stage(tile, q, b, h, r * blk, j, blk, D)
            for i in range(blk):
                g = ds[i]
                for d in range(D):
                    acc_k[d] += g * tile[i * D + d]
        for d in range(D):
            dk[b, h, kj, d] = acc_k[d] * scale
            dv[b, h, kj, d] = acc_v[d]

    return {"forward": forward, "backward_dq": backward_dq, "backward_dkdv": backward_dkdv}


_SOURCES = {"float32": _make_kernels(_load_same), "float16": _make_kernels(_load_same),
            "bfloat16": _make_kernels(_load_bf16_bits)}
_JITTED = {storage: {name: cuda.jit(fn) for name, fn in fns.items()} for storage, fns in _SOURCES.items()}


def storage_of(array) -> str:
    """Which kernel family an input array needs: float32, float16, or bfloat16 (int16 bits)."""
    kind = np.dtype(array.dtype)
    if kind == np.float32:
        return "float32"
    if kind == np.float16:
        return "float16"
    if kind == np.int16:
        return "bfloat16"
    raise ValueError(f"q/k/v storage dtype {kind} is not supported: use float32, float16 or bf16 bits as int16")


def check_shapes(block: int, head_dim: int) -> None:
    """Raise ValueError if (block, head_dim) does not fit the kernels' fixed-size buffers."""
    if block > MAX_BLOCK:
        raise ValueError(f"block={block} exceeds the CUDA kernels' MAX_BLOCK={MAX_BLOCK}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} exceeds the CUDA kernels' MAX_HEAD_DIM={MAX_HEAD_DIM}")
    if block * head_dim > TILE_ELEMS:
        raise ValueError(f"block * head_dim = {block} * {head_dim} exceeds the shared tile of {TILE_ELEMS} floats")


def forward(q, k, v, row_ptr, col_idx, key_bias, attn_bias, causal, scale, out, lse):
    B, H, S, D = q.shape
    nb = row_ptr.shape[1] - 1
    check_shapes(S // nb, D)
    _JITTED[storage_of(q)]["forward"][(nb, H, B), S // nb](
        q, k, v, row_ptr, col_idx, key_bias, attn_bias, causal, np.float32(scale), out, lse)


def backward(q, k, v, dout, lse, delta, row_ptr, col_idx, col_ptr, row_idx, key_bias, attn_bias, causal, scale,
             dq, dk, dv):
    B, H, S, D = q.shape
    nb = row_ptr.shape[1] - 1
    check_shapes(S // nb, D)
    fns = _JITTED[storage_of(q)]
    fns["backward_dq"][(nb, H, B), S // nb](
        q, k, v, dout, lse, delta, row_ptr, col_idx, key_bias, attn_bias, causal, np.float32(scale), dq)
    fns["backward_dkdv"][(nb, H, B), S // nb](
        q, k, v, dout, lse, delta, col_ptr, row_idx, key_bias, attn_bias, causal, np.float32(scale), dk, dv)


def compile_ptx(cc: tuple[int, int]) -> dict[str, str]:
    """PTX of every kernel for every storage type on compute capability `cc` (no GPU needed).

    Needs numba-cuda with NVRTC (`nvidia-cuda-nvrtc`) and must run without the simulator.
    """
    from numba import types

    f32 = types.float32
    ptx = {}
    for storage, fns in _SOURCES.items():
        x = {"float32": types.float32, "float16": types.float16, "bfloat16": types.int16}[storage]
        X4 = types.Array(x, 4, "C")
        F4, F3, F2 = types.Array(f32, 4, "C"), types.Array(f32, 3, "C"), types.Array(f32, 2, "C")
        I2, I1 = types.Array(types.int32, 2, "C"), types.Array(types.int32, 1, "C")
        sigs = {
            "forward": (X4, X4, X4, I2, I1, F2, F4, types.boolean, f32, F4, F3),
            "backward_dq": (X4, X4, X4, X4, F3, F3, I2, I1, F2, F4, types.boolean, f32, F4),
            "backward_dkdv": (X4, X4, X4, X4, F3, F3, I2, I1, F2, F4, types.boolean, f32, F4, F4),
        }
        for name, fn in fns.items():
            ptx[f"{name}_{storage}"] = cuda.compile_ptx(fn, sigs[name], cc=cc)[0]
    return ptx
