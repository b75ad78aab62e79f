"""train_step against plain references: accumulation, overflow skipping, donation, precision."""

import gc
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fspeed as fs
from fspeed.optim import adamw, chain, clip_by_global_norm, sgd
from fspeed.rng import dropout_seed
from fspeed.train_step import on_device, split_micro_batches


def tiny_gpt(dropout=0.0, vocab=40, seq=12):
    cfg = fs.models.GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=2, n_head=2, d_model=16, dropout=dropout)
    return cfg, fs.models.gpt(cfg)


def token_batch(rows, seq, vocab, seed):
    x = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return {"inputs": x[:, :-1], "targets": x[:, 1:]}


@given(seed=st.integers(0, 10_000), grad_accum=st.sampled_from([2, 3, 4]), micro=st.integers(1, 3),
       clip=st.sampled_from([None, 0.05]))
def test_grad_accum_equals_one_big_batch(seed, grad_accum, micro, clip):
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(seed))
    inner = sgd(0.5, momentum=0.9)  # linear in the gradients: Adam would amplify rounding of ~0 grads
    opt = chain(clip_by_global_norm(clip), inner) if clip else inner
    batch = token_batch(grad_accum * micro, cfg.seq_len, cfg.vocab_size, seed)
    accumulated = fs.init_train_state(params, opt)
    whole = fs.init_train_state(params, opt)
    for _ in range(2):
        accumulated, m_acc = fs.make_train_step(model.loss, opt, grad_accum=grad_accum)(accumulated, batch)
        whole, m_whole = fs.make_train_step(model.loss, opt, grad_accum=1)(whole, batch)
    torch.testing.assert_close(accumulated.params.buffer, whole.params.buffer, rtol=1e-5, atol=1e-6)
    assert math.isclose(m_acc["loss"], m_whole["loss"], rel_tol=1e-5)
    assert math.isclose(m_acc["grad_norm"], m_whole["grad_norm"], rel_tol=1e-4)


def test_train_step_matches_manual_grad_and_optimizer():
    """fspeed's step == torch.func.grad on the structured params + the optimizer's pure update."""
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(0))
    opt = chain(clip_by_global_norm(0.1), adamw(1e-2, weight_decay=0.1))
    batch = token_batch(4, cfg.seq_len, cfg.vocab_size, 1)
    state = fs.init_train_state(params, opt)
    state, metrics = fs.make_train_step(model.loss, opt)(state, batch)

    ref_params = {k: v for k, v in params.items()}
    grads = torch.func.grad(lambda p: model.loss(p, batch))(ref_params)
    updates, _ = opt.update(grads, opt.init(ref_params), ref_params)
    expected = fs.optim.apply_updates(ref_params, updates)
    got = state.params.tree()
    for path, value in fs.Flat.from_tree(expected).items():
        torch.testing.assert_close(state.params[path], value, rtol=1e-5, atol=1e-6)
    assert metrics["grad_norm"] == pytest.approx(float(fs.optim.global_norm(grads)), rel=1e-5)
    assert got["wte"].shape == params["wte"].shape


def poisoned_loss(model):
    """model.loss times batch['mult'][0]: an inf multiplier makes every gradient inf/NaN."""

    def loss(params, batch, *, rng=None):
        core = {k: v for k, v in batch.items() if k != "mult"}
        return model.loss(params, core, rng=rng) * batch["mult"][0]

    return loss


