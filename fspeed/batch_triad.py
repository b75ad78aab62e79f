"""The batch-size triad: train_batch_size = micro_batch_size x grad_accum x dp.

DeepSpeed derives whichever of `train_batch_size`, `train_micro_batch_size_per_gpu` and
`gradient_accumulation_steps` are missing from the ones given (``_set_batch_related_parameters``)
with integer division, so inconsistent inputs are silently truncated and only surface later as
"train_batch_size != mbs * GAS * world". fspeed follows the same resolution table but never
truncates: a derivation that does not divide evenly, or a triple that does not satisfy the
invariant, is a `BatchTriadError` that shows dp (the data-parallel size, not the world size),
the derivation used and consistent triples to choose from.
"""

from __future__ import annotations

from typing import NamedTuple, Optional


class BatchTriad(NamedTuple):
    """A resolved triad; always satisfies ``train_batch_size == micro_batch_size * grad_accum * dp_world_size``."""

    train_batch_size: int
    micro_batch_size: int
    grad_accum: int
    dp_world_size: int
    derivation: str


class BatchTriadError(ValueError):
    """The triad cannot be resolved without truncating, or the given values contradict each other."""


_MISSING_MESSAGE = (
    "either train_batch_size or micro_batch_size (DeepSpeed: train_micro_batch_size_per_gpu) "
    "needs to be provided"
)


def _check_size(name: str, value: object) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be a positive integer or None, got {type(value).__name__}")
    if value < 1:
        raise BatchTriadError(f"{name}={value} must be a positive integer")
    return value


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _nearest(values: list[int], target: int, count: int) -> list[int]:
    return sorted(sorted(values, key=lambda v: (abs(v - target), v))[:count])


