"""Zero bubble's split of a linear layer's backward: the input's gradient now (B), the weight's later (W).

A stage that defers its weight gradients runs its forward with `DeferringOps` (layers whose linears
all go through ops) or under `DeferWeightGrads` (layers that call `F.linear` or `addmm` themselves):
each linear on a stage weight becomes a `DeferredLinear` (or `DeferredAddmm`), whose backward
computes the input's gradient and records (the weight's id, its shape, dY, X) in a store; the
weight pass later adds dW = dYᵀ X into the weight's sum (`add_weight_grad`), one GEMM each.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..models.ops import DenseOps, flat_linear


class DeferredLinear(torch.autograd.Function):
    """`F.linear` whose backward computes the input's (and bias's) gradient now and leaves the
    weight's to the weight pass: it records (the stage parameter's id, the weight's shape, dY, X) in
    `store`, for dW = dYᵀ X. The id is taken in forward: a checkpointed group's saved tensors
    come back from its recompute as other tensor objects. (Written with `forward(ctx, ...)`: a
    separate `setup_context` makes every call bind its arguments with `inspect`, about 6% of a small
    layer's forward.)"""

    @staticmethod
    def forward(ctx, x, w, b, store, key):
        ctx.save_for_backward(x, w)
        ctx.store, ctx.key, ctx.has_bias = store, key, b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        ctx.store.append((ctx.key, w.shape, grad.detach(), x.detach()))  # data only: no path back into the graph
        gx = grad.matmul(w) if ctx.needs_input_grad[0] else None
        gb = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, None, gb, None, None


class DeferredAddmm(torch.autograd.Function):
    """`torch.addmm(bias, x, w)` with a stage weight `w` of shape (in, out) (Hugging Face's `Conv1D`):
    the input's and bias's gradients now, the weight's left to the weight pass as dW = Xᵀ dY."""

    @staticmethod
    def forward(ctx, bias, x, w, store, key):
        ctx.save_for_backward(x, w)
        ctx.store, ctx.key = store, key
        return torch.addmm(bias, x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        ctx.store.append((ctx.key, w.shape, x.detach(), grad.detach()))
        gx = grad.mm(w.t()) if ctx.needs_input_grad[1] else None
        gb = grad.sum(0) if ctx.needs_input_grad[0] else None
        return gb, gx, None, None, None


def _deferred_or_plain_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], weights: set[int],
                              store: list) -> torch.Tensor:
    key = id(w if w._base is None else w._base)
    if key in weights and torch.is_grad_enabled():
        return DeferredLinear.apply(x, w, b, store, key)
    return F.linear(x, w, b)


class DeferringOps(DenseOps):
    """Dense ops whose `linear` defers a stage weight's gradient (`DeferredLinear`): zero bubble's
    split for layers whose linears all go through ops (`Layer.linear_via_ops`), with no per-op cost."""

    def __init__(self, weights: set[int], store: list):
        self.deferred_linear = functools.partial(_deferred_or_plain_linear, weights=weights, store=store)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None, *,
               out_axis: Optional[str] = None, in_axis: Optional[str] = None) -> torch.Tensor:
        return flat_linear(x, w, b, linear=self.deferred_linear)


class DeferWeightGrads(TorchFunctionMode):
    """During a zero-bubble forward of layers that may call `F.linear` themselves (a module's, or an
    exported graph's `aten.linear`): every linear whose weight is (a view of) a stage parameter
    becomes a `DeferredLinear`; every plain `addmm(bias, x, w)` of a 2-D stage weight `w` (Hugging
    Face's `Conv1D`) a `DeferredAddmm`."""

    def __init__(self, weights: set[int], store: list):
        super().__init__()
        self.weights, self.store = weights, store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear or func is torch.ops.aten.linear.default:
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            return _deferred_or_plain_linear(x, w, b, self.weights, self.store)
        if (func is torch.addmm or func is torch.ops.aten.addmm.default) and len(args) == 3 and not kwargs:
            bias, x, w = args
            if id(w) in self.weights and bias.dim() == 1 and torch.is_grad_enabled():  # the parameter itself
                return DeferredAddmm.apply(bias, x, w, self.store, id(w))
        return func(*args, **kwargs)


def add_weight_grad(acc_w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc_w += aᵀ b over all leading dims (a linear's dYᵀ X, an addmm's Xᵀ dY): one GEMM that
    accumulates into the sum."""
    a, b = a.reshape(-1, a.shape[-1]).t(), b.reshape(-1, b.shape[-1])
    if a.dtype == acc_w.dtype:
        acc_w.addmm_(a, b)
    else:  # 16-bit activations: dW in their dtype, as backward makes it, added to the fp32 sum
        acc_w.add_(a @ b)


__all__ = ["DeferWeightGrads", "DeferredAddmm", "DeferredLinear", "DeferringOps", "add_weight_grad"]
