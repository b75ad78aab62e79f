"""A `Model` from a list of `nn.Module` layers: DeepSpeed's `PipelineModule` in functional form.

    model = fs.models.sequential([embed, *blocks, head], loss_fn=fs.causal_lm_loss)
    model = fs.models.sequential([TiedLayer("embed", emb), *blocks, TiedLayer("embed", emb, forward=head_of("weight"))],
                                 loss_fn=fs.causal_lm_loss)

Each entry becomes one `Layer` of the model's `LayerSequence` (`fspeed.models.layers`): an `nn.Module`
(its parameters under `"<index>."`), a `TiedLayer` (a module used at several places, its parameters
once under `"tied.<key>."`, DeepSpeed's `TiedLayerSpec`) or a parameter-free callable. With
`loss_fn=fs.causal_lm_loss` and a last layer that is the output head (an `nn.Linear` without bias,
or a `TiedLayer` called as `head_of("wte.weight")`), the head and the loss run as one fused op
(`causal_lm.fused_tail`): the logits are never kept for backward.
"""

from __future__ import annotations

import functools
import types
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from ..pytree import PyTree, subtree
from ..rng import layer_generators
from .causal_lm import fused_tail, head_axes
from .fused_ops import fused_forwards
from .layers import Layer, LayerSequence, with_state
from .model import Model
from .module import FP32_MODULES, Slots, fp32_forward, nested
from .module_calls import ModuleCall, computing, flat_named, seed_of, seeded, state_of
from .module_tp import is_plain_op, logical_axes_of, styles_of
from .ops import DENSE