def _multiples_around(value: int, step: int) -> list[int]:
    below = (value // step) * step
    return sorted({m for m in (below, below + step) if m > 0})


def suggest_consistent_triples(
    train_batch_size: int | None,
    micro_batch_size: int | None,
    grad_accum: int | None,
    dp_world_size: int = 1,
    *,
    limit: int = 4,
) -> list[tuple[int, int, int]]:
    """Consistent (train_batch_size, micro_batch_size, grad_accum) triples close to the given values.

    Each keeps as many of the given values as possible and changes the others the least; every
    returned triple satisfies ``tbs == mbs * gas * dp``.
    """
    tbs, mbs, gas, dp = train_batch_size, micro_batch_size, grad_accum, dp_world_size
    out: list[tuple[int, int, int]] = []

    def add(m: int, g: int) -> None:
        triple = (m * g * dp, m, g)
        if m > 0 and g > 0 and triple not in out:
            out.append(triple)

    if mbs is not None and gas is not None:
        add(mbs, gas)  # keep the per-rank shape, recompute the global batch
    if tbs is not None:
        per_rank = [t // dp for t in _multiples_around(tbs, dp)] if tbs % dp else [tbs // dp]
        for samples in per_rank:
            if mbs is not None:
                for m in _nearest(_divisors(samples), mbs, 2):
                    add(m, samples // m)
            if gas is not None:
                for g in _nearest(_divisors(samples), gas, 2):
                    add(samples // g, g)
            if mbs is None and gas is None:
                add(samples, 1)
        step = dp * (mbs if mbs is not None else 1) * (gas if gas is not None else 1)
        for t in _multiples_around(tbs, step):
            if mbs is not None and gas is not None:
                continue  # already covered by add(mbs, gas)
            if mbs is not None:
                add(mbs, t // (mbs * dp))
            elif gas is not None:
                add(t // (gas * dp), gas)
    return out[:limit]


def _failure(reason: str, derivation: str, tbs, mbs, gas, dp: int) -> BatchTriadError:
    given = f"train_batch_size={tbs}, micro_batch_size={mbs}, grad_accum={gas}, dp={dp}"
    lines = [f"inconsistent batch sizes: {reason}", f"  given: {given}", f"  derivation: {derivation}"]
    suggestions = suggest_consistent_triples(tbs, mbs, gas, dp)
    if suggestions:
        lines.append(f"  consistent choices (train_batch_size = micro_batch_size x grad_accum x dp={dp}):")
        lines += [f"    train_batch_size={t}, micro_batch_size={m}, grad_accum={g}" for t, m, g in suggestions]
    return BatchTriadError("\n".join(lines))


def resolve_batch_triad(
    train_batch_size: int | None,
    micro_batch_size: int | None,
    grad_accum: int | None,
    dp_world_size: int = 1,
) -> BatchTriad:
    """Resolve the triad with DeepSpeed's table (reference 4.1), refusing to truncate.

    | given        | derived                                   |
    |--------------|-------------------------------------------|
    | all three    | nothing; check tbs == mbs * gas * dp      |
    | tbs + mbs    | gas = tbs / (mbs * dp)                    |
    | tbs + gas    | mbs = tbs / (gas * dp)                    |
    | mbs + gas    | tbs = mbs * gas * dp                      |
    | tbs only     | gas = 1, mbs = tbs / dp                   |
    | mbs only     | gas = 1, tbs = mbs * dp                   |
    | gas or none  | error, as in DeepSpeed                    |

    `dp_world_size` is the data-parallel size (world / (tensor x pipeline x sequence parallel)).
    """
    tbs = _check_size("train_batch_size", train_batch_size)
    mbs = _check_size("micro_batch_size", micro_batch_size)
    gas = _check_size("grad_accum", grad_accum)
    dp = _check_size("dp_world_size", dp_world_size)
    if dp is None:
        raise TypeError("dp_world_size must be a positive integer, got None")

    if tbs is not None and mbs is not None and gas is not None:
        derivation = f"all given; check train_batch_size == micro_batch_size x grad_accum x dp = {mbs} x {gas} x {dp}"
        if tbs != mbs * gas * dp:
            raise _failure(f"{tbs} != {mbs} x {gas} x {dp} = {mbs * gas * dp}", derivation, tbs, mbs, gas, dp)
        return BatchTriad(tbs, mbs, gas, dp, derivation)
    if tbs is not None and mbs is not None:
        derivation = f"grad_accum = train_batch_size / (micro_batch_size x dp) = {tbs} / ({mbs} x {dp})"
        if tbs % (mbs * dp):
            raise _failure(f"{tbs} is not divisible by {mbs} x {dp} = {mbs * dp}", derivation, tbs, mbs, gas, dp)
        return BatchTriad(tbs, mbs, tbs // (mbs * dp), dp, f"{derivation} = {tbs // (mbs * dp)}")
    if tbs is not None and gas is not None:
        derivation = f"micro_batch_size = train_batch_size / (grad_accum x dp) = {tbs} / ({gas} x {dp})"
        if tbs % (gas * dp):
            raise _failure(f"{tbs} is not divisible by {gas} x {dp} = {gas * dp}", derivation, tbs, mbs, gas, dp)
        return BatchTriad(tbs, tbs // (gas * dp), gas, dp, f"{derivation} = {tbs // (gas * dp)}")
    if mbs is not None and gas is not None:
        derivation = f"train_batch_size = micro_batch_size x grad_accum x dp = {mbs} x {gas} x {dp}"
        return BatchTriad(mbs * gas * dp, mbs, gas, dp, f"{derivation} = {mbs * gas * dp}")
    if tbs is not None:
        derivation = f"grad_accum = 1; micro_batch_size = train_batch_size / dp = {tbs} / {dp}"
        if tbs % dp:
            raise _failure(f"{tbs} is not divisible by dp={dp}", derivation, tbs, mbs, gas, dp)
        return BatchTriad(tbs, tbs // dp, 1, dp, f"{derivation} = {tbs // dp}")
    if mbs is not None:
        derivation = f"grad_accum = 1; train_batch_size = micro_batch_size x dp = {mbs} x {dp}"
        return BatchTriad(mbs * dp, mbs, 1, dp, f"{derivation} = {mbs * dp}")
    raise BatchTriadError(f"{_MISSING_MESSAGE} (given: grad_accum={gas}, dp={dp})")
