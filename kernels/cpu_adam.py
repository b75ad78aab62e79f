"""CPU Adam/AdamW over flat buffers: one multi-threaded Numba pass per buffer.

DeepSpeed FusedAdam / DeepSpeedCPUAdam semantics (reference sections 3.2 and 5.1), per element,
with bc1 = 1 - beta1^t and bc2 = 1 - beta2^t (both 1 without bias correction):

    L2 mode    (adam_w_mode=False): g += wd * p
    m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
    AdamW mode (adam_w_mode=True):  p -= lr * wd * p            (decoupled, before the Adam step)
    p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

The math is fp32 with fp32 scalars, as in DeepSpeed's AVX kernel and torch's fused CPU Adam. One
call reads p, g, m, v and writes p, m, v once: 28 bytes per parameter with fp32 gradients, the
memory roofline of an in-place update. Two mixed-precision savings ride on the same pass:

* gradients may be bf16 or fp16 (read as 16-bit words and widened in registers), saving the fp32
  copy torch needs before `torch._fused_adam_`;
* `cast_out`, a bf16/fp16 buffer, receives the updated params rounded to nearest even, bit for bit
  what `params.to(dtype)` gives (NaN included), saving torch's separate cast pass.

Tiling: the buffer is cut into chunks of `CHUNK` elements (a multiple of the 64-byte cache line
and of the 16-lane AVX-512 width) and `prange` walks chunks, so each thread streams contiguous
memory, the inner loop vectorises without a remainder inside a chunk, and no two threads write
the same cache line (no false sharing at thread boundaries, given a 64-byte aligned buffer).
Each chunk is taken as array views indexed from 0: with absolute indices Numba's negative-index
wraparound check kept LLVM from vectorising the loop (scalar code, measured 4x slower).

fastmath: only `nsz` (signed zeros are irrelevant here) and `contract` (FMA contraction: one
rounding instead of two, as DeepSpeed's FMA intrinsics; results stay within fp32 tolerance of
torch). Not `nnan`/`ninf`: NaN/inf gradients must propagate (fp16 overflow) and the NaN branch of
the bf16 rounding must survive; not `afn`: approximate sqrt/reciprocal costs accuracy near v=0;
not `reassoc`/`arcp`: an element-wise kernel has no reduction to vectorise, and they would change
rounding unpredictably.

`error_model="numpy"`: a division by zero (eps=0 and v=0) gives IEEE inf/NaN as torch does,
instead of Python's ZeroDivisionError, whose per-element check would stop the vectorisation.

Threads: `torch.get_num_threads()` (capped by Numba's pool), set per call; torch's own count is
restored after the call. The first call of each
of the four variants (fp32 or 16-bit gradients, with or without the cast copy; bf16 vs fp16 is
a run-time flag) compiles in ~1.5-3 s on this 2-core machine; `cache=True` stores them next to
this file, and a later process loads one in ~0.4 s (then ~0.02 s for the others).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

CHUNK = 16384  # elements per prange iteration: 64 KiB of each fp32 stream

_FASTMATH = {"nsz", "contract"}
_HALF_DTYPES = (torch.bfloat16, torch.float16)
_BF16_NAN_BITS = 0xFFFF  # what torch's fp32 -> bf16 cast writes for every NaN


# --------------------------------------------------------------------------- bit-level conversions


@intrinsic
def _bits_as_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an unsigned integer as a float32 (no conversion)."""
    if not isinstance(bits, types.Integer) or bits.signed or bits.bitwidth < 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0],
                               ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_as_bits(typingctx, value):
    """Reinterpret a float32 as a uint32 (no conversion)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _f16_bits_to_f32(typingctx, bits):
    """IEEE half (as uint16 bits) widened to float32: exact (LLVM fpext; vcvtph2ps on x86)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_f16_bits(typingctx, value):
    """float32 rounded to IEEE half, nearest even (LLVM fptrunc; vcvtps2ph on x86), as bits."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@numba.njit(inline="always", cache=True)
def _bf16_bits_to_f32(bits):
    return _bits_as_f32(np.uint32(bits) << np.uint32(16))


@numba.njit(inline="always", cache=True)
def _f32_to_bf16_bits(value):
    """Round to nearest even, as torch's cast; every NaN becomes 0xFFFF, as torch writes it."""
    u = _f32_as_bits(value)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.uint16(_BF16_NAN_BITS) if value != value else np.uint16(rounded)


