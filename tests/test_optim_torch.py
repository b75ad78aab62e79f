"""from_torch: any elementwise torch.optim optimizer as a GradientTransformation, against torch itself.

Each optimizer steps fspeed's flat buffer as one parameter; torch steps the same numbers as separate
tensors. Elementwise math makes the two equal up to the order of operations of torch's foreach and
single-tensor implementations (tolerance rtol=1e-5, atol=1e-6 over a few steps of values of order
1), and bit-exact where both sides run the same kernel (fused AdamW).
"""

from __future__ import annotations

import math

import pytest
import torch

import fspeed as fs
from fspeed.optim import (
    ELEMENTWISE_OPTIMIZERS,
    TorchOptimizerState,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    from_torch,
    learning_rate,
    no_decay,
    warmup,
)
from fspeed.parallel import zero

RTOL, ATOL = 1e-5, 1e-6


def random_tree(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g), "s": torch.randn((), generator=g)}


def grads_for(tree, step: int) -> list:
    g = torch.Generator().manual_seed(1000 + step)
    return {k: torch.randn(v.shape, generator=g) for k, v in tree.items()}


def run_fspeed(opt, params, steps, *, flat=True, pure=False):
    """Steps of `opt` on `params` (as a Flat or a dict), fused `apply` or pure `update`."""
    p = fs.Flat.from_tree(params) if flat else {k: v.clone() for k, v in params.items()}
    state = opt.init(p)
    for i in range(steps):
        g = grads_for(params, i)
        g = fs.Flat.from_tree(g) if flat else g
        if pure:
            before = p.clone() if flat else {k: v.clone() for k, v in p.items()}
            updates, state = opt.update(g, state, p)
            assert torch.equal(p.buffer, before.buffer) if flat else all(torch.equal(p[k], before[k]) for k in p)
            p = apply_updates(p, updates)
        else:
            p, state = opt.apply(g, state, p)
    return (p.tree() if flat else p), state


def run_torch(cls, kwargs, params, steps):
    tensors = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = cls(list(tensors.values()), **kwargs)
    for i in range(steps):
        for k, g in grads_for(params, i).items():
            tensors[k].grad = g
        opt.step()
    return {k: v.detach() for k, v in tensors.items()}


def assert_trees_close(got, want, rtol=RTOL, atol=ATOL):
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


# --------------------------------------------------------------------------- against fspeed's AdamW


def test_from_torch_fused_adamw_equals_fspeed_adamw_bit_for_bit():
    """Same kernel (torch._fused_adamw_) on both sides: equal bits, schedule included."""
    lr = warmup(0.0, 1e-2, num_steps=3)
    ours = adamw(lr, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1, backend="torch")
    theirs = from_torch(torch.optim.AdamW, lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, fused=True)
    params = random_tree(0)
    a, sa = run_fspeed(ours, params, 5)
    b, sb = run_fspeed(theirs, params, 5)
    for k in params:
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(sa.mu.buffer, sb.elementwise["exp_avg"].buffer)
    assert torch.equal(sa.nu.buffer, sb.elementwise["exp_avg_sq"].buffer)
    assert float(sb.scalars["step"][0]) == 5 and sb.count == 5
    assert learning_rate(sb) == learning_rate(sa) == pytest.approx(1e-2)


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("impl", [{}, {"foreach": True}])
def test_from_torch_adamw_equals_fspeed_adamw(flat, impl):
    """torch's single-tensor and foreach AdamW against fspeed's default (Numba kernel on CPU)."""
    ours = adamw(3e-3, weight_decay=0.05)
    theirs = from_torch(torch.optim.AdamW, lr=3e-3, weight_decay=0.05, **impl)
    params = random_tree(1)
    a, _ = run_fspeed(ours, params, 6, flat=flat)
    b, _ = run_fspeed(theirs, params, 6, flat=flat)
    assert_trees_close(b, a)


# --------------------------------------------------------------------------- against torch itself


