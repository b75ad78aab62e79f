"""Schedules against independent transcriptions of DeepSpeed's lr_schedules formulas.

Each ``ds_*`` reference below is written in DeepSpeed's own terms: a function of
``it = last_batch_iteration``, with ``it = -1`` giving the value the constructor writes into the
optimizer. fspeed's ``schedule(count)`` must equal ``ds_*(count - 1)``, which also checks the
count -> iteration offset (update ``count`` runs after ``count`` calls to ``scheduler.step()``).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fspeed.optim import schedules as S


def close(actual: float, expected: float) -> bool:
    return math.isclose(actual, expected, rel_tol=1e-12, abs_tol=1e-15)


def assert_matches(schedule, reference, counts) -> None:
    for count in counts:
        value = schedule(count)
        assert type(value) is float, (count, type(value))
        expected = reference(count - 1)
        assert close(value, expected), f"count={count}: got {value!r}, DeepSpeed gives {expected!r}"


# --------------------------------------------------------------------------- DeepSpeed references


def ds_lr_range_test(it, min_lr, step_size, step_rate, staircase):
    # Constructor writes min_lr; step() recomputes from it.
    if it == -1:
        return min_lr
    interval = math.floor(float(it + 1) / step_size) if staircase else float(it + 1) / step_size
    return min_lr * (1 + step_rate * interval)


def ds_warmup_gamma(it, W, warmup_type):
    if warmup_type == "log":
        return (1.0 / math.log(W)) * math.log(it + 1)
    return it / W


def ds_warmup_lr(it, min_lr, max_lr, num_steps, warmup_type):
    W = max(2, num_steps)
    if it < 0:  # get_lr before the first step() returns min_lrs
        return min_lr
    gamma = ds_warmup_gamma(it, W, warmup_type) if it < W else 1.0
    return min_lr + (max_lr - min_lr) * gamma


def ds_warmup_decay_lr(it, total, min_lr, max_lr, num_steps, warmup_type):
    W = max(2, num_steps)
    if it < 0:
        return min_lr
    if it < W:
        gamma = ds_warmup_gamma(it, W, warmup_type)
    else:
        gamma = max(0.0, float(total - it) / float(max(1.0, total - W)))
    return min_lr + (max_lr - min_lr) * gamma


def ds_warmup_cosine_lr(it, org_lr, total, warmup_min_ratio, num_steps, cos_min_ratio, warmup_type):
    W = max(2, num_steps)
    if it < 0:  # get_lr before the first step() returns 0.0 per group
        return 0.0
    if it < W:
        ratio = ds_warmup_gamma(it, W, warmup_type)
        ratio = warmup_min_ratio + ratio * (1.0 - warmup_min_ratio)
    else:
        progress = min(1.0, (it - W + 1) / max(1, total - W))
        ratio = (1 + math.cos(math.pi * progress)) / 2
        ratio = max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * ratio)
    return org_lr * ratio


def ds_one_cycle_scale(it, first, second, first_stairs, second_stairs):
    first, second = float(first), float(second)
    total = first + second
    ratio = first / total
    b = it + 1
    cycle = math.floor(1 + b / total)
    x = 1.0 + b / total - cycle
    if x <= ratio:
        scale, stairs = x / ratio, first_stairs
    else:
        scale, stairs = (x - 1) / (ratio - 1), second_stairs
    if stairs > 0:
        in_cycle = b % total
        if in_cycle <= first:
            position = in_cycle * stairs / first
        else:
            position = (total - in_cycle) * stairs / second
        scale = math.floor(position) / stairs
    return scale


def ds_one_cycle(it, shape, min_lr, max_lr, decay_lr_rate):
    first, second, first_stairs, second_stairs, decay_size = shape
    if it == -1:  # constructor writes cycle_min_lr
        return min_lr
    if it < first + second:
        return min_lr + (max_lr - min_lr) * ds_one_cycle_scale(it, first, second, first_stairs, second_stairs)
    if decay_size == 0 or decay_lr_rate == 0:
        return min_lr
    d = it - (first + second) + 1
    return min_lr / (1 + decay_lr_rate * (d / decay_size))


def ds_one_cycle_mom(it, shape, min_mom, max_mom, decay_mom_rate):
    first, second, first_stairs, second_stairs, decay_size = shape
    if it == -1:  # constructor writes betas = (cycle_min_mom, 0.99)
        return min_mom
    if it < first + second:
        scale = ds_one_cycle_scale(it, first, second, first_stairs, second_stairs)
        return max_mom - (max_mom - min_mom) * scale
    if decay_size == 0 or decay_mom_rate == 0:
        return max_mom
    d = it - (first + second) + 1
    return max_mom * (1 + decay_mom_rate * (d / decay_size))


# --------------------------------------------------------------------------- strategies

lrs = st.floats(0.0, 1.0, allow_subnormal=False)
ratios = st.floats(0.0, 1.0, allow_subnormal=False)
small_steps = st.integers(1, 40)
warmup_types = st.sampled_from(["log", "linear"])


@st.composite
def lr_pairs(draw, element=lrs):
    a, b = draw(element), draw(element)
    return min(a, b), max(a, b)


@st.composite
def cycle_shapes(draw):
    first = draw(small_steps)
    second = draw(st.none() | small_steps)
    first_stairs = draw(st.integers(0, 12))
    second_stairs = draw(st.none() | st.integers(0, 12))
    decay_size = draw(st.integers(0, 10))
    resolved = (first, first if second is None else second, first_stairs,
                first_stairs if second_stairs is None else second_stairs, decay_size)
    kwargs = dict(first_step_size=first, second_step_size=second, first_stair_count=first_stairs,
                  second_stair_count=second_stairs, decay_step_size=decay_size)
    return kwargs, resolved


# --------------------------------------------------------------------------- property tests


@given(min_lr=lrs, step_size=small_steps, step_rate=st.floats(0.0, 10.0), staircase=st.booleans())
def test_lr_range_test_matches_deepspeed(min_lr, step_size, step_rate, staircase):
    schedule = S.lr_range_test(min_lr=min_lr, step_size=step_size, step_rate=step_rate, staircase=staircase)
    assert_matches(schedule, lambda it: ds_lr_range_test(it, min_lr, step_size, step_rate, staircase),
                   range(4 * step_size + 3))
    assert schedule(0) == min_lr


@given(bounds=lr_pairs(), num_steps=small_steps, warmup_type=warmup_types)
def test_warmup_matches_deepspeed(bounds, num_steps, warmup_type):
    min_lr, max_lr = bounds
    schedule = S.warmup(min_lr=min_lr, max_lr=max_lr, num_steps=num_steps, warmup_type=warmup_type)
    assert_matches(schedule, lambda it: ds_warmup_lr(it, min_lr, max_lr, num_steps, warmup_type),
                   range(max(2, num_steps) + 5))
    # Quirk: construction and first step() both give min_lr.
    assert schedule(0) == schedule(1) == min_lr
    assert schedule(10**6) == max_lr


@given(bounds=lr_pairs(), num_steps=small_steps, extra=st.integers(-5, 60), warmup_type=warmup_types)
def test_warmup_decay_matches_deepspeed(bounds, num_steps, extra, warmup_type):
    min_lr, max_lr = bounds
    total = max(0, max(2, num_steps) + extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # total < W warns, checked separately
        schedule = S.warmup_decay(total, min_lr=min_lr, max_lr=max_lr, num_steps=num_steps,
                                  warmup_type=warmup_type)
    assert_matches(schedule, lambda it: ds_warmup_decay_lr(it, total, min_lr, max_lr, num_steps, warmup_type),
                   range(total + max(2, num_steps) + 5))
    assert schedule(0) == schedule(1) == min_lr
    assert schedule(total + num_steps + 10) == min_lr


@given(base_lr=lrs, num_steps=small_steps, extra=st.integers(-5, 60), warmup_min_ratio=ratios,
       cos_min_ratio=ratios, warmup_type=warmup_types)
def test_warmup_cosine_matches_deepspeed(base_lr, num_steps, extra, warmup_min_ratio, cos_min_ratio,
                                         warmup_type):
    total = max(0, max(2, num_steps) + extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        schedule = S.warmup_cosine(base_lr, total, warmup_min_ratio=warmup_min_ratio, num_steps=num_steps,
                                   cos_min_ratio=cos_min_ratio, warmup_type=warmup_type)
    assert_matches(
        schedule,
        lambda it: ds_warmup_cosine_lr(it, base_lr, total, warmup_min_ratio, num_steps, cos_min_ratio,
                                       warmup_type),
        range(total + max(2, num_steps) + 5),
    )
    # Quirk: the very first update runs at lr 0, the second at base_lr * warmup_min_ratio.
    assert schedule(0) == 0.0
    assert close(schedule(1), base_lr * warmup_min_ratio)
    assert close(schedule(total + num_steps + 10), base_lr * cos_min_ratio)


@given(shape=cycle_shapes(), bounds=lr_pairs(), decay_lr_rate=st.floats(0.0, 5.0) | st.just(0.0))
def test_one_cycle_matches_deepspeed(shape, bounds, decay_lr_rate):
    kwargs, resolved = shape
    min_lr, max_lr = bounds
    schedule = S.one_cycle(min_lr, max_lr, decay_lr_rate=decay_lr_rate, **kwargs)
    total = resolved[0] + resolved[1]
    assert_matches(schedule, lambda it: ds_one_cycle(it, resolved, min_lr, max_lr, decay_lr_rate),
                   range(total + 3 * max(1, resolved[4]) + 5))
    assert schedule(0) == min_lr
    assert close(schedule(resolved[0]), max_lr)  # the peak is reached, stairs or not
    assert schedule(total) == min_lr


@given(shape=cycle_shapes(), bounds=lr_pairs(st.floats(0.0, 0.999)),
       decay_mom_rate=st.floats(0.0, 5.0) | st.just(0.0))
def test_one_cycle_momentum_matches_deepspeed(shape, bounds, decay_mom_rate):
    kwargs, resolved = shape
    min_mom, max_mom = bounds
    schedule = S.one_cycle_momentum(min_mom, max_mom, decay_mom_rate=decay_mom_rate, **kwargs)
    total = resolved[0] + resolved[1]
    assert_matches(schedule, lambda it: ds_one_cycle_mom(it, resolved, min_mom, max_mom, decay_mom_rate),
                   range(total + 3 * max(1, resolved[4]) + 5))
    # Quirk: construction writes min_mom although the cycle starts at max_mom.
    assert schedule(0) == min_mom
    assert close(schedule(resolved[0]), min_mom)


@given(shape=cycle_shapes(), lr_bounds=lr_pairs(), mom_bounds=lr_pairs(st.floats(0.0, 0.999)))
def test_one_cycle_momentum_moves_opposite_to_lr(shape, lr_bounds, mom_bounds):
    kwargs, resolved = shape
    lr = S.one_cycle(*lr_bounds, **kwargs)
    mom = S.one_cycle_momentum(*mom_bounds, **kwargs)
    lr_span, mom_span = lr_bounds[1] - lr_bounds[0], mom_bounds[1] - mom_bounds[0]
    for count in range(1, resolved[0] + resolved[1] + 1):
        lr_scale = (lr(count) - lr_bounds[0]) / lr_span if lr_span > 1e-6 else None
        mom_scale = (mom_bounds[1] - mom(count)) / mom_span if mom_span > 1e-6 else None
        if lr_scale is not None and mom_scale is not None:
            assert math.isclose(lr_scale, mom_scale, abs_tol=1e-6)


@given(min_lr=lrs, step_size=st.integers(1, 10**6), step_rate=st.floats(0.0, 10.0), staircase=st.booleans(),
       counts=st.lists(st.integers(0, 10**9), max_size=20))
def test_lr_range_test_large_counts(min_lr, step_size, step_rate, staircase, counts):
    schedule = S.lr_range_test(min_lr, step_size, step_rate, staircase)
    assert_matches(schedule, lambda it: ds_lr_range_test(it, min_lr, step_size, step_rate, staircase), counts)


@given(first=st.integers(1, 10**5), second=st.integers(1, 10**5), stairs=st.integers(0, 1000),
       decay_size=st.integers(0, 10**4), bounds=lr_pairs(), rate=st.floats(0.0, 5.0),
       counts=st.lists(st.integers(0, 3 * 10**5), max_size=20))
def test_one_cycle_large_shapes(first, second, stairs, decay_size, bounds, rate, counts):
    resolved = (first, second, stairs, stairs, decay_size)
    schedule = S.one_cycle(*bounds, decay_lr_rate=rate, first_step_size=first, second_step_size=second,
                           first_stair_count=stairs, decay_step_size=decay_size)
    edges = [first - 1, first, first + 1, first + second - 1, first + second, first + second + 1]
    assert_matches(schedule, lambda it: ds_one_cycle(it, resolved, *bounds, rate), counts + edges)


@given(num_steps=st.integers(1, 5000), total=st.integers(0, 20000),
       counts=st.lists(st.integers(0, 30000), max_size=20), warmup_type=warmup_types, ratio=ratios)
def test_warmups_large_counts(num_steps, total, counts, warmup_type, ratio):
    W = max(2, num_steps)
    counts = counts + [0, 1, 2, W - 1, W, W + 1, W + 2, total, total + 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decay = S.warmup_decay(total, 0.0, 1e-3, num_steps, warmup_type)
        cosine = S.warmup_cosine(1e-3, total, ratio, num_steps, 1e-4, warmup_type)
    assert_matches(decay, lambda it: ds_warmup_decay_lr(it, total, 0.0, 1e-3, num_steps, warmup_type), counts)
    assert_matches(cosine,
                   lambda it: ds_warmup_cosine_lr(it, 1e-3, total, ratio, num_steps, 1e-4, warmup_type), counts)


# --------------------------------------------------------------------------- quirks and conversions


def test_warmup_clamps_num_steps_to_two():
    # W = max(2, 1): linear warm-up goes min, min, mid, max.
    schedule = S.warmup(0.0, 1.0, num_steps=1, warmup_type="linear")
    assert [schedule(c) for c in range(4)] == [0.0, 0.0, 0.5, 1.0]


@pytest.mark.parametrize("factory", [
    lambda t: S.warmup(warmup_type=t),
    lambda t: S.warmup_decay(5000, warmup_type=t),
    lambda t: S.warmup_cosine(1e-3, 5000, warmup_type=t),
])
def test_unknown_warmup_type_warns_and_uses_log(factory):
    with pytest.warns(UserWarning, match="cosine"):
        unknown = factory("cosine")
    log = factory("log")
    assert [unknown(c) for c in range(0, 1200, 7)] == [log(c) for c in range(0, 1200, 7)]


def test_total_below_warmup_warns():
    with pytest.warns(UserWarning, match="total_num_steps"):
        S.warmup_decay(10, num_steps=100)
    with pytest.warns(UserWarning, match="total_num_steps"):
        S.warmup_cosine(1e-3, 10, num_steps=100)


def one_cycle_run(cycle_momentum, stairs, decay_lr_rate, decay_mom_rate, steps):
    """Train one fp32 tensor with the optimizer a DeepSpeed config builds (AdamW betas (0.9, 0.999),
    OneCycle over 6 + 4 steps, then decay every 3) on known gradients, and read back, per update,
    the beta1 and beta2 its moments show (m = b1 m' + (1 - b1) g, v = b2 v' + (1 - b2) g^2) and the
    lr its step shows (p - p' = -lr m / bc1 / (sqrt(v / bc2) + eps), bc = 1 - beta ** t)."""
    import torch

    import fspeed as fs
    from fspeed.config.build import build_optimizer
    from fspeed.config.compose import compose_run_config

    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                    "weight_decay": 0.0}},
          "scheduler": {"type": "OneCycle", "params": {
              "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "decay_lr_rate": decay_lr_rate, "cycle_first_step_size": 6,
              "cycle_second_step_size": 4, "cycle_first_stair_count": stairs, "decay_step_size": 3,
              "cycle_momentum": cycle_momentum, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
              "decay_mom_rate": decay_mom_rate}}}
    run, _ = compose_run_config(ds)
    opt = build_optimizer(run)
    state = fs.init_train_state({"w": torch.zeros(3)}, opt)
    step = fs.make_train_step(lambda params, batch, rng=None: (params["w"] * batch).sum(), opt)
    seen = []
    for k in range(steps):
        g = torch.tensor([1.0, -2.0, 3.0]) * (k + 1) * (-1) ** k  # far from the moments: betas read back exactly
        m0, v0, p0 = (x.buffer.double().clone() for x in (state.opt_state.mu, state.opt_state.nu, state.params))
        state, _ = step(state, g)
        m, v, p, g = state.opt_state.mu.buffer.double(), state.opt_state.nu.buffer.double(), \
            state.params.buffer.double(), g.double()
        b1 = ((m - g) / (m0 - g)).mean().item()
        b2 = ((v - g * g) / (v0 - g * g)).mean().item()
        direction = (m / (1 - b1 ** (k + 1))) / ((v / (1 - b2 ** (k + 1))).sqrt() + 1e-8)
        seen.append((b1, b2, (-(p - p0) / direction).mean().item()))
    return seen


