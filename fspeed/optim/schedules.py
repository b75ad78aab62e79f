"""DeepSpeed's learning-rate and momentum schedules as plain functions of the step count.

A schedule is Optax-style: ``schedule(count) -> float`` where ``count`` is the number of
optimizer updates already applied (0 for the very first update). It returns the value
DeepSpeed would use *for that update*.

How that maps onto DeepSpeed (``deepspeed/runtime/lr_schedules.py``): the scheduler is built
with ``last_batch_iteration=-1``, which writes a construction-time value into the optimizer,
and the engine calls ``scheduler.step()`` after every successful optimizer step (not on an fp16
overflow, not per micro-step). So update ``count`` runs with DeepSpeed's value at
``last_batch_iteration = count - 1``, and ``count = 0`` gets the construction-time value.
Callers therefore advance ``count`` only on applied (non-skipped) updates.

Values are computed with integer arithmetic where DeepSpeed uses floats of integers; results
agree with DeepSpeed to a few ulps.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable
from numbers import Real

Schedule = Callable[[int], float]
"""A hyperparameter as a function of the number of updates already applied."""

ONE_CYCLE_BETA2: float = 0.99
"""DeepSpeed's OneCycle writes ``betas = (momentum, 0.99)`` while cycling momentum, overriding
the optimizer's own beta2 (quirk). Callers that match DeepSpeed use this as Adam's beta2."""

_WARMUP_TYPES = ("log", "linear")


# --------------------------------------------------------------------------- validation


def _real(name: str, value: object, *, low: float | None = None, high: float | None = None,
          high_open: bool = False) -> float:
    """``value`` as a finite float within [low, high] (or [low, high)), else a clear error."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and result < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    if high is not None and (result >= high if high_open else result > high):
        bound = f"< {high}" if high_open else f"<= {high}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return result


def _integer(name: str, value: object, *, low: int) -> int:
    """``value`` as an int >= ``low`` (bools and floats rejected), else a clear error."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {value!r} of type {type(value).__name__}"
        ) from None
    if result < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {result}")
    return result


def _ordered(low_name: str, low: float, high_name: str, high: float) -> None:
    if low > high:
        raise ValueError(f"{low_name} ({low!r}) must be <= {high_name} ({high!r})")


def _warmup_type(warmup_type: object) -> str:
    """DeepSpeed accepts any warmup_type: unknown ones warn and fall back to 'log'."""
    if not isinstance(warmup_type, str):
        raise TypeError(f"warmup_type must be a str ('log' or 'linear'), got {type(warmup_type).__name__}")
    if warmup_type not in _WARMUP_TYPES:
        warnings.warn(
            f"unknown warmup_type {warmup_type!r} (allowed: 'log', 'linear'); using 'log' as DeepSpeed does",
            UserWarning,
            stacklevel=3,
        )
        return "log"
    return warmup_type


def _count(count: object) -> int:
    """The step count as a non-negative int (accepts ints, numpy ints, integer 0-d tensors)."""
    try:
        result = operator.index(count)
    except TypeError:
        raise TypeError(f"schedule count must be an integer, got {type(count).__name__} {count!r}") from None
    if result < 0:
        raise ValueError(f"schedule count must be >= 0 (updates already applied), got {result}")
    return result


def _warmup_fraction(count: int, warmup_steps: int, warmup_type: str) -> float:
    """DeepSpeed's warm-up gamma at ``last_batch_iteration = count - 1``, for ``1 <= count <= W``.

    log: ``log(it + 1) / log(W)``; linear: ``it / W``.
    """
    if warmup_type == "log":
        return math.log(count) / math.log(warmup_steps)
    return (count - 1) / warmup_steps


# --------------------------------------------------------------------------- schedules


def constant(value: float) -> Schedule:
    """Always ``value``. Any non-NaN real is accepted (``inf`` can mean "disabled")."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"constant value must be a real number, got {type(value).__name__}")
    fixed = float(value)
    if math.isnan(fixed):
        raise ValueError("constant value must not be NaN")

    def schedule(count: int) -> float:
        return fixed

    return schedule


def as_schedule(value: float | Schedule) -> Schedule:
    """A hyperparameter given as a number or a schedule, as a schedule."""
    if callable(value):
        return value
    if isinstance(value, Real) and not isinstance(value, bool):
        return constant(value)
    raise TypeError(
        f"expected a float or a schedule (callable of the step count), got {type(value).__name__}"
    )