@pytest.mark.parametrize("name", ELEMENTWISE_OPTIMIZERS)
def test_every_elementwise_optimizer_equals_torch_on_separate_tensors(name):
    """The flat buffer as one parameter equals torch on the separate tensors; fused apply and
    pure update agree; the state survives a copy (what a checkpoint does) and goes on equal."""
    cls = getattr(torch.optim, name)
    kwargs = {"lr": 1e-2}
    params = random_tree(2)
    want = run_torch(cls, kwargs, params, 4)
    got, state = run_fspeed(from_torch(cls, **kwargs), params, 4)
    assert_trees_close(got, want)
    pure, _ = run_fspeed(from_torch(cls, **kwargs), params, 4, pure=True)
    assert_trees_close(pure, want)
    assert isinstance(state, TorchOptimizerState) and state.count == 4


def test_state_lives_in_the_pytree_and_resumes_exactly():
    """Three steps, copy the state and params (a checkpoint's round trip), three more: the same
    bits as six steps straight, for an optimizer whose state appears lazily (SGD with dampening)."""
    opt = from_torch(torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
    params = fs.Flat.from_tree(random_tree(3))
    straight, s_state = params.clone(), opt.init(params)
    for i in range(6):
        straight, s_state = opt.apply(fs.Flat.from_tree(grads_for(random_tree(3), i)), s_state, straight)
    p, state = params.clone(), opt.init(params)
    assert torch.count_nonzero(state.elementwise["momentum_buffer"].buffer) == 0
    for i in range(3):
        p, state = opt.apply(fs.Flat.from_tree(grads_for(random_tree(3), i)), state, p)
    p = p.clone()
    state = fs.pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
    for i in range(3, 6):
        p, state = opt.apply(fs.Flat.from_tree(grads_for(random_tree(3), i)), state, p)
    assert torch.equal(p.buffer, straight.buffer)
    assert torch.equal(state.elementwise["momentum_buffer"].buffer, s_state.elementwise["momentum_buffer"].buffer)


# --------------------------------------------------------------------------- through train_step


def tiny_gpt(seed=0):
    cfg = fs.models.GPTConfig(vocab_size=40, seq_len=12, n_layer=2, n_head=2, d_model=16)
    model = fs.models.gpt(cfg)
    return cfg, model, model.init(torch.Generator().manual_seed(seed))


def batch_for(cfg, rows, step):
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=torch.Generator().manual_seed(step))
    return {"inputs": x[:, :-1], "targets": x[:, 1:]}


def assert_params_close(got: fs.Flat, want: dict, rtol=RTOL, atol=ATOL):
    """Every parameter, the attention key bias left out of the comparison: its true gradient is
    zero (softmax ignores a shift), so Adagrad/Adam turn its rounding noise into lr-sized steps."""
    for path, value in fs.Flat.from_tree(want).items():
        mine = got[path]
        if path.endswith("attn.bqkv"):
            mine, value = mine[[0, 2]], value[[0, 2]]
        torch.testing.assert_close(mine, value, rtol=rtol, atol=atol, msg=lambda m: f"{path}: {m}")


