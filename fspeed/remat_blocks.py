"""How a checkpointed block runs: remat's policies, settings and `checkpointed` (below the models that call it).

`checkpointed(remat, fn, *args)` is `torch.utils.checkpoint` (non-reentrant; the step
differentiates with plain autograd) with torch's selective-checkpoint contexts for the policies
(`remat_policies`, as JAX's `checkpoint_policies`); the block's floating inputs are held as
`Remat` says: as they are, on the host, partitioned over the model axis, or in one contiguous
arena. Models call it through `ops.call`; `fspeed.rematerialization` turns a whole Model's
blocks into checkpointed ones and is the public face of both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .host_copies import HostCopies, HostCopy
from .timers import synced_clock

aten = torch.ops.aten
MATMUL_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_cudnn_attention.default,
})


@torch.library.custom_op("fspeed::remat_name", mutates_args=())
def _name_op(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.clone()


@_name_op.register_fake
def _(x, name):
    return torch.empty_like(x)


_name_op.register_autograd(lambda ctx, grad: (grad, None))


def remat_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """`x`, tagged `name` for `remat_policies.save_named(name)` (JAX's `remat_name`); outside
    a remat block it is only a copy."""
    return _name_op(x, name)


@dataclass(frozen=True)
class RematPolicy:
    """Which tensors a checkpointed block saves: `full` none but its inputs, else the outputs of
    `saved_ops`, or of the `remat_name` tags in `names`."""

    name: str
    saved_ops: frozenset = frozenset()
    names: tuple[str, ...] = ()

    def context_fn(self) -> Optional[Callable]:
        if not self.saved_ops and not self.names:
            return None
        saved, names = self.saved_ops, set(self.names)

        def policy(ctx, op, *args, **kwargs):
            if op in saved or (op is torch.ops.fspeed.remat_name.default and args[1] in names):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE
        return lambda: create_selective_checkpoint_contexts(policy)

    def __repr__(self) -> str:
        return f"remat_policies.{self.name}" + (f"{self.names}" if self.names else "")


def save_named(*names: str) -> RematPolicy:
    """Save the tensors tagged with `remat_name(x, name)` for one of `names`; recompute the rest."""
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"save_named needs one or more non-empty tag names, got {names!r}")
    return RematPolicy("save_named", names=tuple(names))


remat_policies = SimpleNamespace(
    full=RematPolicy("full"),
    save_matmuls=RematPolicy("save_matmuls", MATMUL_OPS),
    save_named=save_named,
)
POLICIES = {"full": remat_policies.full, "save_matmuls": remat_policies.save_matmuls}


PHASES = ("forward", "recompute", "backward")
METRIC_KEYS = tuple(f"remat_{phase}_ms" for phase in PHASES)  # a step's totals over its checkpointed blocks


class RematProfile:
    """Per checkpointed block (its unit's name), forward, recompute and backward seconds, summed
    since the last `take()` (DeepSpeed's activation-checkpoint timing, `profile=true`)."""

    def __init__(self):
        self.seconds: dict[str, dict[str, float]] = {}

    def add(self, phase: str, block: str, seconds: float) -> None:
        row = self.seconds.setdefault(block, dict.fromkeys(PHASES, 0.0))
        row[phase] += seconds

    def take(self) -> dict[str, dict[str, float]]:
        """The sums so far in milliseconds ({block: {phase: ms}}), and a fresh start."""
        out = {block: {phase: s * 1e3 for phase, s in row.items()} for block, row in self.seconds.items()}
        self.seconds = {}
        return out

    @staticmethod
    def totals(sums: dict[str, dict[str, float]]) -> dict[str, float]:
        """`sums` (from `take`) summed over the blocks, as metrics (`METRIC_KEYS`)."""
        return {key: sum(row[p] for row in sums.values()) for key, p in zip(METRIC_KEYS, PHASES)}

    @staticmethod
    def merge(into: dict[str, dict[str, float]], sums: dict[str, dict[str, float]]) -> None:
        """Add `sums` (from `take`) into `into`, block by block."""
        for block, row in sums.items():
            mine = into.setdefault(block, dict.fromkeys(PHASES, 0.0))
            for p in PHASES:
                mine[p] += row[p]

    @staticmethod
    def table(sums: dict[str, dict[str, float]]) -> str:
        """`sums` (from `take`) as a table, one row per block and a total."""
        total = {p: sum(row[p] for row in sums.values()) for p in PHASES}
        lines = [f"{'block':<24} {'forward ms':>11} {'recompute ms':>13} {'backward ms':>12}"]
        for block, row in {**sums, "total": total}.items():
            lines.append(f"{block:<24} " + " ".join(f"{row[p]:{w}.1f}" for p, w in zip(PHASES, (11, 13, 12))))
        return "\n".join(lines)


class ContiguousArena:
    """One buffer that every kept block input of a forward is copied into (DeepSpeed's
    `contiguous_memory_optimization`): a bump allocator, back to its start once every input it
    holds has been recomputed, grown (a new buffer) when a forward needs more."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None
        self.offset = self.used = 0
        self.outstanding = 0
        self.allocations = 0  # buffers created so far (one per growth)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        if self.outstanding == 0:
            self.offset = self.used = 0
        need = -(-like.numel() * like.element_size() // 64) * 64  # 64-byte aligned slots
        if self.buffer is None or self.buffer.device != like.device or self.offset + need > self.buffer.numel():
            # big enough for this forward so far and this input: the next forward fits in it
            size = max(self.used + need, 2 * (self.buffer.numel() if self.buffer is not None else 0))
            self.buffer = torch.empty(size, dtype=torch.uint8, device=like.device)
            self.allocations += 1
            self.offset = 0
        view = self.buffer[self.offset:self.offset + like.numel() * like.element_size()]
        view = view.view(like.dtype).view(like.shape)
        self.offset += need
        self.used += need
        self.outstanding += 1
        view.copy_(like.detach())
        return view

    def release(self) -> None:
        self.outstanding -= 1


@dataclass(frozen=True)
class Remat:
    """How checkpointed blocks run: the policy, every k-th block; the kept block inputs on the
    host (`offload`), or 1/t of each on every tensor-slicing rank (`partition`); timing (`profile`);
    a device synchronize at the start and end of each block's forward and backward (`synchronize`,
    DeepSpeed's synchronize_checkpoint_boundary: what a block's time then covers is its own work)."""

    policy: RematPolicy = remat_policies.full
    every: int = 1
    offload: bool = False
    partition: bool = False
    profile: Optional[RematProfile] = None
    contiguous: Optional[ContiguousArena] = None
    synchronize: bool = False
    host_copies: Optional[HostCopies] = field(default=None, compare=False, repr=False)  # made for offload

    def __post_init__(self):
        if self.offload and self.host_copies is None:
            object.__setattr__(self, "host_copies", HostCopies())
        if isinstance(self.policy, str):
            if self.policy not in POLICIES:
                raise ValueError(f"remat policy {self.policy!r} is not one of {sorted(POLICIES)} (or save_named(...))")
            object.__setattr__(self, "policy", POLICIES[self.policy])
        if not isinstance(self.policy, RematPolicy):
            raise TypeError(f"remat policy must be a RematPolicy (fs.remat_policies.*) or its name, "
                            f"got {self.policy!r}")
        if self.contiguous is not None and (self.partition or self.offload):
            raise ValueError("remat: contiguous buffers hold whole inputs on the device; with partition or offload "
                             "(partition_activations, cpu_checkpointing) they are not implemented")
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"remat every={self.every!r}: checkpoint every k-th block needs an integer k >= 1")

    def chosen(self, index: int) -> bool:
        """Whether the block at `index` (0-based, in forward order) is checkpointed."""
        return index % self.every == 0


def checkpointed(remat: Remat, fn: Callable, *args: Any, model_comm: Any = None, label: str = "block",
                 **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` keeping only what `remat.policy` saves (module docstring). Every
    tensor `fn` computes with must come in through its arguments: a recompute in backward sees
    nothing else of the forward's context. The floating tensors among `args[1:]` (and in tuples
    there: a pipeline stage's (hidden, mask)) are the block's inputs (`args[0]` is its parameters):
    kept as they are, on the host (`offload`), or 1/t of them on each rank of `model_comm`
    (`partition`), gathered again for the recompute."""
    states = {i: a.get_state() for i, a in enumerate(args) if isinstance(a, torch.Generator)}
    held = [_hold(a) if i else None for i, a in enumerate(args)]
    inputs = [(h, a) for hs, args_ in zip(held, args) for h, a in zip(_flat(hs), _flat(args_)) if h is not None]
    runs = [0]
    profile = remat.profile
    clock: dict[str, float] = {}
    device = next((h.device for h, _ in inputs), None)
    sync = _synchronizer(device) if remat.synchronize and device is not None else None

    def replayed(*a, **kw):
        recompute = runs[0] > 0  # the block's backward starts with its recompute
        runs[0] += 1
        if sync is not None:
            sync()
        a = [_value(h, x) for h, x in zip(held, a)]
        if recompute and states:  # fresh generators in the state of the first run
            for i, state in states.items():
                g = torch.Generator(device=a[i].device)
                g.set_state(state)
                a[i] = g
        start = synced_clock() if profile is not None else 0.0
        try:
            return fn(*a, **kw)
        finally:  # a recompute ends early (by an exception) once it has what backward needs
            if profile is not None:
                profile.add("recompute" if recompute else "forward", label, synced_clock() - start)
                if recompute:
                    clock["recomputed"] = synced_clock()
            if sync is not None and not recompute:  # the forward's end; the backward's is backward_done
                sync()

    def backward_done(grad: torch.Tensor) -> torch.Tensor:
        if sync is not None:
            sync()
        if profile is not None:
            now = synced_clock()
            profile.add("backward", label, now - clock.get("recomputed", now))
        return grad

    context_fn = remat.policy.context_fn()
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    passed = [_passed(h, a) for h, a in zip(held, args)]
    out = checkpoint(replayed, *passed, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)
    for h, a in inputs:
        if (profile is not None or sync is not None) and a.requires_grad:
            a.register_hook(backward_done)  # the block's backward ends when its input's gradient is done
        if remat.partition:
            h.partition(model_comm, remat.offload)
        elif remat.offload:
            h.offload(remat.host_copies)
        elif remat.contiguous is not None:
            h.into(remat.contiguous)
    return out


def _hold(a: Any) -> Any:
    """A block argument's held form: a `_HeldInput` for a floating tensor, a tuple of them (None for
    the other items) for a tuple of tensors, else None (passed as it is)."""
    def one(t: Any) -> Optional[_HeldInput]:
        return _HeldInput(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else None
    if isinstance(a, tuple):
        held = tuple(one(t) for t in a)
        return held if any(h is not None for h in held) else None
    return one(a)


def _flat(x: Any) -> list:
    return list(x) if isinstance(x, tuple) else [x]


def _passed(h: Any, a: Any) -> Any:
    if isinstance(h, tuple):
        return tuple(_passed(hi, ai) for hi, ai in zip(h, a))
    return a if h is None else h


def _value(h: Any, a: Any) -> Any:
    """What the block's function gets for an argument (`a` as checkpoint hands it back)."""
    if isinstance(h, tuple):
        return tuple(_value(hi, ai) for hi, ai in zip(h, a))
    return a if h is None else h.value()


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """Wait for the work queued on `device` (CUDA's streams; on the CPU, where work runs as it is
    issued, torch.cpu.synchronize returns at once, as DeepSpeed's CPU accelerator does)."""
    module = torch.get_device_module(device)
    return lambda: module.synchronize(device)


class _HeldInput:
    """A checkpointed block's input as the recompute will see it: the tensor itself during the
    forward, then (after it) only its host copy or this rank's 1/t slice. The recompute needs the
    values only: autograd's graph of the forward, which the gradient flows through, keeps the
    tensor's identity without its memory."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor: Optional[torch.Tensor] = tensor
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.requires_grad = tensor.requires_grad  # the recompute records the same graph (the same saved tensors)
        self.host: Optional[HostCopy] = None
        self.copies: Optional[HostCopies] = None
        self.part: Optional[torch.Tensor] = None
        self.comm: Any = None
        self.arena: Optional[ContiguousArena] = None

    def value(self) -> torch.Tensor:
        if self.arena is not None:  # the slot stays valid through this backward; the next forward reuses it
            self.arena = self.arena.release()
            return self.tensor.detach().requires_grad_(self.requires_grad)
        if self.tensor is not None:
            return self.tensor
        if self.host is not None:
            value = self.copies.fetch(self.host)
        else:
            value = self.comm.gathered(self.part.to(self.device, non_blocking=True))[: self.shape.numel()]
        return value.view(self.shape).requires_grad_(self.requires_grad)

    def offload(self, copies: HostCopies) -> None:
        self.host, self.copies, self.tensor = copies.offload(self.tensor), copies, None

    def into(self, arena: ContiguousArena) -> None:
        self.tensor, self.arena = arena.take(self.tensor), arena

    def partition(self, comm: Any, offload: bool) -> None:
        if comm is None or comm.size == 1:
            raise ValueError("remat partition=True (partition_activations) splits checkpointed inputs over the "
                             "'model' axis, and this run has no tensor slicing (model axis size 1)")
        flat = self.tensor.detach().reshape(-1)
        per = -(-flat.numel() // comm.size)
        padded = torch.nn.functional.pad(flat, (0, per * comm.size - flat.numel()))
        part = padded[comm.rank * per:(comm.rank + 1) * per]
        self.part = part.to("cpu", copy=True) if offload else part.clone()  # DeepSpeed: partitioned, then on the host
        self.comm, self.tensor = comm, None