def test_fp16_overflow_skips_step_and_follows_hysteresis():
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(0))
    opt = adamw(fs.optim.warmup(0.0, 1e-2, num_steps=5))
    precision = fs.precision.fp16(initial_scale_power=10, hysteresis=2)
    state = fs.init_train_state(params, opt, precision=precision)
    step = fs.make_train_step(poisoned_loss(model), opt, grad_accum=2)
    batch = token_batch(4, cfg.seq_len, cfg.vocab_size, 0)
    clean = dict(batch, mult=torch.ones(4))
    bad = dict(batch, mult=torch.full((4,), math.inf))

    state, m = step(state, clean)
    assert not m["skipped"] and m["loss_scale"] == 1024
    snapshot = [t.clone() for t in (state.params.buffer, state.master.buffer, state.opt_state.mu.buffer,
                                    state.opt_state.nu.buffer)]
    count, lr = state.opt_state.count, state.lr

    state, m = step(state, bad)  # first overflow: hysteresis 2 -> 1, scale kept
    assert m["skipped"] and state.skipped_steps == 1 and state.step == 2
    assert state.loss_scale.scale == 1024 and state.loss_scale.cur_hysteresis == 1
    state, m = step(state, bad)  # second overflow: scale halved
    assert m["skipped"] and state.skipped_steps == 2 and state.loss_scale.scale == 512
    after = (state.params.buffer, state.master.buffer, state.opt_state.mu.buffer, state.opt_state.nu.buffer)
    for before, now in zip(snapshot, after):
        assert torch.equal(before, now)  # bitwise unchanged
    assert state.opt_state.count == count and state.lr == lr  # the schedule did not advance

    state, m = step(state, clean)
    assert not m["skipped"] and m["loss_scale"] == 512 and state.opt_state.count == count + 1


def test_overflow_at_min_scale_raises_and_keeps_state_usable():
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(0))
    opt = adamw(1e-3)
    precision = fs.precision.fp16(initial_scale_power=0, hysteresis=1, min_loss_scale=1)
    state = fs.init_train_state(params, opt, precision=precision)
    step = fs.make_train_step(poisoned_loss(model), opt)
    batch = token_batch(2, cfg.seq_len, cfg.vocab_size, 0)
    with pytest.raises(fs.LossScaleAtMinimumError, match="raise_at_min_scale"):
        step(state, dict(batch, mult=torch.full((2,), math.inf)))
    state, m = step(state, dict(batch, mult=torch.ones(2)))  # the failed call did not consume the state
    assert not m["skipped"]

    carry_on = fs.precision.fp16(initial_scale_power=0, hysteresis=1, raise_at_min_scale=False)
    state = fs.init_train_state(params, opt, precision=carry_on)
    for _ in range(3):
        state, m = step(state, dict(batch, mult=torch.full((2,), math.inf)))
        assert m["skipped"] and state.loss_scale.scale == 1.0


def test_bf16_nan_skips_step_fp32_does_not():
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(0))
    opt = sgd(0.1)
    batch = token_batch(2, cfg.seq_len, cfg.vocab_size, 0)
    bad = dict(batch, mult=torch.full((2,), math.nan))
    state = fs.init_train_state(params, opt, precision=fs.precision.bf16())
    state, m = fs.make_train_step(poisoned_loss(model), opt)(state, bad)
    assert m["skipped"]
    state = fs.init_train_state(params, opt, precision=fs.precision.bf16(check_grad_overflow=False))
    state, m = fs.make_train_step(poisoned_loss(model), opt)(state, bad)
    assert not m["skipped"] and torch.isnan(state.params.buffer).any()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16_static"])