@pytest.mark.parametrize("cls, kwargs", [
    (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)),
    (torch.optim.SGD, dict(lr=0.2, momentum=0.9, dampening=0.1, weight_decay=0.01)),
])
def test_trained_through_fspeed_equals_a_plain_torch_loop(cls, kwargs):
    """Clipping first, two micro-batches accumulated: fspeed's train_step with from_torch equals
    torch autograd + clip_grad_norm_ + the same torch optimizer on the module's own tensors."""
    cfg, model, params = tiny_gpt()
    opt = chain(clip_by_global_norm(0.5), from_torch(cls, **kwargs))
    state = fs.init_train_state(params, opt)
    step = fs.make_train_step(model.loss, opt, grad_accum=2)
    leaves = fs.pytree.tree_map(lambda t: t.clone().requires_grad_(), params)
    tensors = fs.pytree.tensor_leaves(leaves)
    reference = cls(tensors, **kwargs)
    for i in range(4):
        batch = batch_for(cfg, 4, i)
        state, metrics = step(state, batch)
        for half in (0, 1):
            micro = {k: v[2 * half:2 * half + 2] for k, v in batch.items()}
            (model.loss(leaves, micro) / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(tensors, 0.5)
        reference.step()
        reference.zero_grad()
        assert math.isclose(metrics["grad_norm"], float(norm), rel_tol=1e-4)
    assert_params_close(state.params, fs.pytree.tree_map(torch.Tensor.detach, leaves))


def test_bf16_training_equals_fspeed_fused_adamw_bit_for_bit():
    """Precision composes: fp32 masters updated by torch's fused AdamW and cast to the bf16
    compute copy give the same bits as fspeed's AdamW on the same kernel."""
    cfg, model, params = tiny_gpt()
    results = []
    for opt in (chain(clip_by_global_norm(1.0), adamw(1e-2, weight_decay=0.1, backend="torch")),
                chain(clip_by_global_norm(1.0), from_torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True))):
        state = fs.init_train_state(params, opt, precision=fs.precision.bf16())
        step = fs.make_train_step(model.loss, opt, grad_accum=2)
        for i in range(3):
            state, _ = step(state, batch_for(cfg, 4, i))
        results.append(state)
    assert torch.equal(results[0].master.buffer, results[1].master.buffer)
    assert torch.equal(results[0].params.buffer, results[1].params.buffer)
    assert results[1].params.dtype == torch.bfloat16


def test_checkpoint_of_a_torch_optimizer_resumes_bit_exact(tmp_path):
    cfg, model, params = tiny_gpt()
    opt = chain(clip_by_global_norm(1.0), from_torch(torch.optim.Adagrad, lr=0.05, initial_accumulator_value=0.1))
    step = fs.make_train_step(model.loss, opt)
    straight = fs.init_train_state(params, opt)
    for i in range(4):
        straight, _ = step(straight, batch_for(cfg, 2, i))
    state = fs.init_train_state(params, opt)
    for i in range(2):
        state, _ = step(state, batch_for(cfg, 2, i))
    fs.checkpoint.save_checkpoint(tmp_path, state)
    resumed, _ = fs.checkpoint.load_checkpoint(tmp_path, fs.init_train_state(params, opt))
    assert torch.equal(resumed.opt_state[1].elementwise["sum"].buffer, state.opt_state[1].elementwise["sum"].buffer)
    for i in range(2, 4):
        resumed, _ = step(resumed, batch_for(cfg, 2, i))
    assert torch.equal(resumed.params.buffer, straight.params.buffer)
    assert float(resumed.opt_state[1].scalars["step"][0]) == 4


def zero_case(stage: int, steps: int = 3):
    """Train the tiny GPT with from_torch(Adagrad) on this rank's ZeRO partition; the full params."""
    mesh = fs.Mesh(data=-1)
    dp, rank = mesh.size("data"), mesh.coordinate("data")
    cfg, model, params = tiny_gpt()
    opt = chain(clip_by_global_norm(0.5), from_torch(torch.optim.Adagrad, lr=0.05, initial_accumulator_value=0.1))
    plan = zero(stage)
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh)
    step = fs.make_train_step(model.loss, opt, grad_accum=2, plan=plan, mesh=mesh)
    for i in range(steps):
        batch = batch_for(cfg, 4 * dp, i)
        state, _ = step(state, {k: v[rank * 4:(rank + 1) * 4] for k, v in batch.items()})
    partition = state.opt_state[1].elementwise["sum"].buffer.numel()
    return fs.Flat.from_tree(fs.parallel.gather_params(state, mesh)).buffer, partition


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_partitions_train_like_one_process(world2, stage):
    """Under ZeRO 1-2 the torch optimizer steps each rank's partition (its state is half the size)."""
    results = world2.run(zero_case, stage)
    cfg, model, params = tiny_gpt()
    opt = chain(clip_by_global_norm(0.5), from_torch(torch.optim.Adagrad, lr=0.05, initial_accumulator_value=0.1))
    state = fs.init_train_state(params, opt)
    step = fs.make_train_step(model.loss, opt, grad_accum=4)
    for i in range(3):
        state, _ = step(state, batch_for(cfg, 8, i))
    full = state.params.numel
    for flat, partition in results:
        assert partition == math.ceil(full / 2)
        torch.testing.assert_close(flat[:full], state.params.buffer[:full], rtol=RTOL, atol=ATOL)


