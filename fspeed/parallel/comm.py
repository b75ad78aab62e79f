"""The communication layer: every collective fspeed issues goes through here.

`AxisComm` binds one mesh axis's process group. Its plain methods work on flat contiguous
buffers (gloo silently reduces strided views wrong, so anything else is refused), split them into
buckets, launch the buckets asynchronously and wait for them together. Its autograd-aware
functions are `torch.autograd.Function`s with a separate `setup_context` and their own backward,
which compose with `torch.func.grad` (a c10d call differentiated by autograd gives silently local
gradients there, and torch's own autograd collectives raise); in forward and backward they call
c10d on the plain tensors below torch.func's transforms. Every collective is a c10d one: torch's
functional collectives on gloo hang, now and then, with any other collective in flight (a ZeRO-3
prefetch beside the reduce-scatters: 2 ranks hung twice in 480 runs of a test's case, none in 960
since; a loop of them beside reduce-scatters, within 1000-4000 iterations; c10d's own never did):

    copy_to_group     forward identity,         backward all-reduce     (Megatron's f)
    reduce_in_group   forward all-reduce,       backward identity       (Megatron's g)
    gather_from_group forward all-gather (last dim), backward this rank's slice

Every call is recorded in the mesh's `CommLog` (DeepSpeed's comms_logger: op, message size,
count, latency, algbw, busbw, and a timeline of issue and wait times), and a failure or timeout
raises `CommError` naming the op, the axis and its ranks instead of hanging. Asynchronous
collectives (`start_*`) return a `Pending`, recorded when waited for: gradient buckets overlap
backward this way.
"""

from __future__ import annotations

import atexit
import functools
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from ..torch_internals import below_functorch, unwrapped


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


class CommEvent(NamedTuple):
    """One collective on the timeline (`time.perf_counter()` seconds): issued, and done waiting;
    `blocked` is how long the caller waited for it (less than `waited - issued` when it ran
    asynchronously while other work went on)."""

    op: str
    axis: str
    nbytes: int
    issued: float
    waited: float
    blocked: float