def test_divergence_guard_stops_naming_the_step_or_skips(precision):
    """A non-finite step is never applied (fp32, bf16, static fp16): on_nonfinite='stop' raises naming
    the step and leaves the state untouched, 'skip' skips the step; an unknown value is refused."""
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(0))
    opt = sgd(0.1)
    policy = fs.precision.fp16(loss_scale=128.0) if precision == "fp16_static" else getattr(fs.precision, precision)()
    batch = token_batch(2, cfg.seq_len, cfg.vocab_size, 0)
    bad = dict(batch, mult=torch.full((2,), math.nan))
    state = fs.init_train_state(params, opt, precision=policy)
    stop = fs.make_train_step(poisoned_loss(model), opt, on_nonfinite="stop")
    state, _ = stop(state, dict(batch, mult=torch.ones(2)))
    before = state.params.buffer.clone()
    with pytest.raises(FloatingPointError, match=r"step 2: the loss is nan .*the state is still that of step 1"):
        stop(state, bad)
    assert state.step == 1 and torch.equal(state.params.buffer, before)  # not donated, untouched
    state, m = fs.make_train_step(poisoned_loss(model), opt, on_nonfinite="skip")(state, bad)
    assert m["skipped"] and state.skipped_steps == 1 and torch.equal(state.params.buffer, before)
    with pytest.raises(ValueError, match="on_nonfinite='halt'; allowed: None, 'stop', 'skip'"):
        fs.make_train_step(model.loss, opt, on_nonfinite="halt")


def test_divergence_guard_leaves_dynamic_fp16_to_the_loss_scaler():
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(0))
    state = fs.init_train_state(params, sgd(0.1), precision=fs.precision.fp16(initial_scale_power=4))
    bad = dict(token_batch(2, cfg.seq_len, cfg.vocab_size, 0), mult=torch.full((2,), math.inf))
    state, m = fs.make_train_step(poisoned_loss(model), sgd(0.1), on_nonfinite="stop")(state, bad)
    assert m["skipped"] and state.loss_scale.cur_hysteresis == 1  # an overflow, as DeepSpeed handles it


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_mixed_precision_masters_and_compute_copy(name):
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(0))
    opt = sgd(0.5, momentum=0.9)
    precision = getattr(fs.precision, name)()
    state = fs.init_train_state(params, opt, precision=precision)
    assert state.master.dtype == torch.float32 and state.params.dtype == precision.param_dtype
    batch = token_batch(4, cfg.seq_len, cfg.vocab_size, 0)
    reference = fs.init_train_state(params, opt)
    step = fs.make_train_step(model.loss, opt, grad_accum=2)
    for _ in range(3):
        state, m = step(state, batch)
        reference, m_ref = step(reference, batch)
        assert m["loss"] == pytest.approx(m_ref["loss"], rel=2e-2)
    assert torch.equal(state.params.buffer, state.master.buffer.to(precision.param_dtype))
    # low-precision training tracks fp32 training closely on a few steps
    torch.testing.assert_close(state.master.buffer, reference.params.buffer, rtol=0, atol=5e-3)


def test_fp16_unscaled_grad_norm_matches_fp32():
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(0))
    batch = token_batch(4, cfg.seq_len, cfg.vocab_size, 0)
    _, m16 = fs.make_train_step(model.loss, sgd(0.0))(fs.init_train_state(params, sgd(0.0), precision=fs.precision.fp16()), batch)
    _, m32 = fs.make_train_step(model.loss, sgd(0.0))(fs.init_train_state(params, sgd(0.0)), batch)
    assert m16["loss_scale"] == 2**16
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=2e-2)


def test_donated_state_raises_clear_error():
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(0))
    opt = adamw(1e-3)
    state = fs.init_train_state(params, opt)
    step = fs.make_train_step(model.loss, opt)
    batch = token_batch(2, cfg.seq_len, cfg.vocab_size, 0)
    new_state, _ = step(state, batch)
    with pytest.raises(fs.DonatedStateError, match="donated to train_step at step 0"):
        state.params
    with pytest.raises(fs.DonatedStateError):
        step(state, batch)
    assert "donated" in repr(state)
    assert new_state.step == 1 and new_state.samples == 2
    with pytest.raises(AttributeError, match="immutable"):
        new_state.step = 3


