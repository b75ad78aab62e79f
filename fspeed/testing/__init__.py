"""Prove that a model trains the same under any plan: gloo worlds, the equivalence check, and
hypothesis strategies over plans, meshes, precisions and accumulation.

    from fspeed.testing import GlooWorld, assert_trains_like_one_process, plans
    assert_trains_like_one_process(my_pkg.build_model, fs.zero(3), make_batch=my_pkg.make_batch, world_size=2)

    @given(plan=plans())            # hypothesis, in your own tests
    def test_my_model(plan): assert_trains_like_one_process(my_pkg.build_model, plan, ...)
"""

from .equivalence import Trained, assert_trains_like_one_process, train_on_world
from .world import GlooWorld, WorkerError, free_port

STRATEGIES = ("accumulations", "meshes", "plans", "precisions")


def __getattr__(name: str):
    """The hypothesis strategies, imported when asked for (hypothesis is a test dependency)."""
    if name in STRATEGIES:
        from . import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'fspeed.testing' has no attribute {name!r}")

__all__ = ["GlooWorld", "Trained", "WorkerError", "accumulations", "assert_trains_like_one_process", "free_port",
           "meshes", "plans", "precisions", "train_on_world"]