def lr_range_test(min_lr: float = 1e-3, step_size: int = 2000, step_rate: float = 1.0,
                  staircase: bool = False) -> Schedule:
    """DeepSpeed ``LRRangeTest``: ``lr = min_lr * (1 + step_rate * interval)``.

    ``interval = (it + 1) / step_size`` (``floor`` of it when ``staircase``), which with
    ``it = count - 1`` is ``count / step_size``. Growth is linear, not exponential. The
    construction-time lr (first update) is ``min_lr``, which is also the formula at it = -1.
    """
    min_lr = _real("min_lr", min_lr, low=0.0)
    step_size = _integer("step_size", step_size, low=1)
    step_rate = _real("step_rate", step_rate, low=0.0)
    if not isinstance(staircase, bool):
        raise TypeError(f"staircase must be a bool, got {type(staircase).__name__}")

    def schedule(count: int) -> float:
        count = _count(count)
        interval = count // step_size if staircase else count / step_size
        return min_lr * (1.0 + step_rate * interval)

    return schedule


def warmup(min_lr: float = 0.0, max_lr: float = 1e-3, num_steps: int = 1000,
           warmup_type: str = "log") -> Schedule:
    """DeepSpeed ``WarmupLR``: ``min_lr + (max_lr - min_lr) * gamma(it)``, then ``max_lr``.

    ``W = max(2, num_steps)`` (DeepSpeed's clamp). For ``it < W``, ``gamma`` is
    ``log(it + 1) / log(W)`` (log) or ``it / W`` (linear); afterwards 1. Quirks matched:

    * the construction-time lr is ``min_lr`` and the first ``step()`` gives ``it = 0``, where
      gamma is 0 too, so the first two updates both run at ``min_lr`` (with ``min_lr = 0`` they
      change nothing);
    * linear warm-up reaches ``(W - 1) / W`` at its last warm-up step and jumps to ``max_lr`` at
      ``it = W``; log warm-up reaches ``max_lr`` at ``it = W - 1``;
    * an unknown ``warmup_type`` warns and uses log.

    DeepSpeed's code defaults ``warmup_max_lr`` to the optimizer's lr when unset; here it is an
    explicit argument (default 1e-3, the documented value).
    """
    min_lr = _real("min_lr", min_lr, low=0.0)
    max_lr = _real("max_lr", max_lr, low=0.0)
    _ordered("min_lr", min_lr, "max_lr", max_lr)
    warmup_steps = max(2, _integer("num_steps", num_steps, low=1))
    warmup_type = _warmup_type(warmup_type)
    delta = max_lr - min_lr

    def schedule(count: int) -> float:
        count = _count(count)
        if count == 0:
            return min_lr
        if count <= warmup_steps:  # it = count - 1 < W
            return min_lr + delta * _warmup_fraction(count, warmup_steps, warmup_type)
        return max_lr

    return schedule


def warmup_decay(total_num_steps: int, min_lr: float = 0.0, max_lr: float = 1e-3,
                 num_steps: int = 1000, warmup_type: str = "log") -> Schedule:
    """DeepSpeed ``WarmupDecayLR``: :func:`warmup`, then linear decay back to ``min_lr``.

    For ``it >= W``: ``gamma = max(0, (total - it) / max(1, total - W))`` and
    ``lr = min_lr + (max_lr - min_lr) * gamma``, so gamma is 1 at ``it = W`` and 0 (lr =
    ``min_lr``, not 0) from ``it = total`` on. All :func:`warmup` quirks apply (first two
    updates at ``min_lr``, ``W = max(2, num_steps)``, unknown type -> log). As in DeepSpeed,
    ``total_num_steps < W`` only warns; every post-warm-up update then runs at ``min_lr``.
    """
    total = _integer("total_num_steps", total_num_steps, low=0)
    min_lr = _real("min_lr", min_lr, low=0.0)
    max_lr = _real("max_lr", max_lr, low=0.0)
    _ordered("min_lr", min_lr, "max_lr", max_lr)
    warmup_steps = max(2, _integer("num_steps", num_steps, low=1))
    warmup_type = _warmup_type(warmup_type)
    if total < warmup_steps:
        warnings.warn(f"total_num_steps {total} is less than warmup steps {warmup_steps}", UserWarning,
                      stacklevel=2)
    delta = max_lr - min_lr
    decay_steps = max(1, total - warmup_steps)

    def schedule(count: int) -> float:
        count = _count(count)
        if count == 0:
            return min_lr
        if count <= warmup_steps:
            return min_lr + delta * _warmup_fraction(count, warmup_steps, warmup_type)
        iteration = count - 1
        return min_lr + delta * max(0.0, (total - iteration) / decay_steps)

    return schedule