def _load_f32(array, i, is_bf16):
    """array[i] as float32: fp32 as is, 16-bit words as bf16 (is_bf16) or fp16 bits."""


@overload(_load_f32, inline="always")
def _load_f32_impl(array, i, is_bf16):
    if array.dtype == types.float32:
        return lambda array, i, is_bf16: array[i]
    if array.dtype == types.uint16:
        def load_half(array, i, is_bf16):
            bits = array[i]
            return _bf16_bits_to_f32(bits) if is_bf16 else _f16_bits_to_f32(bits)
        return load_half
    return None


def _chunk(out, start, stop):
    """out[start:stop], or None when there is no output."""


@overload(_chunk, inline="always")
def _chunk_impl(out, start, stop):
    if isinstance(out, types.NoneType):
        return lambda out, start, stop: None
    return lambda out, start, stop: out[start:stop]


def _store_half(out, i, value, is_bf16):
    """out[i] = value rounded to bf16 (is_bf16) or fp16; nothing when out is None."""


@overload(_store_half, inline="always")
def _store_half_impl(out, i, value, is_bf16):
    if isinstance(out, types.NoneType):
        return lambda out, i, value, is_bf16: None
    if isinstance(out, types.Array) and out.dtype == types.uint16:
        def store(out, i, value, is_bf16):
            out[i] = _f32_to_bf16_bits(value) if is_bf16 else _f32_to_f16_bits(value)
        return store
    return None


# --------------------------------------------------------------------------- the kernel


@numba.njit(inline="always", cache=True)
def _adam_chunk(pc, gc, mc, vc, oc, grad_is_bf16, out_is_bf16, scalars):
    """The update of one chunk (the module docstring's formulas), inlined into both kernels;
    `scalars` as `adam_scalars` makes them. Weight decay is branch-free: `l2_decay` is wd in L2
    mode (else 0); `decoupled_keep` is 1 - lr*wd in AdamW mode (else 1). The chunk's arrays are
    indexed from 0: the indices are provably non-negative, so no wraparound check per element and
    LLVM vectorises the loop (absolute indices defeat it)."""
    beta1, one_minus_beta1, beta2, one_minus_beta2, eps = scalars[:5]
    l2_decay, decoupled_keep, step_size, inv_sqrt_bc2 = scalars[5:]
    for i in range(pc.size):
        param = pc[i]
        grad = _load_f32(gc, i, grad_is_bf16) + l2_decay * param
        mi = beta1 * mc[i] + one_minus_beta1 * grad
        vi = beta2 * vc[i] + one_minus_beta2 * grad * grad
        mc[i] = mi
        vc[i] = vi
        param = param * decoupled_keep - step_size * mi / (math.sqrt(vi) * inv_sqrt_bc2 + eps)
        pc[i] = param
        _store_half(oc, i, param, out_is_bf16)


@numba.njit(fastmath={"reassoc", "nsz", "contract"}, error_model="numpy", cache=True)
def _sum_squares(gc, is_bf16):
    """The chunk's sum of squared gradients in fp32, read again while the chunk is in cache. Its own
    function for `reassoc`: instruction flags survive LLVM's inlining, so this reduction vectorises
    while the update's loop keeps its order-preserving flags. NaN and inf propagate (no `nnan`)."""
    total = np.float32(0.0)
    for i in range(gc.size):
        x = _load_f32(gc, i, is_bf16)
        total += x * x
    return total


