"""Parameter groups and weight-decay masks, against each group's plain optimizer run alone and
against torch's own param groups.

The property test draws parameters, a grouping with random overrides, and a ZeRO-style cut of the
flat buffer into one rank's 1-D pieces plus a padding piece; the grouped optimizer on that Flat
(one call per run of segments) must equal, piece for piece, each group's plain optimizer run on
its own pieces packed alone, and the padding must stay zero. Tolerance rtol=1e-5, atol=1e-6 (as
tests/test_optim.py: the same formulas, kernels on differently aligned views).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fspeed as fs
from fspeed.flat import Flat
from fspeed.optim import (
    ParamGroupsState,
    adam,
    adamw,
    apply_updates,
    chain,
    check_param_groups,
    clip_by_global_norm,
    from_torch,
    lamb,
    learning_rate,
    no_decay,
    onebit_adam,
    param_groups,
    sgd,
    warmup,
    with_hparams,
)
from fspeed.parallel.layout import labelled_layout

RTOL, ATOL = 1e-5, 1e-6


def from_torch_adagrad(**h):
    return from_torch(torch.optim.Adagrad, **h)


# kind: (factory, base hyperparameters, overrides a group may draw, whether it needs whole tensors)
KINDS = {
    "adamw": (adamw, dict(lr=1e-2, weight_decay=0.1),
              dict(weight_decay=[0.0, 0.3], lr_scale=[0.0, 0.5, 3.0], betas=[(0.8, 0.9)], eps=[1e-4]), False),
    "adam": (adam, dict(lr=1e-2, weight_decay=0.05),
             dict(weight_decay=[0.0], lr=[3e-3], bias_correction=[False]), False),
    "sgd": (sgd, dict(lr=0.1, momentum=0.9, weight_decay=0.01),
            dict(weight_decay=[0.0, 0.1], lr_scale=[0.5], momentum=[0.0, 0.5]), False),
    "adagrad": (from_torch_adagrad, dict(lr=0.05),
                dict(weight_decay=[0.0, 0.1], lr_scale=[2.0], lr_decay=[0.1]), False),
    "lamb": (lamb, dict(lr=1e-2, weight_decay=0.01), dict(weight_decay=[0.0], lr_scale=[0.5], max_coeff=[1.0]), True),
}


def reference_settings(kind: str, overrides: dict) -> dict:
    """A group's hyperparameters written out by hand (lr_scale and betas resolved)."""
    factory, base, _, _ = KINDS[kind]
    out = dict(base)
    for key, value in overrides.items():
        if key == "lr_scale":
            out["lr"] = base["lr"] * value
        elif key == "betas" and factory is not from_torch_adagrad:
            out["b1"], out["b2"] = value
        else:
            out[key] = value
    return out


def slice_pieces(paths, shapes, lo, hi):
    """One rank's slice [lo, hi) of a flat buffer as 1-D pieces named by parameter path, plus a
    padding piece past the last parameter (what ZeRO 1-2 hand the optimizer)."""
    names, sizes, off = [], [], 0
    for path, shape in zip(paths, shapes):
        size = math.prod(shape)
        a, b = max(off, lo), min(off + size, hi)
        if a < b:
            names.append(path)
            sizes.append((b - a,))
        off += size
    if hi > max(off, lo):
        names.append("zero.pad")
        sizes.append((hi - max(off, lo),))
    return names, sizes


@st.composite
def grouped_problems(draw):
    kind = draw(st.sampled_from(sorted(KINDS)))
    _, _, choices, whole = KINDS[kind]
    n = draw(st.integers(1, 6))
    shapes = [draw(st.sampled_from([(1,), (3,), (2, 3), (4, 2), (5,)])) for _ in range(n)]
    paths = [f"layer{i}.{draw(st.sampled_from(['weight', 'bias']))}" for i in range(n)]
    n_groups = draw(st.integers(0, 3))
    groups = []
    for g in range(n_groups):
        keys = draw(st.lists(st.sampled_from(sorted(choices)), unique=True, max_size=2))
        groups.append({key: draw(st.sampled_from(choices[key])) for key in keys})
    membership = [draw(st.integers(-1, n_groups - 1)) for _ in range(n)]  # -1: no group
    world = 1 if whole else draw(st.integers(1, 3))
    rank = draw(st.integers(0, world - 1))
    return kind, paths, shapes, groups, membership, world, rank, draw(st.integers(0, 2**16))