def warmup_cosine(base_lr: float, total_num_steps: int, warmup_min_ratio: float = 0.0,
                  num_steps: int = 1000, cos_min_ratio: float = 1e-4,
                  warmup_type: str = "log") -> Schedule:
    """DeepSpeed ``WarmupCosineLR``: ``base_lr * ratio(it)``, warm-up then cosine decay.

    ``base_lr`` is DeepSpeed's ``org_lr`` (the optimizer's lr when the scheduler is built).
    ``W = max(2, num_steps)``. For ``it < W``: ``ratio = warmup_min_ratio + (1 -
    warmup_min_ratio) * g`` with ``g = log(it + 1) / log(W)`` or ``it / W``. Afterwards
    ``p = min(1, (it - W + 1) / max(1, total - W))`` and ``ratio = cos_min_ratio + (1 -
    cos_min_ratio) * (1 + cos(pi * p)) / 2``, held at ``cos_min_ratio`` once ``p`` reaches 1
    (current DeepSpeed clamps ``p``; older releases let the cosine swing back up). Quirks matched:

    * the construction-time lr is **0** (DeepSpeed's ``get_lr`` returns 0 before the first
      ``step()``), so the very first update runs at lr 0 whatever ``warmup_min_ratio`` is; the
      second runs at ``base_lr * warmup_min_ratio``;
    * an unknown ``warmup_type`` warns and uses log; ``total_num_steps < W`` only warns.
    """
    base_lr = _real("base_lr", base_lr, low=0.0)
    total = _integer("total_num_steps", total_num_steps, low=0)
    warmup_min_ratio = _real("warmup_min_ratio", warmup_min_ratio, low=0.0, high=1.0)
    warmup_steps = max(2, _integer("num_steps", num_steps, low=1))
    cos_min_ratio = _real("cos_min_ratio", cos_min_ratio, low=0.0, high=1.0)
    warmup_type = _warmup_type(warmup_type)
    if total < warmup_steps:
        warnings.warn(f"total_num_steps {total} is less than warmup steps {warmup_steps}", UserWarning,
                      stacklevel=2)
    decay_steps = max(1, total - warmup_steps)

    def schedule(count: int) -> float:
        count = _count(count)
        if count == 0:
            return 0.0
        if count <= warmup_steps:
            fraction = _warmup_fraction(count, warmup_steps, warmup_type)
            return base_lr * (warmup_min_ratio + (1.0 - warmup_min_ratio) * fraction)
        progress = min(1.0, (count - warmup_steps) / decay_steps)  # (it - W + 1) / ...
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return base_lr * max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * cosine)

    return schedule


# --------------------------------------------------------------------------- OneCycle


def _one_cycle_shape(first_step_size: object, second_step_size: object, first_stair_count: object,
                     second_stair_count: object, decay_step_size: object
                     ) -> tuple[Callable[[int], float], int, int]:
    """Validated cycle shape: (scale function of ``count`` for ``count <= T``, T, decay size)."""
    first = _integer("first_step_size", first_step_size, low=1)
    second = first if second_step_size is None else _integer("second_step_size", second_step_size, low=1)
    first_stairs = _integer("first_stair_count", first_stair_count, low=0)
    second_stairs = (first_stairs if second_stair_count is None
                     else _integer("second_stair_count", second_stair_count, low=0))
    decay_size = _integer("decay_step_size", decay_step_size, low=0)
    total = first + second

    ratio = first / total

    def scale(count: int) -> float:
        # DeepSpeed's float arithmetic, kept as is so values match it to the last bit:
        # b = it + 1 = count; x = position in the cycle as a fraction of T.
        cycle = math.floor(1 + count / total)
        x = 1.0 + count / total - cycle
        if x <= ratio:
            value, stairs = x / ratio, first_stairs
        else:
            value, stairs = (x - 1) / (ratio - 1), second_stairs
        if stairs > 0:
            in_cycle = count % total
            if in_cycle <= first:
                return math.floor(in_cycle * stairs / first) / stairs
            return math.floor((total - in_cycle) * stairs / second) / stairs
        return value

    return scale, total, decay_size


