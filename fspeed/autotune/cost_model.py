"""Each candidate's step time, predicted from measured parts, so only the promising ones become trials.

    links = measure_collectives(world=2)                      # latency and bandwidth of each collective
    cost = predict_step(candidate, profile, links)
    cost.seconds, cost.parts                                   # {"compute": .., "zero comm": .., "optimizer": ..}

The parts of a step, each from a measurement:

- compute: a micro-batch's forward and backward on one process under the candidate's remat
  (`Profile.micro_seconds`, linear in the micro-batch: its fixed part is the dispatch every
  micro-batch pays again), times the accumulation steps, split over tensor-slicing ranks; with a
  pipeline, the schedule simulator (`fspeed.parallel.schedules.simulate`) over the stages' summed
  layer forward, backward and weight-gradient times (`Profile.layer_costs`), each stage's sends
  of its output and of the gradient back added to its F and B;
- tensor slicing: two all-reduces of a block's output in forward and two in backward per block;
- ZeRO communication per step, from the bytes each stage moves (stage 0: one all-reduce of the
  gradients; 1: their reduction and an all-gather of the updated partition; 2: a reduction every
  micro-batch and the all-gather; 3: every micro-batch two all-gathers of the parameters and a
  reduce-scatter of the gradients), in bucket-sized collectives (each pays the latency); with
  `overlap_comm` what fits under backward is hidden, the last bucket is not;
- the optimizer update of the rank's partition (`Profile.optimizer_s_per_element`); with
  ZeRO-Offload the copies of the gradients down and the parameters up (`host_copy_s_per_byte`).

Data loading is left out: at a fixed global batch it differs between layouts only by the rows per
rank, which the trials measure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from ..parallel.schedules import build_schedule, simulate
from .profiling import Profile
from .space import Candidate

MAX_RECOMPUTE = 2.0  # a backward that recomputes its forward: at most (F + F + B) / B of it, B >= F
BACKWARD_SHARE = 2 / 3  # of a forward + backward: the backward's (two matmuls per forward one)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send")


@dataclass(frozen=True)
class LinkCost:
    """One collective's cost on an axis: `latency_s + bytes * s_per_byte` (bytes: the message
    `bus_bandwidth` names: the whole buffer of an all-reduce, the per-rank part of a gather)."""

    latency_s: float
    s_per_byte: float

    def seconds(self, nbytes: float, calls: int = 1) -> float:
        return calls * self.latency_s + nbytes * self.s_per_byte


@dataclass(frozen=True)
class CommCosts:
    """The collectives of a mesh: per axis ("data", "model", "pipe"), per op of `COLLECTIVES`."""

    axes: Mapping[str, Mapping[str, LinkCost]]

    def seconds(self, axis: str, op: str, nbytes: float, size: int, calls: int = 1) -> float:
        """Seconds of `calls` collectives moving `nbytes` in all on an axis of `size` ranks (0 alone)."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        links = self.axes.get(axis) or next(iter(self.axes.values()))
        return links[op].seconds(nbytes, max(calls, 1))


@dataclass(frozen=True)
class StepCost:
    """A candidate's predicted seconds per optimizer step and its parts."""

    candidate: Candidate
    seconds: float
    parts: dict[str, float] = field(default_factory=dict)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _remat_key(candidate: Candidate, profile: Profile) -> tuple[str, int]:
    if candidate.remat == "budget":
        from .memory_model import budget_choice  # noqa: PLC0415 (the budget's pick is the memory model's)

        return budget_choice(profile, candidate.remat_budget_mib, candidate.micro_batch)[0]
    return candidate.remat, candidate.remat_every


def zero_comm_seconds(candidate: Candidate, profile: Profile, links: CommCosts, backward_s: float) -> float:
    """Exposed seconds of ZeRO's collectives in one step (module docstring)."""
    c = candidate
    psi = profile.parameters / (c.tensor * c.pipe)
    pb = _dtype_bytes(profile.precision.param_dtype)
    gb = _dtype_bytes(profile.precision.grad_accum_dtype)
    d = c.data
    grads, params = psi * gb, psi * pb
    reduce_bucket = max(c.reduce_bucket_size * gb, 1)
    gather_bucket = max(c.allgather_bucket_size * pb, 1)

    def calls(nbytes: float, bucket: float) -> int:
        return max(1, math.ceil(nbytes / bucket))

    if c.zero_stage == 0:
        comm = links.seconds("data", "all_reduce", grads, d, calls(grads, reduce_bucket))
    elif c.zero_stage in (1, 2):
        per_reduce = links.seconds("data", "reduce_scatter", grads / d, d, calls(grads, reduce_bucket))
        reductions = 1 if c.zero_stage == 1 else c.grad_accum
        comm = reductions * per_reduce + links.seconds("data", "all_gather", params / d, d,
                                                       calls(params, gather_bucket))
    else:
        gathers = 2 * links.seconds("data", "all_gather", params / d, d, calls(params, gather_bucket))
        comm = c.grad_accum * (gathers + links.seconds("data", "reduce_scatter", grads / d, d,
                                                       calls(grads, reduce_bucket)))
    overlap = c.overlap_comm if c.overlap_comm is not None else c.zero_stage == 3
    if not overlap or d <= 1:
        return comm
    last = links.seconds("data", "all_reduce", min(grads, reduce_bucket), d)
    return max(comm - backward_s, last)


