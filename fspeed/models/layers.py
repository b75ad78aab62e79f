"""A model as a sequence of layers: what the pipeline assigns to stages (DeepSpeed's `PipelineModule`).

    seq = model.layers                      # the reference GPT's: embed, blocks.0 .. blocks.n-1, head
    loss = seq.loss(y, micro_batch, ops=ops) where y = layers[-1](... layers[0](seq.inputs(micro_batch)))
    loss = seq.last_with_loss(params, x, micro_batch, ops=ops) where x = layers[-2](...), when given

A `Layer` is a pure function `fn(params, x, *, rng, ops) -> y` of the model's parameter tree (of which
it reads only the subtrees under its `uses` paths), its input activation and the step's generator.
A layer's output is a tensor or a tuple of tensors (a hidden state and a mask, say): what crosses a
stage boundary, one message per tensor; the floating ones carry gradients back. A layer that gets a
tuple gets it as one argument, as in DeepSpeed's `PipelineModule`. Two layers that use the same path share
that parameter (a tied embedding and output head, DeepSpeed's `TiedLayerSpec`): each stage that holds
one of them keeps a copy, and the pipeline sums their gradients so the copies stay equal.

`sequential(modules, loss_fn=...)` builds a `Model` with such a sequence from a list of `nn.Module`s
(and `TiedLayer`s), for users who bring their own layers, as DeepSpeed users write a `PipelineModule`.
With `loss_fn=fs.causal_lm_loss` and a last layer that is the output head (an `nn.Linear` without
bias, or a `TiedLayer` called as `head_of("wte.weight")`), the head and the loss run as one fused op
(`causal_lm.fused_tail`): the logits are never kept for backward.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..pytree import PyTree, subtree
from ..rng import layer_generators
from .fused_ops import fused_forwards
from .model import Model
from .module import FP32_MODULES, TP_AXES, Slots, fp32_forward, nested, restore_forwards, set_forwards
from .module_tp import explain_failure, is_plain_op, logical_axes_of, styles_of, tp_forward
from .ops import DENSE


@dataclass(frozen=True)
class Layer:
    """One layer (module docstring). `kind` is what `partition="type:<regex>"` matches (a class name).
    `linear_via_ops`: every `F.linear` on the layer's parameters goes through `ops.linear` (fspeed's
    own layers), so zero bubble's weight-gradient split needs no torch-function mode on every op.
    A layer with `state` is called with `buffers=` (the model's buffer tree, `Model.init_buffers`),
    whose tensors under those paths its forward updates in place."""

    name: str
    fn: Callable[..., torch.Tensor]
    uses: tuple[str, ...]
    kind: str = ""
    linear_via_ops: bool = False
    state: tuple[str, ...] = ()  # the buffer subtrees it reads and updates (BatchNorm statistics): fn takes buffers=


@dataclass(frozen=True)
class LayerSequence:
    """The layers in order, what the first one gets from a micro-batch, and the loss of the last one's
    output: `loss(y, micro_batch, *, ops) -> scalar`. `last_with_loss(params, x, micro_batch, *, ops)`,
    when given, is the last layer and the loss as one function, run in their place (the GPT's fused
    head and loss, which keeps no logits for backward); the last layer still says what it uses."""

    layers: tuple[Layer, ...]
    inputs: Callable[[PyTree], Any]
    loss: Callable[..., torch.Tensor]
    last_with_loss: Optional[Callable[..., torch.Tensor]] = None

    def __post_init__(self):
        if not self.layers:
            raise ValueError("a LayerSequence needs at least one layer")
        names = [layer.name for layer in self.layers]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"layer names must be unique; repeated: {repeated}")

    def __len__(self) -> int:
        return len(self.layers)

    def run(self, params: PyTree, micro_batch: PyTree, *, rng: Optional[torch.Generator] = None,
            ops: Any = DENSE, layer_rng: Optional[Callable[[int], Optional[torch.Generator]]] = None,
            buffers: Optional[PyTree] = None) -> torch.Tensor:
        """The loss of one micro-batch through every layer in order (the one-process reference of a
        pipeline). Layer i draws from `layer_rng(i)` when given, else from generator i of
        `layer_generators(rng, ...)` (what a pipeline stage seeds it with: the same masks); layers
        with state update theirs in `buffers`."""
        x = self.inputs(micro_batch)
        rngs = [layer_rng(i) for i in range(len(self.layers))] if layer_rng is not None else \
            layer_generators(rng, len(self.layers))
        last = len(self.layers) - (self.last_with_loss is not None)
        for layer, rng_i in zip(self.layers[:last], rngs):
            x = layer.fn(params, x, rng=rng_i, ops=ops, **with_state(layer, buffers))
        return self.tail(params, x, micro_batch, ops=ops)

    def tail(self, params: PyTree, x: Any, micro_batch: PyTree, *, ops: Any = DENSE) -> torch.Tensor:
        """The loss from the output of the layer before the last (`last_with_loss`), or from the last one's."""
        if self.last_with_loss is not None:
            return self.last_with_loss(params, x, micro_batch, ops=ops)
        return self.loss(x, micro_batch, ops=ops)


def with_state(layer: Layer, buffers: Optional[PyTree]) -> dict:
    """The keyword arguments that give `layer` its state: `buffers=` for a layer that has some."""
    return {"buffers": buffers} if layer.state else {}


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
    entries: list[tuple[str, str, Optional[nn.Module], Callable]] = []  # (layer name, prefix, module, call)
    owners: dict[str, nn.Module] = {}
    for i, entry in enumerate(modules):
        if isinstance(entry, TiedLayer):
            prefix = f"tied.{entry.key}"
            if prefix in owners and owners[prefix] is not entry.module:
                raise ValueError(f"TiedLayer key {entry.key!r} names two different modules; one key, one module")
            owners[prefix] = entry.module
            call = entry.forward or (lambda m, x: m(x))
            entries.append((f"{i}", prefix, entry.module, call))
        elif isinstance(entry, nn.Module):
            entries.append((f"{i}", f"{i}", entry, lambda m, x: m(x)))
        elif callable(entry):
            entries.append((f"{i}", "", None, lambda m, x, f=entry: f(x)))
        else:
            raise TypeError(f"layer {i} is {type(entry).__name__}; allowed: nn.Module, fs.models.TiedLayer, "
                            "or a parameter-free callable")
    seen: dict[str, nn.Module] = {}
    states: dict[str, list[str]] = {}  # prefix -> its module's persistent buffers (the model's state)
    for _, prefix, module, _ in entries:
        if module is None or prefix in seen:
            continue
        seen[prefix] = module
        stateful = [n for n in module.state_dict() if n not in dict(module.named_parameters())]
        if stateful and prefix.startswith("tied."):
            raise ValueError(f"TiedLayer {prefix[5:]!r} has persistent buffers {stateful[:3]} (module state such as "
                             "BatchNorm statistics), which would be updated at each place it runs, on different "
                             "stages; give each place a module of its own or a normalisation without running statistics")
        if stateful:
            states[prefix] = stateful

    styles = _styles(seen, entries, modules, tp_plan, getattr(loss_fn, "fuses_head", False)) if tp_plan else {}
    places = Counter(prefix for _, prefix, module, _ in entries if module is not None)

    def layer(layer_name: str, prefix: str, module: Optional[nn.Module], call: Callable) -> Layer:
        caller = _Call(module, call) if module is not None else None
        owns = module is not None and next(module.parameters(), None) is not None  # GELU, Dropout: no parameters
        shared = places[prefix] > 1  # a TiedLayer's module, used at several places: taken once per micro-batch
        sliced = [(module.get_submodule(path[len(prefix) + 1:]), style, path)
                  for path, style in styles.items() if _within(path, prefix)]
        norms = {m: fp32_forward(m, types.MethodType(type(m).forward, m), Slots(m))
                 for m in (module.modules() if module is not None else ()) if isinstance(m, fp32_modules)}
        fused = fused_forwards(module) if fused_ops else {}

        state_names = states.get(prefix, [])

        def run(tree: PyTree, x: Any, *, seed: Optional[int], ops: Any, state: dict) -> Any:
            named = _flat_named(tree)
            dtype = next(iter(named.values())).dtype if named else None
            if named:  # the floating input (or floating parts of a tuple) in the layer's dtype
                cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
                x = tuple(cast(t) for t in x) if isinstance(x, tuple) else cast(x)
            in_fp32 = norms if dtype is not None and dtype != torch.float32 else {}
            with _seeded(seed), _computing(sliced, {**fused, **in_fp32}, ops):
                return torch.func.functional_call(caller, {f"inner.{k}": v for k, v in {**named, **state}.items()},
                                                  (x,), strict=False, tie_weights=False)

        def fn(params: PyTree, x: torch.Tensor, *, rng: Optional[torch.Generator] = None, ops: Any = DENSE,
               buffers: Optional[PyTree] = None):
            if module is None:
                return call(None, x)
            if rng is None and module.training:  # no generator: evaluation, dropout off, statistics read
                module.eval()
                try:
                    return fn(params, x, rng=None, ops=ops, buffers=buffers)
                finally:
                    module.train()
            seed = seed_of(rng)  # drawn here, so a recompute of the call draws the same masks
            state = _state_of(buffers, prefix, state_names)
            if not owns and not state:
                with _seeded(seed), _computing((), fused, ops):
                    return call(module, x)
            run_here = functools.partial(run, seed=seed, ops=ops, state=state)
            if not owns:  # state without parameters (a BatchNorm without affine weights)
                return run_here({}, x)
            tree = subtree(params, prefix)
            if shared:
                return run_here(ops.param(tree), x)
            return ops.call(tree, run_here, x, _label=layer_name)
        kind = type(module).__name__ if module is not None else "callable"
        return Layer(layer_name, fn, (prefix,) if owns else (), kind, state=(prefix,) if state_names else ())

    layers = tuple(layer(*e) for e in entries)

    def init(generator: Optional[torch.Generator] = None) -> dict:
        flat = {f"{prefix}.{n}": p.detach().clone() for prefix, m in seen.items() for n, p in m.named_parameters()}
        return nested(flat)

    def loss(y: torch.Tensor, micro_batch: Any, *, ops: Any = DENSE) -> torch.Tensor:
        return loss_fn(y, micro_batch)

    seq = LayerSequence(layers, inputs, loss, _fused_head(modules, entries, styles)
                        if getattr(loss_fn, "fuses_head", False) else None)

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
    from .causal_lm import fused_tail, head_axes  # noqa: PLC0415 (causal_lm imports the module helpers)

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


@contextlib.contextmanager
def _computing(sliced: Sequence[tuple[nn.Module, str, str]], computes: Mapping[nn.Module, Callable],
               ops: Any) -> Iterator[None]:
    """For one call: the sliced submodules (module, style, path) compute through `ops`
    (`module_tp.tp_forward`) when the ops slice; the `computes` ones by their given forwards (fp32
    ones, `module.fp32_forward`; fused ones, `fused_ops`)."""
    sliced = sliced if set(ops.tensor_axes) & TP_AXES else []
    overrides = {m: tp_forward(m, style, ops, path) for m, style, path in sliced}
    overrides.update(computes)
    if not overrides:
        yield
        return
    before = set_forwards(overrides)
    try:
        yield
    except (RuntimeError, ValueError, TypeError) as err:
        if sliced and type(err) in (RuntimeError, ValueError, TypeError):  # torch's, not fspeed's own errors
            raise explain_failure(err) from err
        raise
    finally:
        restore_forwards(before)


def _state_of(buffers: Optional[PyTree], prefix: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """A layer's state tensors by name (relative to its module) from the model's buffer tree."""
    if not names:
        return {}
    try:
        flat = _flat_named(subtree(buffers, prefix)) if buffers is not None else {}
    except (KeyError, IndexError, TypeError):
        flat = {}
    missing = [n for n in names if n not in flat]
    if missing:
        raise ValueError(f"layer {prefix!r} has state buffers ({missing[0]!r}, ...) that were not given: build the "
                         "state with fs.init_train_state(..., model=model) (or buffers=model.init_buffers()) and "
                         "call the model's loss with buffers=")
    return {n: flat[n] for n in names}


def _within(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _flat_named(tree: PyTree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    out: dict[str, torch.Tensor] = {}
    for key, sub in tree.items():
        out.update(_flat_named(sub, f"{prefix}.{key}" if prefix else key))
    return out


class _Call(nn.Module):
    """`call(inner, x)` as a module's forward, so functional_call can swap `inner`'s parameters for a
    forward other than `inner.forward` (a tied embedding used as the head)."""

    def __init__(self, inner: nn.Module, call: Callable):
        super().__init__()
        self.inner = inner
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(self.inner, x)


def seed_of(rng: Optional[torch.Generator]) -> Optional[int]:
    """A seed for torch's global generator drawn from `rng` (None without one)."""
    if rng is None:
        return None
    return int(torch.randint(0, 2**62, (1,), generator=rng, device=rng.device))


class _seeded:
    """Dropout in torch modules draws from the global generator: fork it, seeded with `seed`."""

    def __init__(self, seed: Optional[int]):
        self.seed = seed
        self.fork = None

    def __enter__(self):
        if self.seed is None:
            return
        self.fork = torch.random.fork_rng(devices=[])
        self.fork.__enter__()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        if self.fork is not None:
            self.fork.__exit__(*exc)
