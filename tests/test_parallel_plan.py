"""fspeed.parallel.plan, zero, tensor_slicing, layout and explain: placements, their composition,
per-parameter persistence, and every option refused where it would have no effect."""

import math

import pytest
import torch

import fspeed as fs
from fspeed.parallel import ZeroConfig, resolve
from fspeed.parallel.layout import default_unit
from fspeed.parallel.memory import layout_memory
from fspeed.parallel.plan import STORAGE, Placement, Plan


def test_plans_compose_print_and_validate():
    plan = fs.zero(stage=3) | fs.tensor_slicing(fs.models.gpt_rules)
    assert plan.find("zero").config.stage == 3 and "zero(stage=3) | tensor_slicing" in repr(plan)
    with pytest.raises(ValueError, match="at most one zero"):
        fs.zero(1) | fs.zero(2)
    with pytest.raises(ValueError, match="stage=4"):
        fs.zero(4)
    with pytest.raises(ValueError, match="shards over 'model' only"):
        fs.tensor_slicing({"mlp": "data"})
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        ZeroConfig(stage=2, reduce_bucket_size=0)


def test_units_layout_and_explain():
    cfg = fs.models.GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator())
    assert default_unit("blocks.1.mlp.w_in") == "blocks.1" and default_unit("wte") == "wte"
    assert default_unit("layers.0.weight") == "layers.0"
    plan = fs.zero(3, param_persistence_threshold=1000) | fs.tensor_slicing(fs.models.gpt_rules)
    layout = resolve(plan, params, {"data": 2, "model": 2}, {"data": 1, "model": 0}, model.logical_axes)
    units = {u.name: u for u in layout.units}
    assert units["blocks.0"].sharded and not units["ln_f"].sharded
    assert units["blocks.0"].shard_numel == math.ceil(units["blocks.0"].numel / 2)
    assert layout.tensor_axes == ("heads", "mlp", "vocab")
    assert layout.info["blocks.0.mlp.w_in"].local_shape == (64, 32)
    mem = layout_memory(layout, fs.precision.bf16())
    assert mem.paper_device == 16 * layout.local.numel // 2

    class FakeMesh:
        sizes = {"data": 2, "model": 2, "pipe": 1}
        coords = {"data": 0, "model": 0, "pipe": 0}

    text = fs.explain(plan, params, FakeMesh, model.logical_axes)
    assert "blocks.0.attn.wqkv" in text and "P(None, 'model', None)" in text and "params+grads+opt: 1/data" in text
    assert "ZeRO paper formula" in text
    with pytest.raises(ValueError, match="add fs.tensor_slicing"):
        resolve(fs.zero(1), params, {"data": 1, "model": 2}, {}, model.logical_axes)


def test_persistence_threshold_is_per_parameter_as_in_deepspeed():
    """DeepSpeed keeps each parameter of at most param_persistence_threshold elements whole; a layer
    with big matrices and small biases is partly sharded (its biases whole, its matrices sharded)."""
    cfg = fs.models.GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=64)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator())
    layout = resolve(fs.zero(3, param_persistence_threshold=5000), params, {"data": 2}, {"data": 0})
    block = next(u for u in layout.units if u.name == "blocks.0")
    sharded = {layout.params[i].path.split(".", 2)[2] for i in block.sharded_params}
    whole = {layout.params[i].path.split(".", 2)[2] for i in block.resident_params}
    assert sharded == {"attn.wqkv", "mlp.w_in", "mlp.w_out"}  # 12,288 and 16,384 elements
    assert {"attn.wo", "mlp.b_in", "ln1.weight"} <= whole  # 4,096, 256 and 64 elements
    assert block.shard_numel == math.ceil(sum(layout.params[i].local_numel for i in block.sharded_params) / 2)
    # DeepSpeed's default of 100,000: every parameter of this small model stays whole
    default = resolve(fs.zero(3), params, {"data": 2}, {"data": 0})
    assert not default.sharded_units
    # the model-wide cap: persistent parameters, in order, while their total fits
    capped = resolve(fs.zero(3, model_persistence_threshold=1000), params, {"data": 2}, {"data": 0})
    persistent = [p for i, p in enumerate(capped.params)
                  if not any(i in u.sharded_params for u in capped.units)]
    assert sum(p.local_numel for p in persistent) <= 1000 and persistent
    text = fs.explain(fs.zero(3, param_persistence_threshold=5000), params, _FakeMesh, model.logical_axes)
    assert "(persistent)" in text and "params+grads+opt: 1/data" in text


class _FakeMesh:
    sizes = {"data": 2, "model": 1, "pipe": 1}
    coords = {"data": 0, "model": 0, "pipe": 0}