def test_state_is_a_pytree_for_optree_and_torch():
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(0))
    state = fs.init_train_state(params, adamw(1e-3), precision=fs.precision.bf16())
    doubled = fs.tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, state)
    assert isinstance(doubled, fs.TrainState) and doubled.precision.name == "bf16"
    torch.testing.assert_close(doubled.master.buffer, state.master.buffer * 2)
    leaves, spec = torch.utils._pytree.tree_flatten(state)
    assert isinstance(torch.utils._pytree.tree_unflatten(leaves, spec), fs.TrainState)
    paths = fs.tree_paths(state)
    assert "params.flat" in paths and "opt_state.mu.flat" in paths and "loss_scale.scale" in paths


def test_dropout_is_reproducible_and_varies_across_micro_batches():
    cfg, model = tiny_gpt(dropout=0.3)
    params = model.init(torch.Generator().manual_seed(0))
    batch = token_batch(4, cfg.seq_len, cfg.vocab_size, 0)
    results = []
    for _ in range(2):
        state = fs.init_train_state(params, adamw(1e-2), seed=7)
        state, m = fs.make_train_step(model.loss, adamw(1e-2), grad_accum=2)(state, batch)
        results.append((state.params.buffer.clone(), m["loss"]))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]
    other = fs.init_train_state(params, adamw(1e-2), seed=8)
    other, _ = fs.make_train_step(model.loss, adamw(1e-2), grad_accum=2)(other, batch)
    assert not torch.equal(other.params.buffer, results[0][0])
    assert len({dropout_seed(0, s, i) for s in range(50) for i in range(4)}) == 200


def test_split_micro_batches_errors_and_views():
    batch = {"a": torch.arange(12).view(6, 2), "b": torch.arange(6)}
    parts = split_micro_batches(batch, 3)
    assert [p["b"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="grad_accum=4 does not divide"):
        split_micro_batches(batch, 4)
    with pytest.raises(ValueError, match="leading"):
        split_micro_batches({"a": torch.zeros(4, 1), "b": torch.zeros(3)}, 1)
    with pytest.raises(ValueError, match="grad_accum"):
        fs.make_train_step(lambda p, b, rng=None: 0, adamw(1e-3), grad_accum=0)


def test_on_device_moves_the_batch_tensors_only_off_the_cpu():
    batch = {"inputs": torch.arange(6).view(2, 3), "mask": (torch.ones(2, 3),), "name": "rows", "none": None}
    assert on_device(batch, torch.device("cpu")) is batch  # the CPU step takes the batch as it is
    moved = on_device(batch, torch.device("meta"))  # a device other than the CPU, on any machine
    assert moved["inputs"].device.type == "meta" and moved["mask"][0].device.type == "meta"
    assert moved["inputs"].shape == (2, 3) and moved["name"] == "rows" and moved["none"] is None
    assert batch["inputs"].device.type == "cpu"  # the caller's batch is left alone


def test_eval_step_and_lr_property():
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(0))
    opt = adamw(fs.optim.warmup(0.0, 1e-2, num_steps=10, warmup_type="linear"))
    state = fs.init_train_state(params, opt)
    assert state.lr == 0.0
    batch = token_batch(2, cfg.seq_len, cfg.vocab_size, 0)
    before = fs.make_eval_step(model.loss)(state, batch)
    assert before == pytest.approx(float(model.loss(params, batch)), rel=1e-6)
    state, m = fs.make_train_step(model.loss, opt)(state, batch)
    assert m["lr"] == 0.0 and state.lr == 0.0  # WarmupLR's first two updates run at min_lr
    state, m = fs.make_train_step(model.loss, opt)(state, batch)
    assert state.lr == pytest.approx(1e-3)


