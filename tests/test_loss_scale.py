"""The fp16 loss scaler against an independent model of DeepSpeed's `DynamicLossScaler`.

`DeepSpeedScaler` below follows `deepspeed/runtime/fp16/loss_scaler.py::DynamicLossScaler`
(reference 1.2) as a small mutable class, the way DeepSpeed writes it; fspeed's pure
`update_loss_scale` must produce the identical trace (scale, hysteresis, iteration counters)
over any sequence of overflow flags, and raise exactly where DeepSpeed raises.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fspeed.loss_scale import LossScaleAtMinimumError, LossScaleState, init_loss_scale, update_loss_scale
from fspeed.precision import LossScaleConfig, fp16


class DeepSpeedAtMinimum(Exception):
    """DeepSpeed's "Current loss scale already at minimum" exception."""


class DeepSpeedScaler:
    """DynamicLossScaler(init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
    raise_error_at_min_scale), scale_factor 2."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
                 raise_at_min):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_at_min

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise DeepSpeedAtMinimum
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state(self) -> tuple:
        return (self.cur_scale, self.cur_iter, self.last_overflow_iter, self.cur_hysteresis)


# overflow flags: random flips around a run of overflows long enough to reach the minimum scale
overflow_sequences = st.tuples(
    st.lists(st.booleans(), max_size=40), st.integers(0, 16), st.lists(st.booleans(), max_size=30)
).map(lambda parts: parts[0] + [True] * parts[1] + parts[2])


@st.composite
def dynamic_configs(draw) -> LossScaleConfig:
    return LossScaleConfig(
        loss_scale=0.0,
        initial_scale_power=draw(st.integers(0, 8)),
        loss_scale_window=draw(st.integers(1, 6)),
        hysteresis=draw(st.integers(1, 4)),
        consecutive_hysteresis=draw(st.booleans()),
        # 1000 is above every initial scale: DeepSpeed's max() then raises the scale to it
        min_loss_scale=draw(st.sampled_from([1.0, 0.25, 2.0, 3.0, 1000.0])),
        raise_at_min_scale=draw(st.booleans()),
    )


def as_tuple(state: LossScaleState) -> tuple:
    return (state.scale, state.cur_iter, state.last_overflow_iter, state.cur_hysteresis)


@given(dynamic_configs(), overflow_sequences)
def test_dynamic_scale_trace_matches_deepspeed(cfg: LossScaleConfig, overflows: list[bool]) -> None:
    model = DeepSpeedScaler(2**cfg.initial_scale_power, cfg.loss_scale_window, cfg.min_loss_scale,
                            cfg.hysteresis, cfg.consecutive_hysteresis, cfg.raise_at_min_scale)
    state = init_loss_scale(cfg)
    assert as_tuple(state) == model.state()
    for i, overflow in enumerate(overflows):
        try:
            model.update_scale(overflow)
        except DeepSpeedAtMinimum:
            message = f"at step {i} .*minimum \\({cfg.min_loss_scale}\\)"
            with pytest.raises(LossScaleAtMinimumError, match=message):
                update_loss_scale(cfg, state, overflow)
            return
        state = update_loss_scale(cfg, state, overflow)
        assert as_tuple(state) == model.state(), f"after update {i} (overflow={overflow})"
        assert type(state.scale) is float


@given(dynamic_configs(), st.integers(0, 30), overflow_sequences)
def test_without_raise_overflows_at_minimum_keep_skipping(cfg, extra_overflows, tail) -> None:
    """raise_at_min_scale=False: the scale stops at min_loss_scale and overflows keep coming."""
    cfg = dataclasses.replace(cfg, raise_at_min_scale=False)
    state = init_loss_scale(cfg)
    # enough overflows to exhaust the hysteresis and halve down to the minimum, then some more
    needed = cfg.hysteresis + max(0, math.ceil(math.log2(max(state.scale / cfg.min_loss_scale, 1.0))))
    for _ in range(needed + 1):
        state = update_loss_scale(cfg, state, True)
    assert state.scale == cfg.min_loss_scale
    for _ in range(extra_overflows):
        state = update_loss_scale(cfg, state, True)
        assert state.scale == cfg.min_loss_scale and state.cur_hysteresis == 1
    for overflow in tail:
        state = update_loss_scale(cfg, state, overflow)
        assert state.scale >= cfg.min_loss_scale


def test_hand_computed_trace() -> None:
    """Defaults' shape (hysteresis 2, not consecutive) worked by hand: the first overflow only
    spends the hysteresis, later ones halve; the scale doubles `window` clean steps after the
    last overflow; at the minimum the next overflow raises."""
    cfg = LossScaleConfig(initial_scale_power=2, loss_scale_window=3, hysteresis=2, min_loss_scale=1.0)
    state = init_loss_scale(cfg)
    assert state == LossScaleState(4.0, 0, -1, 2)
    trace = []
    for overflow in [False, False, False, False, True, True, False, False, False, False, True, True, True]:
        state = update_loss_scale(cfg, state, overflow)
        trace.append((state.scale, state.cur_hysteresis))
    assert trace == [
        (4.0, 2), (4.0, 2), (4.0, 2), (8.0, 2),  # clean iters 0..3: doubles at iter 3 (stable = 3)
        (8.0, 1),  # iter 4 overflow: hysteresis 2 -> 1, scale kept
        (4.0, 1),  # iter 5 overflow: halves
        (4.0, 1), (4.0, 1), (4.0, 1),  # iters 6..8 clean: stable = 0, 1, 2
        (8.0, 2),  # iter 9: stable = 3 = window -> double and refill hysteresis
        (8.0, 1), (4.0, 1), (2.0, 1),  # iters 10..12 overflow
    ]
    state = update_loss_scale(cfg, state, True)  # 2 -> 1
    assert state.scale == 1.0
    with pytest.raises(LossScaleAtMinimumError, match="at step 14 .*raise_at_min_scale=false"):
        update_loss_scale(cfg, state, True)


def test_consecutive_hysteresis_only_lowers_on_runs() -> None:
    """consecutive_hysteresis: a clean step refills the budget, so isolated overflows never lower
    the scale."""
    cfg = LossScaleConfig(initial_scale_power=4, loss_scale_window=100, hysteresis=2,
                          consecutive_hysteresis=True)
    state = init_loss_scale(cfg)
    for overflow in [True, False] * 10:
        state = update_loss_scale(cfg, state, overflow)
        assert state.scale == 16.0
    for expected in (16.0, 8.0, 4.0):  # a run of overflows: the second one and after halve
        state = update_loss_scale(cfg, state, True)
        assert state.scale == expected


@given(st.floats(1e-3, 2.0**20), overflow_sequences)
def test_static_scale_never_changes(scale: float, overflows: list[bool]) -> None:
    cfg = LossScaleConfig(loss_scale=scale)
    assert not cfg.dynamic
    state = init_loss_scale(cfg)
    for i, overflow in enumerate(overflows):
        state = update_loss_scale(cfg, state, overflow)
        assert state.scale == scale and state.cur_iter == i + 1


@given(overflow_sequences)
def test_no_config_means_scale_one(overflows: list[bool]) -> None:
    state = init_loss_scale(None)
    for overflow in overflows:
        state = update_loss_scale(None, state, overflow)
        assert state.scale == 1.0
    assert state.cur_iter == len(overflows)


def test_fp16_builds_its_loss_scale_config() -> None:
    policy = fp16(initial_scale_power=5, loss_scale_window=7, hysteresis=3, consecutive_hysteresis=True,
                  min_loss_scale=2, raise_at_min_scale=False)
    assert policy.param_dtype == torch.float16 and policy.check_overflow
    assert policy.loss_scale == LossScaleConfig(0.0, 5, 7, 3, True, 2.0, False)
    assert init_loss_scale(policy.loss_scale) == LossScaleState(32.0, 0, -1, 3)
    assert not fp16(loss_scale=128).loss_scale.dynamic


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_scale=-1.0), r"fp16\.loss_scale=-1\.0 must be 0 \(dynamic\) or a positive finite number"),
        (dict(loss_scale=float("nan")), r"fp16\.loss_scale=nan"),
        (dict(loss_scale=float("inf")), r"fp16\.loss_scale=inf"),
        (dict(loss_scale_window=0), r"fp16\.loss_scale_window=0 must be >= 1"),
        (dict(hysteresis=0), r"fp16\.hysteresis=0 must be >= 1"),
        (dict(min_loss_scale=0.0), r"fp16\.min_loss_scale=0\.0 must be a positive finite number"),
        (dict(min_loss_scale=float("inf")), r"fp16\.min_loss_scale=inf must be a positive finite number"),
        (dict(hysteresis=1.5), r"fp16\.hysteresis=1\.5 must be an integer"),
        (dict(min_loss_scale=-2.0), r"fp16\.min_loss_scale=-2\.0"),
        (dict(initial_scale_power=65), r"fp16\.initial_scale_power=65 must be in \[0, 64\]"),
        (dict(initial_scale_power=-1), r"fp16\.initial_scale_power=-1"),
    ],
)
def test_bad_fp16_settings_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fp16(**kwargs)
    with pytest.raises(ValueError, match=match):
        LossScaleConfig(**kwargs)


def test_bad_fp16_types_raise() -> None:
    with pytest.raises(ValueError, match=r"fp16\.loss_scale=True"):
        LossScaleConfig(loss_scale=True)
    with pytest.raises(ValueError, match=r"grad_accum_dtype='fp64' is not a known dtype; allowed: fp32"):
        fp16(grad_accum_dtype="fp64")