@numba.njit(parallel=True, fastmath=_FASTMATH, error_model="numpy", cache=True)
def _adam_kernel(p, g, m, v, out, grad_is_bf16, out_is_bf16, scalars, squares):
    """One Adam step over flat arrays, chunk by chunk (`scalars`: `adam_scalars`); when `squares`
    is not empty, `squares[c]` receives chunk c's sum of squared gradients."""
    n = p.size
    for c in numba.prange((n + CHUNK - 1) // CHUNK):
        start = c * CHUNK
        stop = min(start + CHUNK, n)
        _adam_chunk(p[start:stop], g[start:stop], m[start:stop], v[start:stop], _chunk(out, start, stop),
                    grad_is_bf16, out_is_bf16, scalars)
        if squares.size:
            squares[c] = _sum_squares(g[start:stop], grad_is_bf16)


@intrinsic
def _f32_at(typingctx, address):
    """The float32 pointer at an integer address (a torch tensor's data_ptr)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))

    return types.CPointer(types.float32)(address), codegen


@numba.njit(parallel=True, fastmath=_FASTMATH, error_model="numpy", cache=True)
def _adam_runs_kernel(table, first_chunk, scalars, squares):
    """`_adam_kernel` over many fp32 runs in one parallel pass: `table[r]` holds run r's addresses
    of p, g, m, v and its length; `first_chunk[r]` its first chunk in the pass (a prefix sum);
    `squares` as in `_adam_kernel`."""
    for c in numba.prange(first_chunk[-1]):
        r = np.searchsorted(first_chunk, c, side="right") - 1
        start = (c - first_chunk[r]) * CHUNK
        size = min(CHUNK, table[r, 4] - start)
        offset = start * 4
        p = numba.carray(_f32_at(table[r, 0] + offset), size)
        g = numba.carray(_f32_at(table[r, 1] + offset), size)
        m = numba.carray(_f32_at(table[r, 2] + offset), size)
        v = numba.carray(_f32_at(table[r, 3] + offset), size)
        _adam_chunk(p, g, m, v, None, False, False, scalars)
        if squares.size:
            squares[c] = _sum_squares(g, False)


# --------------------------------------------------------------------------- torch entry point


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
    grad_sq: list | None = None,
) -> None:
    """One in-place Adam (adam_w_mode=False) or AdamW step over contiguous CPU buffers.

    `params`, `exp_avg`, `exp_avg_sq`: fp32. `grads`: fp32, bf16 or fp16. `step` is the 1-based
    count of this update (bias correction uses beta^step). `cast_out` (bf16/fp16, optional)
    receives the updated params, cast. All must have the same number of elements; shapes may
    differ (the buffers are used flat). `grad_sq` (a list, optional) gets the sum of the squared
    gradients appended, taken in the same pass (a grad norm with no read of the gradient of its own).
    """
    _check_buffers(params, grads, exp_avg, exp_avg_sq, cast_out)
    scalars = adam_scalars("adam_step", lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction)
    squares = _squares_for((params.numel() + CHUNK - 1) // CHUNK, grad_sq)
    _on_torchs_threads(
        _adam_kernel,
        _as_numpy(params), _as_numpy(grads), _as_numpy(exp_avg), _as_numpy(exp_avg_sq),
        None if cast_out is None else _as_numpy(cast_out),
        grads.dtype == torch.bfloat16, cast_out is not None and cast_out.dtype == torch.bfloat16, scalars, squares,
    )
    if grad_sq is not None:
        grad_sq.append(float(squares.sum()))


_NO_SQUARES = np.empty(0, dtype=np.float64)


def _squares_for(chunks: int, grad_sq: list | None) -> np.ndarray:
    """The per-chunk sums a kernel fills when the caller asks for `grad_sq` (summed in float64 in
    chunk order: the same bits on any thread count), else an empty array (none taken)."""
    return _NO_SQUARES if grad_sq is None else np.zeros(chunks, dtype=np.float64)


def adam_scalars(name: str, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 adam_w_mode: bool, bias_correction: bool) -> tuple:
    """The Adam kernels' fp32 scalars in their order (`_adam_chunk`'s here, `adam_kernel`'s in
    cuda_adam), the bias corrections and the two weight-decay modes folded in; `step` must be a
    positive integer (`name` is the caller's, for the error)."""
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{name}: step={step!r} must be a positive integer (1 for the first update)")
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    f32 = np.float32
    return (f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2), f32(eps),
            f32(0.0 if adam_w_mode else weight_decay), f32(1.0 - lr * weight_decay if adam_w_mode else 1.0),
            f32(lr / bc1), f32(1.0 / math.sqrt(bc2)))