@pytest.mark.parametrize("pause_gc", [True, False])
def test_step_holds_the_garbage_collector_off_and_restores_it(pause_gc):
    cfg, model = tiny_gpt()
    seen = []

    def loss(params, batch, *, rng=None):
        seen.append(gc.isenabled())
        return model.loss(params, batch, rng=rng)

    opt = adamw(1e-3)
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt)
    step = fs.make_train_step(loss, opt, grad_accum=2, pause_gc=pause_gc)
    assert gc.isenabled()
    state, _ = step(state, token_batch(4, cfg.seq_len, cfg.vocab_size, 0))
    assert seen == [not pause_gc] * 2 and gc.isenabled()
    gc.disable()  # a caller's choice stands
    try:
        step(state, token_batch(4, cfg.seq_len, cfg.vocab_size, 1))
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("remat", [False, True])
def test_functionalized_step_leaves_no_reference_cycles(remat):
    """Held off in the step, the collector must have nothing of fspeed's to find after it: a forward's
    module routes and its units' closures must not hold each other (they did, once per unit per
    micro-batch). (torch.utils.checkpoint's own pytree flattening leaves a few cycles of its own.)"""
    from tests.hf_models import hf_gpt2, lm_batch, lm_loss

    model = fs.functionalize(hf_gpt2(), lm_loss)
    model = fs.remat(model, where=["transformer.h.0"]) if remat else model
    opt = adamw(1e-3)
    state = fs.init_train_state(model.init(), opt, model=model)
    step = fs.make_train_step(model.loss, opt, grad_accum=2)
    state, _ = step(state, lm_batch(4, 0))
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        state, _ = step(state, lm_batch(4, 1))
        gc.collect()
        ours = [o for o in gc.garbage if (getattr(o, "__module__", None) or type(o).__module__).startswith("fspeed")]
        functions = {o.__qualname__ for o in gc.garbage if type(o).__name__ == "function"}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not ours
    assert functions <= ({"tree_flatten.<locals>.helper"} if remat else set())


