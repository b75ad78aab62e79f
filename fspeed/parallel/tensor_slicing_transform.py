"""Tensor slicing (Megatron) over the `model` axis: the transform and the ops it gives a model.

    plan = fs.tensor_slicing({"heads": "model", "mlp": "model", "vocab": "model"})

Placement: each parameter's compute spec comes from its logical axes and the rules (Flax's
first-free-axis resolution, `fspeed.parallel.specs.logical_to_spec`).

Ops: a linear whose output axis is sharded is column-parallel (its input goes through
`copy_to_group`: identity forward, all-reduce of the gradient); one whose input axis is sharded is
row-parallel (partial outputs summed by `reduce_in_group`, bias added after). The
vocabulary-parallel embedding masks ids outside the local slice and sums over the group; the
vocabulary-parallel cross-entropy combines per-rank max, sum of exponentials and target logit, so
full logits never exist on one rank. Everything else passes to the inner ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from ..models.head_loss import head_loss
from .comm import AxisComm, all_reduce_max, copy_to_group, gather_from_group, reduce_in_group, split_to_group
from .plan import COMPUTE, ParamEntry, Placement, Plan
from .specs import AxisEntry, Rules, _rule_items, local_shape, logical_to_spec


@dataclass(frozen=True)
class TensorSlicing:
    """The tensor-slicing transform (build it with `tensor_slicing(rules)`)."""

    rules: tuple[tuple[str, AxisEntry], ...]
    name: str = "tensor_slicing"
    phase: int = COMPUTE

    def mesh_axes(self) -> tuple[str, ...]:
        return ("model",)

    def place(self, entries: Sequence[ParamEntry], placements: Sequence[Placement],
              mesh_sizes: Mapping[str, int]) -> tuple[Placement, ...]:
        out = []
        for entry, placement in zip(entries, placements):
            spec = logical_to_spec(entry.axes, self.rules, mesh_sizes)
            local_shape(entry.shape, spec, mesh_sizes, entry.path)  # raises when a dim does not divide
            out.append(placement.computed_as(repr(self), spec))
        return tuple(out)

    def sliced_axes(self, mesh_sizes: Mapping[str, int]) -> tuple[str, ...]:
        """The logical axes this transform shards over `model` on a mesh of `mesh_sizes`."""
        if mesh_sizes.get("model", 1) <= 1:
            return ()
        return tuple(name for name, target in self.rules if target is not None
                     and "model" in ((target,) if isinstance(target, str) else target))

    def wrap_ops(self, ops: Any, mesh: Any, tensor_axes: Sequence[str]) -> Any:
        return TensorSlicedOps(ops, mesh.comm("model"), tensor_axes) if tensor_axes else ops

    def __repr__(self) -> str:
        return "tensor_slicing({" + ", ".join(f"{k!r}: {v!r}" for k, v in self.rules) + "})"


def tensor_slicing(rules: Rules) -> Plan:
    """Megatron-style tensor slicing over `model`, by logical-axis rules (`{"mlp": "model", ...}`)."""
    items = tuple(_rule_items(rules))
    for name, target in items:
        if target not in (None, "model") and not (isinstance(target, tuple) and set(target) <= {"model"}):
            raise ValueError(f"tensor_slicing rule {name!r} -> {target!r}: tensor slicing shards over 'model' only")
    return Plan((TensorSlicing(items),))


class TensorSlicedOps:
    """Model ops with the logical axes in `tensor_axes` sliced over `model` (module docstring);
    `param`, `scan` and anything else go to `inner`."""

    def __init__(self, inner: Any, model: AxisComm, tensor_axes: Sequence[str]):
        self.inner = inner
        self.model = model
        self.tensor_axes = frozenset(tensor_axes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def local(self, size: int, axis: str) -> int:
        return size // self.model.size if axis in self.tensor_axes else size

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None, *,
               out_axis: Optional[str] = None, in_axis: Optional[str] = None) -> torch.Tensor:
        if out_axis in self.tensor_axes:  # column-parallel
            return self.inner.linear(copy_to_group(x, self.model), w, b)
        if in_axis in self.tensor_axes:  # row-parallel
            y = reduce_in_group(self.inner.linear(x, w), self.model)
            return y if b is None else y + b
        return self.inner.linear(x, w, b)

    def embedding(self, ids: torch.Tensor, w: torch.Tensor, *, vocab_axis: Optional[str] = None,
                  padding_idx: Optional[int] = None) -> torch.Tensor:
        if vocab_axis not in self.tensor_axes:
            return F.embedding(ids, w, padding_idx)
        rows = w.shape[0]
        lo = self.model.rank * rows
        inside = (ids >= lo) & (ids < lo + rows)
        local_pad = padding_idx - lo if padding_idx is not None and lo <= padding_idx < lo + rows else None
        local = F.embedding((ids - lo).clamp(0, rows - 1), w, local_pad) * inside.unsqueeze(-1).to(w.dtype)
        return reduce_in_group(local, self.model)

    def gather(self, x: torch.Tensor, *, axis: Optional[str] = None) -> torch.Tensor:
        """`x` whole along its last dim when that dim is the sliced logical `axis` (a
        column-parallel output made whole, e.g. the logits a Hugging Face head computes its loss from)."""
        return gather_from_group(x, self.model) if axis in self.tensor_axes else x

    def split(self, x: torch.Tensor, *, axis: Optional[str] = None) -> torch.Tensor:
        """This rank's slice of a whole `x` along its last dim when that dim is the sliced `axis` (the
        input of a row-parallel layer that the model computes whole); the gradient is gathered."""
        return split_to_group(x, self.model) if axis in self.tensor_axes else x

    def sum_grads(self, x: torch.Tensor, *, axis: Optional[str] = None) -> torch.Tensor:
        """`x` as it is; its gradient summed over `model` when `axis` is sliced (each rank's is partial)."""
        return copy_to_group(x, self.model) if axis in self.tensor_axes else x

    def head_loss(self, x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, *,
                  norm: Callable[..., torch.Tensor] = lambda x: x, norm_params: Sequence[torch.Tensor] = (),
                  vocab_axis: Optional[str] = None, in_axis: Optional[str] = None,
                  partition: bool = False) -> torch.Tensor:
        """The fused head and loss; a vocab-sliced `w` reduces its softmax terms over `model`, and with
        `partition` (activation partitioning) keeps 1/t of the x gradient per rank until backward."""
        if in_axis in self.tensor_axes:  # a row-parallel head: the separate ops
            logits = self.linear(norm(x, *norm_params), w, out_axis=vocab_axis, in_axis=in_axis)
            return self.cross_entropy(logits, targets, vocab_axis=vocab_axis)
        if vocab_axis not in self.tensor_axes:
            return self.inner.head_loss(x, w, targets, norm=norm, norm_params=norm_params)
        return head_loss(x, w, targets, norm=norm, norm_params=norm_params, comm=self.model, partition=partition)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, *,
                      vocab_axis: Optional[str] = None) -> torch.Tensor:
        if vocab_axis not in self.tensor_axes:
            return self.inner.cross_entropy(logits, targets)
        logits = logits.float()
        rows = logits.shape[-1]
        lo = self.model.rank * rows
        peak = all_reduce_max(logits.detach().amax(-1), self.model)
        shifted = logits - peak.unsqueeze(-1)
        sum_exp = reduce_in_group(shifted.exp().sum(-1), self.model)
        inside = (targets >= lo) & (targets < lo + rows)
        picked = shifted.gather(-1, (targets - lo).clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = reduce_in_group(picked * inside.to(picked.dtype), self.model)
        return (sum_exp.log() - target_logit).mean()


__all__ = ["TensorSlicedOps", "TensorSlicing", "tensor_slicing"]