@given(grouped_problems(), st.booleans())
def test_grouped_runs_equal_each_group_run_alone(problem, with_cast):
    """(Without `cast_to`, fspeed's CPU Adam takes a group's runs in one pass: `adam_step_runs`.)"""
    kind, paths, shapes, overrides, membership, world, rank, seed = problem
    factory, base, _, _ = KINDS[kind]
    groups = [dict(o, params=[p for p, m in zip(paths, membership) if m == g], name=f"g{g}")
              for g, o in enumerate(overrides)]
    opt = param_groups(factory(**base), groups)
    total = sum(math.prod(s) for s in shapes)
    part = -(-total // world)
    names, pieces = slice_pieces(paths, shapes, rank * part, (rank + 1) * part)
    if world == 1:
        names, pieces = list(paths), [tuple(s) for s in shapes]
    layout = labelled_layout(names, pieces)
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(world * part, generator=gen)
    full[total:] = 0
    params = Flat(full[rank * part:(rank + 1) * part].clone(), layout)
    grads = [Flat(torch.randn(part, generator=gen), layout) for _ in range(3)]  # nonzero on the padding too

    state = opt.init(params)
    pure_params, pure_state = params.clone(), opt.init(params)
    cast = Flat(torch.randn(part, generator=gen).bfloat16(), layout) if with_cast else None  # garbage, padding too
    for g in grads:
        params, state = opt.apply(g, state, params, cast_to=cast)
        updates, pure_state = opt.update(g, pure_state, pure_params)
        pure_params = apply_updates(pure_params, updates)

    initial = Flat(full[rank * part:(rank + 1) * part], layout)
    member = dict(zip(paths, membership))
    for g in range(-1, len(overrides)):
        mine = [i for i, name in enumerate(names) if name != "zero.pad" and member[name] == g]
        if not mine:
            continue
        alone = factory(**reference_settings(kind, overrides[g] if g >= 0 else {}))
        seg = lambda flat: {str(i): flat[names[i]].clone() for i in mine}  # noqa: E731
        p = Flat.from_tree(seg(initial))
        s = alone.init(p)
        for grad in grads:
            p, s = alone.apply(Flat.from_tree(seg(grad)), s, p)
        for i in mine:
            torch.testing.assert_close(params[names[i]], p[str(i)], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(pure_params[names[i]], p[str(i)], rtol=RTOL, atol=ATOL)
    if "zero.pad" in names:
        assert torch.count_nonzero(params["zero.pad"]) == 0 and torch.count_nonzero(pure_params["zero.pad"]) == 0
    assert cast is None or torch.equal(cast.buffer, params.buffer.bfloat16())


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("path, decays", [
    ("transformer.h.0.attn.c_attn.weight", True),
    ("transformer.h.0.attn.c_attn.bias", False),
    ("transformer.h.0.ln_1.weight", False),
    ("transformer.ln_f.bias", False),
    ("model.layers.0.input_layernorm.weight", False),
    ("model.norm.weight", False),
    ("encoder.layer.0.output.LayerNorm.weight", False),
    ("layer1.0.bn1.weight", False),
    ("blocks.0.ln1.weight", False),
    ("blocks.0.mlp.w_in", True),
    ("wte", True),
    ("zero.pad", False),
    ("blocks.3.pad", False),
])
def test_no_decay_rule(path, decays):
    assert no_decay()(path) is decays


def test_no_decay_names_match_within_parts_ignoring_case():
    mask = no_decay("bias", "NORM")
    assert not mask("a.LayerNorm.weight") and not mask("a.my_bias") and mask("a.ln_1.weight")
    with pytest.raises(ValueError, match="without dots"):
        no_decay("ln.weight")


def test_mask_decays_only_what_it_selects():
    """adamw(mask=...) == adamw on the decayed parameters and adamw(weight_decay=0) on the rest."""
    params = {"w": torch.randn(4, 3), "bias": torch.randn(3), "ln.weight": torch.randn(3)}
    masked = adamw(1e-2, weight_decay=0.5, mask=no_decay("bias", "ln"))
    flat = Flat.from_tree(params)
    state = masked.init(flat)
    grads = Flat.from_tree({k: torch.randn(v.shape) for k, v in params.items()})
    flat, state = masked.apply(grads, state, flat)
    for path, wd in (("w", 0.5), ("bias", 0.0), ("ln.weight", 0.0)):
        alone = adamw(1e-2, weight_decay=wd)
        p = {path: params[path].clone()}
        p, _ = alone.apply({path: grads[path]}, alone.init(p), p)
        torch.testing.assert_close(flat[path], p[path], rtol=RTOL, atol=ATOL)
    assert learning_rate(state) == 1e-2 and isinstance(state, ParamGroupsState)


@pytest.mark.parametrize("make", [
    lambda m: adam(1e-3, weight_decay=0.1, mask=m), lambda m: sgd(0.1, weight_decay=0.1, mask=m),
    lambda m: lamb(1e-3, weight_decay=0.1, mask=m),
    lambda m: from_torch(torch.optim.RMSprop, lr=1e-3, weight_decay=0.1, mask=m),
])
def test_every_optimizer_takes_a_mask(make):
    opt = make(no_decay())
    assert opt.info.name == "param_groups" and opt.info.hparams["groups"][0]["weight_decay"] == 0.0


@pytest.mark.parametrize("call, error, message", [
    (lambda: adamw(1e-3, weight_decay=0.0, mask=no_decay()), ValueError, "weight_decay=0; set weight_decay > 0"),
    (lambda: adamw(1e-3, mask=["bias"]), TypeError, "mask must be a predicate over parameter paths"),
])
def test_bad_masks_are_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_mask_returning_a_non_bool_is_named():
    opt = adamw(1e-3, weight_decay=0.1, mask=lambda path: 1)
    with pytest.raises(TypeError, match="returned 1 for 'w'; it must return a bool"):
        opt.init({"w": torch.zeros(2)})


# --------------------------------------------------------------------------- groups


def test_groups_by_glob_pattern_with_lr_scale_and_betas():
    params = {"blocks": [{"attn": {"w": torch.randn(3)}, "mlp": {"w": torch.randn(3)}} for _ in range(2)],
              "head": torch.randn(2)}
    lr = warmup(0.0, 1e-2, num_steps=4)
    opt = param_groups(adamw(lr, weight_decay=0.1), [
        {"name": "attn", "params": "blocks.*.attn.*", "lr_scale": 0.1, "weight_decay": 0.0},
        {"name": "head", "params": ["head"], "betas": (0.5, 0.6)},
    ])
    flat = Flat.from_tree(params)
    state = opt.init(flat)
    assert len(state.groups) == 3  # attn, the rest, head: one state each, over their runs
    assert [len(inner.mu) for inner in state.groups] == [2, 2, 1]  # runs: attn | mlp | attn | mlp | head
    grads = [Flat.from_tree(fs.pytree.tree_map(torch.randn_like, params)) for _ in range(3)]
    for g in grads:
        flat, state = opt.apply(g, state, flat)
    expect = {"blocks.0.attn.w": adamw(lambda t: 0.1 * lr(t), weight_decay=0.0),
              "blocks.1.mlp.w": adamw(lr, weight_decay=0.1),
              "head": adamw(lr, b1=0.5, b2=0.6, weight_decay=0.1)}
    start = Flat.from_tree(params)
    for path, alone in expect.items():
        p = {path: start[path].clone()}
        s = alone.init(p)
        for g in grads:
            p, s = alone.apply({path: g[path]}, s, p)
        torch.testing.assert_close(flat[path], p[path], rtol=RTOL, atol=ATOL)
    assert learning_rate(state) == pytest.approx(lr(3))


def test_torch_style_groups_equal_torch_adamw_with_the_same_groups():
    """DeepSpeed/torch groups (paths, absolute lr, betas, every parameter in one group) on a Flat
    equal torch.optim.AdamW(fused) with those groups on separate tensors, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    params = {"emb": torch.randn(6, 4, generator=gen), "w": torch.randn(4, 4, generator=gen),
              "b": torch.randn(4, generator=gen), "norm": torch.randn(4, generator=gen)}
    groups = [{"params": ["emb", "w"], "weight_decay": 0.1},
              {"params": ["b", "norm"], "weight_decay": 0.0, "lr": 1e-3, "betas": (0.8, 0.95)}]
    ours = param_groups(adamw(1e-2, backend="torch"), groups, complete=True)
    tensors = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    theirs = torch.optim.AdamW([dict(g, params=[tensors[p] for p in g["params"]]) for g in groups], lr=1e-2,
                               fused=True)
    flat = Flat.from_tree(params)
    state = ours.init(flat)
    for i in range(4):
        g = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        flat, state = ours.apply(Flat.from_tree(g), state, flat)
        for k, t in tensors.items():
            t.grad = g[k]
        theirs.step()
    for k, t in tensors.items():
        assert torch.equal(flat[k], t.detach()), k


def test_groups_of_a_torch_optimizer_take_torch_names():
    opt = param_groups(from_torch(torch.optim.AdamW, lr=1e-2), [{"params": "b", "betas": (0.5, 0.6), "amsgrad": True}])
    assert opt.info.hparams["groups"][0]["betas"] == (0.5, 0.6)
    params = {"a": torch.randn(3), "b": torch.randn(3)}
    state = opt.init(Flat.from_tree(params))
    assert "max_exp_avg_sq" in state.groups[1].elementwise and "max_exp_avg_sq" not in state.groups[0].elementwise


def gpt_setup():
    cfg = fs.models.GPTConfig(vocab_size=40, seq_len=12, n_layer=2, n_head=2, d_model=16)
    model = fs.models.gpt(cfg)
    return cfg, model, model.init(torch.Generator().manual_seed(0))


def test_grouped_sgd_trains_like_torch_sgd_with_the_same_groups():
    """Through train_step (clipping, accumulation): DeepSpeed-style groups by path equal a plain
    torch loop whose SGD has the same groups over the module's own tensors."""
    cfg, model, params = gpt_setup()
    paths = list(Flat.from_tree(params).layout.paths)
    no_wd = [p for p in paths if not no_decay("ln", "bqkv", "bo", "b_in", "b_out")(p)]
    groups = [{"params": [p for p in paths if p not in no_wd], "weight_decay": 0.05},
              {"params": no_wd, "weight_decay": 0.0, "lr": 0.05, "momentum": 0.5}]
    opt = chain(clip_by_global_norm(0.5), param_groups(sgd(0.2, momentum=0.9), groups, complete=True))
    check_param_groups(opt, paths)
    state = fs.init_train_state(params, opt)
    step = fs.make_train_step(model.loss, opt, grad_accum=2)
    leaves = fs.pytree.tree_map(lambda t: t.clone().requires_grad_(), params)
    by_path = dict(zip(paths, fs.pytree.tensor_leaves(leaves)))
    reference = torch.optim.SGD([dict(g, params=[by_path[p] for p in g["params"]]) for g in groups], lr=0.2,
                                momentum=0.9)
    for i in range(3):
        x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(i))
        batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
        state, _ = step(state, batch)
        for half in (0, 1):
            (model.loss(leaves, {k: v[2 * half:2 * half + 2] for k, v in batch.items()}) / 2).backward()
        torch.nn.utils.clip_grad_norm_(list(by_path.values()), 0.5)
        reference.step()
        reference.zero_grad()
    for path, tensor in by_path.items():
        torch.testing.assert_close(state.params[path], tensor.detach(), rtol=RTOL, atol=ATOL)


def test_grouped_state_checkpoint_resumes_bit_exact(tmp_path):
    """bf16 compute copy written per run (cast_to), the runs' states saved by parameter path and
    loaded back: 2 + 2 steps equal 4 straight."""
    cfg, model, params = gpt_setup()
    opt = chain(clip_by_global_norm(1.0), param_groups(adamw(1e-2, weight_decay=0.1, mask=no_decay("ln")),
                                                       [{"params": "blocks.1.*", "lr_scale": 0.5}]))
    step = fs.make_train_step(model.loss, opt)
    fresh = lambda: fs.init_train_state(params, opt, precision=fs.precision.bf16())  # noqa: E731
    batches = [{"inputs": x[:, :-1], "targets": x[:, 1:]} for x in
               (torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(i))
                for i in range(4))]
    straight = fresh()
    for b in batches:
        straight, _ = step(straight, b)
    state = fresh()
    for b in batches[:2]:
        state, _ = step(state, b)
    fs.checkpoint.save_checkpoint(tmp_path, state)
    resumed, _ = fs.checkpoint.load_checkpoint(tmp_path, fresh())
    for b in batches[2:]:
        resumed, _ = step(resumed, b)
    assert torch.equal(resumed.params.buffer, straight.params.buffer)
    assert torch.equal(resumed.master.buffer, straight.master.buffer)
    assert torch.equal(resumed.params.buffer, resumed.master.buffer.bfloat16())


