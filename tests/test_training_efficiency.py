"""Curriculum learning by sequence length and progressive layer dropping: DeepSpeed's formulas,
the batch cut, the reference GPT's skipped blocks, and PLD under ZeRO-3 and tensor slicing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed as fs
from fspeed.data.curriculum import CurriculumSchedule, difficulty_at, truncate_to_seqlen
from fspeed.models.gpt import _block
from fspeed.models.layer_drop import LayerDrop, keep_probabilities, kept_blocks, pld_theta_at, step_layer_drop


class DeepSpeedCurriculum:
    """DeepSpeed's CurriculumScheduler (legacy seqlen), transcribed as it runs: a state that starts at
    min_difficulty and that update_difficulty(global_steps + 1) moves while it is below the max."""

    def __init__(self, cfg: dict) -> None:
        self.cfg, self.current = cfg, cfg["min_difficulty"]

    def get_difficulty(self, global_steps: int) -> int:
        c, sc = self.cfg, self.cfg["schedule_config"]
        if c["schedule_type"] == "fixed_discrete":
            if global_steps > sc["max_step"][-1]:
                return sc["difficulty"][-1]
            for i in range(len(sc["max_step"])):
                if global_steps <= sc["max_step"][i]:
                    return sc["difficulty"][i]
        degree = 1 if c["schedule_type"] == "fixed_linear" else sc["root_degree"]
        d = (float(global_steps) / sc["total_curriculum_step"]) ** (1.0 / degree)
        d = math.floor(d * (c["max_difficulty"] - c["min_difficulty"]) + c["min_difficulty"])
        d -= d % sc["difficulty_step"]
        return min(d, c["max_difficulty"])

    def forward(self, global_steps: int) -> int:  # the engine, in every training forward
        if self.current < self.cfg["max_difficulty"]:
            self.current = self.get_difficulty(global_steps + 1)
        return self.current


curricula = st.one_of(
    st.builds(lambda lo, span, kind, total, step, root: {
        "min_difficulty": lo, "max_difficulty": lo + span, "schedule_type": kind,
        "schedule_config": {"total_curriculum_step": total, "difficulty_step": step, "root_degree": root}},
        st.integers(8, 128), st.integers(0, 2048), st.sampled_from(["fixed_linear", "fixed_root"]),
        st.integers(1, 300), st.sampled_from([1, 8, 16, 64]), st.integers(1, 4)),
    st.builds(lambda lo, hi, ds, gaps: {
        "min_difficulty": lo, "max_difficulty": hi, "schedule_type": "fixed_discrete",
        "schedule_config": {"difficulty": ds, "max_step": sorted(gaps)[:len(ds) - 1]}},
        st.integers(1, 64), st.integers(1, 512), st.lists(st.integers(1, 600), min_size=2, max_size=5),
        st.lists(st.integers(0, 200), min_size=5, max_size=5)),
)


def _schedule(cfg: dict) -> CurriculumSchedule:
    sc = cfg["schedule_config"]
    return CurriculumSchedule(min_difficulty=cfg["min_difficulty"], max_difficulty=cfg["max_difficulty"],
                              schedule_type=cfg["schedule_type"], total_curriculum_step=sc.get("total_curriculum_step"),
                              difficulty_step=sc.get("difficulty_step"),
                              root_degree=sc.get("root_degree") if cfg["schedule_type"] == "fixed_root" else None,
                              difficulty=sc.get("difficulty"), max_step=sc.get("max_step"))


@settings(max_examples=60, deadline=None)
@given(cfg=curricula)
def test_curriculum_equals_deepspeeds_scheduler_at_every_step(cfg):
    reference, schedule = DeepSpeedCurriculum(cfg), _schedule(cfg)
    for step in range(320):
        assert difficulty_at(schedule, step) == reference.forward(step), step
        assert schedule.get_difficulty(step) == reference.get_difficulty(step)


def test_curriculum_known_values_and_bad_settings():
    s = CurriculumSchedule(min_difficulty=64, max_difficulty=1024, schedule_type="fixed_linear",
                           total_curriculum_step=2000, difficulty_step=8)
    assert [difficulty_at(s, t) for t in (0, 999, 1999, 5000)] == [64, 544, 1024, 1024]
    root = CurriculumSchedule(min_difficulty=8, max_difficulty=72, schedule_type="fixed_root",
                              total_curriculum_step=100, difficulty_step=8, root_degree=2)
    assert difficulty_at(root, 24) == 40  # floor(sqrt(25/100) * 64 + 8) = 40
    with pytest.raises(ValueError, match="difficulty must hold one more value than max_step"):
        CurriculumSchedule(min_difficulty=1, max_difficulty=4, schedule_type="fixed_discrete", difficulty=[1, 2],
                           max_step=[1, 2])
    with pytest.raises(ValueError, match="root_degree must be a positive integer with fixed_root"):
        CurriculumSchedule(min_difficulty=1, max_difficulty=4, schedule_type="fixed_root", total_curriculum_step=5,
                           difficulty_step=1)
    with pytest.raises(ValueError, match="allowed: fixed_linear, fixed_root, fixed_discrete"):
        CurriculumSchedule(min_difficulty=1, max_difficulty=4, schedule_type="custom")


def test_truncation_cuts_every_sequence_dim_and_leaves_the_rest():
    batch = {"inputs": torch.arange(24).reshape(2, 12), "targets": torch.arange(24).reshape(2, 12) + 1,
             "mask": torch.ones(2, 1, 12, 12), "weight": torch.ones(2), "tag": "x"}
    cut = truncate_to_seqlen(batch, 5)
    assert cut["inputs"].shape == (2, 5) and torch.equal(cut["targets"], batch["targets"][:, :5])
    assert cut["mask"].shape == (2, 1, 5, 5) and cut["weight"].shape == (2,) and cut["tag"] == "x"
    assert truncate_to_seqlen(batch, 12) is batch


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_gpt_trains_at_the_curriculum_length(attention):
    cfg = fs.models.GPTConfig(vocab_size=20, seq_len=32, n_layer=2, n_head=2, d_model=16, attention=attention,
                              sparse_attention=fs.sparse.SparseAttentionConfig(block=8) if attention == "sparse"
                              else None)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    x = torch.randint(0, 20, (2, 33), generator=torch.Generator().manual_seed(1))
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
    short = truncate_to_seqlen(batch, 12)  # not a multiple of the sparse block
    logits = model.apply(params, short["inputs"])
    assert logits.shape == (2, 12, 20)
    # causal: the first 12 positions do not depend on the rest of the sequence
    torch.testing.assert_close(logits, model.apply(params, batch["inputs"])[:, :12], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- PLD

@settings(max_examples=50, deadline=None)
@given(theta=st.floats(0.01, 1.0), gamma=st.floats(0.0, 0.1), step=st.integers(0, 100_000))
def test_pld_theta_is_deepspeeds_bit_for_bit(theta, gamma, step):
    # DeepSpeed: current_theta starts at 1.0; step() calls update_state(global_steps) before global_steps += 1
    current = 1.0 if step == 0 else (1. - theta) * np.exp(-gamma * (step - 1)) + theta
    assert pld_theta_at(step, theta, gamma) == current
    assert pld_theta_at(step, theta, gamma) >= theta


def test_keep_probabilities_fall_with_depth_and_draws_follow_them():
    assert keep_probabilities(0.5, 4) == [0.875, 0.75, 0.625, 0.5]
    kept = torch.tensor([[s is not None for s in kept_blocks(LayerDrop(0.5, seed), 4)]
                         for seed in range(4000)], dtype=torch.float64)
    torch.testing.assert_close(kept.mean(0), torch.tensor([0.875, 0.75, 0.625, 0.5], dtype=torch.float64),
                               atol=0.03, rtol=0)
    assert kept_blocks(LayerDrop(0.5, 3), 4, training=False) == [1.0] * 4  # evaluation keeps every block
    assert step_layer_drop(7, 0, 0.5, 0.01) == step_layer_drop(7, 0, 0.5, 0.01) != step_layer_drop(8, 0, 0.5, 0.01)


def _gpt(n_layer=4):
    cfg = fs.models.GPTConfig(vocab_size=24, seq_len=8, n_layer=n_layer, n_head=4, d_model=16)
    return fs.models.gpt(cfg)


def _drop_with(pattern):
    """A LayerDrop whose draw keeps exactly the blocks of `pattern` (searching seeds)."""
    for seed in range(10_000):
        drop = LayerDrop(0.3, seed)
        if [s is not None for s in kept_blocks(drop, len(pattern))] == pattern:
            return drop
    raise AssertionError(pattern)


def test_a_dropped_block_is_skipped_and_kept_ones_rescaled():
    model = _gpt()
    params = model.init(torch.Generator().manual_seed(0))
    x = torch.randint(0, 24, (2, 9), generator=torch.Generator().manual_seed(2))
    drop = _drop_with([True, False, True, False])
    scales = kept_blocks(drop, 4)
    rng = torch.Generator()
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:], "layer_drop": drop}
    grads, loss = torch.func.grad_and_value(lambda p: model.loss(p, batch, rng=rng))(params)
    for i in (1, 3):
        assert all(float(g.abs().max()) == 0.0 for g in fs.pytree.tree_leaves(grads["blocks"][i]))
    # the same as a 2-block GPT made of blocks 0 and 2 with their branches scaled
    two = {**params, "blocks": [params["blocks"][0], params["blocks"][2]]}
    h = params["wte"][x[:, :-1]] + params["wpe"][:8]
    for p, s in zip(two["blocks"], (scales[0], scales[2])):
        h = _block(p, h, None, n_head=4, dropout=0.0, ops=fs.models.ops.DENSE, scale=s)
    h = torch.nn.functional.layer_norm(h, (16,), params["ln_f"]["weight"], params["ln_f"]["bias"], eps=1e-5)
    expected = torch.nn.functional.cross_entropy((h @ params["wte"].T).flatten(0, 1), x[:, 1:].flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def _pld_batches(steps, rows):
    out = []
    for t in range(steps):
        x = torch.randint(0, 24, (rows, 9), generator=torch.Generator().manual_seed(100 + t))
        out.append({"inputs": x[:, :-1], "targets": x[:, 1:], "layer_drop": step_layer_drop(t + 5, 0, 0.3, 0.5)})
    return out


def _train_pld(stage, tensor, steps=3, micro=2, grad_accum=1):
    """The tiny GPT with PLD, on a mesh (stage not None) or one process; the params and losses."""
    model = _gpt()
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.adamw(3e-3, weight_decay=0.1))
    params = model.init(torch.Generator().manual_seed(0))
    mesh, plan, rank, data = None, None, 0, 1
    if stage is not None:
        mesh = fs.parallel.Mesh(data=-1, model=tensor)
        plan = fs.parallel.zero(stage)
        if tensor > 1:
            plan = plan | fs.parallel.tensor_slicing(fs.models.GPT_RULES)
        rank, data = mesh.coordinate("data"), mesh.size("data")
    state = fs.init_train_state(params, opt, seed=0, plan=plan, mesh=mesh, model=model)
    step = fs.make_train_step(model.loss, opt, grad_accum=grad_accum if stage is not None else grad_accum * 2,
                              plan=plan, mesh=mesh)
    losses = []
    rows = micro * grad_accum * 2
    for batch in _pld_batches(steps, rows):
        share = {k: (v[rank * rows // data:(rank + 1) * rows // data] if isinstance(v, torch.Tensor) else v)
                 for k, v in batch.items()}
        state, metrics = step(state, share)
        losses.append(metrics["loss"])
    full = fs.gather_params(state, mesh) if mesh else state.master_params.tree()
    return fs.Flat.from_tree(full).buffer, losses


@pytest.mark.parametrize("stage,tensor", [(3, 1), (1, 2)])
def test_pld_under_zero3_and_tensor_slicing_equals_one_process(world2, stage, tensor):
    patterns = [[s is not None for s in kept_blocks(b["layer_drop"], 4)] for b in _pld_batches(3, 4)]
    assert any(not all(p) for p in patterns) and any(any(p) for p in patterns)  # something is dropped, not all
    ref_params, ref_losses = _train_pld(None, 1)
    for params, losses in world2.run(_train_pld, stage, tensor):
        # atol: Adam amplifies the rounding noise of the attention key bias (zero true gradient) to ~1e-6
        torch.testing.assert_close(params, ref_params, rtol=1e-5, atol=1e-5)
        assert losses == pytest.approx(ref_losses, rel=1e-5)


def _pld_gathers(patterns):
    """ZeRO-3 on the tiny GPT, one step per block pattern (kept or not) after a step keeping all: the
    all-gathers each step issued (prefetches included, used or not)."""
    model = _gpt()
    mesh = fs.parallel.Mesh(data=-1)
    plan, opt = fs.parallel.zero(3, param_persistence_threshold=0), fs.optim.sgd(0.1)
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt, plan=plan, mesh=mesh, model=model)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    counts = []
    log = step.runtime_for(state).data.log
    was_enabled, log.enabled = log.enabled, True  # every collective's event, not only byte counts
    try:
        for t, pattern in enumerate([[True] * 4] + patterns):
            x = torch.randint(0, 24, (2, 9), generator=torch.Generator().manual_seed(t))
            log.reset()
            state, _ = step(state, {"inputs": x[:, :-1], "targets": x[:, 1:], "layer_drop": _drop_with(pattern)})
            counts.append(sum(1 for e in log.events if e.op == "all_gather"))
    finally:
        log.enabled = was_enabled
        log.reset()
    return counts


def test_pld_under_zero3_prefetches_the_next_kept_block(world2):
    """Each kept block names the next kept one as its successor, so ZeRO-3 prefetches that (not the
    block after it in the model, dropped or not): a dropped block takes its forward and backward
    gathers away, and nothing else is gathered (no prefetch of a dropped block)."""
    patterns = [[True, False, True, False], [False, True, False, True], [True, False, False, True]]
    for full, *dropped in world2.run(_pld_gathers, patterns):
        assert dropped == [full - 2 * pattern.count(False) for pattern in patterns]


class DroppingStack(torch.nn.Module):
    """A user's module using the documented hook: its forward takes `layer_drop`."""

    def __init__(self, width=8, depth=4):
        super().__init__()
        self.embed = torch.nn.Embedding(24, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 24)

    def forward(self, inputs, layer_drop=None):
        x = self.embed(inputs)
        for block, scale in zip(self.blocks, kept_blocks(layer_drop, len(self.blocks), self.training)):
            if scale is not None:
                x = x + scale * torch.tanh(block(x))
        return self.head(x)


