"""The communication layer: every collective fspeed issues goes through here.

`AxisComm` binds one mesh axis's process group. Its plain methods work on flat contiguous
buffers (gloo silently reduces strided views wrong, so anything else is refused), split them into
buckets, launch the buckets asynchronously and wait for them together. Its autograd-aware
functions are `torch.autograd.Function`s with a separate `setup_context` that call functional
collectives in forward and backward; only those compose with `torch.func.grad` (plain c10d
calls give silently local gradients there, and torch's own autograd collectives raise):

    gather_shards   forward all-gather,         backward reduce-scatter (sum)
    copy_to_group   forward identity,           backward all-reduce     (Megatron's f)
    reduce_in_group forward all-reduce,         backward identity       (Megatron's g)

Every call is recorded in the mesh's `CommLog` (DeepSpeed's comms_logger: op, message size,
count, latency, algbw, busbw), and a failure or timeout raises `CommError` naming the op, the
axis and its ranks instead of hanging.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor


# torch 2.13 renamed these (the old names warn); older torch has only the old names
_funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_funcol_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the op, the axis and its ranks."""


# ---------------------------------------------------------------------------------------- log


def bus_bandwidth(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in Gbps with DeepSpeed's formulas (reference section 14).

    `nbytes` is the message size: the per-rank input for all-gather / reduce-scatter (scaled by
    the world size here), the whole buffer for all-reduce.
    """
    if seconds <= 0:
        return 0.0, 0.0
    n = max(world, 1)
    to_gbps = 8 / 1e9
    if op in ("all_gather", "reduce_scatter"):
        size = nbytes * n
        algbw = size / seconds
        busbw = algbw * (n - 1) / n
    elif op == "all_reduce":
        algbw = 2 * nbytes / seconds
        busbw = nbytes / seconds * 2 * (n - 1) / n
    elif op == "all_to_all":
        algbw = nbytes / seconds
        busbw = algbw * (n - 1) / n
    else:
        algbw = busbw = nbytes / seconds
    return algbw * to_gbps, busbw * to_gbps


@dataclass
class CommLog:
    """Records of every collective: `records[op][message bytes] -> list of latencies (s)`.

    `enabled=False` keeps only byte counts (cheap); `verbose=True` prints each op as it happens.
    """

    enabled: bool = True
    verbose: bool = False
    records: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    bytes_by_op: dict = field(default_factory=lambda: defaultdict(int))
    world_by_op: dict = field(default_factory=dict)

    def record(self, op: str, axis: str, nbytes: int, seconds: float, world: int) -> None:
        self.bytes_by_op[op] += nbytes
        if not self.enabled:
            return
        self.records[op][nbytes].append(seconds)
        self.world_by_op[op] = world
        if self.verbose:
            algbw, busbw = bus_bandwidth(op, nbytes, seconds, world)
            print(f"comm: {op} ({axis}) {_human(nbytes)} {seconds * 1e3:.2f} ms algbw {algbw:.2f} Gbps "
                  f"busbw {busbw:.2f} Gbps")

    def reset(self) -> None:
        self.records.clear()
        self.bytes_by_op.clear()

    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    def summary(self) -> str:
        """DeepSpeed's table: per op and message size, count, total/avg latency, algbw, busbw.
        Averages are 10%-trimmed means, as DeepSpeed computes them."""
        header = (f"{'Comm. Op':<16}{'Message Size':>14}{'Count':>8}{'Total Latency(ms)':>19}"
                  f"{'Avg Latency(ms)':>17}{'tput_avg (Gbps)':>17}{'busbw_avg (Gbps)':>18}")
        lines = [header]
        for op in sorted(self.records):
            lines.append(op)
            for nbytes in sorted(self.records[op]):
                lat = self.records[op][nbytes]
                avg = _trimmed_mean(lat)
                algbw, busbw = bus_bandwidth(op, nbytes, avg, self.world_by_op.get(op, 1))
                lines.append(f"{'':<16}{_human(nbytes):>14}{len(lat):>8}{sum(lat) * 1e3:>19.2f}"
                             f"{avg * 1e3:>17.2f}{algbw:>17.2f}{busbw:>18.2f}")
        return "\n".join(lines)


def _trimmed_mean(values: Sequence[float], trim: float = 0.1) -> float:
    ordered = sorted(values)
    k = int(len(ordered) * trim)
    kept = ordered[k: len(ordered) - k] or ordered
    return statistics.fmean(kept)


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.2f} GB"


# ----------------------------------------------------------------------------------- axis comm


class AxisComm:
    """Collectives over one mesh axis (`name`), recorded in `log`.

    With a group of one rank every collective is a local no-op (copy where an output is asked
    for), so single-process code runs the same path.
    """

    def __init__(self, name: str, group: Optional[dist.ProcessGroup], ranks: Sequence[int], log: CommLog):
        self.name = name
        self.group = group
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank()) if self.size > 1 else 0
        self.log = log

    def __repr__(self) -> str:
        return f"AxisComm({self.name!r}, rank {self.rank} of {self.size}, global ranks {list(self.ranks)})"

    # -- plain collectives on flat buffers -------------------------------------------------

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError(
                    f"{op} on axis {self.name!r} needs contiguous buffers (gloo reduces strided views wrong, "
                    f"silently); got shape {list(t.shape)} with strides {t.stride()}"
                )

    def _run(self, op: str, nbytes: int, launch):
        """Launch a collective (returning a Work) and wait, recording time and turning failures into CommError."""
        start = time.perf_counter()
        try:
            work = launch()
            if work is not None:
                work.wait()
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._error(op, start, err) from err
        self.log.record(op, self.name, nbytes, time.perf_counter() - start, self.size)

    def _error(self, op: str, start: float, err: Exception) -> CommError:
        return CommError(
            f"{op} over mesh axis {self.name!r} (global ranks {list(self.ranks)}) failed after "
            f"{time.perf_counter() - start:.1f}s on rank {dist.get_rank()}: {err}. A peer rank probably "
            "crashed, was killed, or took another code path; check the other ranks' logs."
        )

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of a contiguous tensor (sum, max, min, avg)."""
        if self.size == 1:
            return tensor
        self._check("all_reduce", tensor)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                     "avg": dist.ReduceOp.AVG}[op]
        self._run("all_reduce", _nbytes(tensor),
                  lambda: dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True))
        return tensor

    def all_reduce_scalar(self, value: float, op: str = "sum") -> float:
        if self.size == 1:
            return float(value)
        t = torch.tensor([value], dtype=torch.float64)
        return float(self.all_reduce_(t, op)[0])

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, bucket_elems: int = 0) -> torch.Tensor:
        """Sum-reduce `full` (viewed as [size, P]) across the axis; this rank's row lands in `out` [P].

        With `bucket_elems > 0`, the rows are reduced in column chunks of that many elements per
        rank, all launched before any is waited for.
        """
        if full.numel() != out.numel() * self.size:
            raise ValueError(f"reduce_scatter on {self.name!r}: input has {full.numel()} elements, "
                             f"output {out.numel()}, axis size {self.size}")
        if self.size == 1:
            return out.copy_(full)
        self._check("reduce_scatter", full, out)
        rows = full.view(self.size, -1)
        works, start = [], time.perf_counter()
        try:
            for lo, hi in _chunks(out.numel(), bucket_elems):
                src = full if (lo, hi) == (0, out.numel()) else rows[:, lo:hi].contiguous().view(-1)
                works.append(dist.reduce_scatter_single(out[lo:hi], src, group=self.group, async_op=True))
            for w in works:
                w.wait()
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._error("reduce_scatter", start, err) from err
        self.log.record("reduce_scatter", self.name, _nbytes(out), time.perf_counter() - start, self.size)
        return out

    def all_gather(self, part: torch.Tensor, out: torch.Tensor, bucket_elems: int = 0) -> torch.Tensor:
        """Gather every rank's `part` [P] into `out` [size * P] (rank order), in buckets."""
        if out.numel() != part.numel() * self.size:
            raise ValueError(f"all_gather on {self.name!r}: input has {part.numel()} elements, "
                             f"output {out.numel()}, axis size {self.size}")
        if self.size == 1:
            return out.copy_(part)
        self._check("all_gather", part, out)
        chunks = list(_chunks(part.numel(), bucket_elems))
        rows = out.view(self.size, -1)
        start = time.perf_counter()
        try:
            if len(chunks) == 1:
                dist.all_gather_single(out, part, group=self.group, async_op=True).wait()
            else:
                staged = []
                for lo, hi in chunks:
                    buf = torch.empty(self.size * (hi - lo), dtype=out.dtype, device=out.device)
                    staged.append((lo, hi, buf, dist.all_gather_single(buf, part[lo:hi].contiguous(),
                                                                      group=self.group, async_op=True)))
                for lo, hi, buf, work in staged:
                    work.wait()
                    rows[:, lo:hi].copy_(buf.view(self.size, -1))
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._error("all_gather", start, err) from err
        self.log.record("all_gather", self.name, _nbytes(part), time.perf_counter() - start, self.size)
        return out

    def all_to_all(self, send: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Equal-split all-to-all: chunk i of `send` ([size * C]) goes to rank i; chunk j of `out`
        comes from rank j. Logged with the per-rank input size, as DeepSpeed's all_to_all_single."""
        if send.numel() != out.numel() or send.numel() % self.size:
            raise ValueError(f"all_to_all on {self.name!r}: input has {send.numel()} elements, output "
                             f"{out.numel()}; both must be equal and divisible by the axis size {self.size}")
        if self.size == 1:
            return out.copy_(send)
        self._check("all_to_all", send, out)
        self._run("all_to_all", _nbytes(send),
                  lambda: dist.all_to_all_single(out, send, group=self.group, async_op=True))
        return out

    # -- functional collectives, used inside autograd Functions ------------------------------

    def _funcol(self, op: str, nbytes: int, call) -> torch.Tensor:
        start = time.perf_counter()
        try:
            result = call()
            if isinstance(result, funcol.AsyncCollectiveTensor):
                result = result.wait()
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._error(op, start, err) from err
        self.log.record(op, self.name, nbytes, time.perf_counter() - start, self.size)
        return result

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        """All-gather along dim 0 (out of place, functional)."""
        if self.size == 1:
            return shard.clone()
        shard = unwrapped(shard).contiguous()
        return self._funcol("all_gather", _nbytes(shard),
                            lambda: _funcol_all_gather(shard, 0, self.group))

    def start_gather(self, shard: torch.Tensor) -> "PendingGather":
        """Start an all-gather along dim 0 without waiting (ZeRO-3 prefetch); `.wait()` returns it."""
        shard = unwrapped(shard).contiguous()
        start = time.perf_counter()
        try:
            result = _funcol_all_gather(shard, 0, self.group)
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._error("all_gather", start, err) from err
        return PendingGather(self, result, _nbytes(shard), start)

    def reduce_scattered(self, full: torch.Tensor) -> torch.Tensor:
        """Sum-reduce-scatter along dim 0 (out of place, functional)."""
        if self.size == 1:
            return full.clone()
        full = unwrapped(full).contiguous()
        return self._funcol("reduce_scatter", _nbytes(full) // self.size,
                            lambda: _funcol_reduce_scatter(full, "sum", 0, self.group))

    def all_reduced(self, x: torch.Tensor) -> torch.Tensor:
        """Sum all-reduce (out of place, functional)."""
        if self.size == 1:
            return x.clone()
        x = unwrapped(x).contiguous()
        return self._funcol("all_reduce", _nbytes(x), lambda: funcol.all_reduce(x, "sum", self.group))


class PendingGather:
    """An all-gather in flight; `wait()` returns the gathered tensor and records the op."""

    def __init__(self, comm: AxisComm, result, nbytes: int, start: float):
        self.comm, self.result, self.nbytes, self.start = comm, result, nbytes, start

    def wait(self) -> torch.Tensor:
        try:
            out = self.result.wait() if isinstance(self.result, funcol.AsyncCollectiveTensor) else self.result
        except (RuntimeError, dist.DistBackendError) as err:
            raise self.comm._error("all_gather", self.start, err) from err
        self.comm.log.record("all_gather", self.comm.name, self.nbytes, time.perf_counter() - self.start,
                             self.comm.size)
        return out


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under torch.func's wrappers.

    Collectives move data and are never differentiated through (the autograd Functions below
    define their own backward), and funcol's own autograd registration fails under torch.func,
    so they always run on the unwrapped tensor.
    """
    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _chunks(n: int, bucket: int):
    if bucket <= 0 or bucket >= n:
        yield 0, n
        return
    for lo in range(0, n, bucket):
        yield lo, min(n, lo + bucket)


# ------------------------------------------------------------------------ autograd functions


class _GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(shard, comm):
        return comm.gathered(shard)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.reduce_scattered(grad), None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(x, comm):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduced(grad), None


class _ReduceInGroup(torch.autograd.Function):
    @staticmethod
    def forward(x, comm):
        return comm.all_reduced(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def gather_shards(shard: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Concatenate every rank's `shard` along dim 0; the gradient is reduce-scattered back."""
    return shard if comm.size == 1 else _GatherShards.apply(shard, comm)


def copy_to_group(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Identity whose gradient is summed over the group (input of a column-parallel layer)."""
    return x if comm.size == 1 else _CopyToGroup.apply(x, comm)


def reduce_in_group(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Sum over the group; the gradient passes through (output of a row-parallel layer)."""
    return x if comm.size == 1 else _ReduceInGroup.apply(x, comm)


def all_gather_objects(obj: Any, what: str) -> list:
    """Every rank's `obj` (small, picklable), in global rank order, over the whole world.

    For agreeing on decisions (did every rank write its file?), not for tensors. A failure
    raises CommError naming `what`.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    start = time.perf_counter()
    try:
        dist.all_gather_object(out, obj)
    except (RuntimeError, dist.DistBackendError) as err:
        raise CommError(f"all_gather_object ({what}) failed after {time.perf_counter() - start:.1f}s on rank "
                        f"{dist.get_rank()}: {err}. A peer rank probably crashed or took another code path.") from err
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else a


__all__ = [
    "AxisComm", "CommError", "CommLog", "all_gather_objects", "bus_bandwidth", "ceil_div", "copy_to_group", "gather_shards",
    "reduce_in_group",
]