@dataclass
class CommLog:
    """Records of every collective: `records[op][message bytes] -> list of latencies (s)`, and the
    timeline of `events` (`CommEvent`: issue and wait times, time blocked).

    `enabled=False` keeps only byte counts (cheap); `verbose=True` prints each op as it happens.
    """

    enabled: bool = True
    verbose: bool = False
    records: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    bytes_by_op: dict = field(default_factory=lambda: defaultdict(int))
    blocked_by_op: dict = field(default_factory=lambda: defaultdict(float))  # seconds callers waited, always kept
    world_by_op: dict = field(default_factory=dict)
    events: list = field(default_factory=list)

    def record(self, op: str, axis: str, nbytes: int, seconds: float, world: int, *,
               issued: Optional[float] = None, blocked: Optional[float] = None) -> None:
        """One finished collective: `seconds` from issue to done; `blocked` (default: all of it)."""
        self.bytes_by_op[op] += nbytes
        self.blocked_by_op[op] += seconds if blocked is None else blocked
        if not self.enabled:
            return
        self.records[op][nbytes].append(seconds)
        self.world_by_op[op] = world
        waited = time.perf_counter()
        self.events.append(CommEvent(op, axis, nbytes, waited - seconds if issued is None else issued, waited,
                                     seconds if blocked is None else blocked))
        if self.verbose:
            algbw, busbw = bus_bandwidth(op, nbytes, seconds, world)
            print(f"comm: {op} ({axis}) {_human(nbytes)} {seconds * 1e3:.2f} ms algbw {algbw:.2f} Gbps "
                  f"busbw {busbw:.2f} Gbps")

    def reset(self) -> None:
        self.records.clear()
        self.bytes_by_op.clear()
        self.blocked_by_op.clear()
        self.events.clear()

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
    for), so single-process code runs the same path. The `start_*` methods launch a collective
    and return a `Pending` at once; its `wait()` records it (issue time, time blocked).
    """

    def __init__(self, name: str, group: Optional[dist.ProcessGroup], ranks: Sequence[int], log: CommLog,
                 rank: int = 0):
        self.name = name
        self.group = group
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.global_rank = rank
        self.rank = self.ranks.index(rank) if self.size > 1 else 0
        self.log = log

    def __repr__(self) -> str:
        return f"AxisComm({self.name!r}, rank {self.rank} of {self.size}, global ranks {list(self.ranks)})"

    @functools.cached_property
    def backend(self) -> str:
        return str(dist.get_backend(self.group)) if self.size > 1 else ""

    # -- plain collectives on flat buffers -------------------------------------------------

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError(
                    f"{op} on axis {self.name!r} needs contiguous buffers (gloo reduces strided views wrong, "
                    f"silently); got shape {list(t.shape)} with strides {t.stride()}"
                )

    def _start(self, op: str, nbytes: int, launch: Callable[[], Any], keep: Any = None,
               result: Optional[torch.Tensor] = None) -> "Pending":
        start = time.perf_counter()
        try:
            work = launch()
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._error(op, start, err) from err
        return Pending(self, op, nbytes, start, work, keep, result)

    def _error(self, op: str, start: float, err: Exception) -> CommError:
        return CommError(
            f"{op} over mesh axis {self.name!r} (global ranks {list(self.ranks)}) failed after "
            f"{time.perf_counter() - start:.1f}s on rank {self.global_rank}: {err}. A peer rank probably "
            "crashed, was killed, or took another code path; check the other ranks' logs."
        )

    def start_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> "Pending":
        """Launch an in-place all-reduce of a contiguous tensor (sum, max, min, avg)."""
        if self.size == 1:
            return Pending.done(self)
        self._check("all_reduce", tensor)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                     "avg": dist.ReduceOp.AVG}[op]
        return self._start("all_reduce", _nbytes(tensor),
                           lambda: dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True))

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of a contiguous tensor (sum, max, min, avg)."""
        self.start_all_reduce(tensor, op).wait()
        return tensor

    def start_reduce(self, tensor: torch.Tensor, owner: int) -> "Pending":
        """Launch a sum-reduce of a contiguous tensor onto axis rank `owner` (in place there; the
        other ranks' buffers are scratch afterwards): ZeRO-1/2's reduction into a partition."""
        if self.size == 1:
            return Pending.done(self)
        self._check("reduce", tensor)
        dst = self.ranks[owner]
        if self.size == 2 and self.backend == "gloo":  # one peer: a send, and an add on the owner
            return self._start("reduce", _nbytes(tensor), lambda: _ReduceFromPeer(self, tensor, owner), keep=tensor)
        return self._start("reduce", _nbytes(tensor),
                           lambda: dist.reduce(tensor, dst=dst, group=self.group, async_op=True))

    def start_reduce_scatter(self, full: torch.Tensor, out: torch.Tensor) -> "Pending":
        """Launch a sum-reduce-scatter of `full` ([size * P]) into this rank's `out` ([P])."""
        if full.numel() != out.numel() * self.size:
            raise ValueError(f"reduce_scatter on {self.name!r}: input has {full.numel()} elements, "
                             f"output {out.numel()}, axis size {self.size}")
        if self.size == 1:
            out.copy_(full)
            return Pending.done(self)
        self._check("reduce_scatter", full, out)
        return self._start("reduce_scatter", _nbytes(out),
                           lambda: dist.reduce_scatter_single(out, full, group=self.group, async_op=True), keep=full)

    def broadcast_(self, tensor: torch.Tensor, source: int = 0) -> torch.Tensor:
        """In-place broadcast of a contiguous tensor from axis rank `source`."""
        if self.size == 1:
            return tensor
        self._check("broadcast", tensor)
        src = self.ranks[source]
        self._start("broadcast", _nbytes(tensor),
                    lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True)).wait()
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
        pending = []
        for lo, hi in _chunks(out.numel(), bucket_elems):
            src = full if (lo, hi) == (0, out.numel()) else rows[:, lo:hi].contiguous().view(-1)
            pending.append(self.start_reduce_scatter(src, out[lo:hi]))
        for p in pending:
            p.wait()
        return out

    def all_gather(self, part: torch.Tensor, out: torch.Tensor, bucket_elems: int = 0) -> torch.Tensor:
        """Gather every rank's `part` [P] into `out` [size * P] (rank order), in buckets."""
        self.start_all_gather(part, out, bucket_elems).wait()
        return out

    def start_all_gather(self, part: torch.Tensor, out: torch.Tensor, bucket_elems: int = 0) -> "GatherInFlight":
        """`all_gather` started bucket by bucket and not waited for: `part` must not change and
        `out` must not be read until the buckets covering it are waited (`GatherInFlight`)."""
        if out.numel() != part.numel() * self.size:
            raise ValueError(f"all_gather on {self.name!r}: input has {part.numel()} elements, "
                             f"output {out.numel()}, axis size {self.size}")
        if self.size == 1:
            out.copy_(part)
            return GatherInFlight(out, [])
        self._check("all_gather", part, out)
        chunks, n = list(_chunks(part.numel(), bucket_elems)), part.numel()
        if len(chunks) == 1:
            pending = self._start("all_gather", _nbytes(part),
                                  lambda: dist.all_gather_single(out, part, group=self.group, async_op=True))
            return GatherInFlight(out, [(((0, out.numel()),), pending, None)])
        staged = []
        for lo, hi in chunks:
            buf = torch.empty(self.size * (hi - lo), dtype=out.dtype, device=out.device)
            piece = part[lo:hi].contiguous()
            pending = self._start("all_gather", _nbytes(piece),
                                  lambda buf=buf, piece=piece: dist.all_gather_single(buf, piece, group=self.group,
                                                                                      async_op=True), keep=piece)
            # .data: a plain memory write, no version bump of views taken meanwhile
            land = lambda buf=buf, lo=lo, hi=hi: out.data.view(self.size, -1)[:, lo:hi].copy_(buf.view(self.size, -1))
            staged.append((tuple((r * n + lo, r * n + hi) for r in range(self.size)), pending, land))
        return GatherInFlight(out, staged)

    def start_gather_by_broadcast(self, out: torch.Tensor, pieces: Sequence[tuple[int, int]],
                                  prepare: Optional[Callable[[int, int], None]] = None) -> "GatherInFlight":
        """All-gather `out` ([size * P]) in place, rank r's part `out[r*P:(r+1)*P]` being already
        there on rank r: one broadcast per piece `(a, b)` of `out` (each within one rank's part),
        from that part's owner, in the order given; not waited for (`GatherInFlight`).
        `prepare(a, b)` runs before each piece's broadcast is issued (ZeRO-1/2 update their own
        pieces there, so the first pieces travel while the rest is updated). The caller
        orders the pieces as it will read them (ZeRO-1/2: the forward's order), where an
        all-gather's first bucket carries a slice of every rank's part; on gloo broadcasts also move
        the data faster (2 ranks, 13.8M fp32 elements in 2M buckets, compute running: the first
        3.2M land after 8 ms against 23, all of it after 34 against 49)."""
        if out.numel() % self.size:
            raise ValueError(f"gather on {self.name!r}: {out.numel()} elements do not split into {self.size} parts")
        part = out.numel() // self.size
        for a, b in pieces:
            if not (0 <= a < b <= out.numel() and a // part == (b - 1) // part):
                raise ValueError(f"gather on {self.name!r}: piece [{a}, {b}) is not within one rank's part "
                                 f"(parts of {part} elements)")
        if self.size == 1:
            for a, b in pieces if prepare is not None else ():
                prepare(a, b)
            return GatherInFlight(out, [])
        self._check("broadcast", out)
        chunks = []
        for a, b in pieces:
            if prepare is not None:
                prepare(a, b)
            piece, src = out[a:b], self.ranks[a // part]
            chunks.append((((a, b),), self._start(
                "broadcast", _nbytes(piece),
                lambda piece=piece, src=src: dist.broadcast(piece, src=src, group=self.group, async_op=True)), None))
        return GatherInFlight(out, chunks)

    def all_to_all(self, send: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Equal-split all-to-all: chunk i of `send` ([size * C]) goes to rank i; chunk j of `out`
        comes from rank j. Logged with the per-rank input size, as DeepSpeed's all_to_all_single."""
        if send.numel() != out.numel() or send.numel() % self.size:
            raise ValueError(f"all_to_all on {self.name!r}: input has {send.numel()} elements, output "
                             f"{out.numel()}; both must be equal and divisible by the axis size {self.size}")
        if self.size == 1:
            return out.copy_(send)
        self._check("all_to_all", send, out)
        self._start("all_to_all", _nbytes(send),
                    lambda: dist.all_to_all_single(out, send, group=self.group, async_op=True)).wait()
        return out

    # -- point to point (pipeline stages) ----------------------------------------------------

    def start_send(self, tensor: torch.Tensor, peer: int) -> "Pending":
        """Launch a send of a contiguous tensor to axis rank `peer`; keep the Pending until it is done."""
        self._check("send", tensor)
        return self._start("send", _nbytes(tensor),
                           lambda: dist.isend(tensor, dst=self.ranks[peer], group=self.group), keep=tensor)

    def recv_(self, out: torch.Tensor, peer: int, what: str) -> torch.Tensor:
        """Receive into the contiguous `out` from axis rank `peer`; a failure or timeout names `what`
        (the tensor, its micro-batch and the peer stage) besides the op and the axis."""
        return self.finish_recv(self.start_recv(out, peer), out, what)

    def start_recv(self, out: torch.Tensor, peer: int) -> "Pending":
        """Post a receive into the contiguous `out` from axis rank `peer` without waiting (a receive
        posted early lets the transfer land while this rank computes)."""
        self._check("recv", out)
        return self._start("recv", _nbytes(out), lambda: dist.irecv(out, src=self.ranks[peer], group=self.group),
                           keep=out)

    @staticmethod
    def finish_recv(pending: "Pending", out: torch.Tensor, what: str) -> torch.Tensor:
        """Wait for a receive `start_recv` posted into `out`; a failure or timeout names `what`."""
        try:
            pending.wait()
        except CommError as err:
            raise CommError(f"while receiving {what}: {err}") from err
        return out

    # -- out-of-place collectives, used inside autograd Functions ----------------------------

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        """All-gather along dim 0 (out of place)."""
        if self.size == 1:
            return shard.clone()
        return self.start_gather(shard).wait()

    def start_gather(self, shard: torch.Tensor) -> "Pending":
        """Start an all-gather along dim 0 without waiting (ZeRO-3 prefetch); `.wait()` returns it."""
        shard = unwrapped(shard).contiguous()
        with below_functorch():  # c10d on plain tensors, also inside a torch.func transform
            out = shard.new_empty((self.size * shard.shape[0], *shard.shape[1:]))
            return self._start("all_gather", _nbytes(shard),
                               lambda: dist.all_gather_single(out, shard, group=self.group, async_op=True),
                               keep=shard, result=out)

    def reduce_scattered(self, full: torch.Tensor) -> torch.Tensor:
        """Sum-reduce-scatter along dim 0 (out of place)."""
        if self.size == 1:
            return full.clone()
        with below_functorch():
            full = unwrapped(full).contiguous()
            out = full.new_empty((full.shape[0] // self.size, *full.shape[1:]))
            self.start_reduce_scatter(full, out).wait()
        return out

    def all_reduced(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce (out of place; sum, max, min, avg)."""
        if self.size == 1:
            return x.clone()
        with below_functorch():
            out = unwrapped(x).contiguous().clone()
            self.all_reduce_(out, op)
        return out


class _ReduceFromPeer:
    """A sum-reduce onto `owner` over two ranks as a send and a receive: the owner adds what it
    received when waited. On gloo this takes half the time of its reduce (2 ranks, 7.1 MB: 3.2
    against 6.3-8.3 ms), and ZeRO-1's backward 12-15 ms less on a 6-layer GPT-2 of width 384."""

    def __init__(self, comm: AxisComm, tensor: torch.Tensor, owner: int):
        self.tensor = tensor
        if comm.rank == owner:
            self.received: Optional[torch.Tensor] = torch.empty_like(tensor)
            self.work = dist.irecv(self.received, src=comm.ranks[1 - owner], group=comm.group)
        else:
            self.received = None
            self.work = dist.isend(tensor, dst=comm.ranks[owner], group=comm.group)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        self.work.wait()
        if self.received is not None:
            self.tensor.add_(self.received)
            self.received = None


class GatherInFlight:
    """A gather into `out` in flight, bucket by bucket (`AxisComm.start_all_gather`,
    `start_gather_by_broadcast`): ZeRO-1/2 start the gather of the updated parameters at the end of a
    step and the next forward waits for each unit's buckets as it reaches the unit.
    `wait_range(a, b)` completes the buckets that write any of `out[a:b]`; `wait()` completes them all."""

    def __init__(self, out: torch.Tensor, chunks: list):
        self.out = out
        # per bucket: (the ranges of `out` it writes, its Pending, what lands it from a staging
        # buffer or None), None once done
        self.chunks = chunks
        if chunks:
            for landed in [g for g in _UNWAITED if g.landed]:  # what a dropped state left: finish it
                landed.wait()
            _UNWAITED.add(self)

    @property
    def done(self) -> bool:
        return all(c is None for c in self.chunks)

    @property
    def landed(self) -> bool:
        """Every bucket has arrived (waiting would not block)."""
        return all(c is None or c[1].landed for c in self.chunks)

    def extend(self, other: "GatherInFlight") -> None:
        """Take over the buckets of `other` (a gather into the same buffer), waited with these."""
        if other.out.data_ptr() != self.out.data_ptr():
            raise ValueError("GatherInFlight.extend: the gathers write different buffers")
        self.chunks += other.chunks
        other.chunks = []
        _UNWAITED.discard(other)
        if self.chunks and not self.done:
            _UNWAITED.add(self)

    def wait_range(self, start: int, stop: int) -> None:
        for k, chunk in enumerate(self.chunks):
            if chunk is not None and any(a < stop and start < b for a, b in chunk[0]):
                self._finish(k)

    def wait(self) -> None:
        for k in range(len(self.chunks)):
            self._finish(k)

    def _finish(self, k: int) -> None:
        chunk = self.chunks[k]
        if chunk is None:
            return
        _, pending, land = chunk
        pending.wait()
        if land is not None:
            land()
        self.chunks[k] = None
        if self.done:
            _UNWAITED.discard(self)


# Process-group state: the gathers not waited for yet, held here even when their state is dropped.
# A run may end without reading its last ZeRO-1/2 parameter gather, and gloo kills a process that
# exits with a collective never waited (std::terminate, exit code -6, after all its work was done),
# so what is left is waited at exit, even after the process group was destroyed (measured: the wait
# still succeeds then, and the exit is clean).
_UNWAITED: set[GatherInFlight] = set()
# The gathers waited at exit, with their buffers and gloo works: gloo's worker thread drops its own
# reference to a work just after the work completes; were it the last, the work's tensors would be
# freed on that thread, which needs the GIL, and a thread taking the GIL once the interpreter is
# finalizing ends itself inside C++ (std::terminate, exit code -6). Held here, they are freed by
# the main thread as the interpreter tears down (seen: 1 exit in 10 aborted before).
_HELD_TO_THE_END: list = []


@atexit.register
def _settle_communication_at_exit() -> None:
    """Wait what is left, then tear the process group down while the interpreter still runs (its
    gloo threads joined in order, not destroyed running as the process ends)."""
    for gather in list(_UNWAITED):
        _HELD_TO_THE_END.append((gather, list(gather.chunks)))
        try:
            gather.wait()
        except RuntimeError:  # a peer already gone (CommError): nothing is left to save
            pass
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class Pending:
    """A collective in flight. `wait()` blocks until it is done, records it (issue time, time
    blocked) and returns its result: the output tensor of an out-of-place collective, else None."""

    __slots__ = ("comm", "op", "nbytes", "issued", "work", "keep", "result", "finished")

    def __init__(self, comm: AxisComm, op: str, nbytes: int, issued: float, work: Any, keep: Any = None,
                 result: Optional[torch.Tensor] = None):
        self.comm, self.op, self.nbytes, self.issued, self.work = comm, op, nbytes, issued, work
        self.keep = keep  # inputs that must stay alive until the collective is done
        self.result = result  # the output of an out-of-place collective, returned by `wait()`
        self.finished = False

    @classmethod
    def done(cls, comm: AxisComm) -> "Pending":
        pending = cls(comm, "", 0, 0.0, None)
        pending.finished = True
        return pending

    def wait(self) -> Optional[torch.Tensor]:
        if self.finished:
            return self.result
        start = time.perf_counter()
        try:
            if self.work is not None:
                self.work.wait()
        except (RuntimeError, dist.DistBackendError) as err:
            raise self.comm._error(self.op, self.issued, err) from err
        now = time.perf_counter()
        self.comm.log.record(self.op, self.comm.name, self.nbytes, now - self.issued, self.comm.size,
                             issued=self.issued, blocked=now - start)
        self.finished, self.keep = True, None
        return self.result

    @property
    def landed(self) -> bool:
        """Done, or done in the backend and only not waited for yet (so `wait()` would not block)."""
        return self.finished or not hasattr(self.work, "is_completed") or self.work.is_completed()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _chunks(n: int, bucket: int):
    if bucket <= 0 or bucket >= n:
        yield 0, n
        return
    for lo in range(0, n, bucket):
        yield lo, min(n, lo + bucket)


# ------------------------------------------------------------------------ autograd functions


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


class _AllReduceMax(torch.autograd.Function):
    """Max over the group, not differentiated (the stabilizing max of the vocab-parallel softmax)."""

    @staticmethod
    def forward(x, comm):
        return comm.all_reduced(x, "max")

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx, grad):
        return None, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(x, comm):
        gathered = comm.gathered(x.movedim(-1, 0).contiguous())
        return gathered.movedim(0, -1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.comm.size, dim=-1)[ctx.comm.rank].contiguous(), None


class _SplitToGroup(torch.autograd.Function):
    @staticmethod
    def forward(x, comm):
        return x.chunk(comm.size, dim=-1)[comm.rank].contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.gathered(grad.movedim(-1, 0).contiguous()).movedim(0, -1), None


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


def copy_to_group(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Identity whose gradient is summed over the group (input of a column-parallel layer)."""
    return x if comm.size == 1 else _CopyToGroup.apply(x, comm)


def gather_from_group(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dim; the gradient keeps this rank's part
    (Megatron's gather: a column-parallel layer's output made whole)."""
    return x if comm.size == 1 else _GatherFromGroup.apply(x, comm)


def split_to_group(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """This rank's slice of `x` along the last dim; the gradient is every rank's concatenated
    (Megatron's scatter: a whole input entering a row-parallel layer)."""
    return x if comm.size == 1 else _SplitToGroup.apply(x, comm)


def reduce_in_group(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Sum over the group; the gradient passes through (output of a row-parallel layer)."""
    return x if comm.size == 1 else _ReduceInGroup.apply(x, comm)


def all_reduce_max(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Elementwise max over the group; not differentiated."""
    return x if comm.size == 1 else _AllReduceMax.apply(x, comm)


def all_gather_objects(obj: Any, what: str, world_size: int, rank: int,
                       group: Optional[dist.ProcessGroup] = None) -> list:
    """Every rank's `obj` (small, picklable), in global rank order, over the whole world of
    `world_size` ranks (`Mesh.all_gather_objects` passes its own), on `group` (default: the world's).

    For agreeing on decisions (did every rank write its file?), not for tensors. A failure
    raises CommError naming `what`.
    """
    if world_size == 1:
        return [obj]
    out: list = [None] * world_size
    start = time.perf_counter()
    try:
        dist.all_gather_object(out, obj, group=group)
    except (RuntimeError, dist.DistBackendError) as err:
        raise CommError(f"all_gather_object ({what}) failed after {time.perf_counter() - start:.1f}s on rank "
                        f"{rank}: {err}. A peer rank probably crashed or took another code path.") from err
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else a


__all__ = [
    "AxisComm", "CommError", "CommEvent", "CommLog", "Pending", "all_gather_objects", "all_reduce_max",
    "bus_bandwidth", "ceil_div", "copy_to_group", "gather_from_group", "reduce_in_group", "unwrapped",
]
