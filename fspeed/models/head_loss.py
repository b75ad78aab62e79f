"""A language model's final norm, output head and cross-entropy in one op, its gradient taken in forward.

    loss = mean over positions i (targets[i] != -100) of CE(norm(x_i) @ w.T, targets[i])

The loss is the last op of a training step, so the forward can take the gradients with respect to
`x`, the norm's parameters and `w` at once, chunk by chunk over positions, and keep only those. The
logits (positions x vocab, a language model's largest activation), their softmax and the normalised
`x` live for one chunk and are never kept for backward, which multiplies the kept gradients by the
incoming scalar (the loss scale over the accumulation steps). What backward keeps is one tensor of
`x`'s size and the parameters' gradients, instead of `x`, norm(x) and the logits (twice, with the
log-softmax) that autograd would keep.

With `w` sliced over the vocabulary (tensor slicing, `comm` the model axis), each chunk's maximum, sum
of exponentials and target logit are reduced over the model ranks (Megatron's vocab-parallel
cross-entropy), and so is the gradient of norm(x), as a column-parallel layer's backward does. With
`partition` (activation partitioning) each rank keeps 1/t of the x gradient (the same on every rank),
all-gathered again in backward, as partitioned checkpointed inputs are.

Under `torch.func` transforms the op has no rule for (`jvp`, `jacfwd`, `hessian`, a `grad` of a `grad`,
`vmap`) the loss is computed as separate differentiable ops instead (the logits are then kept).

The gradient is computed for a loss multiplier of 1, so it is only as exact as the compute dtype at
that scale: fp16 would underflow the small softmax terms that a loss scale protects. `gpt` uses this
op in fp32 and bf16 and the separate head and loss in fp16.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..torch_internals import decomposed_ops_needed

IGNORE_INDEX = -100  # F.cross_entropy's default: such targets add nothing to the loss or its mean
CHUNK_ELEMENTS = 1 << 23  # logits elements per chunk (32 MiB in fp32)


class _HeadLoss(torch.autograd.Function):
    """Outputs the loss and the gradients for a loss multiplier of 1 (not differentiable); backward
    scales those. Written for `torch.func` too: a pure forward, the gradients saved in `setup_context`.
    With `partition`, the x gradient is kept as this rank's 1/t of it and all-gathered in backward."""

    @staticmethod
    def forward(x, w, targets, norm, comm, chunk_rows, partition, *norm_params):
        loss, (dx, dw, dnorm) = _loss_and_grads(x, w, targets, norm, comm, chunk_rows, norm_params, True, partition)
        return (loss, dx, dw, *dnorm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(*output[1:])
        x, comm, partition = inputs[0], inputs[4], inputs[6]
        ctx.gather = (comm, x.shape) if partition else None

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, *unused):
        dx, dw, *dnorm = ctx.saved_tensors
        if ctx.gather is not None:
            comm, shape = ctx.gather
            dx = comm.gathered(dx)[:shape.numel()].view(shape)
        return (dx * grad_loss, dw * grad_loss, None, None, None, None, None, *(g * grad_loss for g in dnorm))


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a loss is computed in: fp32, or fp64 for fp64 inputs (never narrower than fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_loss(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, *,
              norm: Callable[..., torch.Tensor] = lambda x: x, norm_params: Sequence[torch.Tensor] = (),
              comm=None, chunk_rows: Optional[int] = None, partition: bool = False) -> torch.Tensor:
    """Mean cross-entropy of `norm(x, *norm_params) @ w.T` against `targets`, in fp32 or fp64 (module
    docstring). `w` is `[vocab, d]`, or this rank's `[vocab / t, d]` rows with `comm` the model axis;
    `chunk_rows`: positions per chunk (default: about CHUNK_ELEMENTS logits per chunk). `partition`
    (with `comm`: activation partitioning) keeps 1/t of the x gradient on each rank until backward."""
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // max(w.shape[0], 1))
    comm = comm if comm is not None and comm.size > 1 else None
    if partition and comm is None:
        raise ValueError("head_loss(partition=True) splits the kept x gradient over the model axis: it needs a "
                         "vocab-sliced head (comm with more than one rank)")
    if decomposed_ops_needed(vmap=True):
        if comm is not None:
            raise NotImplementedError("head_loss over a vocabulary-sliced head (tensor slicing) has no forward-mode, "
                                      "batching or double-backward rule: under torch.func's jvp, vmap or nested grad, "
                                      "compute the loss from whole logits")
        return _separate_ops(x, w, targets, norm, norm_params)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, w, *norm_params))):
        return _loss_and_grads(x, w, targets, norm, comm, rows, norm_params, False)[0]
    return _HeadLoss.apply(x, w, targets, norm, comm, rows, partition, *norm_params)[0]


