"""Partition specs, logical-axis rules, plans, layouts and the comm log (single process)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fspeed as fs
from fspeed.parallel.comm import CommLog, bus_bandwidth
from fspeed.parallel import ZeroConfig, resolve
from fspeed.parallel.layout import default_unit
from fspeed.parallel.memory import layout_memory
from fspeed.parallel.specs import P, local_shape, logical_to_spec, shard


def test_first_free_axis_wins_like_flax():
    rules = [("embed", "fsdp"), ("mlp", ("fsdp", "tensor")), ("mlp", "tensor"), ("embed", None)]
    sizes = {"fsdp": 2, "tensor": 2}
    assert logical_to_spec(("embed", "mlp"), rules, sizes) == P("fsdp", "tensor")  # mlp falls back to its 2nd rule
    assert logical_to_spec(("mlp", "embed"), rules, sizes) == P("tensor", "fsdp")
    assert logical_to_spec(("mlp",), rules, sizes) == P(("fsdp", "tensor"))
    assert logical_to_spec(("mlp", "embed"), rules, {"fsdp": 1, "tensor": 2}) == P("tensor", None)  # size-1 skipped
    assert logical_to_spec((None, "vocab"), rules, sizes) == P(None, None)
    with pytest.raises(ValueError, match="appear twice"):
        logical_to_spec(("mlp", "mlp"), rules, sizes)


def test_spec_helpers_and_errors():
    spec = P(None, ("data", "model"))
    assert spec.axes() == ["data", "model"] and spec.dim_of("model") == 1 and spec.dim_of("pipe") is None
    assert repr(spec) == "P(None, ('data', 'model'))"
    with pytest.raises(TypeError, match="PartitionSpec entries"):
        P(3)
    with pytest.raises(ValueError, match="dim 0 of size 5 cannot be split into 2"):
        local_shape((5, 4), P("model", None), {"model": 2}, "w")


@given(dims=st.lists(st.integers(1, 4), min_size=1, max_size=3), parts=st.sampled_from([1, 2, 4]),
       which=st.integers(0, 2))
def test_shards_concatenate_back_to_the_tensor(dims, parts, which):
    which %= len(dims)
    shape = [d * (parts if i == which else 1) for i, d in enumerate(dims)]
    x = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    spec = P(*[("model" if i == which else None) for i in range(len(shape))])
    pieces = [shard(x, spec, {"model": parts}, {"model": r}) for r in range(parts)]
    assert all(tuple(p.shape) == local_shape(shape, spec, {"model": parts}) for p in pieces)
    assert torch.equal(torch.cat(pieces, dim=which), x)


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


def test_single_process_mesh_and_mpu_interface():
    mesh = fs.Mesh()
    assert mesh.sizes == {"pipe": 1, "data": 1, "model": 1}
    assert mesh.get_data_parallel_world_size() == 1 and mesh.get_model_parallel_rank() == 0
    assert mesh.get_model_parallel_group() is None
    x = torch.arange(4.0)
    assert torch.equal(mesh.comm("data").all_reduce_(x.clone()), x)
    with pytest.raises(ValueError, match="but the world size is 1"):
        fs.Mesh(data=2)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        fs.Mesh(data=-1, model=-1)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        mesh.comm("tensor")


def test_bus_bandwidth_formulas_and_summary():
    n, size, t = 4, 1_000_000, 0.002
    algbw, busbw = bus_bandwidth("all_reduce", size, t, n)
    assert algbw == pytest.approx(2 * size / t * 8 / 1e9) and busbw == pytest.approx(size / t * 2 * 3 / 4 * 8 / 1e9)
    algbw, busbw = bus_bandwidth("all_gather", size, t, n)
    assert algbw == pytest.approx(size * n / t * 8 / 1e9) and busbw == pytest.approx(algbw * 3 / 4)
    log = CommLog()
    for latency in (0.001, 0.002, 0.003, 0.1):
        log.record("all_reduce", "data", 4096, latency, 2)
    log.record("all_gather", "data", 1 << 20, 0.01, 2)
    assert log.total_bytes() == 4 * 4096 + (1 << 20)
    table = log.summary()
    assert "Comm. Op" in table and "all_reduce" in table and "4.00 KB" in table and "1.00 MB" in table