@pytest.mark.parametrize("stairs, decay_lr_rate, decay_mom_rate", [(0, 0.0, 0.0), (3, 0.5, 0.01)])
def test_one_cycle_cycles_beta1_against_lr_and_forces_beta2_as_deepspeed(stairs, decay_lr_rate, decay_mom_rate):
    """DeepSpeed's OneCycle with cycle_momentum (lr_schedules.py): beta1 moves between
    cycle_max_mom and cycle_min_mom opposite to the lr (``_get_cycle_mom``), then holds
    cycle_max_mom or grows by ``1 + decay_mom_rate * d / decay_step_size`` (``_get_decay_mom``);
    the constructor writes ``betas = (cycle_min_mom, 0.99)`` and every later write keeps that
    0.99 (``min_moms = [(mom, 0.99) ...]``): beta2 is forced to 0.99, not the optimizer's 0.999.
    Checked update by update over the cycle and 20 decay steps, against the transcriptions above."""
    shape = (6, 4, stairs, stairs, 3)
    steps = 30
    seen = one_cycle_run(True, stairs, decay_lr_rate, decay_mom_rate, steps)
    for count, (b1, b2, lr) in enumerate(seen):
        it = count - 1  # DeepSpeed's last_batch_iteration when this update runs
        assert b1 == pytest.approx(ds_one_cycle_mom(it, shape, 0.8, 0.9, decay_mom_rate), abs=1e-6), count
        assert b2 == pytest.approx(S.ONE_CYCLE_BETA2, abs=1e-6), count
        assert lr == pytest.approx(ds_one_cycle(it, shape, 1e-4, 1e-3, decay_lr_rate), rel=1e-4), count
        if 0 < count <= 10:  # in the cycle: the same fraction of each span, in opposite directions
            assert (lr - 1e-4) / 9e-4 == pytest.approx((0.9 - b1) / 0.1, abs=1e-4), count
    b1s = [b1 for b1, _, _ in seen]
    assert b1s[0] == pytest.approx(0.8) and b1s[6] == pytest.approx(0.8)  # construction, then the lr's peak
    assert b1s[1] > 0.86 and b1s[10] == pytest.approx(0.9)  # back at cycle_max_mom as the lr is back at min
    decayed = [ds_one_cycle_mom(c - 1, shape, 0.8, 0.9, decay_mom_rate) for c in range(11, steps)]
    assert b1s[11:] == pytest.approx(decayed, abs=1e-6)
    assert (b1s[-1] > 0.9) == (decay_mom_rate > 0)  # the "decay" grows beta1 past cycle_max_mom


