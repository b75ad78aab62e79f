"""fspeed.parallel.specs: partition specs, logical-axis rules (Flax's first free axis), shards."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

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