def optimizer_seconds(candidate: Candidate, profile: Profile) -> float:
    """The update of this rank's partition, and with ZeRO-Offload the copies down and up."""
    c = candidate
    psi = profile.parameters / (c.tensor * c.pipe)
    updated = psi / c.data if c.zero_stage >= 1 else psi
    seconds = updated * profile.optimizer_s_per_element
    if c.offload_optimizer:
        per_element = _dtype_bytes(profile.precision.grad_accum_dtype) + _dtype_bytes(profile.precision.param_dtype)
        moved = updated * per_element
        seconds += moved * profile.host_copy_s_per_byte
    return seconds


def tensor_comm_seconds(candidate: Candidate, profile: Profile, links: CommCosts, micro_batches: int) -> float:
    """Megatron's four all-reduces of a block's output per block and micro-batch (two forward, two backward)."""
    c = candidate
    if c.tensor <= 1:
        return 0.0
    blocks = [cost for cost in profile.layer_costs if cost.name.startswith("blocks.")] or list(profile.layer_costs)
    if not blocks:
        return 0.0
    scale = c.micro_batch / profile.layer_micro_batch
    nbytes = sum(cost.output_bytes for cost in blocks) * scale
    return micro_batches * 4 * links.seconds("model", "all_reduce", nbytes, c.tensor, len(blocks))


def pipeline_seconds(candidate: Candidate, profile: Profile, links: CommCosts, remat: tuple[str, int],
                     partition: str = "parameters") -> float:
    """The simulated makespan of the candidate's schedule over its stages' measured layer costs
    (stages cut by `partition`, the run's pipeline.partition)."""
    from .memory_model import pipeline_bounds  # noqa: PLC0415 (the same stages as the memory model's)

    c = candidate
    costs = profile.layer_costs
    bounds = pipeline_bounds(c, partition, profile)
    scale = c.micro_batch / profile.layer_micro_batch
    recompute = 1.0
    if remat[0] != "none":
        plain = profile.micro_seconds("none", 1, c.micro_batch)
        ratio = profile.micro_seconds(*remat, c.micro_batch) / plain if plain else 1.0
        recompute = min(max(ratio, 1.0), MAX_RECOMPUTE)
    pieces = list(zip(bounds, bounds[1:]))
    forward = [0.0] * c.pipe
    backward = [0.0] * c.pipe
    for k, (a, b) in enumerate(pieces):
        stage = k % c.pipe
        send = links.seconds("pipe", "send", costs[b - 1].output_bytes * scale, c.pipe) if b < len(costs) else 0.0
        forward[stage] += sum(x.forward_s for x in costs[a:b]) * scale + send
        backward[stage] += sum(x.backward_s for x in costs[a:b]) * scale * recompute + send
    chunks = c.virtual_stages
    forward = [f / chunks for f in forward]
    backward = [b / chunks for b in backward]
    schedule = build_schedule(c.schedule, c.pipe, c.grad_accum, c.virtual_stages)
    if schedule.split_backward:  # B is the input's gradient, W the weights': about half each
        return simulate(schedule, forward, [b / 2 for b in backward], [b / 2 for b in backward]).makespan
    return simulate(schedule, forward, backward, [0.0] * c.pipe).makespan


def predict_step(candidate: Candidate, profile: Profile, links: CommCosts, partition: str = "parameters") -> StepCost:
    """`candidate`'s predicted seconds per step and its parts (module docstring); `partition`: the
    run's pipeline.partition."""
    c = candidate
    remat = _remat_key(c, profile)
    parts: dict[str, float] = {}
    if c.pipe > 1:
        parts["compute"] = pipeline_seconds(c, profile, links, remat, partition)
    else:
        parts["compute"] = c.grad_accum * profile.micro_seconds(*remat, c.micro_batch) / c.tensor
    parts["tensor comm"] = tensor_comm_seconds(c, profile, links, c.grad_accum)
    parts["zero comm"] = zero_comm_seconds(c, profile, links, BACKWARD_SHARE * parts["compute"])
    parts["optimizer"] = optimizer_seconds(c, profile)
    return StepCost(c, sum(parts.values()), parts)


__all__ = ["BACKWARD_SHARE", "COLLECTIVES", "CommCosts", "LinkCost", "StepCost", "optimizer_seconds",
           "pipeline_seconds", "predict_step", "tensor_comm_seconds", "zero_comm_seconds"]