def test_recompute_blocks_needs_stage_3_and_overlap_follows_deepspeed():
    for stage in (0, 1, 2):
        with pytest.raises(ValueError, match="zero.recompute_blocks=True needs zero stage 3"):
            fs.zero(stage, recompute_blocks=True)
    assert fs.zero(3, recompute_blocks=True).find("zero").config.recompute_blocks
    assert ZeroConfig(stage=3).overlaps and not ZeroConfig(stage=2).overlaps  # DeepSpeed's default for None
    assert ZeroConfig(stage=1, overlap_comm=True).overlaps and not ZeroConfig(stage=3, overlap_comm=False).overlaps
    with pytest.raises(ValueError, match="zero.overlap_comm='yes'"):
        ZeroConfig(overlap_comm="yes")
    with pytest.raises(ValueError, match="model_persistence_threshold"):
        ZeroConfig(model_persistence_threshold=-1)


def test_a_third_transform_composes_without_touching_the_others():
    """Any object with the Transform protocol composes; explain shows what each transform placed."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class ShardOptimizerOfEmbeddings:  # a toy storage transform: the embeddings' optimizer state over data
        name: str = "embeddings_optimizer"
        phase: int = STORAGE

        def mesh_axes(self):
            return ("data",)

        def place(self, entries, placements, mesh_sizes):
            return tuple(p.partitioned(repr(self), "data", "optimizer") if e.path in ("wte", "wpe") else p
                         for e, p in zip(entries, placements))

        def wrap_ops(self, ops, mesh, tensor_axes):
            return ops

        def __repr__(self):
            return "embeddings_optimizer()"

    cfg = fs.models.GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=4, d_model=32)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator())
    plan = fs.tensor_slicing(fs.models.gpt_rules) | Plan((ShardOptimizerOfEmbeddings(),))
    assert repr(plan).endswith("| embeddings_optimizer()") and len(plan.transforms) == 2
    layout = resolve(plan, params, {"data": 2, "model": 2}, {"data": 0, "model": 0}, model.logical_axes)
    wte = layout.info["wte"].placement
    assert wte.optimizer == "data" and wte.compute == fs.P("model", None)
    assert ("optimizer", "data", "embeddings_optimizer()") in wte.placed_by
    assert ("compute", "model", repr(plan.transforms[0])) in wte.placed_by
    assert layout.info["ln_f.weight"].placement == Placement(fs.P(None))
    with pytest.raises(ValueError, match="at most one embeddings_optimizer"):
        plan | ShardOptimizerOfEmbeddings()
    with pytest.raises(TypeError, match="composes parallel transforms"):
        Plan(("zero",))


def test_slices_and_shards_are_named_pieces_of_parameters():
    """A rank's ZeRO slice (stages 1-2) and shards (stage 3) list the 1-D pieces of the parameters
    in them under the parameters' paths, so optimizers and checkpoints see parameter names."""
    params = {"a": torch.zeros(5), "b": torch.zeros(4, 2), "c": torch.zeros(3)}  # 16 elements
    for rank, expected in enumerate([[("a", 5), ("b", 1)], [("b", 6)], [("b", 1), ("c", 3), ("zero.pad", 2)]]):
        layout = resolve(fs.zero(2), params, {"data": 3}, {"data": rank})
        assert list(zip(layout.partition.paths, layout.partition.sizes)) == expected
        assert layout.partition.numel == layout.partition_numel == 6
    layout = resolve(fs.zero(3, param_persistence_threshold=3), params, {"data": 3}, {"data": 2})
    assert [u.name for u in layout.sharded_units] == ["a", "b"]  # "c" (3 elements) is persistent
    a, b = layout.sharded_units
    assert (a.shard_numel, b.shard_numel) == (2, 3)
    # masters, moments and gradients: the shards, then the rank's partition of the persistent "c"
    assert list(zip(layout.storage.paths, layout.storage.sizes)) == [("a", 1), ("a.pad", 1), ("b", 2), ("b.pad", 1),
                                                                    ("c", 1)]
    # the compute parameters: the same, the partition's compute copy, and "c" whole
    assert list(zip(layout.param_storage.paths, layout.param_storage.shapes)) == \
        [("a", (1,)), ("a.pad", (1,)), ("b", (2,)), ("b.pad", (1,)), ("zero.persistent", (1,)), ("c", (3,))]
    assert layout.shard_starts == (0, 2, -1) and layout.persistent_start == 5
    persistent = resolve(fs.zero(3), params, {"data": 3}, {"data": 2})  # all persistent: 16 elements, 6 a rank
    assert persistent.persistent_part == 6 and not persistent.sharded_units
    assert list(zip(persistent.storage.paths, persistent.storage.sizes)) == [("b", 1), ("c", 3), ("zero.pad", 2)]
    assert list(zip(persistent.param_storage.paths, persistent.param_storage.sizes)) == \
        [("zero.persistent", 6), ("a", 5), ("b", 8), ("c", 3), ("zero.persistent.pad", 2)]
