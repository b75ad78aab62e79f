"""1-bit Adam, 0/1 Adam and 1-bit LAMB in one process: warmup = Adam/LAMB exactly, DeepSpeed's
schedules and factor logic against plain transcriptions, checkpoints with error buffers, the ZeRO
refusal (multi-rank training: test_onebit_distributed)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed as fs
from fspeed.flat import Flat
from fspeed.optim.onebit import ZeroOneAdamState, zero_one_counters, zero_one_full_allreduce
from fspeed.optim.onebit_lamb import frozen_factor, momentum_scaling

SHAPES = {"a": (5, 3), "b": (7,), "c": (40,)}  # 62 elements: no segment fills a 16- or 32-element unit


def tree(seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=gen) for k, s in SHAPES.items()}


# ---------------------------------------------------------------------------------- warmup


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), wd=st.sampled_from([0.0, 0.1]), steps=st.integers(1, 6))
def test_warmup_equals_adam_and_lamb_exactly(seed, wd, steps):
    pairs = [
        (fs.optim.onebit_adam(3e-3, freeze_step=steps, weight_decay=wd),
         fs.optim.adamw(3e-3, weight_decay=wd, bias_correction=False, backend="torch")),
        (fs.optim.zero_one_adam(3e-3, weight_decay=wd, var_update_scaler=steps),
         fs.optim.adamw(3e-3, weight_decay=wd, bias_correction=False, backend="torch")),
        (fs.optim.onebit_lamb(3e-3, freeze_step=steps, weight_decay=wd),
         fs.optim.lamb(3e-3, weight_decay=wd, bias_correction=False, backend="torch")),
    ]
    gen = torch.Generator().manual_seed(seed + 1)
    grads = [torch.randn(62, generator=gen) for _ in range(steps)]
    for onebit, reference in pairs:
        p1 = Flat.from_tree(tree(seed))
        p2 = p1.clone()
        s1, s2 = onebit.init(p1), reference.init(p2)
        for g in grads:
            assert onebit.gradient_allreduce(s1)
            p1, s1 = onebit.apply(Flat(g.clone(), p1.layout), s1, p1)
            p2, s2 = reference.apply(Flat(g.clone(), p2.layout), s2, p2)
            assert torch.equal(p1.buffer, p2.buffer), onebit
            assert torch.equal(s1.mu.buffer, s2.mu.buffer) and torch.equal(s1.nu.buffer, s2.nu.buffer)


def test_update_is_the_pure_form_of_apply():
    opt = fs.optim.onebit_adam(1e-2, freeze_step=1)
    params = Flat.from_tree(tree(0))
    state = opt.init(params)
    g = Flat(torch.randn(62), params.layout)
    before = params.buffer.clone()
    updates, new_state = opt.update(g, state, params)
    assert torch.equal(params.buffer, before) and state.count == 0 and new_state.count == 1
    applied, _ = opt.apply(g, state, params)
    torch.testing.assert_close(before + updates.buffer, applied.buffer, rtol=0, atol=1e-7)


def test_pytrees_work_like_flats():
    opt = fs.optim.onebit_lamb(1e-2, freeze_step=2, weight_decay=0.01)
    flat = Flat.from_tree(tree(3))
    plain = tree(3)
    sf, sp = opt.init(flat), opt.init(plain)
    for i in range(4):
        g = torch.randn(62, generator=torch.Generator().manual_seed(i))
        flat, sf = opt.apply(Flat(g.clone(), flat.layout), sf, flat)
        plain, sp = opt.apply(Flat(g.clone(), flat.layout).tree(), sp, plain)
    torch.testing.assert_close(Flat.from_tree(plain).buffer, flat.buffer, rtol=0, atol=0)


# ---------------------------------------------------------------------------------- schedules


def deepspeed_zero_one_schedule(steps, var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper):
    """Transcription of ZeroOneAdam.step's bookkeeping (after its initialization call): per step,
    (variance updated from a full all-reduce?, local sync happened?)."""
    var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
    freeze_key, allreduce_enabled = False, True
    out = []
    for step in range(1, steps + 1):
        if not freeze_key:
            full = step % var_interval == 0
            assert full == allreduce_enabled  # the engine flag set at the end of the previous step
            synced = False
        else:
            full = False
            synced = step % local_interval == 0
        if not freeze_key:
            if step % var_interval == 0:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            allreduce_enabled = (step + 1) % var_interval == 0
        else:
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter, local_interval = 0, min(local_step_clipper, local_interval * 2)
        if step > var_freeze_step:
            freeze_key, allreduce_enabled = True, False
        out.append((full, synced, var_interval, local_interval))
    return out


@settings(max_examples=30, deadline=None)
@given(var_freeze_step=st.integers(0, 300), var_update_scaler=st.integers(1, 8), local_step_scaler=st.integers(1, 20),
       local_step_clipper=st.integers(1, 16))
def test_zero_one_interval_schedules_follow_deepspeed(var_freeze_step, var_update_scaler, local_step_scaler,
                                                      local_step_clipper):
    steps = var_freeze_step + 200
    ref = deepspeed_zero_one_schedule(steps, var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)
    state = ZeroOneAdamState(0, 0.0, None, None, None, 0.0, 1, 0, 1, 0, None, None)
    for t, (full, synced, var_interval, local_interval) in enumerate(ref, 1):
        assert zero_one_full_allreduce(state, var_freeze_step) == full, t
        if t > var_freeze_step + 1:
            assert (t % state.local_step_interval == 0) == synced, t
        counters = zero_one_counters(state, t, var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)
        state = state._replace(count=t, **counters)
        assert (state.var_interval, state.local_step_interval) == (var_interval, local_interval), t


def test_zero_one_default_schedule_doubles_every_16_variance_updates():
    state = ZeroOneAdamState(0, 0.0, None, None, None, 0.0, 1, 0, 1, 0, None, None)
    full_steps = []
    for t in range(1, 200):
        if zero_one_full_allreduce(state, 100000):
            full_steps.append(t)
        state = state._replace(count=t, **zero_one_counters(state, t, 100000, 16, 32678, 16))
    assert full_steps[:17] == list(range(1, 17)) + [18]
    assert full_steps[16:32] == list(range(18, 50, 2)) and full_steps[32:35] == [52, 56, 60]


# ---------------------------------------------------------------------------------- 1-bit LAMB factor


def deepspeed_factor(ratio, last, update_ratio, factor_min, factor_max, threshold):
    factor = ratio
    if update_ratio is not None:
        factor = factor * update_ratio + (1.0 - update_ratio)
    if factor > factor_max:
        factor = factor_max
    if factor < factor_min:
        factor = factor_min
    if factor > last * (1.0 + threshold):
        factor = last * (1.0 + threshold)
    if factor < last * (1.0 - threshold):
        factor = last * (1.0 - threshold)
    return factor


@settings(max_examples=50, deadline=None)
@given(ratios=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=6), lasts=st.lists(st.floats(0.3, 5.0), min_size=6,
       max_size=6), fmin=st.floats(0.1, 1.0), span=st.floats(0.0, 5.0), thr=st.floats(0.0, 0.5))
def test_frozen_factor_matches_plain_transcription(ratios, lasts, fmin, span, thr):
    last = torch.tensor(lasts[: len(ratios)], dtype=torch.float64)
    got = frozen_factor(torch.tensor(ratios, dtype=torch.float64), last, fmin, fmin + span, thr)
    want = [deepspeed_factor(r, l, None, fmin, fmin + span, thr) for r, l in zip(ratios, lasts)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-15, atol=0)


def test_momentum_scaling_equalises_rms():
    sizes = [4, 9, 16]
    m = [torch.full((s,), v) for s, v in zip(sizes, (1.0, 3.0, 0.0))]
    norms = torch.stack([x.norm() for x in m])
    scaling = momentum_scaling(norms, sizes)
    # rms = 1, 3, 0 -> mean 4/3; a zero momentum keeps scaling 1 (DeepSpeed would divide by zero)
    torch.testing.assert_close(scaling, torch.tensor([4 / 3, 4 / 9, 1.0], dtype=torch.float64))


def test_onebit_lamb_compression_step_against_transcription():
    """One process (no compression, as DeepSpeed's world of 1): the frozen-coefficient update per
    tensor, written plainly with Python floats as DeepSpeed does."""
    lr, b1, b2, eps, wd, freeze, cb = 1e-2, 0.9, 0.999, 1e-8, 0.01, 3, 0.9
    opt = fs.optim.onebit_lamb(lr, freeze, b1, b2, eps, wd, coeff_beta=cb)
    params = Flat.from_tree(tree(5))
    state = opt.init(params)
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(62, generator=gen) for _ in range(freeze + 3)]
    # the transcription, per tensor
    ps = [t.clone().double() for t in params.segments()]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    vfs, freeze_coeff, last = [None] * len(ps), [0.0] * len(ps), [1.0] * len(ps)
    scaling = None
    for t, g in enumerate(grads, 1):
        gs = [x.double() for x in g.split([p.numel() for p in ps])]
        params, state = opt.apply(Flat(g.clone(), params.layout), state, params)
        if t <= freeze:
            for j, (p, m, v, gj) in enumerate(zip(ps, ms, vs, gs)):
                m.mul_(b1).add_(gj, alpha=1 - b1)
                v.mul_(b2).addcmul_(gj, gj, value=1 - b2)
                if t == freeze:
                    vfs[j] = v.clone()
                u = m / (v.sqrt() + eps) + wd * p
                c = 1.0
                if p.norm() > 0 and u.norm() > 0:
                    c = min(max((p.norm() / u.norm()).item(), 0.01), 10.0)
                if c != 1.0:
                    freeze_coeff[j] = cb * freeze_coeff[j] + (1 - cb) * c
                p.add_(-lr * c * u)
            continue
        if scaling is None:
            rms = [(m.norm() / math.sqrt(m.numel())).item() for m in ms]
            scaling = [sum(rms) / len(rms) / r for r in rms]
        for j, (p, m, v, gj) in enumerate(zip(ps, ms, vs, gs)):
            prev = m.clone()
            m.mul_(b1).add_(gj, alpha=1 - b1)
            m.mul_(scaling[j]).div_(scaling[j])
            rec = (m - prev * b1) / (1 - b1)
            vfs[j].mul_(b2).addcmul_(rec, rec, value=1 - b2)
            denom = v.sqrt() + eps
            prelim = m / denom
            u = prelim + wd * p
            ratio = min(1.0, (prelim.norm() / u.norm()).item())
            factor = deepspeed_factor((denom / (vfs[j].sqrt() + eps)).max().item(), last[j], ratio, 0.5, 4.0, 0.1)
            last[j] = factor
            p.add_(-lr * freeze_coeff[j] * factor * u)
        torch.testing.assert_close(state.last_factor, torch.tensor(last, dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(state.coeff_freeze, torch.tensor(freeze_coeff, dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(params.buffer.double(), torch.cat(ps), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- errors, checkpoints


def test_zero_stage_one_and_more_is_a_clear_error():
    """Refused when the state is built, and by the step for a state built with another optimizer."""
    mesh = fs.Mesh(data=-1)
    params = tree(0)
    for stage in (1, 2, 3):
        plan = fs.zero(stage)
        opt = fs.optim.onebit_adam(1e-3, freeze_step=2)
        with pytest.raises(ValueError, match=f"onebit_adam .* cannot run with ZeRO stage {stage}"):
            fs.init_train_state(params, opt, plan=plan, mesh=mesh)
        state = fs.init_train_state(params, fs.optim.adamw(1e-3), plan=plan, mesh=mesh)
        step = fs.make_train_step(linear_loss, opt, plan=plan, mesh=mesh)
        with pytest.raises(ValueError, match=f"cannot run with ZeRO stage {stage}"):
            step(state, batch_for(0, 4))


def test_chain_refuses_a_communicating_transform_before_the_end():
    with pytest.raises(ValueError, match="must be the last transform"):
        fs.optim.chain(fs.optim.onebit_adam(), fs.optim.clip_by_global_norm(1.0))


def test_world_mismatch_is_a_clear_error():
    opt = fs.optim.onebit_adam(world_size=2)
    params = Flat.from_tree(tree(0))
    state = opt.init(params)
    with pytest.raises(ValueError, match="built for a data-parallel size of 2"):
        opt.apply(Flat(torch.zeros(62), params.layout), state, params)


@pytest.mark.parametrize("make", [
    lambda: fs.optim.onebit_adam(1e-2, freeze_step=2, world_size=4),
    lambda: fs.optim.zero_one_adam(1e-2, var_freeze_step=2, var_update_scaler=1, world_size=4),
    lambda: fs.optim.onebit_lamb(1e-2, freeze_step=2, world_size=4),
])
def test_checkpoint_round_trips_error_buffers(tmp_path, make):
    opt = make()
    state = fs.init_train_state(tree(1), opt)
    # give every buffer distinct values, as after compressed steps on 4 ranks
    gen = torch.Generator().manual_seed(0)
    leaves = [x for x in fs.pytree.tree_leaves(state.opt_state) if isinstance(x, torch.Tensor)]
    for leaf in leaves:
        leaf.copy_(torch.randn(leaf.shape, generator=gen).to(leaf.dtype))
    state = state.replace(opt_state=state.opt_state._replace(count=7, lr=0.5))
    fs.checkpoint.save_checkpoint(tmp_path, state, tag="t")
    loaded, _ = fs.checkpoint.load_checkpoint(tmp_path, fs.init_train_state(tree(2), opt), tag="t")
    assert loaded.opt_state.count == 7
    for a, b in zip(leaves, [x for x in fs.pytree.tree_leaves(loaded.opt_state) if isinstance(x, torch.Tensor)]):
        assert torch.equal(a, b)
    assert torch.equal(loaded.opt_state.worker_error, state.opt_state.worker_error)


# ---------------------------------------------------------------------------------- multi-rank training


def linear_loss(params, batch, *, rng=None):
    """(p . mean of x over rows): gradients are exact dyadic numbers, so every reduction order agrees."""
    flat = torch.cat([params[k].reshape(-1) for k in sorted(params)])
    return (flat * batch["x"].mean(0)).sum()


def batch_for(step, rows, seed=0):
    x = torch.randint(-8, 9, (rows, 62), generator=torch.Generator().manual_seed(seed * 1000 + step)).float() / 16
    return {"x": x}


# ---------------------------------------------------------------------------------- configuration


def test_deepspeed_types_translate_case_insensitively():
    from fspeed.config import translate_deepspeed_config

    t = translate_deepspeed_config({"optimizer": {"type": "ZeroOneAdam", "params": {
        "lr": 1e-3, "var_freeze_step": 400, "local_step_clipper": 8, "cuda_aware": False, "comm_backend_name": "nccl",
        "bias_correction": False}}})
    assert "optimizer=zero_one_adam" in t.overrides
    assert "optimizer.var_freeze_step=400" in t.overrides and "optimizer.local_step_clipper=8" in t.overrides
    for key in ("cuda_aware", "comm_backend_name", "bias_correction"):
        assert any(item.startswith(f"optimizer.params.{key}") for item in t.no_effect), key
    for ds_type, kind in (("onebitadam", "onebit_adam"), ("OneBitLamb", "onebit_lamb")):
        t = translate_deepspeed_config({"optimizer": {"type": ds_type, "params": {"freeze_step": 20, "coeff_beta": 0.8}
                                                      if kind == "onebit_lamb" else {"freeze_step": 20}}})
        assert f"optimizer={kind}" in t.overrides and "optimizer.freeze_step=20" in t.overrides


def test_hydra_groups_build_and_refuse_zero_and_tensor_slicing():
    from hydra import compose, initialize_config_module

    from fspeed.config import ConfigError
    from fspeed.config.build import build_optimizer
    from fspeed.config.validate import to_run_config

    with initialize_config_module("conf", version_base=None):
        def run(*overrides):
            return to_run_config(compose("train", overrides=["checkpoint.dir=/tmp/x", *overrides]))

        built = build_optimizer(run("optimizer=onebit_adam", "optimizer.freeze_step=200", "train.gradient_clipping=0"))
        assert built.info.name == "onebit_adam" and built.info.hparams["freeze_step"] == 200
        assert build_optimizer(run("optimizer=zero_one_adam")).info.children[1].info.name == "zero_one_adam"
        assert build_optimizer(run("optimizer=onebit_lamb", "optimizer.factor_threshold=0.2")).gradient_allreduce
        for extra, what in (("zero.stage=1", r"zero\.stage=1"), ("parallel.tensor=2", r"parallel\.tensor=2")):
            with pytest.raises(ConfigError, match=what):
                run("optimizer=onebit_adam", extra)