def _ce(outputs, batch):
    return torch.nn.functional.cross_entropy(outputs.flatten(0, 1), batch["targets"].flatten())


def test_a_functionalized_module_drops_through_the_hook_and_others_are_refused():
    from hf_models import hf_gpt2

    from fspeed.models.layer_drop import supports_layer_drop

    torch.manual_seed(0)
    model = fs.functionalize(DroppingStack(), _ce)
    assert supports_layer_drop(model) and supports_layer_drop(_gpt())
    assert not supports_layer_drop(fs.functionalize(hf_gpt2(), lambda out, batch: out.loss))  # **kwargs only
    params = model.init()
    opt = fs.optim.sgd(0.5)
    before = {k: v.clone() for k, v in zip(fs.tree_paths(params), fs.pytree.tree_leaves(params))}
    state = fs.init_train_state(params, opt, seed=0, model=model)
    step = fs.make_train_step(model.loss, opt)
    drop = _drop_with([True, False, False, True])
    x = torch.randint(0, 24, (4, 7))
    state, _ = step(state, {"inputs": x[:, :-1], "targets": x[:, 1:], "layer_drop": drop})
    after = dict(zip(fs.tree_paths(state.master_params.tree()), fs.pytree.tree_leaves(state.master_params.tree())))
    for i, kept in enumerate([True, False, False, True]):
        assert torch.equal(after[f"blocks.{i}.weight"], before[f"blocks.{i}.weight"]) != kept


