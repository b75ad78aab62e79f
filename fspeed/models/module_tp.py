"""Tensor slicing for `nn.Module`s: a plan of submodule path patterns -> styles, as torchtitan's
`parallelize_module` and Hugging Face's `tp_plan`.

    model = fs.functionalize(llama, loss, tp_plan=fs.tp_plan_from(llama))   # or tp_plan="auto"
    plan = fs.zero(1) | fs.tensor_slicing(fs.models.module_tp_rules)

Styles (Hugging Face's names) and what they do on `nn.Linear`, Hugging Face's transposed `Conv1D`
and `nn.Embedding`:

    colwise                 output features sliced (the input's gradient is summed over ranks)
    rowwise                 input features sliced; partial outputs summed, bias added after
    colwise_gather_output   colwise, then the output gathered whole (a head whose logits a loss reads)
    colwise_rep             the same as colwise_gather_output
    embedding_rowwise       the vocabulary sliced; rows outside the local slice masked, outputs summed
    replicate / local       nothing sliced

A style sets the logical axes of the module's parameters ("tp_out", "tp_in", "vocab"), which
`module_tp_rules` map to the `model` mesh axis, and, under a plan that slices them, routes the
module's forward through the plan's ops. Attention modules see 1/t of the heads: a model that
reshapes with -1 (Llama) follows; one that reshapes with a fixed head count (GPT-2's fused c_attn)
fails with an error that says which attribute to adjust.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

MODULE_TP_RULES = (("tp_out", "model"), ("tp_in", "model"), ("vocab", "model"))
STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise", "replicate", "local")


def tp_plan_from(module: nn.Module) -> dict[str, str]:
    """Hugging Face's tensor-parallel plan of a transformers model (module path patterns ->
    styles), as the model class declares it; {} when it has none."""
    plan = getattr(module, "_tp_plan", None) or {}
    if not plan:
        base = getattr(getattr(module, "config", None), "base_model_tp_plan", None) or {}
        prefix = getattr(module, "base_model_prefix", "")
        plan = {f"{prefix}.{k}" if prefix and hasattr(module, prefix) else k: v for k, v in base.items()}
    return dict(plan)


def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # Hugging Face's transposed linear
        return "conv1d"
    return type(module).__name__


def styles_of(module: nn.Module, tp_plan: Mapping[str, str]) -> dict[str, str]:
    """Each submodule path the plan names -> its style (the first matching pattern wins), checked:
    every pattern matches something, every style is known and fits the module's kind."""
    out = {}
    modules = dict(module.named_modules())
    for pattern, style in tp_plan.items():
        if style not in STYLES:
            raise ValueError(f"tp_plan: style {style!r} of {pattern!r} is not supported; allowed: {', '.join(STYLES)}")
        matched = [path for path in modules if path and fnmatch.fnmatchcase(path, pattern)]
        if not matched:
            raise ValueError(f"tp_plan: pattern {pattern!r} matches no submodule of {type(module).__name__}")
        for path in matched:
            kind = _kind(modules[path])
            fits = style in ("replicate", "local") or (kind == "embedding") == (style == "embedding_rowwise")
            if not fits or kind not in ("linear", "conv1d", "embedding"):
                raise ValueError(f"tp_plan: {path} is a {type(modules[path]).__name__}; style {style!r} needs "
                                 f"{'an nn.Embedding' if style == 'embedding_rowwise' else 'nn.Linear or Conv1D'}")
            if kind == "embedding" and style == "embedding_rowwise" and (modules[path].max_norm is not None
                                                                        or modules[path].sparse):
                raise ValueError(f"tp_plan: {path} uses max_norm or sparse gradients, which a vocabulary-parallel "
                                 "embedding does not support")
            out.setdefault(path, style)
    return {path: style for path, style in out.items() if style not in ("replicate", "local")}


def logical_axes_of(module: nn.Module, styles: Mapping[str, str]) -> dict[str, tuple[Optional[str], ...]]:
    """The logical axes the styles give each parameter (tied parameters must agree)."""
    axes: dict[str, tuple[Optional[str], ...]] = {}
    names = {id(p): n for n, p in module.named_parameters()}
    for path, style in styles.items():
        m = module.get_submodule(path)
        kind, out_axis = _kind(m), "tp_out" if style != "embedding_rowwise" else "vocab"
        for leaf, p in m.named_parameters(recurse=False):
            if kind == "embedding":
                spec = ("vocab", None)
            elif leaf == "bias":
                spec = (out_axis,) if style != "rowwise" else (None,)
            elif style == "rowwise":
                spec = (None, "tp_in") if kind == "linear" else ("tp_in", None)
            else:
                spec = (out_axis, None) if kind == "linear" else (None, out_axis)
            name = names[id(p)]
            sliced = [d for d, a in enumerate(spec) if a]
            if name in axes and [d for d, a in enumerate(axes[name]) if a] != sliced:
                raise ValueError(f"tp_plan: tied parameter {name!r} is sliced along different dims by two styles")
            axes.setdefault(name, spec)
    return axes


def tp_forward(module: nn.Module, style: str, ops: Any, path: str) -> Callable:
    """The module's forward under tensor slicing, through `ops` (its parameters are whatever the
    module holds at call time: a unit's gathered or local shards)."""
    kind = _kind(module)

    def forward(x: torch.Tensor, *args, **kwargs):
        if args or kwargs:
            raise TypeError(f"{path}: a tensor-sliced {type(module).__name__} takes one input")
        if kind == "embedding":
            return ops.embedding(x, module.weight, vocab_axis="vocab", padding_idx=module.padding_idx)
        w = module.weight if kind == "linear" else module.weight.t()
        if style == "rowwise":
            return ops.linear(x, w, module.bias, in_axis="tp_in")
        y = ops.linear(x, w, module.bias, out_axis="tp_out")
        return ops.gather(y, axis="tp_out") if style in ("colwise_gather_output", "colwise_rep") else y
    return forward


def explain_failure(err: Exception) -> RuntimeError:
    """An error raised inside a tensor-sliced forward, with what usually causes it."""
    return RuntimeError(
        f"the forward failed under tensor slicing: {err}. A sliced attention module sees 1/t of its heads and "
        "features; a model that reshapes with a fixed head count or splits a fused projection by a fixed size "
        "(e.g. GPT-2's c_attn with split_size) must divide those attributes (num_heads, split_size, ...) by the "
        "tensor size, or leave that module out of the tp_plan (models that reshape with -1, like Llama, follow).")


__all__ = ["MODULE_TP_RULES", "STYLES", "explain_failure", "logical_axes_of", "styles_of", "tp_forward",
           "tp_plan_from"]