def _on_torchs_threads(kernel, *args) -> None:
    """Run a parallel kernel on torch's thread count, and keep that count.

    Starting Numba's OpenMP pool resets the process-wide OpenMP thread count, which torch's
    intra-op pool shares: with several ranks per host that oversubscribed the cores (3.2x slower)."""
    torch_threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(torch_threads, numba.config.NUMBA_NUM_THREADS)))
    kernel(*args)
    torch.set_num_threads(torch_threads)


def adam_step_runs(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
                   exp_avg_sq: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, step: int, adam_w_mode: bool, bias_correction: bool = True,
                   checked: bool = False, grad_sq: list | None = None) -> None:
    """`adam_step` with the same settings over several fp32 buffers (the runs of a parameter group)
    in one parallel pass: one dispatch instead of one per run (each about 20 us, which a group of
    many small runs such as biases and norms pays over and over). `checked`: the caller has
    checked every run with `supports_runs`. `grad_sq` as in `adam_step` (one sum over all runs)."""
    scalars = adam_scalars("adam_step_runs", lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction)
    if not (len(params) == len(grads) == len(exp_avg) == len(exp_avg_sq)):
        raise ValueError(f"adam_step_runs: {len(params)} params, {len(grads)} grads, {len(exp_avg)} exp_avg and "
                         f"{len(exp_avg_sq)} exp_avg_sq; one of each per run")
    table = np.empty((len(params), 5), dtype=np.int64)
    for r, run in enumerate(zip(params, grads, exp_avg, exp_avg_sq)):
        if not checked and not supports_runs(*run):
            raise ValueError(f"adam_step_runs: run {r} must be four contiguous fp32 CPU tensors of one size, got "
                             + ", ".join(f"{t.dtype} {list(t.shape)} on {t.device}" for t in run))
        p, g, m, v = run
        table[r] = (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel())
    _step_table(table, scalars, grad_sq)


def adam_step_loose(params: list[torch.Tensor], grads: list[list[torch.Tensor]], exp_avg: list[torch.Tensor],
                    exp_avg_sq: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, step: int, adam_w_mode: bool, bias_correction: bool = True,
                    grad_sq: list | None = None) -> bool:
    """`adam_step_runs` over flat buffers and one gradient tensor per parameter (backward's own,
    `LooseGrads`): `params[r]`, `exp_avg[r]` and `exp_avg_sq[r]` hold the parameters whose gradients
    are `grads[r]`, back to back in that order (a buffer, or each run of a parameter group). The
    runs' addresses follow from the gradients' sizes, so only the gradients are looked at one by one
    (a GPT-2 of 150 small tensors: 0.2 against 1 ms of Python a step). Returns False, updating
    nothing, where a tensor is not contiguous fp32 on the CPU or a buffer is shorter than its
    gradients."""
    if not (len(params) == len(grads) == len(exp_avg) == len(exp_avg_sq)):
        raise ValueError(f"adam_step_loose: {len(params)} params, {len(grads)} gradient lists, {len(exp_avg)} exp_avg "
                         f"and {len(exp_avg_sq)} exp_avg_sq; one of each per buffer")
    f32 = torch.float32
    every = [g for run in grads for g in run]
    if not every or not all(t.dtype == f32 and t.is_cpu and t.is_contiguous()
                            for t in (*params, *exp_avg, *exp_avg_sq, *every)):
        return False
    sizes = np.fromiter((g.numel() for g in every), dtype=np.int64, count=len(every))
    counts = [len(run) for run in grads]
    starts = np.empty(len(every), dtype=np.int64)  # each parameter's offset in its buffer
    at = 0
    for r, k in enumerate(counts):
        run = sizes[at:at + k]
        np.cumsum(run, out=starts[at:at + k])
        starts[at:at + k] -= run
        if run.sum() > min(params[r].numel(), exp_avg[r].numel(), exp_avg_sq[r].numel()):
            return False
        at += k
    scalars = adam_scalars("adam_step_loose", lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction)

    def addresses(buffers: list[torch.Tensor]) -> np.ndarray:
        return np.repeat(np.array([b.data_ptr() for b in buffers], dtype=np.int64), counts) + 4 * starts
    table = np.empty((len(every), 5), dtype=np.int64)
    table[:, 0] = addresses(params)
    table[:, 1] = np.fromiter((g.data_ptr() for g in every), dtype=np.int64, count=len(every))
    table[:, 2] = addresses(exp_avg)
    table[:, 3] = addresses(exp_avg_sq)
    table[:, 4] = sizes
    _step_table(table, scalars, grad_sq)
    return True