def test_curriculum_cuts_a_hugging_face_models_batch():
    from hf_models import SEQ, hf_gpt2

    model = fs.functionalize(hf_gpt2(), lambda out, batch: out.loss)
    params = model.init()
    x = torch.randint(0, 64, (2, SEQ))
    batch = {"input_ids": x, "labels": x, "attention_mask": torch.ones(2, SEQ, dtype=torch.long)}
    short = truncate_to_seqlen(batch, 8)
    assert all(v.shape == (2, 8) for v in short.values())
    reference = hf_gpt2()
    reference.eval()
    with torch.no_grad():
        expected = reference(input_ids=x[:, :8], labels=x[:, :8], attention_mask=batch["attention_mask"][:, :8]).loss
    torch.testing.assert_close(model.loss(params, short, train=False), expected, rtol=1e-5, atol=1e-6)


def test_initialize_applies_a_ds_configs_curriculum_and_layer_drop():
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4,
                                      "max_difficulty": 8, "schedule_type": "fixed_discrete",
                                      "schedule_config": {"difficulty": [4, 8], "max_step": [1]}},
              "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.5}}
    engine, _, _, _ = fs.initialize(model=_gpt(), config=config, overrides=["model.seq_len=8"])
    x = torch.randint(0, 24, (2, 9))
    seen = []
    for _ in range(3):
        engine.backward(engine({"inputs": x[:, :-1], "targets": x[:, 1:]}))
        engine.step()
        seen.append((engine.metrics["curriculum_seqlen"], engine.metrics["pld_theta"]))
    assert [s for s, _ in seen] == [4, 8, 8]  # DeepSpeed: global_steps + 1 <= max_step[0] = 1 only at step 0
    assert [t for _, t in seen] == [pld_theta_at(t, 0.5, 0.5) for t in range(3)]
    with pytest.raises(ValueError, match="does not read the batch's 'layer_drop'"):
        from hf_models import hf_gpt2

        fs.initialize(model=hf_gpt2(), config={**config, "curriculum_learning": {"enabled": False}},
                      loss_fn=lambda out, batch: out.loss)


def test_remat_every_counts_the_models_blocks_under_layer_dropping():
    """With progressive layer dropping the GPT runs its kept blocks one scan call each: remat's
    `every=2` still checkpoints blocks 0 and 2 (by their index in the model), not every block."""
    profile = fs.RematProfile()
    model = fs.remat(_gpt(), "full", every=2, profile=profile)
    params = model.init(torch.Generator().manual_seed(0))
    x = torch.randint(0, 24, (2, 9), generator=torch.Generator().manual_seed(2))
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:], "layer_drop": _drop_with([True, True, False, True])}
    leaves = [t.requires_grad_() for t in fs.pytree.tree_leaves(params)]
    torch.autograd.grad(model.loss(params, batch, rng=torch.Generator()), leaves, allow_unused=True)
    assert sorted(profile.take()) == ["blocks.0"]  # block 2 was dropped; blocks 1 and 3 are not checkpointed
    torch.autograd.grad(model.loss(params, {**batch, "layer_drop": _drop_with([True, True, True, True])},
                                   rng=torch.Generator()), leaves)
    assert sorted(profile.take()) == ["blocks.0", "blocks.2"]
