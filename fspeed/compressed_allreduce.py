"""Error-feedback 1-bit all-reduce: DeepSpeed's `compressed_allreduce` (runtime/comm/nccl.py), over
the segments of a flat buffer in one set of collectives.

Per segment (a parameter tensor for 1-bit/0-1 Adam, the whole flattened momentum for 1-bit LAMB),
on a data axis of n ranks, exactly as DeepSpeed does per tensor:

    x   = pad(x) + worker_error          padded to a multiple of n * divider, divider = 8n / gcd(n, 8)
    s_w = ||x|| / sqrt(numel(x))         the RMS scale
    q   = sign(x), with 0 -> +1          packed 8 signs per byte (MSB first, as numpy.packbits)
    worker_error = x - s_w * q
    phase 1: chunk i of every rank's packed signs goes to rank i (all-to-all); scales all-gathered
    y_i = sum_j (s_w_j / n) * q_j[chunk i] + server_error       rank i is the "server" of chunk i
    s_s = ||y_i|| / sqrt(numel(y_i));  server_error = y_i - s_s * sign(y_i)
    phase 2: all-gather the servers' packed signs and scales
    out[chunk i] = s_s_i * sign(y_i)     for every i: the (approximate) mean over ranks

DeepSpeed issues four collectives per parameter tensor; here every segment travels in the same four
collectives (the send buffer is laid out rank-major: for each destination rank, its chunk of every
segment), with the same bytes. Buffers are "param-major": each segment's padded elements in a row,
as DeepSpeed's per-parameter buffers would be concatenated. `simulate_compressed_allreduce` is the
same algorithm for all ranks in one process (tests compare bits and error buffers with it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .parallel.comm import AxisComm

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def divider(world: int) -> int:
    """DeepSpeed's `divider`: 8n / gcd(n, 8), so that every rank's chunk is a whole number of bytes."""
    return world * 8 // math.gcd(world, 8)


def padded_numel(numel: int, world: int) -> int:
    """`numel` rounded up to a multiple of world * divider(world) (DeepSpeed's corrected_tensor_size)."""
    unit = world * divider(world)
    return -(-numel // unit) * unit


@dataclass(frozen=True)
class CompressionPlan:
    """How segments of `sizes` elements are padded and split into per-rank chunks on `world` ranks."""

    sizes: tuple[int, ...]
    world: int

    def __post_init__(self):
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"CompressionPlan: world={self.world!r} must be a positive integer")
        if any(s < 0 for s in self.sizes):
            raise ValueError(f"CompressionPlan: segment sizes must be >= 0, got {list(self.sizes)}")

    @functools.cached_property
    def padded(self) -> tuple[int, ...]:
        return tuple(padded_numel(s, self.world) for s in self.sizes)

    @functools.cached_property
    def chunks(self) -> tuple[int, ...]:
        """Elements of each segment a server rank owns (padded size / world; a multiple of 8)."""
        return tuple(p // self.world for p in self.padded)

    @functools.cached_property
    def total(self) -> int:
        """Elements of the padded param-major buffer (the worker error's size)."""
        return sum(self.padded)

    @functools.cached_property
    def server_numel(self) -> int:
        """Elements one rank serves (the server error's size)."""
        return self.total // self.world

    @functools.cached_property
    def rank_major(self) -> torch.Tensor:
        """Index: rank-major position -> param-major position (rank i's chunks of every segment in a row)."""
        starts = [0]
        for p in self.padded[:-1]:
            starts.append(starts[-1] + p)
        pieces = [torch.arange(c) + start + i * c for i in range(self.world)
                  for start, c in zip(starts, self.chunks)]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)

    @functools.cached_property
    def real_index(self) -> Optional[torch.Tensor]:
        """Positions of the unpadded elements in the padded buffer; None when nothing is padded."""
        if self.padded == self.sizes:
            return None
        starts, at = [], 0
        for p in self.padded:
            starts.append(at)
            at += p
        return torch.cat([torch.arange(s) + start for s, start in zip(self.sizes, starts)])

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """The param-major padded copy of `flat` (the unpadded segments back to back), zero padding."""
        if flat.numel() != sum(self.sizes):
            raise ValueError(f"pad: got {flat.numel()} elements, the plan's segments hold {sum(self.sizes)}")
        if self.real_index is None:
            return flat.clone()
        out = flat.new_zeros(self.total)
        out[self.real_index.to(flat.device)] = flat
        return out

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """The unpadded segments of a param-major padded buffer, back to back."""
        return padded if self.real_index is None else padded[self.real_index.to(padded.device)]


# ------------------------------------------------------------------------------ sign packing


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Signs of `x` (numel a multiple of 8) as uint8, 8 per byte, MSB first; bit 1 = x >= 0.

    DeepSpeed's `sign().add_(1).bool()`: 0 (and NaN) count as positive.
    """
    if x.numel() % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {x.numel()}")
    bits = (~(x < 0)).to(torch.uint8).view(-1, 8)
    return (bits << _SHIFTS.to(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ±1 values of packed signs (8 per byte), as `dtype`."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_signs needs uint8 packed signs, got {packed.dtype}")
    bits = (packed.view(-1, 1) >> _SHIFTS.to(packed.device)) & 1
    return bits.view(-1).to(dtype).mul_(2).sub_(1)


def _sign_pm1(x: torch.Tensor) -> torch.Tensor:
    return (~(x < 0)).to(x.dtype).mul_(2).sub_(1)


def _segment_rms(x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """||segment|| / sqrt(numel) for every segment of a flat buffer (one foreach pass)."""
    norms = torch.stack(torch._foreach_norm(list(torch.split(x, list(sizes)))))
    return norms / torch.tensor([math.sqrt(max(s, 1)) for s in sizes], dtype=norms.dtype, device=norms.device)


def _expand(values: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """values[..., p] repeated sizes[p] times along the last dim."""
    return values.repeat_interleave(torch.tensor(list(sizes), device=values.device), dim=-1)


# ------------------------------------------------------------------------------ the three stages


def worker_compress(x: torch.Tensor, worker_error: torch.Tensor, plan: CompressionPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed signs, rank-major [world * server_numel / 8] bytes; scales [segments]); updates
    `worker_error` in place. `x` is the param-major padded input (not modified)."""
    _check_sizes("worker_error", worker_error, plan.total)
    x = x + worker_error
    scales = _segment_rms(x, plan.padded)
    signs = _sign_pm1(x)
    torch.sub(x, signs.mul_(_expand(scales, plan.padded)), out=worker_error)
    return pack_signs(x[plan.rank_major.to(x.device)]), scales


def server_reduce(received: torch.Tensor, worker_scales: torch.Tensor, server_error: torch.Tensor,
                  plan: CompressionPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 on one server: `received` [world * server_numel / 8] are the chunks every rank sent
    here (rank order), `worker_scales` [world * segments] every rank's scales. Returns (packed signs
    [server_numel / 8], server scales [segments]) and updates `server_error` in place."""
    _check_sizes("server_error", server_error, plan.server_numel)
    n = plan.world
    signs = unpack_signs(received, server_error.dtype).view(n, plan.server_numel)
    weights = _expand(worker_scales.view(n, -1).mul(1.0 / n), plan.chunks)
    y = signs.mul_(weights).sum(0).add_(server_error)
    scales = _segment_rms(y, plan.chunks)
    q = _sign_pm1(y)
    torch.sub(y, q.mul(_expand(scales, plan.chunks)), out=server_error)
    return pack_signs(y), scales


def decompress(gathered: torch.Tensor, server_scales: torch.Tensor, plan: CompressionPlan,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Phase 2's result: every server's packed signs [world * server_numel / 8] and scales
    [world * segments] -> the param-major padded output [total]."""
    n = plan.world
    values = unpack_signs(gathered, dtype).view(n, plan.server_numel)
    values.mul_(_expand(server_scales.view(n, -1).to(dtype), plan.chunks))
    out = torch.empty(plan.total, dtype=dtype, device=gathered.device)
    out[plan.rank_major.to(out.device)] = values.view(-1)
    return out


def _check_sizes(name: str, t: torch.Tensor, numel: int) -> None:
    if t.dim() != 1 or t.numel() != numel:
        raise ValueError(f"{name} must be 1-D with {numel} elements for this plan, got shape {list(t.shape)}")


# ------------------------------------------------------------------------------ the collective


def compressed_allreduce(x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         plan: CompressionPlan, comm: AxisComm) -> torch.Tensor:
    """The approximate mean over `comm`'s ranks of the param-major padded buffer `x` [plan.total]
    (see the module docstring); updates both error buffers in place. Four collectives: one
    all-to-all of packed signs, three all-gathers (worker scales, server signs, server scales)."""
    if comm.size != plan.world:
        raise ValueError(f"compressed_allreduce: the plan is for {plan.world} ranks, the axis {comm.name!r} "
                         f"has {comm.size}")
    _check_sizes("x", x, plan.total)
    n = plan.world
    packed, scales = worker_compress(x, worker_error, plan)
    received = torch.empty_like(packed)
    comm.all_to_all(packed, received)
    worker_scales = scales.new_empty(n * scales.numel())
    comm.all_gather(scales, worker_scales)
    server_packed, server_scales = server_reduce(received, worker_scales, server_error, plan)
    gathered = server_packed.new_empty(n * server_packed.numel())
    comm.all_gather(server_packed, gathered)
    all_server_scales = server_scales.new_empty(n * server_scales.numel())
    comm.all_gather(server_scales, all_server_scales)
    return decompress(gathered, all_server_scales, plan, x.dtype)


def simulate_compressed_allreduce(xs: Sequence[torch.Tensor], worker_errors: Sequence[torch.Tensor],
                                  server_errors: Sequence[torch.Tensor], plan: CompressionPlan) -> list[torch.Tensor]:
    """`compressed_allreduce` for all `plan.world` ranks in one process: rank r's input `xs[r]`,
    error buffers updated in place; returns every rank's output. The reference the collective is
    tested against (the shuffles are written out explicitly here)."""
    n = plan.world
    if not len(xs) == len(worker_errors) == len(server_errors) == n:
        raise ValueError(f"simulate_compressed_allreduce: need {n} inputs and error buffers of each kind, got "
                         f"{len(xs)}, {len(worker_errors)}, {len(server_errors)}")
    sent = [worker_compress(x, we, plan) for x, we in zip(xs, worker_errors)]
    chunk_bytes = plan.server_numel // 8
    worker_scales = torch.cat([s for _, s in sent])
    served = []
    for i in range(n):
        received = torch.cat([bits[i * chunk_bytes:(i + 1) * chunk_bytes] for bits, _ in sent])
        served.append(server_reduce(received, worker_scales, server_errors[i], plan))
    gathered = torch.cat([bits for bits, _ in served])
    server_scales = torch.cat([s for _, s in served])
    out = decompress(gathered, server_scales, plan, xs[0].dtype)
    return [out.clone() for _ in range(n)]
