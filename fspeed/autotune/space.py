"""The layouts the autotuner may try: candidates over ZeRO stage, batch split, remat, offload and mesh.

    space = SearchSpace(zero_stage=(1, 2), remat=("none", "full"))
    found = enumerate_candidates(space, base_run, world=2, facts=ModelFacts(layers=6, heads=4))
    for c in found.candidates: print(c.label(), c.to_overrides())
    for s in found.skipped: print(s.candidate.label(), s.reason)   # never tried, with the reason

A `Candidate` is one complete layout: every searched key of fspeed-train with a concrete value,
so `to_overrides()` reproduces the run's configuration exactly whatever the base set, and
`apply_to(base_run)` builds the same `RunConfig` without Hydra. A value fspeed would refuse is
found by fspeed's own validation (`RunConfig`'s rules: ZeRO-3 with a pipeline, offload below
stage 1, the budget remat with ZeRO-3, a 1-bit optimizer with ZeRO, ...) and by what the model
allows (`ModelFacts`: a pipeline needs layers it can cut, tensor slicing needs rules or a plan and
heads it divides); either way the candidate is kept as a `Skipped` record with the reason.

Axes of a `SearchSpace` left at None take their defaults from the world and the base run; a
tuple restricts the axis to those values (one value fixes it). The remat axis is written as
strings: `none`, `save_matmuls`, `full`, `full:2` (every 2nd block; with a pipeline: groups of 2
layers), `budget:512` (fspeed's budget policy, MiB per micro-batch). The slow mode adds
`overlap_comm` and the two bucket sizes (DeepSpeed's autotuner's ZeRO knobs).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ..config.errors import ConfigError
from ..config.overrides import format_override
from ..config.schema import PIPELINE_SCHEDULES, RunConfig
from ..parallel.schedules import build_schedule

REMAT_POLICIES = ("none", "save_matmuls", "full", "budget")
DEFAULT_REMAT = ("none", "save_matmuls", "full")
DEFAULT_BUCKETS = (50_000_000, 500_000_000)


@dataclass(frozen=True)
class Candidate:
    """One layout of a run: the values of every key the autotuner searches.

    `remat` is a policy of `REMAT_POLICIES`; `remat_every` its interval (every k-th block, or a
    pipeline's groups of k layers); `remat_budget_mib` the budget policy's MiB per micro-batch.
    `data x tensor x pipe` is the world; `micro_batch x grad_accum x data` the global batch; a
    pipeline's micro-batches are the accumulation steps (fspeed-train's rule).
    """

    zero_stage: int
    micro_batch: int
    grad_accum: int
    data: int = 1
    tensor: int = 1
    pipe: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    remat: str = "none"
    remat_every: int = 1
    remat_budget_mib: Optional[float] = None
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: Optional[bool] = None
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000

    @property
    def world(self) -> int:
        return self.data * self.tensor * self.pipe

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.data

    def remat_label(self) -> str:
        """The remat axis' spelling of this candidate's policy (`full:2`, `budget:512`)."""
        if self.remat == "budget":
            return f"budget:{self.remat_budget_mib:g}"
        return self.remat if self.remat_every == 1 else f"{self.remat}:{self.remat_every}"

    def label(self) -> str:
        """A short one-line name: `z2 mb4x2 dp2 remat=full offload=opt`."""
        parts = [f"z{self.zero_stage}", f"mb{self.micro_batch}x{self.grad_accum}", f"dp{self.data}"]
        if self.tensor > 1:
            parts.append(f"tp{self.tensor}")
        if self.pipe > 1:
            chunks = f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pipe}{chunks}:{self.schedule}")
        if self.remat != "none":
            parts.append(f"remat={self.remat_label()}")
        offload = [name for name, on in (("opt", self.offload_optimizer), ("param", self.offload_param)) if on]
        if offload:
            parts.append("offload=" + "+".join(offload))
        if self.overlap_comm is not None:
            parts.append(f"overlap={'on' if self.overlap_comm else 'off'}")
        return " ".join(parts)

    def to_overrides(self) -> list[str]:
        """fspeed-train's overrides for this layout: every searched key, explicitly."""
        pipelined = self.pipe > 1
        policy = "none" if self.remat == "budget" else self.remat
        interval = self.remat_every if pipelined and policy != "none" else 0
        values = {
            "zero.stage": self.zero_stage,
            "zero.offload_optimizer.device": "cpu" if self.offload_optimizer else "none",
            "zero.offload_param.device": "cpu" if self.offload_param else "none",
            "zero.overlap_comm": self.overlap_comm,
            "zero.reduce_bucket_size": self.reduce_bucket_size,
            "zero.allgather_bucket_size": self.allgather_bucket_size,
            "train.train_batch_size": self.global_batch,
            "train.micro_batch_size": self.micro_batch,
            "train.grad_accum": self.grad_accum,
            "parallel.data": self.data,
            "parallel.tensor": self.tensor,
            "parallel.pipe": self.pipe,
            "activation_checkpointing.policy": policy,
            "activation_checkpointing.every": 1 if pipelined or policy == "none" else self.remat_every,
            "activation_checkpointing.budget_mib": self.remat_budget_mib if self.remat == "budget" else None,
            "pipeline.micro_batches": None,
            "pipeline.schedule": self.schedule,
            "pipeline.virtual_stages": self.virtual_stages,
            "pipeline.activation_checkpoint_interval": interval,
        }
        return [format_override(key, value) for key, value in values.items()]

    def apply_to(self, base: RunConfig) -> RunConfig:
        """`base` with this layout, validated by fspeed's own rules (ConfigError if it refuses it)."""
        pipelined = self.pipe > 1
        policy = "none" if self.remat == "budget" else self.remat
        zero = dataclasses.replace(
            base.zero, stage=self.zero_stage, overlap_comm=self.overlap_comm,
            reduce_bucket_size=self.reduce_bucket_size, allgather_bucket_size=self.allgather_bucket_size,
            offload_optimizer=dataclasses.replace(base.zero.offload_optimizer,
                                                  device="cpu" if self.offload_optimizer else "none"),
            offload_param=dataclasses.replace(base.zero.offload_param, device="cpu" if self.offload_param else "none"))
        train = dataclasses.replace(base.train, train_batch_size=self.global_batch, micro_batch_size=self.micro_batch,
                                    grad_accum=self.grad_accum)
        parallel = dataclasses.replace(base.parallel, data=self.data, tensor=self.tensor, pipe=self.pipe)
        remat = dataclasses.replace(
            base.activation_checkpointing, policy=policy,
            every=1 if pipelined or policy == "none" else self.remat_every,
            budget_mib=self.remat_budget_mib if self.remat == "budget" else None)
        pipeline = dataclasses.replace(base.pipeline, micro_batches=None, schedule=self.schedule,
                                       virtual_stages=self.virtual_stages,
                                       activation_checkpoint_interval=self.remat_every
                                       if pipelined and policy != "none" else 0)
        return dataclasses.replace(base, zero=zero, train=train, parallel=parallel, activation_checkpointing=remat,
                                   pipeline=pipeline, dp_world_size=self.data)

    @classmethod
    def from_run_config(cls, run: RunConfig) -> "Candidate":
        """The layout a (validated) run configuration has; `parallel.data` must be set (not -1)."""
        if run.parallel.data < 1:
            raise ValueError("Candidate.from_run_config: parallel.data is -1; the layout needs the data ranks")
        ac, pipelined = run.activation_checkpointing, run.parallel.pipe > 1
        if ac.budget_mib is not None:
            remat, every = "budget", 1
        else:
            remat = ac.policy
            every = run.pipeline.activation_checkpoint_interval if pipelined and remat != "none" else ac.every
        return cls(zero_stage=run.zero.stage, micro_batch=run.batch.micro_batch_size, grad_accum=run.batch.grad_accum,
                   data=run.parallel.data, tensor=run.parallel.tensor, pipe=run.parallel.pipe,
                   schedule=run.pipeline.schedule, virtual_stages=run.pipeline.virtual_stages, remat=remat,
                   remat_every=every, remat_budget_mib=ac.budget_mib,
                   offload_optimizer=run.zero.offload_optimizer.device == "cpu",
                   offload_param=run.zero.offload_param.device == "cpu", overlap_comm=run.zero.overlap_comm,
                   reduce_bucket_size=run.zero.reduce_bucket_size,
                   allgather_bucket_size=run.zero.allgather_bucket_size)