def test_one_cycle_without_cycle_momentum_keeps_the_optimizers_betas():
    for b1, b2, _ in one_cycle_run(False, 0, 0.0, 0.0, 14):
        assert b1 == pytest.approx(0.9, abs=1e-6) and b2 == pytest.approx(0.999, abs=1e-6)


def test_constant_and_as_schedule():
    assert S.constant(3)(0) == 3.0 and type(S.constant(3)(7)) is float
    assert S.as_schedule(0.5)(123) == 0.5
    sched = S.warmup()
    assert S.as_schedule(sched) is sched
    with pytest.raises(TypeError, match="str"):
        S.as_schedule("0.1")
    with pytest.raises(TypeError, match="NoneType"):
        S.as_schedule(None)
    with pytest.raises(ValueError, match="NaN"):
        S.constant(float("nan"))


def test_counts_accept_numpy_ints_and_reject_bad_counts():
    schedule = S.lr_range_test(1e-3, 10, 1.0)
    assert schedule(np.int64(20)) == schedule(20)
    with pytest.raises(ValueError, match="count"):
        schedule(-1)
    with pytest.raises(TypeError, match="count must be an integer"):
        schedule(1.5)


@pytest.mark.parametrize("call, error, name", [
    (lambda: S.lr_range_test(min_lr=-1e-3), ValueError, "min_lr"),
    (lambda: S.lr_range_test(step_size=0), ValueError, "step_size"),
    (lambda: S.lr_range_test(step_size=2.5), TypeError, "step_size"),
    (lambda: S.lr_range_test(step_rate=-1.0), ValueError, "step_rate"),
    (lambda: S.lr_range_test(staircase=1), TypeError, "staircase"),
    (lambda: S.warmup(min_lr=0.1, max_lr=0.01), ValueError, "min_lr"),
    (lambda: S.warmup(max_lr=float("inf")), ValueError, "max_lr"),
    (lambda: S.warmup(num_steps=0), ValueError, "num_steps"),
    (lambda: S.warmup(num_steps=True), TypeError, "num_steps"),
    (lambda: S.warmup(warmup_type=None), TypeError, "warmup_type"),
    (lambda: S.warmup_decay(-1), ValueError, "total_num_steps"),
    (lambda: S.warmup_decay(100.0), TypeError, "total_num_steps"),
    (lambda: S.warmup_cosine(-1.0, 100), ValueError, "base_lr"),
    (lambda: S.warmup_cosine(1e-3, 100, warmup_min_ratio=1.5), ValueError, "warmup_min_ratio"),
    (lambda: S.warmup_cosine(1e-3, 100, cos_min_ratio=-0.1), ValueError, "cos_min_ratio"),
    (lambda: S.warmup_cosine(1e-3, 100, num_steps=-3), ValueError, "num_steps"),
    (lambda: S.one_cycle(0.1, 0.01), ValueError, "min_lr"),
    (lambda: S.one_cycle(-0.1, 0.01), ValueError, "min_lr"),
    (lambda: S.one_cycle(0.01, 0.1, decay_lr_rate=-1.0), ValueError, "decay_lr_rate"),
    (lambda: S.one_cycle(0.01, 0.1, first_step_size=0), ValueError, "first_step_size"),
    (lambda: S.one_cycle(0.01, 0.1, second_step_size=-5), ValueError, "second_step_size"),
    (lambda: S.one_cycle(0.01, 0.1, first_stair_count=-1), ValueError, "first_stair_count"),
    (lambda: S.one_cycle(0.01, 0.1, second_stair_count=-1), ValueError, "second_stair_count"),
    (lambda: S.one_cycle(0.01, 0.1, decay_step_size=-1), ValueError, "decay_step_size"),
    (lambda: S.one_cycle("0.01", 0.1), TypeError, "min_lr"),
    (lambda: S.one_cycle_momentum(0.95, 0.85), ValueError, "min_mom"),
    (lambda: S.one_cycle_momentum(0.8, 1.0), ValueError, "max_mom"),
    (lambda: S.one_cycle_momentum(decay_mom_rate=-0.1), ValueError, "decay_mom_rate"),
    (lambda: S.one_cycle_momentum(first_step_size=0), ValueError, "first_step_size"),
])
def test_bad_arguments_are_rejected_eagerly(call, error, name):
    with pytest.raises(error, match=name):
        call()
