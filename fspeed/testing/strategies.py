"""Hypothesis strategies over what a parallel run can vary: plans, meshes, precisions, accumulation.

    @given(plan=plans(tensor=False), accum=accumulations())
    def test_my_model_under_any_plan(plan, accum): ...

hypothesis is a test dependency (`pip install fspeed[test]`); importing this module without it
raises ImportError naming it.
"""

from __future__ import annotations

from typing import Sequence

try:
    from hypothesis import strategies as st
except ImportError as err:  # pragma: no cover - only without the test extra
    raise ImportError("fspeed.testing's strategies need hypothesis: pip install 'fspeed[test]'") from err


@st.composite
def plans(draw, *, stages: Sequence[int] = (0, 1, 2, 3), tensor_rules=None):
    """A plan: a ZeRO stage with random reduce buckets, overlap and persistence threshold, and
    (with `tensor_rules`, e.g. `fs.models.module_tp_rules`) tensor slicing by those rules."""
    import fspeed as fs

    stage = draw(st.sampled_from(list(stages)))
    options = dict(reduce_bucket_size=draw(st.sampled_from([97, 1000, 500_000_000])),
                   overlap_comm=draw(st.sampled_from([None, True, False])))
    if stage == 3:
        options.update(param_persistence_threshold=draw(st.sampled_from([0, 100, 100_000])),
                       prefetch=draw(st.booleans()))
    plan = fs.zero(stage, **options)
    return plan | fs.tensor_slicing(tensor_rules) if tensor_rules is not None else plan


def meshes(world_size: int, *, tensor: bool = False):
    """(data, tensor) sizes whose product is `world_size` (tensor 1 unless `tensor`)."""
    choices = [(world_size // t, t) for t in range(1, world_size + 1) if world_size % t == 0 and (tensor or t == 1)]
    return st.sampled_from(choices)


def precisions():
    """"fp32", "bf16" or "fp16" (compare bf16/fp16 with a tolerance that fits them)."""
    return st.sampled_from(["fp32", "bf16", "fp16"])


def accumulations(most: int = 3):
    """Gradient-accumulation steps, 1 to `most`."""
    return st.integers(1, most)


__all__ = ["accumulations", "meshes", "plans", "precisions"]
