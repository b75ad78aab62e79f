"""Optimizers against torch.optim and against independent transcriptions of DeepSpeed's kernels.

Every optimizer is run over several steps on random trees of small tensors (scalars and
1-element tensors included), through both paths of the protocol (pure `update` +
`apply_updates`, and the fused in-place `apply`) and on both a plain dict and a `Flat`.

Tolerances: fp32 runs compared with fp32 torch use rtol=1e-5, atol=1e-6. The two sides compute
the same formula in a different operation order (lerp vs mul+add, sqrt(v/bc2) vs sqrt(v)/sqrt(bc2),
fused kernels), so they differ by a few ulps per step; over <= 8 steps on values of order 1 that
stays below 1e-6 absolute, and rtol=1e-5 covers parameters up to ~100 (LAMB's scaled params).
The float64 transcriptions are compared with the same tolerance: fp32 rounding is the only
difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fspeed import Flat
from fspeed.optim import (
    AdamState,
    EmptyState,
    GradientTransformation,
    LambState,
    SGDState,
    adam,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    lamb,
    learning_rate,
    optimizer_step,
    sgd,
)
from fspeed.pytree import tree_leaves, tree_map

RTOL, ATOL = 1e-5, 1e-6

# --------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class Problem:
    """Random parameters and a sequence of gradients for them."""

    params: dict[str, torch.Tensor]
    grads: list[dict[str, torch.Tensor]]

    @property
    def steps(self) -> int:
        return len(self.grads)


shape_st = st.one_of(
    st.just(()), st.just((1,)), st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)
)


@st.composite
def problems(draw, *, param_scale: bool = False, zero_param: bool = False, zero_grad: bool = False):
    """Up to 5 tensors of random shapes, 1..8 gradient steps; optionally an all-zero parameter
    tensor, an always-zero gradient and a random magnitude for the parameters."""
    shapes = draw(st.lists(shape_st, min_size=1, max_size=5))
    steps = draw(st.integers(1, 8))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = 10.0 ** draw(st.floats(-3, 2)) if param_scale else 1.0
    params = {f"w{i}": torch.randn(s, generator=gen) * scale for i, s in enumerate(shapes)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(steps)]
    if zero_param and draw(st.booleans()):
        params[draw(st.sampled_from(sorted(params)))].zero_()
    if zero_grad and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(params)))
        for g in grads:
            g[key].zero_()
    return Problem(params, grads)


def container(tree: dict[str, torch.Tensor], flat: bool):
    """A fresh copy of `tree`, as a plain dict or as a Flat."""
    return Flat.from_tree(tree) if flat else {k: v.clone() for k, v in tree.items()}


def as_dict(tree) -> dict[str, torch.Tensor]:
    return dict(tree.items()) if isinstance(tree, Flat) else tree


def run(opt: GradientTransformation, problem: Problem, *, fused: bool, flat: bool):
    """Final (params as a dict, state) after all steps, through `optimizer_step` (the fused `apply`
    where the transform has one) or through `update` + `apply_updates`."""
    params = container(problem.params, flat)
    state = opt.init(params)
    for grads in problem.grads:
        grads = container(grads, flat)
        if fused:
            params, state = optimizer_step(opt, grads, state, params)
        else:
            updates, state = opt.update(grads, state, params)
            params = apply_updates(params, updates)
    return as_dict(params), state


PATHS = [(fused, flat) for fused in (False, True) for flat in (False, True)]


def run_torch(make: Callable, problem: Problem, before_step: Callable = lambda ps: None):
    """Final params (dict) and the optimizer, running a torch.optim optimizer on copies."""
    params = {k: v.clone() for k, v in problem.params.items()}
    opt = make(list(params.values()))
    for grads in problem.grads:
        for k, p in params.items():
            p.grad = grads[k].clone()
        before_step(list(params.values()))
        opt.step()
    return params, opt


def assert_trees_close(actual: dict, expected: dict, what: str, rtol: float = RTOL, atol: float = ATOL):
    assert sorted(actual) == sorted(expected), what
    for k in expected:
        torch.testing.assert_close(actual[k].to(expected[k].dtype), expected[k], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} [{k}]: {m}")


def clone_tree(tree):
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def assert_identical(actual, expected, what: str) -> None:
    """Same structure and bitwise-equal tensors (non-tensor leaves equal)."""
    a, b = tree_leaves(actual), tree_leaves(expected)
    assert len(a) == len(b), what
    for x, y in zip(a, b):
        if isinstance(y, torch.Tensor):
            assert torch.equal(x, y), f"{what} was modified"
        else:
            assert x == y, f"{what} was modified"


# --------------------------------------------------------------------------- hyperparameters

lr_st = st.floats(1e-4, 1e-1)
b1_st = st.sampled_from([0.0, 0.5, 0.9]) | st.floats(0.0, 0.99)
b2_st = st.floats(0.9, 0.9999)
eps_st = st.sampled_from([1e-8, 1e-6, 1e-3])
wd_st = st.sampled_from([0.0, 0.01]) | st.floats(1e-4, 0.2)  # no subnormal decay: fp32 flushes it to 0


@st.composite
def adam_hparams(draw) -> dict:
    return dict(lr=draw(lr_st), b1=draw(b1_st), b2=draw(b2_st), eps=draw(eps_st), weight_decay=draw(wd_st))


@st.composite
def sgd_hparams(draw) -> dict:
    momentum = draw(st.sampled_from([0.0, 0.9]) | st.floats(0.0, 0.99))
    nesterov = momentum > 0 and draw(st.booleans())
    dampening = 0.0 if nesterov else draw(st.sampled_from([0.0, 0.5]) | st.floats(0.0, 1.0))
    return dict(lr=draw(lr_st), momentum=momentum, dampening=dampening, weight_decay=draw(wd_st),
                nesterov=nesterov)


@st.composite
def lamb_hparams(draw) -> dict:
    max_coeff = draw(st.sampled_from([10.0, 1.0]) | st.floats(0.05, 10.0))
    min_coeff = draw(st.floats(0.001, max_coeff))
    return dict(
        lr=draw(lr_st), b1=draw(b1_st), b2=draw(b2_st), eps=draw(eps_st), weight_decay=draw(wd_st),
        bias_correction=draw(st.booleans()), eps_inside_sqrt=draw(st.booleans()),
        max_coeff=max_coeff, min_coeff=min_coeff,
    )


# --------------------------------------------------------------------------- 1. adam vs torch


@given(problems(), adam_hparams(), st.booleans())
def test_adam_matches_torch(problem: Problem, hp: dict, decoupled: bool) -> None:
    if decoupled:
        opt = adamw(**hp)
        make = lambda ps: torch.optim.AdamW(  # noqa: E731
            ps, lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=hp["weight_decay"],
            foreach=False,
        )
    else:
        opt = adam(**hp)
        make = lambda ps: torch.optim.Adam(  # noqa: E731
            ps, lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=hp["weight_decay"],
            foreach=False,
        )
    expected, torch_opt = run_torch(make, problem)
    keys = list(expected)
    exp_avg = {k: torch_opt.state[expected[k]]["exp_avg"] for k in keys}
    exp_avg_sq = {k: torch_opt.state[expected[k]]["exp_avg_sq"] for k in keys}
    for fused, flat in PATHS:
        what = f"{opt.info.name} fused={fused} flat={flat}"
        params, state = run(opt, problem, fused=fused, flat=flat)
        assert isinstance(state, AdamState) and state.count == problem.steps
        assert_trees_close(params, expected, what)
        assert_trees_close(as_dict(state.mu), exp_avg, what + " mu")
        assert_trees_close(as_dict(state.nu), exp_avg_sq, what + " nu")


# --------------------------------------------------------------------------- 2. adam vs FusedAdam's formula


def lr_schedule(base: float) -> Callable[[int], float]:
    return lambda count: base * (1.0 + 0.5 * math.sin(count + 1.0))


def b1_schedule(base: float) -> Callable[[int], float]:
    return lambda count: base * (0.8 + 0.1 * (count % 3))


def as_fn(value) -> Callable[[int], float]:
    return value if callable(value) else (lambda count: value)


def fused_adam_reference(problem: Problem, lr, b1, b2, eps, wd, *, adam_w_mode: bool, bias_correction: bool):
    """FusedAdam's per-element kernel (reference 5.1) in float64, hyperparameters per step."""
    p = {k: v.double() for k, v in problem.params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    for count, grads in enumerate(problem.grads):
        t = count + 1
        lr_t, b1_t = lr(count), b1(count)
        bc1 = 1.0 - b1_t**t if bias_correction else 1.0
        bc2 = 1.0 - b2**t if bias_correction else 1.0
        for k in p:
            g = grads[k].double()
            if not adam_w_mode:
                g = g + wd * p[k]
            m[k] = b1_t * m[k] + (1.0 - b1_t) * g
            v[k] = b2 * v[k] + (1.0 - b2) * g * g
            update = (m[k] / bc1) / (torch.sqrt(v[k] / bc2) + eps)
            if adam_w_mode:
                update = update + wd * p[k]
            p[k] = p[k] - lr_t * update
    return p, m, v


@given(problems(), adam_hparams(), st.booleans(), st.booleans(), st.booleans())
def test_adam_matches_fused_adam_formula(problem, hp, adam_w_mode, bias_correction, scheduled) -> None:
    lr = lr_schedule(hp["lr"]) if scheduled else hp["lr"]
    b1 = b1_schedule(hp["b1"]) if scheduled else hp["b1"]
    expected, exp_m, exp_v = fused_adam_reference(
        problem, as_fn(lr), as_fn(b1), hp["b2"], hp["eps"], hp["weight_decay"],
        adam_w_mode=adam_w_mode, bias_correction=bias_correction,
    )
    opt = adam(lr, b1, hp["b2"], hp["eps"], hp["weight_decay"], bias_correction=bias_correction,
               adam_w_mode=adam_w_mode)
    for fused, flat in PATHS:
        what = f"adam_w_mode={adam_w_mode} bias_correction={bias_correction} fused={fused} flat={flat}"
        params, state = run(opt, problem, fused=fused, flat=flat)
        assert_trees_close(params, expected, what)
        assert_trees_close(as_dict(state.mu), exp_m, what + " mu")
        assert_trees_close(as_dict(state.nu), exp_v, what + " nu")


# --------------------------------------------------------------------------- 3. lamb vs FusedLamb's formula


def fused_lamb_reference(problem: Problem, hp: dict, lr: Callable, b1: Callable):
    """FusedLamb per tensor (reference 5.2) in float64: raw moments, bias correction in the step
    size, trust ratio clamped to [min_coeff, max_coeff] and 1 when either norm is 0; lr and b1
    per step. Returns the final params and the trust ratios of the last step, in key order."""
    p = {k: v.double() for k, v in problem.params.items()}
    m = {k: torch.zeros_like(x) for k, x in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    b2, eps, wd = hp["b2"], hp["eps"], hp["weight_decay"]
    ratios: list[float] = []
    for count, grads in enumerate(problem.grads):
        t = count + 1
        lr_t, b1_t = lr(count), b1(count)
        step_size = lr_t * math.sqrt(1.0 - b2**t) / (1.0 - b1_t**t) if hp["bias_correction"] else lr_t
        ratios = []
        for k in sorted(p):
            g = grads[k].double()
            m[k] = b1_t * m[k] + (1.0 - b1_t) * g
            v[k] = b2 * v[k] + (1.0 - b2) * g * g
            denom = torch.sqrt(v[k] + eps) if hp["eps_inside_sqrt"] else torch.sqrt(v[k]) + eps
            u = m[k] / denom + wd * p[k]
            p_norm, u_norm = float(p[k].norm()), float(u.norm())
            trust = 1.0
            if p_norm != 0.0 and u_norm != 0.0:
                trust = min(max(p_norm / u_norm, hp["min_coeff"]), hp["max_coeff"])
            ratios.append(trust)
            p[k] = p[k] - step_size * trust * u
    return p, ratios


@given(problems(param_scale=True, zero_param=True, zero_grad=True), lamb_hparams(), st.booleans())
def test_lamb_matches_fused_lamb_formula(problem: Problem, hp: dict, scheduled: bool) -> None:
    if scheduled:
        hp = {**hp, "lr": lr_schedule(hp["lr"]), "b1": b1_schedule(hp["b1"])}
    expected, expected_ratios = fused_lamb_reference(problem, hp, as_fn(hp["lr"]), as_fn(hp["b1"]))
    opt = lamb(**hp)
    for fused, flat in PATHS:
        what = f"lamb fused={fused} flat={flat}"
        params, state = run(opt, problem, fused=fused, flat=flat)
        assert isinstance(state, LambState) and state.count == problem.steps
        assert_trees_close(params, expected, what)
        expected_trust = torch.tensor(expected_ratios, dtype=torch.float64)
        torch.testing.assert_close(state.trust_ratio.double(), expected_trust, rtol=RTOL, atol=0.0)


def test_lamb_trust_ratio_is_one_for_zero_norms() -> None:
    """A zero parameter tensor and a zero update both give trust 1, whatever the clamp range."""
    params = {"zero_p": torch.zeros(3), "zero_u": torch.ones(2), "big": torch.full((2,), 100.0)}
    grads = {"zero_p": torch.ones(3), "zero_u": torch.zeros(2), "big": torch.ones(2)}
    opt = lamb(0.1, min_coeff=2.0, max_coeff=3.0)
    _, state = opt.update(grads, opt.init(params), params)
    # sorted leaf order: big, zero_p, zero_u; ||big|| / ||u|| is far above max_coeff.
    assert state.trust_ratio.tolist() == [3.0, 1.0, 1.0]


# --------------------------------------------------------------------------- 4. sgd vs torch


@given(problems(), sgd_hparams())
def test_sgd_matches_torch(problem: Problem, hp: dict) -> None:
    expected, torch_opt = run_torch(lambda ps: torch.optim.SGD(ps, **hp, foreach=False), problem)
    opt = sgd(hp["lr"], hp["momentum"], dampening=hp["dampening"], weight_decay=hp["weight_decay"],
              nesterov=hp["nesterov"])
    for fused, flat in PATHS:
        what = f"sgd fused={fused} flat={flat}"
        params, state = run(opt, problem, fused=fused, flat=flat)
        assert isinstance(state, SGDState) and state.count == problem.steps
        assert_trees_close(params, expected, what)
        if hp["momentum"]:
            buffers = {k: torch_opt.state[p]["momentum_buffer"] for k, p in expected.items()}
            assert_trees_close(as_dict(state.momentum_buffer), buffers, what + " momentum_buffer")
        else:
            assert state.momentum_buffer is None


# --------------------------------------------------------------------------- 5. clipping


@given(problems(), st.floats(0.01, 10.0), st.floats(-2, 2))
def test_clip_by_global_norm_matches_deepspeed(problem: Problem, max_norm: float, log_scale: float) -> None:
    grads = {k: g * 10.0**log_scale for k, g in problem.grads[0].items()}
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    coef = max_norm / (norm + 1e-6)
    expected = {k: g.double() * coef if coef < 1.0 else g.double() for k, g in grads.items()}

    clones = {k: g.clone() for k, g in grads.items()}
    for g in clones.values():
        g.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(list(clones.values()), max_norm, foreach=False)
    torch_clipped = {k: g.grad for k, g in clones.items()}

    clip = clip_by_global_norm(max_norm)
    for flat in (False, True):
        clipped, state = clip.update(container(grads, flat), clip.init(grads))
        assert state == EmptyState()
        clipped = as_dict(clipped)
        assert_trees_close(clipped, expected, f"clip flat={flat}", rtol=1e-6, atol=0.0)
        assert_trees_close(clipped, torch_clipped, f"clip vs torch flat={flat}", rtol=1e-6, atol=0.0)
        if coef >= 1.0:
            assert all(torch.equal(clipped[k], grads[k]) for k in grads), "unclipped grads must be unchanged"


@given(problems(), st.floats(0.1, 3.0), adam_hparams())
def test_chain_clip_adamw_matches_torch(problem: Problem, max_norm: float, hp: dict) -> None:
    opt = chain(clip_by_global_norm(max_norm), adamw(**hp))
    expected, _ = run_torch(
        lambda ps: torch.optim.AdamW(ps, lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"],
                                     weight_decay=hp["weight_decay"], foreach=False),
        problem,
        before_step=lambda ps: torch.nn.utils.clip_grad_norm_(ps, max_norm, foreach=False),
    )
    for fused, flat in PATHS:
        params, state = run(opt, problem, fused=fused, flat=flat)
        assert_trees_close(params, expected, f"chain(clip, adamw) fused={fused} flat={flat}")
        assert isinstance(state, tuple) and len(state) == 2
        assert state[0] == EmptyState()
        assert isinstance(state[1], AdamState) and state[1].count == problem.steps


def test_chain_state_structure() -> None:
    params = {"a": torch.ones(2), "b": torch.ones(())}
    opt = chain(clip_by_global_norm(1.0), adamw(1e-2))
    state = opt.init(params)
    assert type(state) is tuple and len(state) == 2
    assert state[0] == EmptyState()
    assert isinstance(state[1], AdamState) and state[1].count == 0 and state[1].lr == 1e-2
    assert sorted(state[1].mu) == ["a", "b"] and all(not x.any() for x in state[1].mu.values())
    _, state = opt.update({"a": torch.ones(2), "b": torch.ones(())}, state, params)
    assert state[0] == EmptyState() and state[1].count == 1
    assert chain().init(params) == () and chain().update(params, (), params) == (params, ())


# --------------------------------------------------------------------------- purity and apply == update


@st.composite
def all_optimizers(draw) -> list[GradientTransformation]:
    """Every optimizer (and chains with clipping), with random hyperparameters."""
    clip = clip_by_global_norm(draw(st.floats(0.1, 3.0)))
    return [
        adam(**draw(adam_hparams())),
        adamw(**draw(adam_hparams())),
        adam(**draw(adam_hparams()), bias_correction=False),
        adamw(lr_schedule(0.01), b1_schedule(0.9)),
        lamb(**draw(lamb_hparams())),
        sgd(**draw(sgd_hparams())),
        clip,
        chain(clip, lamb(**draw(lamb_hparams()))),
        chain(clip, sgd(**draw(sgd_hparams()))),
    ]


def storages(tree) -> set[int]:
    tensors = [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor) and x.numel()]
    return {x.untyped_storage().data_ptr() for x in tensors}


@given(problems(), all_optimizers(), st.booleans())
def test_update_is_pure(problem: Problem, opts: list[GradientTransformation], flat: bool) -> None:
    """`update` leaves grads, state and params untouched, and its new state shares no memory with
    grads or params (train_step reuses those buffers). Checked on the first update and on a later
    one (count > 0 branches: momentum, bias correction)."""
    for opt in opts:
        params = container(problem.params, flat)
        state = opt.init(params)
        for count in range(2):
            grads = container(problem.grads[count % problem.steps], flat)
            saved = clone_tree((grads, state, params))
            updates, new_state = opt.update(grads, state, params)
            what = f"{opt!r} at count {count}"
            assert_identical((grads, state, params), saved, f"{what}: an input of update()")
            shared = storages(new_state) & (storages(grads) | storages(params))
            assert not shared, f"{what}: new state aliases an input"
            params, state = apply_updates(params, updates), new_state


@given(problems(), all_optimizers())
def test_apply_equals_update_then_apply_updates(problem: Problem, opts: list[GradientTransformation]) -> None:
    for opt in opts:
        for flat in (False, True):
            ref_params, ref_state = run(opt, problem, fused=False, flat=flat)
            params, state = run(opt, problem, fused=True, flat=flat)
            assert_trees_close(params, ref_params, f"{opt!r} flat={flat}")
            ref_leaves, leaves = tree_leaves(ref_state), tree_leaves(state)
            assert len(leaves) == len(ref_leaves)
            for a, b in zip(leaves, ref_leaves):
                if isinstance(b, torch.Tensor):
                    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
                else:
                    assert a == b


@given(problems(), all_optimizers())
def test_optimizer_step_without_apply_uses_update(problem: Problem, opts: list) -> None:
    """`optimizer_step` on a transform without `apply` falls back to update + in-place add."""
    for opt in opts:
        plain = opt._replace(apply=None)
        params = container(problem.params, False)
        state = plain.init(params)
        for grads in problem.grads:
            params, state = optimizer_step(plain, container(grads, False), state, params)
        expected, _ = run(opt, problem, fused=False, flat=False)
        assert_trees_close(params, expected, repr(opt), rtol=0.0, atol=0.0)


# --------------------------------------------------------------------------- 7. learning_rate


@given(problems(), lr_st, st.sampled_from(["adam", "lamb", "sgd", "chain"]))
def test_learning_rate_is_the_lr_of_the_next_update(problem: Problem, base: float, kind: str) -> None:
    schedule = lambda count: base / (1.0 + count)  # noqa: E731
    opt = {
        "adam": adamw(schedule), "lamb": lamb(schedule), "sgd": sgd(schedule),
        "chain": chain(clip_by_global_norm(1e9), sgd(schedule)),
    }[kind]
    params = container(problem.params, False)
    state = opt.init(params)
    for count, grads in enumerate(problem.grads):
        lr = learning_rate(state)
        assert lr == schedule(count)
        updates, state = opt.update(grads, state, params)
        if kind in ("sgd", "chain"):  # the update is -lr * g: check the lr really used
            for k, g in grads.items():
                torch.testing.assert_close(updates[k], -lr * g, rtol=1e-6, atol=0.0)
        params = apply_updates(params, updates)
    assert learning_rate(state) == schedule(problem.steps)
    assert learning_rate(EmptyState()) is None


# --------------------------------------------------------------------------- 8. bad hyperparameters


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: adam(lr=-1e-3), ValueError, r"lr=-0\.001"),
        (lambda: adamw(lr=float("nan")), TypeError, r"lr=nan"),
        (lambda: adam(b1=1.0), ValueError, r"b1=1\.0 must be in \[0, 1\)"),
        (lambda: adam(b2=1.5), ValueError, r"b2=1\.5"),
        (lambda: adam(b1=-0.1), ValueError, r"b1=-0\.1"),
        (lambda: adam(eps=-1e-8), ValueError, r"eps"),
        (lambda: adamw(weight_decay=-0.1), ValueError, r"weight_decay=-0\.1"),
        (lambda: adam(lr="0.1"), TypeError, r"lr='0\.1'"),
        (lambda: adam(b2=lambda count: 0.999), TypeError, r"b2"),
        (lambda: adamw(weight_decay=lambda count: 0.01), TypeError, r"weight_decay"),
        (lambda: lamb(b1=1.0), ValueError, r"b1"),
        (lambda: lamb(eps=lambda count: 1e-8), TypeError, r"eps"),
        (lambda: lamb(min_coeff=2.0, max_coeff=1.0), ValueError, r"min_coeff=2\.0, max_coeff=1\.0"),
        (lambda: lamb(min_coeff=0.0), ValueError, r"min_coeff=0\.0"),
        (lambda: sgd(lr=-0.1), ValueError, r"lr=-0\.1"),
        (lambda: sgd(0.1, momentum=1.0), ValueError, r"momentum=1\.0"),
        (lambda: sgd(0.1, nesterov=True), ValueError, r"nesterov needs momentum"),
        (lambda: sgd(0.1, 0.9, dampening=0.1, nesterov=True), ValueError, r"dampening=0\.1"),
        (lambda: sgd(0.1, 0.9, dampening=lambda count: 0.0), TypeError, r"dampening"),
        (lambda: clip_by_global_norm(0.0), ValueError, r"max_norm=0\.0"),
        (lambda: clip_by_global_norm(float("inf")), ValueError, r"max_norm=inf"),
        (lambda: chain(adam(), "sgd"), TypeError, r"argument 1 is str"),
    ],
)
def test_bad_hyperparameters_raise_clear_errors(build, error, match) -> None:
    with pytest.raises(error, match=match):
        build()


def test_chain_rejects_state_of_the_wrong_length() -> None:
    params = {"a": torch.ones(2)}
    opt = chain(clip_by_global_norm(1.0), adamw())
    state = opt.init(params)
    with pytest.raises(ValueError, match="chain of 2 transforms got a tuple of 1 states as its state"):
        opt.update(params, state[:1], params)
    with pytest.raises(ValueError, match="chain of 2 transforms got AdamState as its state"):
        opt.apply(params, state[1], params)


def test_update_without_params_when_needed_raises() -> None:
    grads = {"a": torch.ones(2)}
    for opt, match in [
        (adamw(weight_decay=0.1), "adamw with weight_decay needs params"),
        (sgd(0.1, weight_decay=0.1), "sgd with weight_decay needs params"),
        (lamb(), "lamb needs params"),
    ]:
        with pytest.raises(ValueError, match=match):
            opt.update(grads, opt.init(grads))