def head_of(name: str) -> "_HeadOf":
    """A `TiedLayer` forward that uses the module's parameter `name` (a dotted path in it) as an output
    head, `x @ weight.T`: `TiedLayer("embed", embed, forward=head_of("weight"))`. Unlike a lambda, it
    says which weight it uses, so `sequential(..., loss_fn=fs.causal_lm_loss)` can fuse it with the loss."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"head_of(name={name!r}): name the head's weight, a parameter path in the module")
    return _HeadOf(name)


class _HeadOf:
    def __init__(self, name: str):
        self.name = name

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, module.get_parameter(self.name))

    def __repr__(self) -> str:
        return f"head_of({self.name!r})"


@dataclass(frozen=True)
class TiedLayer:
    """A module used at several places of a `sequential` list under one `key`, its parameters kept
    once (DeepSpeed's `TiedLayerSpec`): `forward(module, x)` says how this place calls it (default:
    `module(x)`), e.g. an embedding reused as the output head: `lambda emb, x: x @ emb.weight.T`."""

    key: str
    module: nn.Module
    forward: Optional[Callable[[nn.Module, torch.Tensor], torch.Tensor]] = None


def sequential(modules: Sequence[Union[nn.Module, TiedLayer, Callable]], *, loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
               inputs: Callable[[Any], Any] = lambda batch: batch["inputs"], name: str = "sequential",
               tp_plan: Optional[Mapping[str, str]] = None, fp32_modules: tuple[type, ...] = FP32_MODULES,
               fused_ops: bool = True) -> Model:
    """A `Model` from a list of layers, DeepSpeed's `PipelineModule(layers=..., loss_fn=...)` in functional
    form: each entry is an `nn.Module` (its parameters under `"<index>."`), a `TiedLayer` (its
    parameters once, under `"tied.<key>."`), or a parameter-free callable `x -> y` (a reshape).
    DeepSpeed's own `LayerSpec` and `TiedLayerSpec` entries are built here (one module per tied key,
    as `PipelineModule` builds them, in list order), so a PipelineModule's list is taken as it is.

    `loss_fn(y, micro_batch)` gives the loss of the last layer's output; `inputs(micro_batch)` what the
    first layer gets. Dropout in the modules draws from a generator per layer (`fspeed.rng`), so a
    layer draws the same masks wherever it runs; called without one (evaluation) the modules run in
    eval mode. A module's persistent buffers (BatchNorm statistics) are the model's state
    (`init_buffers`, carried in the TrainState and its checkpoints), updated by each training forward
    in place; evaluation reads them. A `TiedLayer`'s module has none (it runs at several places).
    Below fp32, the `fp32_modules` (normalisation layers by default, as `functionalize`) compute in
    fp32 with fp32 statistics, their output cast back.

    `tp_plan`: parameter-path patterns of submodules -> tensor-slicing styles (`fspeed.models.module_tp`;
    paths as the parameters', `"3.self_attn.q_proj"`, `"tied.embed"`); under
    `fs.tensor_slicing(fs.models.module_tp_rules)` those modules compute on their slices, in a pipeline
    or not. Each layer is a unit under a plan (`ops.call`: ZeRO-3 gathers it for its call only; a
    `TiedLayer`'s module is taken once per micro-batch). `fused_ops`: Hugging Face's Python tanh-GELUs
    compute as torch's fused kernel (`fspeed.models.fused_ops`), as in `functionalize`.
    """
    modules = _built(modules)
    entries = _entries(modules)
    seen, states = _modules_and_states(entries)
    fuses_head = getattr(loss_fn, "fuses_head", False)
    styles = _styles(seen, entries, modules, tp_plan, fuses_head) if tp_plan else {}
    places = Counter(entry.prefix for entry in entries if entry.module is not None)
    layers = tuple(_module_layer(entry, styles, places[entry.prefix] > 1, states.get(entry.prefix, []),
                                 fp32_modules, fused_ops) for entry in entries)

    def loss(y: torch.Tensor, micro_batch: Any, *, ops: Any = DENSE) -> torch.Tensor:
        return loss_fn(y, micro_batch)

    seq = LayerSequence(layers, inputs, loss, _fused_head(modules, entries, styles) if fuses_head else None)
    return _model(seq, seen, states, styles, name)


class _Entry(NamedTuple):
    """One entry of a `sequential` list: its layer name, its parameters' prefix ("" for none), its
    module (None for a parameter-free callable) and how this place calls it, `call(module, x)`."""

    name: str
    prefix: str
    module: Optional[nn.Module]
    call: Callable


def _entries(modules: Sequence[Any]) -> list[_Entry]:
    """The list's entries (`_built`'s), each with its prefix and call; one module per TiedLayer key."""
    entries: list[_Entry] = []
    owners: dict[str, nn.Module] = {}
    for i, entry in enumerate(modules):
        if isinstance(entry, TiedLayer):
            prefix = f"tied.{entry.key}"
            if prefix in owners and owners[prefix] is not entry.module:
                raise ValueError(f"TiedLayer key {entry.key!r} names two different modules; one key, one module")
            owners[prefix] = entry.module
            call = entry.forward or (lambda m, x: m(x))
            entries.append(_Entry(f"{i}", prefix, entry.module, call))
        elif isinstance(entry, nn.Module):
            entries.append(_Entry(f"{i}", f"{i}", entry, lambda m, x: m(x)))
        elif callable(entry):
            entries.append(_Entry(f"{i}", "", None, lambda m, x, f=entry: f(x)))
        else:
            raise TypeError(f"layer {i} is {type(entry).__name__}; allowed: nn.Module, fs.models.TiedLayer, "
                            "or a parameter-free callable")
    return entries


def _modules_and_states(entries: list[_Entry]) -> tuple[dict[str, nn.Module], dict[str, list[str]]]:
    """(each module once, by prefix; each prefix's persistent buffers, the model's state)."""
    seen: dict[str, nn.Module] = {}
    states: dict[str, list[str]] = {}
    for _, prefix, module, _ in entries:
        if module is None or prefix in seen:
            continue
        seen[prefix] = module
        stateful = [n for n in module.state_dict() if n not in dict(module.named_parameters())]
        if stateful and prefix.startswith("tied."):
            raise ValueError(f"TiedLayer {prefix[5:]!r} has persistent buffers {stateful[:3]} (module state such as "
                             "BatchNorm statistics), which would be updated at each place it runs, on different "
                             "stages; give each place a module of its own or a normalisation without running "
                             "statistics")
        if stateful:
            states[prefix] = stateful
    return seen, states


def _module_layer(entry: _Entry, styles: Mapping[str, str], shared: bool, state_names: list[str],
                  fp32_modules: tuple[type, ...], fused_ops: bool) -> Layer:
    """The `Layer` of one entry: `_ModuleLayerFn` over its module, using its prefix if it has parameters."""
    fn = _ModuleLayerFn(entry, styles, shared, state_names, fp32_modules, fused_ops)
    kind = type(entry.module).__name__ if entry.module is not None else "callable"
    return Layer(entry.name, fn, (entry.prefix,) if fn.owns else (), kind,
                 state=(entry.prefix,) if state_names else ())


class _ModuleLayerFn:
    """A layer's `fn(params, x, *, rng, ops, buffers)` over one module of a `sequential` list: the
    module's forward with its parameters (and state) taken from the trees, under the step's ops (its
    tensor-sliced submodules through them; a unit the plan gathers, recomputes and delivers
    gradients by), fp32 normalisation below fp32, fused GELUs, and dropout from the layer's generator.
    A `TiedLayer`'s module, used at several places (`shared`), takes its parameters once per micro-batch."""

    def __init__(self, entry: _Entry, styles: Mapping[str, str], shared: bool, state_names: list[str],
                 fp32_modules: tuple[type, ...], fused_ops: bool):
        self.name, self.prefix, self.module, self.call = entry
        module, prefix = entry.module, entry.prefix
        self.caller = ModuleCall(module, entry.call) if module is not None else None
        self.owns = module is not None and next(module.parameters(), None) is not None  # GELU, Dropout: no parameters
        self.shared = shared
        self.sliced = [(module.get_submodule(path[len(prefix) + 1:]), style, path)
                       for path, style in styles.items() if _within(path, prefix)]
        self.norms = {m: fp32_forward(m, types.MethodType(type(m).forward, m), Slots(m))
                      for m in (module.modules() if module is not None else ()) if isinstance(m, fp32_modules)}
        self.fused = fused_forwards(module) if fused_ops else {}
        self.state_names = state_names

    def __call__(self, params: PyTree, x: torch.Tensor, *, rng: Optional[torch.Generator] = None, ops: Any = DENSE,
                 buffers: Optional[PyTree] = None):
        module = self.module
        if module is None:
            return self.call(None, x)
        if rng is None and module.training:  # no generator: evaluation, dropout off, statistics read
            module.eval()
            try:
                return self(params, x, rng=None, ops=ops, buffers=buffers)
            finally:
                module.train()
        seed = seed_of(rng)  # drawn here, so a recompute of the call draws the same masks
        state = state_of(buffers, self.prefix, self.state_names)
        if not self.owns and not state:
            with seeded(seed), computing((), self.fused, ops):
                return self.call(module, x)
        run_here = functools.partial(self._run, seed=seed, ops=ops, state=state)
        if not self.owns:  # state without parameters (a BatchNorm without affine weights)
            return run_here({}, x)
        tree = subtree(params, self.prefix)
        if self.shared:
            return run_here(ops.param(tree), x)
        return ops.call(tree, run_here, x, _label=self.name)

    def _run(self, tree: PyTree, x: Any, *, seed: Optional[int], ops: Any, state: dict) -> Any:
        named = flat_named(tree)
        dtype = next(iter(named.values())).dtype if named else None
        if named:  # the floating input (or floating parts of a tuple) in the layer's dtype
            cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
            x = tuple(cast(t) for t in x) if isinstance(x, tuple) else cast(x)
        in_fp32 = self.norms if dtype is not None and dtype != torch.float32 else {}
        with seeded(seed), computing(self.sliced, {**self.fused, **in_fp32}, ops):
            return torch.func.functional_call(self.caller, {f"inner.{k}": v for k, v in {**named, **state}.items()},
                                              (x,), strict=False, tie_weights=False)


def _model(seq: LayerSequence, seen: dict[str, nn.Module], states: dict[str, list[str]], styles: Mapping[str, str],
           name: str) -> Model:
    """The `Model` of a layer sequence over the modules `seen` (by prefix)."""
    layers = seq.layers

    def init(generator: Optional[torch.Generator] = None) -> dict:
        flat = {f"{prefix}.{n}": p.detach().clone() for prefix, m in seen.items() for n, p in m.named_parameters()}
        return nested(flat)

    def model_loss(params: PyTree, batch: Any, *, rng: Optional[torch.Generator] = None, ops: Any = DENSE,
                   buffers: Optional[PyTree] = None):
        return seq.run(params, batch, rng=rng, ops=ops, buffers=buffers)

    def apply(params: PyTree, x: Any, *, rng: Optional[torch.Generator] = None, buffers: Optional[PyTree] = None):
        for layer_, rng_i in zip(layers, layer_generators(rng, len(layers))):
            x = layer_.fn(params, x, rng=rng_i, **with_state(layer_, buffers))
        return x

    def init_buffers() -> dict:
        return nested({f"{prefix}.{n}": b.detach().clone() for prefix, m in seen.items() if prefix in states
                       for n, b in m.named_buffers() if n in states[prefix]})

    units = {f"{prefix}.{n}": prefix for prefix, m in seen.items() for n, _ in m.named_parameters()}
    axes = logical_axes_of(_as_tree(seen), styles) if styles else {}
    return Model(init, apply, model_loss, axes, name=name, units=units, layers=seq,
                 init_buffers=init_buffers if states else None)


def _built(modules: Sequence[Any]) -> list[Any]:
    """`modules` with DeepSpeed's `LayerSpec`s built and its `TiedLayerSpec`s as `TiedLayer`s over one
    module per key (recognised by class name: DeepSpeed need not be importable here)."""
    tied: dict[str, nn.Module] = {}
    out = []
    for i, entry in enumerate(modules):
        kinds = {c.__name__ for c in type(entry).__mro__}
        if "TiedLayerSpec" in kinds:
            if entry.key not in tied:
                tied[entry.key] = entry.build()
            module = tied[entry.key]
            untied = [n for n, _ in module.named_parameters()
                      if not any(n == a or n.startswith(a + ".") for a in entry.tied_weight_attr)]
            if untied:
                raise ValueError(f"layer {i}: TiedLayerSpec {entry.key!r} ties {list(entry.tied_weight_attr)} of a module "
                                 f"that also has {untied[:4]}; DeepSpeed keeps a copy of those per stage, a TiedLayer ties "
                                 "the whole module: tie every parameter (tied_weight_attr) or split the module")
            out.append(TiedLayer(entry.key, module, entry.forward_fn))
        elif "LayerSpec" in kinds:
            out.append(entry.build())
        else:
            out.append(entry)
    return out


def _fused_head(modules: Sequence[Any], entries: list, styles: Mapping[str, str]) -> Callable[..., torch.Tensor]:
    """The last layer (the output head) and causal_lm_loss as one function (`LayerSequence.last_with_loss`);
    a head that `styles` slice computes its loss over the slices (`causal_lm.head_axes`)."""
    last, (_, prefix, module, _) = modules[-1], entries[-1]
    if isinstance(last, nn.Linear) and is_plain_op(last) and last.bias is None:
        weight = "weight"
    elif isinstance(last, TiedLayer) and isinstance(last.forward, _HeadOf):
        module.get_parameter(last.forward.name)  # names a parameter of the module, or raises naming it
        weight = last.forward.name
    else:
        raise ValueError(f"sequential(loss_fn=fs.causal_lm_loss) fuses the last layer, the output head, with the loss, "
                         f"and the last layer is {type(last).__name__}: make it an nn.Linear (that class, its own "
                         "forward) without bias or fs.models.TiedLayer(key, module, forward=fs.models.head_of("
                         "'weight')), or pass loss_fn=lambda logits, batch: fs.causal_lm_loss(logits, batch) (unfused)")
    axes = head_axes(styles.get(f"{prefix}.{weight}".rsplit(".", 1)[0]))

    def tail(params: PyTree, x: torch.Tensor, micro_batch: Any, *, ops: Any = DENSE) -> torch.Tensor:
        w = subtree(ops.param(subtree(params, prefix)), weight)
        return fused_tail(x, w, micro_batch, ops, **axes)
    return tail


def _as_tree(modules: Mapping[str, nn.Module]) -> nn.Module:
    """The layers' modules under one root, each at its prefix (`3`, `tied.embed`): the names a
    tp_plan's patterns match and the parameters' paths."""
    root = _SequentialLayers()
    for prefix, module in modules.items():
        parent = root
        *path, last = prefix.split(".")
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        parent.add_module(last, module)
    return root


class _SequentialLayers(nn.Module):
    """The root `_as_tree` builds (the name tp_plan errors give)."""


def _styles(seen: Mapping[str, nn.Module], entries: list, modules: Sequence[Any], tp_plan: Mapping[str, str],
            fuses_head: bool) -> dict[str, str]:
    """The tp_plan's styles by submodule path, checked: no module appears under two prefixes, and no
    sliced module computes through a TiedLayer's own forward (which reads its weights directly),
    except the output head fused with the loss."""
    ids = [id(m) for m in seen.values()]
    if len(set(ids)) != len(ids):
        raise ValueError("sequential(tp_plan=...): a module appears as two different layers; list it once, or as "
                         "one fs.models.TiedLayer used at each place")
    styles = styles_of(_as_tree(seen), tp_plan)
    for i, ((_, prefix, _, _), entry) in enumerate(zip(entries, modules)):
        custom = isinstance(entry, TiedLayer) and entry.forward is not None
        fused = fuses_head and i == len(entries) - 1 and isinstance(entry.forward, _HeadOf) if custom else False
        inside = [path for path in styles if _within(path, prefix)]
        if custom and inside and not fused:
            raise ValueError(f"sequential(tp_plan=...) slices {inside[:3]}, which layer {i} computes with its own "
                             f"forward ({entry.forward!r}) on the weights themselves; slicing would give it 1/t of "
                             "them. Leave those modules out of the tp_plan, or fuse the head with the loss "
                             "(loss_fn=fs.causal_lm_loss, forward=fs.models.head_of(...))")
    return styles


def _within(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


__all__ = ["TiedLayer", "head_of", "sequential"]
