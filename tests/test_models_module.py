"""fspeed.models.module: functionalize(nn.Module) on third-party models (Hugging Face GPT-2 and
Llama, a BatchNorm CNN), against plain PyTorch loops, one process."""

import copy

import pytest
import torch
from torch import nn

import fspeed as fs
from tests.hf_models import (MODELS, call, cnn_batch, cnn_loss, hf_gpt2, hf_llama, lm_batch, lm_loss, small_cnn,
                             split, torch_loop, with_fused_gelu)


def train_fspeed(module, loss_fn, batches, grad_accum, precision=None, seed=0, lr=1e-3, clip=0.0, fused_ops=True,
                 **plan):
    model = fs.functionalize(module, loss_fn, fused_ops=fused_ops)
    opt = fs.optim.adamw(lr, weight_decay=0.0)
    if clip:
        opt = fs.optim.chain(fs.optim.clip_by_global_norm(clip), opt)
    state = fs.init_train_state(model.init(), opt, precision=precision or fs.precision.fp32(), seed=seed, model=model)
    step = fs.make_train_step(model.loss, opt, grad_accum=grad_accum)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return model, state, losses


def assert_params_close(state, module, rtol=1e-5, atol=1e-6, skip=()):
    """Every parameter but GPT-2's attention key bias (the middle third of `c_attn.bias`): its true
    gradient is zero (softmax ignores a shift), so Adam turns its rounding noise, which differs with
    the thread count and the CPU's vector width, into steps of lr's size."""
    for name, p in module.named_parameters():
        if any(s in name for s in skip):
            continue
        mine, want = state.master_params[name], p.detach()
        if name.endswith("attn.c_attn.bias"):
            mine, want = (torch.cat([t[: t.numel() // 3], t[2 * t.numel() // 3:]]) for t in (mine, want))
        torch.testing.assert_close(mine, want, rtol=rtol, atol=atol, msg=name)


def test_units_are_the_repeated_blocks_or_patterns():
    gpt2 = fs.functionalize(hf_gpt2(), lm_loss)
    assert gpt2.units["transformer.h.1.attn.c_attn.weight"] == "transformer.h.1"
    assert gpt2.units["transformer.wte.weight"] == "transformer.wte"
    assert "lm_head.weight" not in gpt2.units  # tied to transformer.wte.weight: one value
    llama = fs.functionalize(hf_llama(), lm_loss)
    assert llama.units["model.layers.0.self_attn.q_proj.weight"] == "model.layers.0"
    assert llama.units["model.norm.weight"] == "model.norm"
    cnn = fs.functionalize(small_cnn(), cnn_loss)
    assert cnn.units["blocks.1.bn.weight"] == "blocks.1" and cnn.units["stem.bias"] == "stem"
    custom = fs.functionalize(small_cnn(), cnn_loss, units=["blocks", "head"])
    assert custom.units["blocks.0.conv.weight"] == "blocks" and custom.units["head.weight"] == "head"
    with pytest.raises(ValueError, match=r"units pattern\(s\) \['nope\.\*'\] match no submodule"):
        fs.functionalize(small_cnn(), cnn_loss, units="nope.*")
    params = llama.init()
    assert set(params) == {"model", "lm_head"} and "0" in params["model"]["layers"]  # the module tree
    assert not llama.init_buffers()  # rotary tables are constants (non-persistent), not state


@pytest.mark.parametrize("name,fused_ops", [("gpt2", True), ("gpt2", False), ("llama", True), ("cnn", True)])
def test_trains_like_a_plain_torch_loop(name, fused_ops):
    """By default GPT-2's Python tanh-GELU computes as torch's fused kernel (not bit-equal: compared with
    a loop whose module has that kernel); with fused_ops=False, the module's own ops."""
    build, loss_fn, make_batch = MODELS[name]
    module = build()
    batches = [make_batch(8, seed) for seed in range(3)]
    reference = torch_loop(with_fused_gelu(module) if fused_ops else module, loss_fn, batches, grad_accum=2, clip=1.0)
    _, state, _ = train_fspeed(module, loss_fn, batches, grad_accum=2, clip=1.0, fused_ops=fused_ops)
    assert_params_close(state, reference)
    for path, value in reference.state_dict().items():  # BatchNorm statistics, counters included
        if path in fs.tree_paths(state.buffers) or name == "cnn" and "running" in path:
            torch.testing.assert_close(dict(zip(fs.tree_paths(state.buffers),
                                                fs.pytree.tree_leaves(state.buffers)))[path], value)


def test_tied_weights_stay_one_value_and_go_back_into_the_module():
    module = hf_gpt2()
    batches = [lm_batch(4, seed) for seed in range(2)]
    model, state, _ = train_fspeed(module, lm_loss, batches, grad_accum=1)
    assert "lm_head.weight" not in fs.tree_paths(state.params)
    target = fs.to_module(state, copy.deepcopy(module))
    assert target.lm_head.weight is target.transformer.wte.weight
    assert torch.equal(target.lm_head.weight, state.master_params["transformer.wte.weight"])
    reference = torch_loop(module, lm_loss, batches, grad_accum=1)
    batch = lm_batch(4, 9)
    torch.testing.assert_close(call(target, batch).loss, call(reference, batch).loss)
    with pytest.raises(ValueError, match="do not match GPT2LMHeadModel"):
        fs.to_module({"nope": torch.zeros(1)}, target)


def test_batchnorm_statistics_live_in_the_state_and_evaluation_leaves_them_alone(tmp_path):
    module = small_cnn()
    model = fs.functionalize(module, cnn_loss)
    opt = fs.optim.sgd(0.1)
    state = fs.init_train_state(model.init(), opt, model=model)
    own = module.blocks[0].bn.running_mean.clone()
    step = fs.make_train_step(model.loss, opt, grad_accum=2)
    state, _ = step(state, cnn_batch(8, 0))
    stats = state.buffers["blocks"]["0"]["bn"]
    assert int(stats["num_batches_tracked"]) == 2 and not torch.equal(stats["running_mean"], own)
    assert torch.equal(module.blocks[0].bn.running_mean, own)  # the module's own buffers are untouched
    # evaluation: eval mode (running statistics), nothing updated, equal to module.eval()
    before = {p: t.clone() for p, t in zip(fs.tree_paths(state.buffers), fs.pytree.tree_leaves(state.buffers))}
    x, y = cnn_batch(6, 5)
    loss = fs.make_eval_step(model.loss)(state, (x, y))
    after = dict(zip(fs.tree_paths(state.buffers), fs.pytree.tree_leaves(state.buffers)))
    assert all(torch.equal(before[p], after[p]) for p in before)
    twin = fs.to_module(state.params.tree(), copy.deepcopy(module), state.buffers).eval()
    with torch.no_grad():
        assert loss == pytest.approx(float(cnn_loss(twin(x), (x, y))), rel=1e-6)
    # checkpoints carry them; a resumed run is exact
    fs.checkpoint.save_checkpoint(tmp_path, state)
    resumed, _ = fs.checkpoint.load_checkpoint(tmp_path, fs.init_train_state(model.init(), opt, model=model))
    assert torch.equal(resumed.buffers["blocks"]["1"]["bn"]["running_var"], state.buffers["blocks"]["1"]["bn"]["running_var"])
    a, _ = step(state, cnn_batch(8, 1))
    b, _ = step(resumed, cnn_batch(8, 1))
    assert torch.equal(a.params.buffer, b.params.buffer)
    assert torch.equal(a.buffers["blocks"]["0"]["bn"]["running_mean"], b.buffers["blocks"]["0"]["bn"]["running_mean"])


def test_a_state_without_the_modules_buffers_is_a_clear_error():
    model = fs.functionalize(small_cnn(), cnn_loss)
    opt = fs.optim.sgd(0.1)
    state = fs.init_train_state(model.init(), opt)  # no model=: its BatchNorm statistics are not carried
    with pytest.raises(ValueError, match=r"state buffers \('blocks.0.bn.running_mean', \.\.\.\).*model=model"):
        fs.make_train_step(model.loss, opt)(state, cnn_batch(4, 0))


@pytest.mark.parametrize("plan", [None, fs.zero(3)])
def test_a_state_without_the_modules_units_is_a_clear_error(plan):
    # without model=, the state groups GPT-2's parameters as one unit, 'transformer', so the tied head
    # (lm_head, outside it) would have run on the module's own stale weight and lost its gradient
    model = fs.functionalize(hf_gpt2(), lm_loss)
    opt = fs.optim.sgd(0.1)
    mesh = fs.Mesh() if plan is not None else None
    state = fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh)
    with pytest.raises(ValueError, match=r"into units \['transformer'\], which are not this module's.*model=model"):
        fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)(state, lm_batch(2, 0))


def test_dropout_draws_from_the_seed_and_a_resumed_run_is_exact(tmp_path):
    module = hf_gpt2(dropout=0.2)
    batches = [lm_batch(4, seed) for seed in range(4)]
    _, _, first = train_fspeed(module, lm_loss, batches, grad_accum=2, seed=7)
    _, _, again = train_fspeed(module, lm_loss, batches, grad_accum=2, seed=7)
    _, _, other = train_fspeed(module, lm_loss, batches, grad_accum=2, seed=8)
    assert first == again and first != other
    model = fs.functionalize(module, lm_loss)
    opt = fs.optim.adamw(1e-3)
    step = fs.make_train_step(model.loss, opt, grad_accum=2)
    straight = fs.init_train_state(model.init(), opt, seed=7, model=model)
    for batch in batches:
        straight, _ = step(straight, batch)
    half = fs.init_train_state(model.init(), opt, seed=7, model=model)
    for batch in batches[:2]:
        half, _ = step(half, batch)
    fs.checkpoint.save_checkpoint(tmp_path, half)
    resumed, _ = fs.checkpoint.load_checkpoint(tmp_path, fs.init_train_state(model.init(), opt, seed=0, model=model))
    for batch in batches[2:]:
        resumed, _ = step(resumed, batch)
    assert torch.equal(resumed.params.buffer, straight.params.buffer)


def test_mixed_precision_casts_inputs_and_keeps_batchnorm_in_fp32():
    module = small_cnn()
    batches = [cnn_batch(8, seed) for seed in range(3)]
    _, full, full_losses = train_fspeed(module, cnn_loss, batches, grad_accum=2)
    model, half, half_losses = train_fspeed(module, cnn_loss, batches, grad_accum=2, precision=fs.precision.bf16())
    assert half.params.dtype == torch.bfloat16
    stats = half.buffers["blocks"]["0"]["bn"]["running_mean"]
    assert stats.dtype == torch.float32  # BatchNorm's buffers stay fp32, its math runs in fp32
    torch.testing.assert_close(stats, full.buffers["blocks"]["0"]["bn"]["running_mean"], rtol=0.05, atol=0.02)
    assert half_losses == pytest.approx(full_losses, rel=0.02)
    torch.testing.assert_close(half.master_params.buffer, full.master_params.buffer, rtol=0, atol=2e-2)


def test_a_parameter_used_outside_its_unit_is_an_error_not_a_silent_zero_gradient():
    class Peeking(nn.Module):  # reads a child's weight from its own forward (DeepSpeed's "external parameter")
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            return self.inner(x) + self.inner.weight.sum()

    model = fs.functionalize(Peeking(), lambda out, batch: out.square().mean())
    opt = fs.optim.sgd(0.1)
    state = fs.init_train_state(model.init(), opt, model=model)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        fs.make_train_step(model.loss, opt)(state, (torch.randn(2, 4),))



def test_module_hooks_fire_once_per_call_and_instance_forwards_survive_a_step():
    """A unit's forward hooks run once per forward (its route calls the module's own forward, not
    the module again), with remat too; a forward the user set on an instance (as accelerate's hooks
    do) computes the unit and is still there after the step."""
    for remat in (False, True):
        module = hf_gpt2(layers=2)
        calls = {"hook": 0, "wrapper": 0}
        module.transformer.h[0].register_forward_hook(lambda m, args, out: calls.__setitem__("hook", calls["hook"] + 1))
        block = module.transformer.h[1]
        own = block.forward

        def wrapper(*args, **kwargs):
            calls["wrapper"] += 1
            return own(*args, **kwargs)
        block.forward = wrapper
        model = fs.functionalize(module, lm_loss)
        if remat:
            model = fs.remat(model)
        opt = fs.optim.sgd(0.1)
        state = fs.init_train_state(model.init(), opt, model=model)
        fs.make_train_step(model.loss, opt)(state, lm_batch(2, 0))
        assert calls == {"hook": 1, "wrapper": 2 if remat else 1}, (remat, calls)  # remat recomputes the block
        assert block.__dict__["forward"] is wrapper and "forward" not in module.transformer.h[0].__dict__


# ------------------------------------------------------------------------------ on 2 gloo ranks


def zero_case(name, stage, grad_accum, precision="fp32"):
    """fspeed under ZeRO `stage` on this rank's share of every batch; the gathered parameters and
    this rank's buffers."""
    mesh = fs.Mesh(data=-1)
    build, loss_fn, make_batch = MODELS[name]
    model = fs.functionalize(build(), loss_fn)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(1e-3, weight_decay=0.0))
    plan = fs.zero(stage, param_persistence_threshold=0, reduce_bucket_size=700)
    state = fs.init_train_state(model.init(), opt, precision=getattr(fs.precision, precision)(), plan=plan,
                                mesh=mesh, model=model)
    step = fs.make_train_step(model.loss, opt, grad_accum=grad_accum, plan=plan, mesh=mesh)
    for seed in range(3):
        state, _ = step(state, split(make_batch(8, seed), 2, mesh.rank))
    params = fs.gather_params(state, mesh)
    return dict(zip(fs.tree_paths(params), fs.pytree.tree_leaves(params))), \
        dict(zip(fs.tree_paths(state.buffers), fs.pytree.tree_leaves(state.buffers))), \
        sorted(u.name for u in state.layout.sharded_units)


def ddp_case(name):
    """The plain PyTorch reference on the same 2 ranks: DistributedDataParallel (buffers broadcast
    from rank 0 at each forward), AdamW, global-norm clipping."""
    from torch.nn.parallel import DistributedDataParallel

    fs.Mesh(data=-1)
    build, loss_fn, make_batch = MODELS[name]
    ddp = DistributedDataParallel(build(), broadcast_buffers=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.0, foreach=False)
    rank = torch.distributed.get_rank()
    for seed in range(3):
        x, y = split(make_batch(8, seed), 2, rank)
        opt.zero_grad()
        loss_fn(ddp(x), (x, y)).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
    return {n: p.detach() for n, p in ddp.module.named_parameters()}, \
        {n: b for n, b in ddp.module.named_buffers()}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_language_models_under_zero_equal_a_plain_torch_loop_on_2_ranks(world2, name, stage):
    build, loss_fn, make_batch = MODELS[name]
    reference = torch_loop(build(), loss_fn, [make_batch(8, seed) for seed in range(3)], grad_accum=4, clip=1.0)
    expected = dict(reference.named_parameters())
    for params, _, sharded in world2.run(zero_case, name, stage, 2):
        assert set(params) == set(expected)
        if stage == 3:
            assert len(sharded) >= 2  # the blocks are gathered one at a time
        for path, value in params.items():
            tolerance = 2e-4 if path.endswith("c_attn.bias") else 1e-5  # GPT-2's key bias: zero true gradient
            torch.testing.assert_close(value, expected[path].detach(), rtol=tolerance, atol=tolerance, msg=path)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_batchnorm_cnn_under_zero_equals_ddp_on_2_ranks(world2, stage):
    results = world2.run(zero_case, "cnn", stage, 1)
    reference = world2.run(ddp_case, "cnn")
    for (params, buffers, _), (ref_params, ref_buffers) in zip(results, reference):
        for path, value in params.items():
            torch.testing.assert_close(value, ref_params[path], rtol=1e-5, atol=1e-6, msg=path)
    for path, value in results[0][1].items():  # rank 0's statistics, which DDP broadcasts
        torch.testing.assert_close(value, reference[0][1][path], rtol=1e-5, atol=1e-6, msg=path)


@pytest.mark.parametrize("name", ["gpt2", "cnn"])
def test_bf16_under_zero3_follows_the_fp32_run_on_2_ranks(world2, name):
    for (half, _, _), (full, _, _) in zip(world2.run(zero_case, name, 3, 2, "bf16"), world2.run(zero_case, name, 3, 2)):
        for path, value in full.items():
            torch.testing.assert_close(half[path], value, rtol=0, atol=3e-2, msg=path)


# ------------------------------------------------------------------------- tensor slicing


def test_a_tp_plan_sets_logical_axes_and_refuses_what_it_cannot_slice():
    llama = hf_llama()
    plan = fs.tp_plan_from(llama)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["lm_head"] == "colwise_gather_output"
    model = fs.functionalize(llama, lm_loss, tp_plan="auto")
    assert model.logical_axes["model.layers.0.self_attn.q_proj.weight"] == ("tp_out", None)
    assert model.logical_axes["model.layers.1.mlp.down_proj.weight"] == (None, "tp_in")
    assert model.logical_axes["model.embed_tokens.weight"] == ("vocab", None)
    gpt2 = hf_gpt2()
    conv = fs.functionalize(gpt2, lm_loss, tp_plan={"transformer.h.*.mlp.c_fc": "colwise",
                                                    "transformer.h.*.mlp.c_proj": "rowwise"})
    assert conv.logical_axes["transformer.h.0.mlp.c_fc.weight"] == (None, "tp_out")  # Conv1D is [in, out]
    assert conv.logical_axes["transformer.h.0.mlp.c_proj.weight"] == ("tp_in", None)
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        fs.functionalize(gpt2, lm_loss, tp_plan="auto")
    with pytest.raises(ValueError, match="style 'diagonal'.*allowed: colwise"):
        fs.functionalize(llama, lm_loss, tp_plan={"lm_head": "diagonal"})
    with pytest.raises(ValueError, match="'model.nope' matches no submodule"):
        fs.functionalize(llama, lm_loss, tp_plan={"model.nope": "colwise"})
    with pytest.raises(ValueError, match="RMSNorm; style 'colwise' needs nn.Linear or Conv1D"):
        fs.functionalize(llama, lm_loss, tp_plan={"model.norm": "colwise"})


def tp_case(data, tensor, stage):
    """Llama with its own tp_plan on `tensor` ranks (x `data`), this rank's share of every batch."""
    mesh = fs.Mesh(data=data, model=tensor)
    model = fs.functionalize(hf_llama(), lm_loss, tp_plan="auto")
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(1e-3, weight_decay=0.0))
    plan = fs.zero(stage, param_persistence_threshold=0) | fs.tensor_slicing(fs.models.module_tp_rules)
    state = fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model)
    step = fs.make_train_step(model.loss, opt, grad_accum=2, plan=plan, mesh=mesh)
    for seed in range(3):
        state, _ = step(state, split(lm_batch(8, seed), data, mesh.coordinate("data")))
    params = fs.gather_params(state, mesh)
    return dict(zip(fs.tree_paths(params), fs.pytree.tree_leaves(params)))


def llama_reference():
    reference = torch_loop(hf_llama(), lm_loss, [lm_batch(8, seed) for seed in range(3)], grad_accum=2, clip=1.0)
    return {n: p.detach() for n, p in reference.named_parameters()}


@pytest.mark.parametrize("stage", [0, 3])
def test_llama_with_its_tp_plan_on_2_tensor_ranks_equals_one_process(world2, stage):
    expected = llama_reference()
    for params in world2.run(tp_case, 1, 2, stage):
        for path, value in params.items():
            torch.testing.assert_close(value, expected[path], rtol=1e-5, atol=1e-5, msg=path)


def test_llama_on_2_data_by_2_tensor_ranks_equals_one_process(world4):
    expected = llama_reference()
    for params in world4.run(tp_case, 2, 2, 1):
        for path, value in params.items():
            torch.testing.assert_close(value, expected[path], rtol=1e-5, atol=1e-5, msg=path)