def _separate_ops(x, w, targets, norm, norm_params) -> torch.Tensor:
    """The same loss in differentiable torch ops (what every transform composes with)."""
    logits = F.linear(norm(x, *norm_params).reshape(-1, x.shape[-1]), w)
    logits = logits.to(loss_dtype(logits.dtype))
    return F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE_INDEX)


def _loss_and_grads(x, w, targets, norm, comm, chunk_rows, norm_params, grads_needed, partition=False):
    d = x.shape[-1]
    xs, ts = x.reshape(-1, d), targets.reshape(-1)
    n = xs.shape[0]
    vocab = w.shape[0]
    lo = comm.rank * vocab if comm is not None else 0
    valid = ts != IGNORE_INDEX
    count = valid.sum()
    acc = loss_dtype(w.dtype)
    total = torch.zeros((), dtype=acc, device=x.device)
    if grads_needed:
        dx = torch.empty_like(xs)
        dw = torch.zeros(w.shape, dtype=acc, device=w.device)
        dnorm = [torch.zeros(p.shape, dtype=acc, device=p.device) for p in norm_params]
    for s in range(0, n, chunk_rows):
        xc, tc, vc = xs[s:s + chunk_rows], ts[s:s + chunk_rows], valid[s:s + chunk_rows]
        with torch.enable_grad():
            xc_in = xc.detach().requires_grad_(grads_needed)
            params_in = [p.detach().requires_grad_(grads_needed) for p in norm_params]
            y = norm(xc_in, *params_in)
        y_value = y.detach()
        logits = torch.nn.functional.linear(y_value, w).to(acc)
        peak = logits.amax(-1)
        if comm is not None:
            comm.all_reduce_(peak, "max")
        logits.sub_(peak.unsqueeze(-1))
        inside = (tc >= lo) & (tc < lo + vocab) & vc
        local = (tc - lo).clamp(0, vocab - 1).unsqueeze(-1)
        picked = logits.gather(-1, local).squeeze(-1) * inside
        sums = torch.stack([logits.exp_().sum(-1), picked])  # logits now hold exp(logit - peak)
        if comm is not None:
            comm.all_reduce_(sums)
        sum_exp, target_logit = sums[0], sums[1]
        total += ((sum_exp.log() - target_logit) * vc).sum()
        if not grads_needed:
            continue
        # d loss / d logits = (softmax - onehot) / count on valid positions, 0 on ignored ones
        scale = vc.to(acc) / count
        probs = logits.mul_((scale / sum_exp).unsqueeze(-1))
        probs.scatter_add_(-1, local, -(scale * inside).unsqueeze(-1))
        d_logits = probs.to(w.dtype)
        if dw.dtype == d_logits.dtype:
            dw.addmm_(d_logits.t(), y_value)
        else:  # bf16 products, accumulated over chunks in fp32
            dw += (d_logits.t() @ y_value).to(acc)
        dy = d_logits @ w
        if comm is not None:
            comm.all_reduce_(dy)
        with torch.enable_grad():
            got = torch.autograd.grad(y, [xc_in, *params_in], dy)
        dx[s:s + chunk_rows] = got[0]
        for acc_g, g in zip(dnorm, got[1:]):
            acc_g += g.to(acc)
    loss = total / count
    if not grads_needed:
        return loss, None
    if partition:  # every rank has the same x gradient: each keeps its 1/t of it (as activation partitioning does)
        flat = dx.reshape(-1)
        per = -(-flat.numel() // comm.size)
        dx = torch.nn.functional.pad(flat, (0, per * comm.size - flat.numel()))[comm.rank * per:][:per].clone()
    else:
        dx = dx.view_as(x)
    return loss, (dx, dw.to(w.dtype), [g.to(p.dtype) for g, p in zip(dnorm, norm_params)])


__all__ = ["head_loss", "loss_dtype"]
