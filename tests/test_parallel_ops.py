"""fspeed.parallel.ops: how units enter the model (ZeRO-3 just-in-time gathering, recompute)."""

import pytest
import torch

import fspeed as fs
from tests.parallel_cases import assert_matches_one_process, distributed_case, train


def gathered_bytes_case(recompute):
    """Bytes of gathered ZeRO-3 weights still held when each unit's backward starts."""
    import fspeed.parallel.ops as so
    calls, held = [], []
    real_init, real_backward = so._UnitCall.__init__, so._GatheredUnit.backward

    def init(self, *args):
        real_init(self, *args)
        calls.append(self)

    def backward(ctx, grad):
        held.append(sum(c.full.untyped_storage().nbytes() for c in calls if c.full is not None))
        return real_backward(ctx, grad)
    so._UnitCall.__init__, so._GatheredUnit.backward = init, staticmethod(backward)
    try:
        flat, *_ = distributed_case(1, 1, 1, 2, "sgd", 3, 1, dims={"n_layer": 3, "d_model": 32}, recompute=recompute)
    finally:
        so._UnitCall.__init__, so._GatheredUnit.backward = real_init, staticmethod(real_backward)
    return len(calls), held


@pytest.mark.parametrize("recompute", [False, True])
def test_zero3_frees_gathered_layers_between_forward_and_backward(world2, recompute):
    for n_calls, held in world2.run(gathered_bytes_case, recompute):
        assert n_calls == 3 and len(held) == 3
        assert held == [0, 0, 0]  # every gathered layer was freed after its forward


def test_zero3_recompute_with_partly_persistent_layers_matches_one_process(world2):
    """Per-parameter persistence makes layers part sharded, part whole; recompute handles both."""
    dims = {"n_layer": 2, "d_model": 16}
    results = world2.run(distributed_case, 17, 2, 2, 2, "sgd", 3, 1, "fp32", 300, 1000, dims, True)
    assert_matches_one_process(results, 17, 2, 2, 2, dp=2, dims=dims)


def test_recompute_blocks_takes_effect_on_one_rank(monkeypatch):
    """On one data rank nothing is sharded; recompute_blocks still recomputes every block."""
    import fspeed.parallel.ops as ops

    runs = []
    real = ops.checkpointed

    def counted(remat, fn, *args, **kwargs):
        def block(*a, **k):
            runs.append(1)
            return fn(*a, **k)
        return real(remat, block, *args, **kwargs)

    monkeypatch.setattr(ops, "checkpointed", counted)
    flat, losses, norms, _ = train(4, 2, 1, 2, "sgd", stage=3, mesh=fs.Mesh(data=1), dims={"n_layer": 3},
                                   recompute=True)
    assert len(runs) == 3 * 2 * 2  # 3 blocks x 2 steps, each run twice (forward, recompute)
    ref_flat, ref_losses, ref_norms, _ = train(4, 2, 1, 2, "sgd", dims={"n_layer": 3})
    torch.testing.assert_close(flat, ref_flat, rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
