"""Tensor slicing for `nn.Module`s: a plan of submodule path patterns -> styles, as torchtitan's
`parallelize_module` and Hugging Face's `tp_plan`.

    model = fs.functionalize(llama, loss, tp_plan=fs.tp_plan_from(llama))   # or tp_plan="auto"
    plan = fs.zero(1) | fs.tensor_slicing(fs.models.module_tp_rules)

Styles (Hugging Face's names) and what they do on `nn.Linear`, Hugging Face's transposed `Conv1D`
and `nn.Embedding`:

    colwise                 output features sliced (the input's gradient is summed over ranks)
    rowwise                 input features sliced; partial outputs summed, bias added after
    rowwise_split_input     rowwise on a whole input: each rank takes its slice of the input first
    colwise_gather_output   colwise, then the output gathered whole (a head whose logits a loss reads)
    colwise_rep             the same as colwise_gather_output
    embedding_rowwise       the vocabulary sliced; rows outside the local slice masked, outputs summed
    replicated_with_grad_allreduce
                            any module: parameters whole, their gradient summed over ranks (a norm
                            applied to each rank's own heads, such as Qwen3's q_norm)
    replicate / local       nothing sliced

A style sets the logical axes of the module's parameters ("tp_out", "tp_in", "vocab"), which
`module_tp_rules` map to the `model` mesh axis, and, under a plan that slices them, routes the
module's computation through the plan's ops. A module whose exact class is the plain op computes as
that op; any other (Gemma's scaled embedding, a subclass, a patched forward) runs its own forward
with only its `F.linear` / `F.embedding` calls on its weight sliced, so what it computes around
them stays its own; a forward that uses its sliced weight any other way is refused by name.
Attention modules see 1/t of the heads: a model that reshapes with -1 (Llama) follows; one that
reshapes with a fixed head count (GPT-2's fused c_attn) fails with an error that says which
attribute to adjust.
"""

from __future__ import annotations

import fnmatch
import logging
import types
from typing import Any, Callable, Mapping, Optional

import optree
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

log = logging.getLogger("fspeed")

MODULE_TP_RULES = (("tp_out", "model"), ("tp_in", "model"), ("vocab", "model"))
LINEAR_STYLES = ("colwise", "rowwise", "rowwise_split_input", "colwise_gather_output", "colwise_rep")
STYLES = (*LINEAR_STYLES, "embedding_rowwise", "replicated_with_grad_allreduce", "replicate", "local")


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