class _HandsOverOddGradients(torch.nn.Module):
    """Parameters whose gradients backward hands over shared, expanded or not at all: `a` and `b` get
    one tensor (an add's backward), `s` a stride-0 one (a sum's), `unused` none, `sometimes` one on
    the micro-batches whose inputs sum above zero (as a layer that progressive layer dropping skips)."""

    def __init__(self, width: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.w = torch.nn.Linear(width, width)
        self.a = torch.nn.Parameter(torch.randn(width))
        self.b = torch.nn.Parameter(torch.randn(width))
        self.s = torch.nn.Parameter(torch.randn(3))
        self.unused = torch.nn.Parameter(torch.randn(2))
        self.sometimes = torch.nn.Parameter(torch.randn(width))

    def forward(self, x):
        out = (self.w(x) * (self.a + self.b)).sum(-1) + self.s.sum()
        return out + (x * self.sometimes).sum(-1) if x.sum() > 0 else out


@given(seed=st.integers(0, 10_000), width=st.integers(2, 6), grad_accum=st.sampled_from([1, 2, 3]),
       clip=st.sampled_from([None, 0.01]), groups=st.sampled_from([None, "mask", "mask in groups"]))
def test_loose_gradients_train_as_the_flat_buffer_does(seed, width, grad_accum, clip, groups):
    """One process in fp32 hands AdamW backward's own gradient tensors (no flat gradient buffer, none
    held between steps): the same parameters, loss and grad norm as the flat buffer's path; with a
    weight-decay mask too (parameter groups hand each group its runs of the tensors)."""
    module = _HandsOverOddGradients(width, seed)
    model = fs.functionalize(module, lambda out, batch: out.square().mean())
    batch = (torch.randn(4 * grad_accum, width, generator=torch.Generator().manual_seed(seed)),)
    runs = {}
    for name in ("loose", "flat"):
        adam = adamw(1e-2, weight_decay=0.1, mask=(lambda path: path not in ("w.bias", "a")) if groups else None)
        if groups == "mask in groups":  # an outer param_groups hands the masked one its runs of the tensors
            adam = fs.optim.param_groups(adam, [{"params": ["w.*", "s"], "lr_scale": 0.5}])
        inner = adam if name == "loose" else fs.optim.GradientTransformation(adam.init, adam.update)  # no fused apply
        opt = chain(clip_by_global_norm(clip), inner) if clip else inner
        state = fs.init_train_state(model.init(), opt, model=model)
        step = fs.make_train_step(model.loss, opt, grad_accum=grad_accum)
        metrics = []
        for _ in range(3):
            state, m = step(state, batch)
            metrics += [m["loss"], m["grad_norm"]]
        runs[name] = (state.params.buffer.clone(), metrics, step.persistent_grad_bytes())
    torch.testing.assert_close(runs["loose"][0], runs["flat"][0], rtol=1e-6, atol=1e-7)
    assert runs["loose"][1] == pytest.approx(runs["flat"][1], rel=1e-6)
    assert runs["loose"][2] == 0 and runs["flat"][2] > 0  # the loose path ran, and holds no buffer


@given(seed=st.integers(0, 10_000), width=st.integers(2, 6), grad_accum=st.sampled_from([1, 2]),
       loose=st.booleans(), backend=st.sampled_from(["auto", "torch"]), mask=st.booleans(),
       precision=st.sampled_from(["fp32", "bf16 unchecked"]))
def test_the_grad_norm_from_the_update_pass_is_the_norm_taken_before_it(seed, width, grad_accum, loose, backend,
                                                                         mask, precision):
    """Where nothing reads the grad norm before the update, AdamW's own pass over the gradient sums
    its squares and the sink takes no norms: the same grad norm metric (and parameters) as a run
    whose divergence guard reads the norm first, over loose and flat gradients, the CPU kernel and
    torch's path, with parameter groups, in fp32 and in bf16 without the overflow check."""
    module = _HandsOverOddGradients(width, seed)
    model = fs.functionalize(module, lambda out, batch: out.square().mean())
    batch = (torch.randn(4 * grad_accum, width, generator=torch.Generator().manual_seed(seed)),)
    prec = fs.precision.fp32() if precision == "fp32" else fs.precision.bf16(check_grad_overflow=False)
    runs = {}
    for guard in (None, "skip"):
        opt = adamw(1e-2, weight_decay=0.1, backend=backend, mask=(lambda path: path != "a") if mask else None)
        if not loose:  # the same transform taking only the flat buffer
            opt = opt._replace(capabilities=opt.capabilities._replace(loose_grads=False))
        state = fs.init_train_state(model.init(), opt, model=model, precision=prec)
        step = fs.make_train_step(model.loss, opt, grad_accum=grad_accum, on_nonfinite=guard)
        norms = []
        for _ in range(3):
            state, m = step(state, batch)
            norms.append(m["grad_norm"])
        assert step.runtime_for(state).sink.loose == (loose and precision == "fp32")
        assert step.runtime_for(state).norm_in_update == (guard is None)
        runs[guard] = (state.params.buffer.clone(), norms)
    torch.testing.assert_close(runs[None][0], runs["skip"][0], rtol=0, atol=0)
    assert runs[None][1] == pytest.approx(runs["skip"][1], rel=1e-5)
    assert all(n > 0 for n in runs[None][1])


def test_the_update_pass_gives_no_norm_where_one_is_needed_before_it():
    """Clipping, a loss scale or the overflow check read the norm before the update, and sgd's pass
    sums no squares: the optimizer's pass is not asked for the norm."""
    module = _HandsOverOddGradients(3, 0)
    model = fs.functionalize(module, lambda out, batch: out.square().mean())
    fp32, bf16, fp16 = fs.precision.fp32(), fs.precision.bf16(), fs.precision.fp16()
    for opt, prec in [(chain(clip_by_global_norm(1.0), adamw(1e-2)), fp32), (adamw(1e-2), bf16), (adamw(1e-2), fp16),
                      (sgd(1e-2), fp32)]:
        state = fs.init_train_state(model.init(), opt, model=model, precision=prec)
        step = fs.make_train_step(model.loss, opt)
        assert not step.runtime_for(state).norm_in_update, (opt, prec.name)
