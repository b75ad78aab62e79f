"""The first step's check that tensor slicing left no partial gradient behind.

Under tensor slicing, a parameter the plan keeps whole (a norm, a bias, an activation's own
parameters) gets its gradient from computation every tensor rank repeats, so the ranks' gradients
are the same bits. A parameter a module applies to each rank's own slice (Qwen3's per-head
`q_norm`, a learned activation inside a sliced MLP) gets only this rank's part: training would
silently diverge from one process. Its module needs the tp_plan style
`replicated_with_grad_allreduce`, which a model's own plan sometimes lacks. The check compares the
whole parameters' gradients over the `model` ranks once (two all-reduces of those gradients,
small next to the sliced ones) and names what differs, before any update is applied.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from .comm import AxisComm

# bits repeated work gives agree exactly; a partial gradient is off by O(1) of its size
RELATIVE_TOLERANCE = 1e-4


def replicated_over_model(grads, layout) -> list[tuple[str, torch.Tensor]]:
    """(path, gradient piece) of each parameter of `layout` that tensor slicing keeps whole, from a
    gradient (`Flat` or `LooseGrads`) on that layout's local or partitioned storage."""
    info = layout.info
    return [(path, t) for path, t, size in zip(grads.layout.paths, grads.segments(), grads.layout.sizes)
            if size and path in info and not info[path].tp_sharded]


def differing_across_ranks(named: Sequence[tuple[str, torch.Tensor]], comm: AxisComm) -> list[tuple[str, float]]:
    """(path, largest difference over the ranks relative to the gradient's largest entry) of each
    gradient in `named` that is not the same on every rank of `comm` (every rank calls this)."""
    if comm.size == 1 or not named:
        return []
    flat = torch.cat([t.detach().reshape(-1).float() for _, t in named])
    high = comm.all_reduced(flat, "max")
    low = -comm.all_reduced(-flat, "max")
    out = []
    for (path, _), spread, peak in zip(named, (high - low).split([t.numel() for _, t in named]),
                                       torch.maximum(high.abs(), low.abs()).split([t.numel() for _, t in named])):
        if spread.numel() and float(spread.max()) > RELATIVE_TOLERANCE * float(peak.max()):
            out.append((path, float(spread.max()) / max(float(peak.max()), 1e-30)))
    return out


def check_replicated_grads(named: Sequence[tuple[str, torch.Tensor]], comm: AxisComm) -> None:
    """Raise naming the whole parameters whose gradients differ over the tensor ranks (module docstring)."""
    differing = differing_across_ranks(named, comm)
    if not differing:
        return
    modules = sorted({re.sub(r"\.\d+\.", ".*.", path.rpartition(".")[0]) for path, _ in differing})
    shown = ", ".join(f"{path} ({relative:.2g})" for path, relative in differing[:4])
    more = f" and {len(differing) - 4} more" if len(differing) > 4 else ""
    suggestion = ", ".join(f"{m!r}: 'replicated_with_grad_allreduce'" for m in modules[:3])
    raise ValueError(
        f"tensor slicing: the gradients of {shown}{more} differ between the {comm.size} tensor ranks (relative "
        "spread in brackets): these parameters are kept whole but used on each rank's slice (a norm over each "
        "rank's heads, an activation's parameters inside a sliced MLP), so each rank has only its part. No update "
        f"was applied. Give their modules the style 'replicated_with_grad_allreduce' in the tp_plan, e.g. "
        f"tp_plan={{**fs.tp_plan_from(module), {suggestion}}}")


__all__ = ["RELATIVE_TOLERANCE", "check_replicated_grads", "differing_across_ranks", "replicated_over_model"]