def _step_table(table: np.ndarray, scalars: tuple, grad_sq: list | None) -> None:
    """`_adam_runs_kernel` over the runs of `table` (rows: p, g, m, v addresses and the length)."""
    first_chunk = np.zeros(len(table) + 1, dtype=np.int64)
    np.cumsum((table[:, 4] + CHUNK - 1) // CHUNK, out=first_chunk[1:])
    squares = _squares_for(first_chunk[-1], grad_sq)
    _on_torchs_threads(_adam_runs_kernel, table, first_chunk, scalars, squares)
    if grad_sq is not None:
        grad_sq.append(float(squares.sum()))


def supports_runs(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> bool:
    """Whether `adam_step_runs` takes this run: fp32 throughout (16-bit gradients and the cast copy
    take `adam_step`), contiguous, on the CPU, one size."""
    n, f32 = params.numel(), torch.float32
    return (params.dtype == f32 and grads.dtype == f32 and exp_avg.dtype == f32 and exp_avg_sq.dtype == f32
            and params.is_cpu and grads.is_cpu and exp_avg.is_cpu and exp_avg_sq.is_cpu
            and params.is_contiguous() and grads.is_contiguous() and exp_avg.is_contiguous()
            and exp_avg_sq.is_contiguous() and grads.numel() == n and exp_avg.numel() == n and exp_avg_sq.numel() == n)


def is_available() -> bool:
    """Always True: Numba is one of fspeed's dependencies (the kernel compiles for the host CPU)."""
    return True


def require() -> None:
    """Nothing to check (see `is_available`); present so every kernel module has the same shape."""


def supports(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
             cast_out: torch.Tensor | None = None) -> bool:
    """Whether `adam_step` accepts these buffers (for callers choosing between it and torch)."""
    try:
        _check_buffers(params, grads, exp_avg, exp_avg_sq, cast_out)
    except (TypeError, ValueError):
        return False
    return True


def _check_buffers(params, grads, exp_avg, exp_avg_sq, cast_out) -> None:
    named = {"params": params, "grads": grads, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if cast_out is not None:
        named["cast_out"] = cast_out
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"adam_step: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"adam_step: {name} is on {t.device}; this kernel runs on CPU tensors only")
        if not t.is_contiguous():
            raise ValueError(f"adam_step: {name} (shape {list(t.shape)}) must be contiguous")
        if t.numel() != params.numel():
            raise ValueError(f"adam_step: {name} has {t.numel()} elements, params has {params.numel()}")
    for name in ("params", "exp_avg", "exp_avg_sq"):
        if named[name].dtype != torch.float32:
            raise TypeError(f"adam_step: {name} is {named[name].dtype}; allowed: torch.float32")
    if grads.dtype not in (torch.float32, *_HALF_DTYPES):
        raise TypeError(f"adam_step: grads is {grads.dtype}; allowed: torch.float32, torch.bfloat16, torch.float16")
    if cast_out is not None and cast_out.dtype not in _HALF_DTYPES:
        raise TypeError(f"adam_step: cast_out is {cast_out.dtype}; allowed: torch.bfloat16, torch.float16")


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A zero-copy 1-D numpy view; 16-bit floats as their uint16 bits (numba has no half type)."""
    flat = t.detach().reshape(-1)
    if flat.dtype in _HALF_DTYPES:
        return flat.view(torch.int16).numpy().view(np.uint16)
    return flat.numpy()