def test_groups_nest_with_a_mask():
    """A group of an optimizer with a mask keeps the mask: its biases still get no weight decay."""
    params = {"a": {"w": torch.randn(3), "bias": torch.randn(3)}, "b": {"w": torch.randn(3)}}
    opt = param_groups(sgd(0.1, weight_decay=0.5, mask=no_decay("bias")), [{"params": "a.*", "weight_decay": 0.2}])
    flat = Flat.from_tree(params)
    flat, _ = opt.apply(Flat.from_tree(fs.pytree.tree_map(torch.zeros_like, params)), opt.init(flat), flat)
    torch.testing.assert_close(flat["a.w"], params["a"]["w"] * (1 - 0.1 * 0.2))
    torch.testing.assert_close(flat["a.bias"], params["a"]["bias"])
    torch.testing.assert_close(flat["b.w"], params["b"]["w"] * (1 - 0.1 * 0.5))


def test_grouped_update_on_a_plain_tree():
    params = {"w": torch.randn(2, 2), "bias": torch.randn(2)}
    opt = adamw(1e-2, weight_decay=0.3, mask=no_decay())
    updates, state = opt.update({k: torch.ones_like(v) for k, v in params.items()}, opt.init(params), params)
    plain, _ = adamw(1e-2, weight_decay=0.3).update({"w": torch.ones(2, 2)}, adamw(1e-2).init({"w": params["w"]}),
                                                    {"w": params["w"]})
    torch.testing.assert_close(updates["w"], plain["w"])
    torch.testing.assert_close(updates["bias"], torch.full((2,), -1e-2), rtol=1e-4, atol=0)
    assert state.count == 1