@dataclass(frozen=True)
class Skipped:
    """A layout left out of the search, never tried, and why."""

    candidate: Candidate
    reason: str


@dataclass(frozen=True)
class ModelFacts:
    """What the model allows, found before the search (`fspeed.autotune.profiling.model_facts`).

    `layers`: how many layers a pipeline can cut it into (None: it cannot be cut, `cut_reason`
    says why); `tensor_rules`: whether tensor slicing has rules or a plan for it (`tensor_reason`
    says why not); `heads`: attention heads a tensor size must divide (None: unknown).
    """

    layers: Optional[int] = None
    cut_reason: str = "the model has no layer sequence to cut into pipeline stages"
    tensor_rules: bool = False
    tensor_reason: str = "the model has no tensor-slicing rules or plan"
    heads: Optional[int] = None

    def pipeline_problem(self, pipe: int, virtual_stages: int) -> Optional[str]:
        if pipe == 1:
            return None
        if self.layers is None:
            return f"parallel.pipe={pipe}: {self.cut_reason}"
        if pipe * virtual_stages > self.layers:
            return (f"parallel.pipe={pipe} x pipeline.virtual_stages={virtual_stages} pieces for the model's "
                    f"{self.layers} layers")
        return None

    def tensor_problem(self, tensor: int) -> Optional[str]:
        if tensor == 1:
            return None
        if not self.tensor_rules:
            return f"parallel.tensor={tensor}: {self.tensor_reason}"
        if self.heads is not None and self.heads % tensor:
            return f"parallel.tensor={tensor} does not divide the model's {self.heads} attention heads"
        return None


