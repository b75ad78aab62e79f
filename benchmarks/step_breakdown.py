"""Where a training step's time goes: wall-clock sections, summed per step, for benchmark breakdowns.

`Sections` accumulates named wall-clock intervals within one step; `wrap` times every call of an
attribute (a library function or method) under a label by replacing it with a timing wrapper,
without touching the library's code. Used by `vs_deepspeed.py --breakdown` to split fspeed's
`train_step` into its boundary phases and ZeRO-3's per-layer work (the rest is forward + backward +
accumulation) and DeepSpeed's step into forward, backward and `engine.step`.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator


class Sections:
    """Named wall-clock intervals of the current step; `end_step` files them and starts a new step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._depth = 0

    @contextmanager
    def section(self, label: str) -> Iterator[None]:
        """Time the body under `label`; nested sections are not double-counted (only the outermost)."""
        self._depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.current[label] += time.perf_counter() - start

    def wrap(self, owner: Any, name: str, label: str | Callable[[], str]) -> None:
        """Replace `owner.name` (a function or method) by one that times each call under `label`
        (a string, or a function called at each call that returns it)."""
        original = getattr(owner, name)
        if getattr(original, "_timed_label", None):
            raise ValueError(f"{owner.__name__}.{name} is already timed as {original._timed_label!r}")
        sections = self
        label_now = label if callable(label) else (lambda: label)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            with sections.section(label_now()):
                return original(*args, **kwargs)

        timed._timed_label = label
        setattr(owner, name, timed)

    def end_step(self, total_s: float, rest_label: str) -> None:
        """File this step's sections; `rest_label` gets the part of `total_s` no section covered."""
        step = dict(self.current)
        step[rest_label] = total_s - sum(step.values())
        self.steps.append(step)
        self.current = defaultdict(float)

    def medians_ms(self, skip: int = 0) -> dict[str, float]:
        """Median milliseconds per step of every label over the steps after the first `skip`."""
        steps = self.steps[skip:]
        labels = list(dict.fromkeys(label for step in steps for label in step))
        return {label: statistics.median(step.get(label, 0.0) for step in steps) * 1e3 for label in labels}


def wrap_fspeed_boundary(sections: Sections) -> None:
    """Time fspeed's boundary phases: gradient reduction, grad norm, optimizer, write-back, loss mean.

    Must run before `make_train_step` builds its runtime (it patches the classes and the module
    global the step looks up at call time).
    """
    import fspeed.train_step as train_step_module
    from fspeed.parallel.runtime import ParallelRuntime

    sections.wrap(ParallelRuntime, "finish", "finish grad reduction (what backward did not overlap)")
    sections.wrap(ParallelRuntime, "grad_norm", "grad norm")
    sections.wrap(train_step_module, "optimizer_step", "optimizer (clip folded in, AdamW apply)")
    sections.wrap(ParallelRuntime, "write_back", "write back (ZeRO-1/2 all-gather)")
    sections.wrap(ParallelRuntime, "mean_over_data", "loss all-reduce")


def wrap_fspeed_zero3(sections: Sections) -> list[str]:
    """Time ZeRO-3's per-layer work inside forward and backward: waiting for a layer's gathered
    weights, the layer's forward (run without a graph) and its recomputation in backward, and the
    reduce-scatter of its weight gradient. These are fspeed internals (`fspeed.parallel.ops`); names
    that no longer exist are skipped and returned, so the breakdown degrades instead of failing.
    """
    import torch

    import fspeed.parallel.grads as grads
    import fspeed.parallel.ops as unit_ops

    targets = [
        (getattr(unit_ops, "UnitOps", None), "gathered", "ZeRO-3 wait for a layer's all-gather"),
        (getattr(unit_ops, "_UnitCall", None), "run",
         lambda: "ZeRO-3 layer recompute in backward" if torch.is_grad_enabled() else "ZeRO-3 layer forward"),
        (getattr(grads, "ShardGrads", None), "_complete_shard", "ZeRO-3 wait for a layer's grad reduce-scatter"),
    ]
    missing = []
    for owner, name, label in targets:
        if owner is None or not hasattr(owner, name):
            missing.append(f"{getattr(owner, '__name__', owner)}.{name}")
            continue
        sections.wrap(owner, name, label)
    return missing
