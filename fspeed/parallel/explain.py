"""`explain`: a plan applied to a parameter tree on a mesh, as a table a person can read.

    print(fs.explain(fs.zero(3) | fs.tensor_slicing(fs.models.gpt_rules), params, mesh, model.logical_axes))

Per parameter: global shape, compute spec, how its params / grads / optimizer state are stored,
its local shape, the bytes of its compute parameter on this rank, and which transform placed
each mesh axis. Then the model-state bytes per rank (fspeed's buffers, the peak within a step,
and the ZeRO paper's formula) from the same accounting as `estimate_memory`.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

from ..pytree import PyTree
from .comm import ceil_div
from .layout import Layout, resolve
from .memory import _precision, layout_memory
from .plan import Plan


def explain(plan: Plan, params: PyTree, mesh, logical_axes: Optional[Mapping] = None,
            precision: str = "bf16", layers=None) -> str:
    """The table described in the module docstring (`precision` prices the bytes). Under a pipeline
    (`layers`: the model's `LayerSequence`) the table is this rank's stage's, each parameter with the
    stages holding it, after the layers of every stage. `mesh`: a Mesh, or axis sizes
    (`{"data": 4, "pipe": 2}`) to plan a launch from one process (the table of the first rank)."""
    if logical_axes is None and hasattr(params, "logical_axes"):
        raise TypeError("pass the params tree, and the model's logical axes as logical_axes=")
    if isinstance(mesh, Mapping):
        sizes, coords = {"data": 1, "model": 1, "pipe": 1, **dict(mesh)}, {"data": 0, "model": 0, "pipe": 0}
    else:
        sizes, coords = mesh.sizes, mesh.coords
    layout = resolve(plan, params, sizes, coords, logical_axes, layers=layers)
    policy = _precision(precision)
    stages = "" if layout.pipeline is None else layout.pipeline.describe() + "\n\n"
    return stages + _table(layout, policy) + "\n\n" + str(layout_memory(layout, policy))


def _table(layout: Layout, policy) -> str:
    elem = torch.empty(0, dtype=policy.param_dtype).element_size()
    n = layout.data_size
    sharded = {i for u in layout.units for i in u.sharded_params}
    plan = layout.pipeline
    rows = [("parameter", "global shape", "compute spec", "storage", "local shape", "param bytes/rank", "placed by")
            + (("stages",) if plan is not None else ())]
    for i, p in enumerate(layout.params):
        numel = ceil_div(p.local_numel, n) if i in sharded else p.local_numel
        storage = p.placement.describe()
        if layout.stage == 3 and i not in sharded and n > 1:
            storage += " (persistent)"
        placed = ", ".join(sorted({f"{axis}: {by}" for _, axis, by in p.placement.placed_by})) or "-"
        rows.append((p.path, str(list(p.shape)), repr(p.spec), storage, str(list(p.local_shape)),
                     f"{numel * elem:,}", placed)
                    + ((",".join(map(str, plan.stages_holding(p.path))),) if plan is not None else ()))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(f"\n{layout.describe()}: {sum(math.prod(p.shape) for p in layout.params):,} parameters, "
                 f"{layout.local.numel:,} per model-parallel rank, {len(layout.units)} units"
                 + (f", {len(layout.sharded_units)} sharded" if layout.stage == 3 else ""))
    return "\n".join(lines)


__all__ = ["explain"]