def parse_remat(text: str) -> tuple[str, int, Optional[float]]:
    """(policy, every, budget MiB) of a remat axis value: `none`, `full`, `save_matmuls:2`, `budget:512`."""
    name, _, arg = str(text).partition(":")
    allowed = "none, save_matmuls, full (each with :k for every k-th block), budget:MiB"
    if name not in REMAT_POLICIES:
        raise ValueError(f"autotune.space.remat: {text!r} is not a remat choice; allowed: {allowed}")
    try:
        if name == "budget":
            budget = float(arg)
            if budget <= 0:
                raise ValueError
            return name, 1, budget
        every = int(arg) if arg else 1
        if every < 1 or (name == "none" and every != 1):
            raise ValueError
    except ValueError:
        raise ValueError(f"autotune.space.remat: {text!r} is not a remat choice; allowed: {allowed}") from None
    return name, every, None


@dataclass(frozen=True)
class SearchSpace:
    """The values each axis may take (None: derived from the world and the base run; see module doc).

    `micro_batch`: None = powers of two dividing the global batch per data rank (with no global
    batch: up to 4x the base's micro-batch), within `micro_batch_min`..`micro_batch_max` (DeepSpeed's
    min/max_train_micro_batch_size_per_gpu; without a global batch the max also sets the limit).
    `grad_accum` applies only when no global batch is fixed (None: the base's). `tensor`, `pipe`:
    None = every size dividing the world the model allows. `slow`: also search `overlap_comm` and
    the bucket sizes (else the base's values).
    """

    zero_stage: tuple[int, ...] = (0, 1, 2, 3)
    micro_batch: Optional[tuple[int, ...]] = None
    grad_accum: Optional[tuple[int, ...]] = None
    remat: tuple[str, ...] = DEFAULT_REMAT
    offload_optimizer: tuple[bool, ...] = (False, True)
    offload_param: tuple[bool, ...] = (False, True)
    tensor: Optional[tuple[int, ...]] = None
    pipe: Optional[tuple[int, ...]] = None
    schedule: tuple[str, ...] = ("1f1b", "zero_bubble")
    virtual_stages: Optional[tuple[int, ...]] = None  # interleaved_1f1b's chunks per stage; None: (2,)
    slow: bool = False
    overlap_comm: Optional[tuple[Optional[bool], ...]] = None  # slow mode; None: (False, True)
    reduce_bucket_size: Optional[tuple[int, ...]] = None  # slow mode; None: DEFAULT_BUCKETS
    allgather_bucket_size: Optional[tuple[int, ...]] = None  # slow mode; None: DEFAULT_BUCKETS
    micro_batch_min: int = 1
    micro_batch_max: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("zero_stage", "micro_batch", "grad_accum", "remat", "offload_optimizer", "offload_param",
                     "tensor", "pipe", "schedule", "virtual_stages", "overlap_comm", "reduce_bucket_size",
                     "allgather_bucket_size"):
            value = getattr(self, name)
            if value is None:
                continue
            values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
            if not values:
                raise ValueError(f"autotune.space.{name}: an empty list leaves nothing to try; give at least one value")
            object.__setattr__(self, name, values)
        _check_values("zero_stage", self.zero_stage, lambda v: v in (0, 1, 2, 3), "0, 1, 2, 3")
        for name in ("micro_batch", "grad_accum", "tensor", "pipe", "reduce_bucket_size", "allgather_bucket_size"):
            _check_values(name, getattr(self, name) or (), _positive_int, "positive integers")
        for name in ("micro_batch_min", "micro_batch_max"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise ValueError(f"autotune.space.{name}={value!r}: allowed: a positive integer")
        if self.micro_batch_max is not None and self.micro_batch_max < self.micro_batch_min:
            raise ValueError(f"autotune.space.micro_batch_max={self.micro_batch_max} is below "
                             f"autotune.space.micro_batch_min={self.micro_batch_min}: no micro-batch is left")
        _check_values("virtual_stages", self.virtual_stages or (), lambda v: _positive_int(v) and v >= 2,
                      "integers >= 2 (interleaved_1f1b's chunks per stage)")
        _check_values("schedule", self.schedule, lambda v: v in PIPELINE_SCHEDULES, ", ".join(PIPELINE_SCHEDULES))
        for name in ("offload_optimizer", "offload_param"):
            _check_values(name, getattr(self, name), lambda v: isinstance(v, bool), "true, false")
        _check_values("overlap_comm", self.overlap_comm or (), lambda v: v is None or isinstance(v, bool),
                      "true, false, null (DeepSpeed's default)")
        self._check_applies()
        for text in self.remat:
            parse_remat(text)


    def _check_applies(self) -> None:
        """An axis restricted where it has no effect is an error, not a silent no-op."""
        if not isinstance(self.slow, bool):
            raise ValueError(f"autotune.space.slow={self.slow!r}: allowed: true, false")
        knobs = [n for n in ("overlap_comm", "reduce_bucket_size", "allgather_bucket_size") if getattr(self, n)]
        if knobs and not self.slow:
            raise ValueError(f"autotune.space.{knobs[0]} is searched in the slow mode only; set autotune.space.slow="
                             "true (or leave it: the base's value is used)")
        if self.virtual_stages is not None and "interleaved_1f1b" not in self.schedule:
            raise ValueError("autotune.space.virtual_stages applies to the schedule interleaved_1f1b, which "
                             f"autotune.space.schedule={list(self.schedule)} leaves out")

    def knob_values(self) -> tuple[tuple[Optional[bool], ...], tuple[int, ...], tuple[int, ...]]:
        """The slow mode's overlap_comm and bucket sizes (their defaults where not restricted)."""
        return (self.overlap_comm or (False, True), self.reduce_bucket_size or DEFAULT_BUCKETS,
                self.allgather_bucket_size or DEFAULT_BUCKETS)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_values(name: str, values: Iterable[object], ok, allowed: str) -> None:
    bad = [v for v in values if not ok(v)]
    if bad:
        raise ValueError(f"autotune.space.{name}: {bad[0]!r} is not allowed; allowed: {allowed}")


@dataclass(frozen=True)
class Enumerated:
    """The candidates to consider, in enumeration order, and the ones left out with their reasons."""

    candidates: tuple[Candidate, ...]
    skipped: tuple[Skipped, ...]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batches(space: SearchSpace, per_rank: Optional[int], base_micro: int) -> list[int]:
    if space.micro_batch is not None:
        sizes = list(space.micro_batch)
    else:
        limit = per_rank if per_rank is not None else space.micro_batch_max or 4 * base_micro
        sizes = [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]
        sizes = [m for m in sizes if per_rank is None or per_rank % m == 0]
    top = space.micro_batch_max if space.micro_batch_max is not None else max(sizes)
    return [m for m in sizes if space.micro_batch_min <= m <= top]


def _meshes(space: SearchSpace, world: int) -> list[tuple[int, int]]:
    tensors = space.tensor if space.tensor is not None else _divisors(world)
    pipes = space.pipe if space.pipe is not None else _divisors(world)
    return [(t, p) for t in tensors for p in pipes]


def _pipeline_shapes(space: SearchSpace, pipe: int) -> list[tuple[str, int]]:
    if pipe == 1:
        return [("1f1b", 1)]
    chunks = space.virtual_stages or (2,)
    return [(s, v) for s in space.schedule for v in (chunks if s == "interleaved_1f1b" else (1,))]


def _zero_knobs(space: SearchSpace, base: RunConfig) -> list[tuple[Optional[bool], int, int]]:
    if not space.slow:
        return [(base.zero.overlap_comm, base.zero.reduce_bucket_size, base.zero.allgather_bucket_size)]
    return list(itertools.product(*space.knob_values()))


def enumerate_candidates(space: SearchSpace, base: RunConfig, world: int, facts: ModelFacts,
                         global_batch: Optional[int] = None) -> Enumerated:
    """Every layout of `space` for `world` ranks, split into those fspeed and the model allow and
    those skipped with the reason. `global_batch`: the fixed global batch (None: the base's
    `train.train_batch_size` when set there, else free: micro-batch x accumulation steps vary)."""
    if not _positive_int(world):
        raise ValueError(f"world={world!r}: the number of ranks must be a positive integer")
    if global_batch is None:
        global_batch = base.train.train_batch_size
    if global_batch is not None and space.grad_accum is not None:
        raise ValueError(f"autotune.space.grad_accum: the global batch is fixed (train.train_batch_size="
                         f"{global_batch}), so the accumulation follows from the micro-batch; restrict "
                         "autotune.space.micro_batch instead")
    kept: dict[Candidate, None] = {}
    skipped: dict[Candidate, str] = {}
    for tensor, pipe in _meshes(space, world):
        data = world // (tensor * pipe) if world % (tensor * pipe) == 0 else 0
        per_rank = global_batch // data if data and global_batch is not None and global_batch % data == 0 else None
        micros = _micro_batches(space, per_rank, base.batch.micro_batch_size) if data else [1]
        for stage, micro, remat, offload, knobs, (schedule, chunks) in itertools.product(
                space.zero_stage, micros, space.remat, itertools.product(space.offload_optimizer, space.offload_param),
                _zero_knobs(space, base), _pipeline_shapes(space, pipe)):
            policy, every, budget = parse_remat(remat)
            for accum in _accumulations(space, base, global_batch, micro, max(data, 1)):
                candidate = Candidate(stage, micro, accum, data=max(data, 1), tensor=tensor, pipe=pipe,
                                      schedule=schedule, virtual_stages=chunks, remat=policy, remat_every=every,
                                      remat_budget_mib=budget, offload_optimizer=offload[0],
                                      offload_param=offload[1], overlap_comm=knobs[0], reduce_bucket_size=knobs[1],
                                      allgather_bucket_size=knobs[2])
                if candidate in kept or candidate in skipped:
                    continue
                reason = _refusal(candidate, base, world, facts, global_batch, data)
                if reason is None:
                    kept[candidate] = None
                else:
                    skipped[candidate] = reason
    return Enumerated(tuple(kept), tuple(Skipped(c, r) for c, r in skipped.items()))


def _accumulations(space: SearchSpace, base: RunConfig, global_batch: Optional[int], micro: int,
                   data: int) -> Sequence[int]:
    if global_batch is None:
        return space.grad_accum or (base.batch.grad_accum,)
    return (max(global_batch // (micro * data), 1),)


def _refusal(candidate: Candidate, base: RunConfig, world: int, facts: ModelFacts,
             global_batch: Optional[int], data: int) -> Optional[str]:
    """Why fspeed or the model would refuse `candidate` (None: it may be tried)."""
    c = candidate
    if not data:
        return (f"parallel.tensor={c.tensor} x parallel.pipe={c.pipe} = {c.tensor * c.pipe} ranks per model replica "
                f"do not divide the world of {world}")
    if global_batch is not None and c.global_batch != global_batch:
        return (f"train.micro_batch_size={c.micro_batch} x {c.data} data rank(s) does not divide the global batch "
                f"{global_batch}")
    problem = facts.pipeline_problem(c.pipe, c.virtual_stages) or facts.tensor_problem(c.tensor)
    if problem:
        return problem
    if c.pipe > 1:
        try:
            build_schedule(c.schedule, c.pipe, c.grad_accum, c.virtual_stages)
        except ValueError as err:
            return f"pipeline.schedule={c.schedule}: {err}"
    try:
        c.apply_to(base)
    except ConfigError as err:
        return "; ".join(p.render() for p in err.problems)
    return None


__all__ = ["Candidate", "Enumerated", "ModelFacts", "SearchSpace", "Skipped", "enumerate_candidates", "parse_remat"]