def test_capabilities_follow_the_optimizer():
    assert param_groups(adamw(), [{"params": "x", "lr_scale": 0.5}]).capabilities.elementwise
    assert param_groups(adamw(), [{"params": "x", "lr_scale": 0.5}]).capabilities.cpu
    grouped_lamb = param_groups(lamb(), [{"params": "x", "weight_decay": 0.1}]).capabilities
    assert grouped_lamb.whole_tensors and not grouped_lamb.elementwise


def test_with_hparams_rebuilds_and_names_what_is_allowed():
    assert with_hparams(adamw(1e-3), weight_decay=0.5).info.hparams["weight_decay"] == 0.5
    with pytest.raises(ValueError, match="adamw has no hyperparameter 'momentum'; allowed: lr, b1"):
        with_hparams(adamw(1e-3), momentum=0.9)


@pytest.mark.parametrize("groups, error, message", [
    ([{"params": "w", "momentum": 0.9}], ValueError, r"param group 0: 'momentum' is not a setting of adamw; allowed: "
                                                      r"params, name, lr_scale, lr, b1"),
    ([{"params": "w", "lr": 1e-3, "lr_scale": 0.5}], ValueError, "sets both lr and lr_scale"),
    ([{"params": "w", "lr_scale": -1.0}], ValueError, "lr_scale=-1.0 must be a finite number >= 0"),
    ([{"params": "w", "betas": (0.9,)}], ValueError, r"betas=\(0.9,\) must be a pair"),
    ([{"weight_decay": 0.0}], ValueError, "param group 0 has no 'params'"),
    ([{"params": 3}], TypeError, "params must be a path, a glob pattern, a list of those, or a predicate"),
    ([("w", 0.0)], TypeError, "param group 0 is tuple; a group is a dict"),
    ({"params": "w"}, TypeError, "groups must be a list of dicts"),
    ([{"name": "decay", "params": "w", "weight_decay": -1.0}], ValueError,
     "param group decay: adamw: weight_decay=-1.0 must be >= 0"),
])
def test_bad_groups_are_clear_errors(groups, error, message):
    with pytest.raises(error, match=message):
        param_groups(adamw(1e-3), groups)