def one_cycle(min_lr: float, max_lr: float, decay_lr_rate: float = 0.0, first_step_size: int = 2000,
              second_step_size: int | None = None, first_stair_count: int = 0,
              second_stair_count: int | None = None, decay_step_size: int = 0) -> Schedule:
    """DeepSpeed ``OneCycle`` learning rate: one triangle min -> max -> min, then decay.

    With ``T = first + second`` and ``b = it + 1 = count``, while ``it < T`` (``count <= T``):
    ``lr = min_lr + (max_lr - min_lr) * scale``, where ``scale`` rises linearly over the first
    ``first_step_size`` steps and falls over the next ``second_step_size``
    (``second_step_size=None`` means equal to the first). A stair count ``k > 0`` for a half
    quantises its scale to ``floor(offset * k / half_length) / k`` from the integer offset into
    the half (current DeepSpeed; older releases floored the float scale and could miss the
    peak); ``second_stair_count=None`` means equal to the first, 0 means continuous.

    After the cycle (``d = it - T + 1 = count - T``): ``lr = min_lr / (1 + decay_lr_rate * d /
    decay_step_size)``, continuous in ``d`` (the "step size" does not make it stepwise), and
    simply ``min_lr`` when ``decay_lr_rate`` or ``decay_step_size`` is 0. The construction-time
    lr (first update) is ``min_lr``.
    """
    min_lr = _real("min_lr", min_lr, low=0.0)
    max_lr = _real("max_lr", max_lr, low=0.0)
    _ordered("min_lr", min_lr, "max_lr", max_lr)
    decay_lr_rate = _real("decay_lr_rate", decay_lr_rate, low=0.0)
    scale, total, decay_size = _one_cycle_shape(first_step_size, second_step_size, first_stair_count,
                                                second_stair_count, decay_step_size)
    delta = max_lr - min_lr
    decays = decay_size > 0 and decay_lr_rate != 0.0

    def schedule(count: int) -> float:
        count = _count(count)
        if count <= total:
            return min_lr + delta * scale(count)
        if not decays:
            return min_lr
        return min_lr / (1.0 + decay_lr_rate * (count - total) / decay_size)

    return schedule


def one_cycle_momentum(min_mom: float = 0.8, max_mom: float = 0.9, decay_mom_rate: float = 0.0,
                       first_step_size: int = 2000, second_step_size: int | None = None,
                       first_stair_count: int = 0, second_stair_count: int | None = None,
                       decay_step_size: int = 0) -> Schedule:
    """DeepSpeed ``OneCycle`` momentum (Adam's beta1), moving opposite to the lr.

    Same cycle shape as :func:`one_cycle`: ``mom = max_mom - (max_mom - min_mom) * scale`` while
    ``count <= T``. After the cycle ``mom = max_mom * (1 + decay_mom_rate * d / decay_step_size)``
    (``max_mom`` when the rate or size is 0). Quirks matched:

    * the construction-time momentum is ``min_mom`` (DeepSpeed writes ``betas = (min_mom,
      0.99)`` at construction) although the cycle formula gives ``max_mom`` there, so the first
      update runs at ``min_mom`` and the second jumps to about ``max_mom``;
    * the post-cycle "decay" multiplies by ``1 + rate * d / size``, so momentum *grows* past
      ``max_mom`` (and eventually past 1) for a positive rate;
    * while momentum cycles DeepSpeed forces beta2 to :data:`ONE_CYCLE_BETA2` (0.99).
    """
    min_mom = _real("min_mom", min_mom, low=0.0, high=1.0, high_open=True)
    max_mom = _real("max_mom", max_mom, low=0.0, high=1.0, high_open=True)
    _ordered("min_mom", min_mom, "max_mom", max_mom)
    decay_mom_rate = _real("decay_mom_rate", decay_mom_rate, low=0.0)
    scale, total, decay_size = _one_cycle_shape(first_step_size, second_step_size, first_stair_count,
                                                second_stair_count, decay_step_size)
    delta = max_mom - min_mom
    decays = decay_size > 0 and decay_mom_rate != 0.0

    def schedule(count: int) -> float:
        count = _count(count)
        if count == 0:
            return min_mom
        if count <= total:
            return max_mom - delta * scale(count)
        if not decays:
            return max_mom
        return max_mom * (1.0 + decay_mom_rate * (count - total) / decay_size)

    return schedule