def styles_of(module: nn.Module, tp_plan: Mapping[str, str], *, skip_unmatched: bool = False) -> dict[str, str]:
    """Each submodule path the plan names -> its style (the first matching pattern wins), checked:
    every pattern matches something, every style is known and fits the module's kind.
    `skip_unmatched`: a pattern that matches nothing is skipped (logged), not refused: a model's own
    plan covers variants of its family (dense and MoE layers, prefixed and bare paths) that one
    configuration does not all have."""
    out = {}
    modules = dict(module.named_modules())
    for pattern, style in tp_plan.items():
        matched = [path for path in modules if path and fnmatch.fnmatchcase(path, pattern)]
        params = [] if matched else [n for n, _ in module.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
        if skip_unmatched and not matched and not params:
            log.info("tp_plan: %s has nothing at %r (%s): skipped", type(module).__name__, pattern, style)
            continue
        if style not in STYLES:
            raise ValueError(f"tp_plan: style {style!r} of {pattern!r} is not supported; allowed: {', '.join(STYLES)} "
                             "(pass tp_plan={pattern: style} of your own to slice the rest)")
        if not matched:
            what = (f"names the parameter {params[0]!r}, not a submodule of {type(module).__name__}; fspeed slices "
                    "modules" if params else f"matches no submodule of {type(module).__name__}")
            raise ValueError(f"tp_plan: pattern {pattern!r} {what}")
        for path in matched:
            _check_fits(path, modules[path], style)
            out.setdefault(path, style)
    return {path: style for path, style in out.items() if style not in ("replicate", "local")}


def _check_fits(path: str, module: nn.Module, style: str) -> None:
    kind = _kind(module)
    if style in ("replicate", "local"):
        return
    if style == "replicated_with_grad_allreduce":
        if not any(True for _ in module.parameters(recurse=False)):
            raise ValueError(f"tp_plan: {path} ({type(module).__name__}) holds no parameters of its own for "
                             f"style {style!r}")
        return
    if style == "embedding_rowwise" and kind != "embedding":
        raise ValueError(f"tp_plan: {path} is a {type(module).__name__}; style {style!r} needs an nn.Embedding")
    if style in LINEAR_STYLES and kind not in ("linear", "conv1d"):
        raise ValueError(f"tp_plan: {path} is a {type(module).__name__}; style {style!r} needs nn.Linear or Conv1D")
    if kind == "embedding" and (module.max_norm is not None or module.sparse):
        raise ValueError(f"tp_plan: {path} uses max_norm or sparse gradients, which a vocabulary-parallel "
                         "embedding does not support")


ROWWISE = ("rowwise", "rowwise_split_input")


def logical_axes_of(module: nn.Module, styles: Mapping[str, str]) -> dict[str, tuple[Optional[str], ...]]:
    """The logical axes the styles give each parameter (tied parameters must agree)."""
    axes: dict[str, tuple[Optional[str], ...]] = {}
    names = {id(p): n for n, p in module.named_parameters()}
    for path, style in styles.items():
        if style == "replicated_with_grad_allreduce":
            continue  # whole on every rank
        m = module.get_submodule(path)
        kind, out_axis = _kind(m), "tp_out" if style != "embedding_rowwise" else "vocab"
        for leaf, p in m.named_parameters(recurse=False):
            if kind == "embedding":
                spec = ("vocab", None)
            elif leaf == "bias":
                spec = (out_axis,) if style not in ROWWISE else (None,)
            elif style in ROWWISE:
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
    module holds at call time: a unit's gathered or local shards).

    A module of exactly `nn.Linear`, `nn.Embedding` or Hugging Face's `Conv1D`, with its class's own
    forward, is the plain op, so it computes as that op through `ops`. Any other module (a subclass
    such as Gemma's scaled embedding, a patched forward) runs its own forward, with only its
    `F.linear` / `F.embedding` calls on its own weight routed through `ops` (`_SlicedOpCalls`): what it
    computes around them stays the module's."""
    kind = _kind(module)
    if style == "replicated_with_grad_allreduce":
        return _own_forward_with(module, lambda: _GradSummedParams(module, ops))
    if is_plain_op(module):
        return _plain_forward(module, kind, style, ops, path)
    if kind == "conv1d":
        raise ValueError(f"tp_plan: {path} is a {type(module).__name__}, a subclass of Hugging Face's Conv1D (or one "
                         "whose forward was replaced); fspeed slices only Conv1D's own forward: leave it out of the "
                         "tp_plan")
    return _own_forward_with(module, lambda: _SlicedOpCalls(module, kind, style, ops, path))


def _own_forward_with(module: nn.Module, mode: Callable[[], TorchFunctionMode]) -> Callable:
    """The module's own forward (its instance's, else its class's) run under a fresh `mode()`."""
    own = module.__dict__.get("forward") or types.MethodType(type(module).forward, module)

    def forward(*args, **kwargs):
        with mode() as calls:
            out = own(*args, **kwargs)
        calls.check()
        return out
    return forward


_PLAIN_CLASSES = {"linear": (nn.Linear,), "embedding": (nn.Embedding,)}


def is_plain_op(module: nn.Module) -> bool:
    """Whether `module` computes exactly its kind's op: its exact class is torch's `nn.Linear` or
    `nn.Embedding` (or Hugging Face's Conv1D), with the class's own forward, none set on the instance."""
    cls, kind = type(module), _kind(module)
    if "forward" in module.__dict__:
        return False
    if kind == "conv1d":
        return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils" and \
            getattr(cls.__dict__.get("forward"), "__module__", None) == cls.__module__
    plain = _PLAIN_CLASSES.get(kind, ())
    return cls in plain and cls.forward is plain[0].forward


def _plain_forward(module: nn.Module, kind: str, style: str, ops: Any, path: str) -> Callable:
    def forward(x: torch.Tensor, *args, **kwargs):
        if args or kwargs:
            raise TypeError(f"{path}: a tensor-sliced {type(module).__name__} takes one input")
        if kind == "embedding":
            return ops.embedding(x, module.weight, vocab_axis="vocab", padding_idx=module.padding_idx)
        w = module.weight if kind == "linear" else module.weight.t()
        return _sliced_linear(ops, style, x, w, module.bias)
    return forward


def _sliced_linear(ops: Any, style: str, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]):
    if style == "rowwise_split_input":
        x = ops.split(x, axis="tp_in")
    if style in ROWWISE:
        return ops.linear(x, w, bias, in_axis="tp_in")
    y = ops.linear(x, w, bias, out_axis="tp_out")
    return ops.gather(y, axis="tp_out") if style in ("colwise_gather_output", "colwise_rep") else y


# tensor attributes a forward may read of a sliced weight: they do not depend on its slicing
_METADATA = frozenset({"dtype", "device", "requires_grad", "is_cuda", "is_meta", "layout", "is_leaf"})


class _SlicedOpCalls(TorchFunctionMode):
    """During a module's own forward: its `F.embedding` / `F.linear` calls on its own weight go through
    the sliced ops; any other use of its weight or bias (which hold a slice) is refused by name."""

    def __init__(self, module: nn.Module, kind: str, style: str, ops: Any, path: str):
        super().__init__()
        self.module, self.kind, self.style, self.ops, self.path = module, kind, style, ops, path
        self.routed = 0

    def check(self) -> None:
        if not self.routed:
            raise ValueError(f"tp_plan: {self.path} ({type(self.module).__name__}) computed without calling "
                             f"{'F.embedding' if self.kind == 'embedding' else 'F.linear'} on its weight, so fspeed "
                             "cannot slice it; leave it out of the tp_plan")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight, bias = self.module.weight, getattr(self.module, "bias", None)
        if self.kind == "embedding" and func is F.embedding and _argument(args, kwargs, 1, "weight") is weight:
            self.routed += 1
            return self._embedding(*args, **kwargs)
        if self.kind == "linear" and func is F.linear and _argument(args, kwargs, 1, "weight") is weight:
            self.routed += 1
            x, b = _argument(args, kwargs, 0, "input"), _argument(args, kwargs, 2, "bias")
            return _sliced_linear(self.ops, self.style, x, weight, b)
        if getattr(func, "__name__", "") == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") \
                in _METADATA:
            return func(*args, **kwargs)
        used = [t for t in optree.tree_leaves((args, kwargs)) if t is weight or (bias is not None and t is bias)]
        if used:
            what = getattr(func, "__self__", None) if getattr(func, "__name__", "") == "__get__" else func
            raise ValueError(f"tp_plan: {self.path} ({type(self.module).__name__}) uses its "
                             f"{'weight' if used[0] is weight else 'bias'} in {getattr(what, '__name__', what)!r}, "
                             "which would see only this rank's slice; fspeed slices a module's F.linear / "
                             "F.embedding calls on its weight and nothing else: leave it out of the tp_plan")
        return func(*args, **kwargs)

    def _embedding(self, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                   sparse=False):
        if max_norm is not None or scale_grad_by_freq or sparse:
            raise ValueError(f"tp_plan: {self.path} calls F.embedding with max_norm, scale_grad_by_freq or sparse, "
                             "which a vocabulary-parallel embedding does not support")
        if padding_idx is not None and padding_idx < 0:
            padding_idx += self.module.num_embeddings  # as nn.Embedding normalizes it
        return self.ops.embedding(input, weight, vocab_axis="vocab", padding_idx=padding_idx)


class _GradSummedParams(TorchFunctionMode):
    """During a module's own forward: each of its own parameters enters every call through
    `ops.sum_grads` (identity forward, gradient summed over the tensor ranks), once per forward."""

    def __init__(self, module: nn.Module, ops: Any):
        super().__init__()
        self.module, self.ops = module, ops
        self.entered: dict[int, torch.Tensor] = {}

    def check(self) -> None:
        pass

    def __torch_function__(self, func, types, args=(), kwargs=None):
        own = {id(p): p for _, p in self.module.named_parameters(recurse=False)}

        def entered(x):
            if not isinstance(x, torch.Tensor) or id(x) not in own or own[id(x)] is not x:
                return x
            if id(x) not in self.entered:
                self.entered[id(x)] = self.ops.sum_grads(x, axis="tp_out")
            return self.entered[id(x)]
        args, kwargs = optree.tree_map(entered, (args, kwargs or {}), none_is_leaf=True)
        return func(*args, **kwargs)


def _argument(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def explain_failure(err: Exception) -> RuntimeError:
    """An error raised inside a tensor-sliced forward, with what usually causes it."""
    return RuntimeError(
        f"the forward failed under tensor slicing: {err}. A sliced attention module sees 1/t of its heads and "
        "features; a model that reshapes with a fixed head count or splits a fused projection by a fixed size "
        "(e.g. GPT-2's c_attn with split_size) must divide those attributes (num_heads, split_size, ...) by the "
        "tensor size, or leave that module out of the tp_plan (models that reshape with -1, like Llama, follow).")


__all__ = ["MODULE_TP_RULES", "STYLES", "is_plain_op", "explain_failure", "logical_axes_of", "styles_of", "tp_forward",
           "tp_plan_from"]