def test_overlapping_and_missing_parameters_are_named():
    params = Flat.from_tree({"w": torch.zeros(2), "b": torch.zeros(2)})
    overlapping = param_groups(adamw(), [{"params": "*", "lr_scale": 0.5}, {"name": "bias", "params": "b"}])
    with pytest.raises(ValueError, match="parameter 'b' is in param groups 0, bias; a parameter may be in one group"):
        overlapping.init(params)
    incomplete = param_groups(adamw(), [{"params": ["w"]}], complete=True)
    with pytest.raises(ValueError, match="parameter 'b' is in no param group; with complete=True"):
        incomplete.init(params)
    typo = chain(clip_by_global_norm(1.0), param_groups(adamw(), [{"name": "attn", "params": "blocks.*.atn.*"}]))
    with pytest.raises(ValueError, match="param group attn selects no parameter"):
        check_param_groups(typo, params.layout.paths)


def test_optimizers_that_cannot_be_grouped_are_refused():
    with pytest.raises(ValueError, match="onebit_adam does its own compressed communication"):
        param_groups(onebit_adam(1e-3, world_size=1), [])
    with pytest.raises(TypeError, match="is not an optimizer with an lr built by fspeed.optim"):
        param_groups(chain(clip_by_global_norm(1.0), adamw()), [])


def test_state_from_another_layout_is_refused():
    opt = param_groups(adamw(), [{"params": "b", "lr_scale": 0.5}])
    state = opt.init(Flat.from_tree({"w": torch.zeros(2), "b": torch.zeros(2)}))
    other = Flat.from_tree({"b": torch.zeros(2), "w": torch.zeros(2), "c": torch.zeros(1)})
    with pytest.raises(ValueError, match="was not made by this optimizer's init for params of this layout"):
        opt.apply(other, state, other.clone())
