"""`causal_lm_loss`: a causal language model's next-token loss; given to `functionalize`, it also
fuses the model's output head with the loss, so the logits are never materialized.

    model = fs.functionalize(hf_llama, fs.causal_lm_loss)   # batches: {"input_ids": ..., "labels": ...}

The loss is Hugging Face's causal-LM loss: position t predicts label t+1, labels of -100 are
ignored, the mean is over the rest. Called on a module's outputs it is exactly that, from
`outputs.logits`. Given to `functionalize`, it runs the head (`get_output_embeddings()`, an
`nn.Linear` without bias) as `head_loss` instead: the module is called without `labels`, and when
its head runs it returns the loss itself (the fused op's chunks never hold more than one slice of
the logits), which the module hands back as its output's `logits` (checked: the same tensor, 0-d).
So the logits (positions x vocabulary, a language model's largest activation) and their
log-softmax are neither kept for backward nor written whole, as Liger-Kernel's fused linear
cross-entropy does for Hugging Face models.

The head runs through the step's ops (`ops.head_loss`), so a head that its tp_plan slices over the
vocabulary (colwise) computes Megatron's vocabulary-parallel cross-entropy on its slice. A model that
transforms its logits after the head (a scale, Gemma's soft-capping) gets an error naming it. fp16
computes its logits (unfused), as the reference GPT does: `head_loss` takes its gradient for a loss
multiplier of 1, which fp16 would underflow.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..torch_internals import unwrapped
from .head_loss import IGNORE_INDEX, loss_dtype
from .module_tp import is_plain_op


def causal_lm_loss(outputs: Any, batch: Any) -> torch.Tensor:
    """Mean next-token cross-entropy of `outputs.logits` (or of `outputs`, the logits themselves: a
    layer list's last output) against `batch["labels"]` (module docstring)."""
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs["logits"] if isinstance(outputs, dict) \
        else outputs.logits
    labels = labels_of(batch)
    shifted = logits[:, :-1].flatten(0, 1)
    return F.cross_entropy(shifted.to(loss_dtype(shifted.dtype)), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)


causal_lm_loss.fuses_head = True  # functionalize runs the output head and this loss as one op


def output_head(module: nn.Module, name: str) -> nn.Linear:
    """The module's output head, checked for fusing: its `get_output_embeddings()`, a plain `nn.Linear`
    (that exact class and forward: a subclass may compute more than the matmul) without bias."""
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        raise ValueError(f"causal_lm_loss fuses the output head with the loss, and {name} has no nn.Linear head "
                         f"(get_output_embeddings() gave {type(head).__name__}): give functionalize a loss_fn of "
                         "your own, e.g. lambda outputs, batch: fs.causal_lm_loss(outputs, batch) computes the same "
                         "loss from the logits")
    if not is_plain_op(head):
        raise ValueError(f"causal_lm_loss fuses the output head with the loss, and {name}'s head is a "
                         f"{type(head).__name__} whose forward is not nn.Linear's own (it may compute more than the "
                         "matmul); give functionalize lambda outputs, batch: fs.causal_lm_loss(outputs, batch) "
                         "(unfused)")
    if head.bias is not None:
        raise ValueError(f"causal_lm_loss: {name}'s output head has a bias, which the fused head and loss does not "
                         "take; give functionalize lambda outputs, batch: fs.causal_lm_loss(outputs, batch) (unfused)")
    return head


class FusedHead:
    """One forward's fused head: the head module's forward (`forward`) returns the loss of its input
    against `labels`, and `loss` checks that the module handed it back untouched."""

    def __init__(self, head: nn.Linear, labels: torch.Tensor, ops: Any, style: Optional[str] = None):
        self.head, self.labels, self.ops = head, labels, ops
        self.axes = head_axes(style)
        self.installed = False  # whether this forward runs the head as `forward` (not in fp16)
        self.result: Optional[torch.Tensor] = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.result = shifted_head_loss(hidden, self.head.weight, self.labels, self.ops, **self.axes)
        return self.result

    def loss(self, outputs: Any, name: str) -> torch.Tensor:
        """The loss as the module handed it back (under a plan, through its unit's route, which
        carries the gradient to the head's parameters), checked to be the head's own result."""
        logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
        # the same storage (a unit's route may hand it back as a view; under torch.func, below its
        # wrappers): no device sync, unlike comparing values
        if self.result is None or not isinstance(logits, torch.Tensor) or logits.dim() != 0 or \
                unwrapped(logits).data_ptr() != unwrapped(self.result).data_ptr():
            raise ValueError(f"causal_lm_loss: {name} changes its logits after the output head (a scale, soft-capping, "
                             "a slice), so the head cannot be fused with the loss; give functionalize "
                             "lambda outputs, batch: fs.causal_lm_loss(outputs, batch) (unfused)")
        return logits


def check_positions(hidden: torch.Tensor, labels: torch.Tensor) -> None:
    """The head's input covers every labelled position."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"causal_lm_loss: the head's input has positions {list(hidden.shape[:-1])}, the labels "
                         f"{list(labels.shape)}; the module must apply its head to every position")


def shifted_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ops: Any,
                      **axes: Any) -> torch.Tensor:
    """The loss of the head `weight` on `hidden` (rows, positions, width) against `labels` shifted by
    one position, as one `ops.head_loss` call (`axes`: a tensor-sliced head's)."""
    check_positions(hidden, labels)
    x = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    return ops.head_loss(x, weight, labels[:, 1:].reshape(-1), **axes)


def head_axes(style: Optional[str]) -> dict[str, str]:
    """How `ops.head_loss` sees a head that a tp_plan `style` slices (`fspeed.models.module_tp`): over
    the vocabulary (Megatron's vocabulary-parallel cross-entropy over the slices) or over its input
    features; {} for a whole head."""
    if style in ("colwise", "colwise_rep", "colwise_gather_output"):
        return {"vocab_axis": "tp_out"}
    if style == "embedding_rowwise":  # an embedding's weight used as the head: its rows are the vocabulary
        return {"vocab_axis": "vocab"}
    if style == "rowwise":
        return {"in_axis": "tp_in"}
    if style is not None:
        raise ValueError(f"causal_lm_loss fuses the output head with the loss, which takes a head sliced colwise, "
                         f"rowwise or embedding_rowwise, not {style!r}; pass loss_fn=lambda outputs, batch: "
                         "fs.causal_lm_loss(outputs, batch) (unfused) or change the head's style")
    return {}


def fused_tail(hidden: torch.Tensor, weight: torch.Tensor, micro_batch: Any, ops: Any, **axes: str) -> torch.Tensor:
    """A pipeline's last layer when it is the output head `weight` under `causal_lm_loss`: the loss of
    `hidden` (cast to the head's dtype), fused (`shifted_head_loss`; `axes`: a sliced head's,
    `head_axes`); in fp16 unfused, as in `functionalize` (module docstring)."""
    h, labels = hidden.to(weight.dtype), labels_of(micro_batch)
    if weight.dtype == torch.float16:
        check_positions(h, labels)
        vocab = axes.get("vocab_axis")
        logits = ops.linear(h, weight, out_axis=vocab, in_axis=axes.get("in_axis"))
        return causal_lm_loss(ops.gather(logits, axis=vocab) if vocab else logits, micro_batch)
    return shifted_head_loss(h, weight, labels, ops, **axes)


def labels_of(batch: Any) -> torch.Tensor:
    """`batch["labels"]`, checked: token ids [rows, positions]."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ValueError("causal_lm_loss needs batch['labels'], token ids [rows, positions] (-100: ignored), got "
                         f"{type(labels).__name__ if labels is None else list(getattr(labels, 'shape', []))}")
    return labels


__all__ = ["FusedHead", "causal_lm_loss", "check_positions", "fused_tail", "head_axes", "labels_of", "output_head",
           "shifted_head_loss"]