def test_zero_offload_runs_the_torch_optimizer_on_the_host():
    cfg, model, params = tiny_gpt()
    opt = from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)
    plan, mesh = zero(2, offload_optimizer="cpu"), fs.Mesh(data=1)
    state = fs.init_train_state(params, opt, precision=fs.precision.bf16(), plan=plan, mesh=mesh)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    reference = fs.init_train_state(params, opt, precision=fs.precision.bf16())
    plain = fs.make_train_step(model.loss, opt)
    for i in range(2):
        state, _ = step(state, batch_for(cfg, 2, i))
        reference, _ = plain(reference, batch_for(cfg, 2, i))
    assert torch.equal(state.master.buffer[:reference.master.numel], reference.master.buffer)


# --------------------------------------------------------------------------- errors and description


@pytest.mark.parametrize("cls, message", [
    (torch.optim.LBFGS, "LBFGS needs a closure"),
    (torch.optim.SparseAdam, "SparseAdam takes sparse gradients only"),
    (torch.optim.Adafactor, "Adafactor factors its second moment per matrix"),
])
def test_non_elementwise_optimizers_are_refused(cls, message):
    with pytest.raises(ValueError, match=message):
        from_torch(cls, lr=1e-3)


class MyAdam(torch.optim.Adam):
    pass


def test_unknown_optimizer_classes_need_the_callers_word():
    with pytest.raises(ValueError, match="pass elementwise=True if it does"):
        from_torch(MyAdam, lr=1e-3)
    params = random_tree(4)
    got, _ = run_fspeed(from_torch(MyAdam, lr=1e-3, elementwise=True), params, 2)
    assert_trees_close(got, run_torch(torch.optim.Adam, {"lr": 1e-3}, params, 2))


@pytest.mark.parametrize("call, error, message", [
    (lambda: from_torch(torch.optim.Adam, lr=1e-3, bogus=1), TypeError, "takes no 'bogus'; allowed: lr, betas"),
    (lambda: from_torch(torch.optim.Adam, lr=-1.0), ValueError, "rejects these hyperparameters: Invalid learning rate"),
    (lambda: from_torch(torch.optim.SGD, lr=0.1, momentum=lambda t: 0.9), TypeError, "momentum is a schedule"),
    (lambda: from_torch(torch.optim.SGD, lr=0.1, params=[]), TypeError, "params are not given"),
    (lambda: from_torch(torch.nn.Linear, lr=0.1), TypeError, "takes a torch.optim.Optimizer subclass"),
    (lambda: from_torch(torch.optim.Adam, elementwise=False), ValueError, "elementwise=False contradicts"),
    (lambda: from_torch(torch.optim.Adam, lr=1e-3, mask=no_decay()), ValueError, "has weight_decay=0"),
])
def test_bad_arguments_are_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_description_and_capabilities():
    opt = from_torch(torch.optim.Adagrad, lr=1e-2)
    assert repr(opt).startswith("torch.optim.Adagrad(lr=0.01, lr_decay=0")
    assert opt.capabilities.elementwise and opt.capabilities.cpu and not opt.capabilities.whole_tensors
    masked = from_torch(torch.optim.AdamW, lr=1e-2, mask=no_decay("bias"))
    assert masked.info.name == "param_groups" and masked.capabilities.elementwise
