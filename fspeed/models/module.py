"""`functionalize(nn.Module)`: any torch module as a `Model`, with its layers, state and ties.

    model = fs.functionalize(hf_gpt2, loss_fn=lambda out, batch: out.loss)
    state = fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model)
    fs.to_module(fs.gather_params(state, mesh), hf_gpt2, state.buffers)   # trained weights back in

What the module becomes:

- **Parameters** are a nested dict that mirrors the module tree (`{"transformer": {"h": {"0":
  ...}}}`); their paths are the state_dict names. A tied parameter (GPT-2's `lm_head.weight` is
  `transformer.wte.weight`) is one value under its first name; every module that holds it uses it.
- **Buffers** with state (BatchNorm's running statistics: the module's persistent buffers) are a
  second nested dict, carried in the TrainState and its checkpoints and updated in place by the
  forward. Non-persistent buffers (rotary tables) stay the module's own constants.
- **Units**: each repeated block (the same class repeated in a ModuleList or Sequential:
  `transformer.h.3`, `model.layers.0`) is a unit, or the modules matching `units=` patterns; every
  other parameter belongs to the module that owns it (`transformer.wte`). Under a plan a unit is
  what ZeRO-3 gathers, what `recompute_blocks` recomputes, and what hands its gradients on as its
  backward ends: the module's forward is routed through `ops.call` (or, for a unit whose
  parameters another module also uses, `ops.param`, taken once per micro-batch).
- **Randomness**: dropout draws from torch's global generator, which the step's `rng` seeds for
  the forward (and the recompute replays): same seed, same run; a resumed run is exact.
- **Mode**: `train=False` runs the module in eval mode (dropout off, BatchNorm on its running
  statistics, which it leaves untouched), as `make_eval_step` asks.
- **Precision**: floating inputs are cast to the parameters' dtype; normalisation layers
  (`fp32_modules`, BatchNorm/LayerNorm/GroupNorm by default, as FSDP's mixed-precision policy)
  compute in fp32 with fp32 buffers, their output cast back (a 16-bit module's; fp64 stays fp64).
- **torch.func**: the loss is a pure function of the parameters for `grad`, `vmap`, `jvp`, `jacrev`
  and `hessian`; under forward mode or nested `grad` the module's
  `F.scaled_dot_product_attention` runs SDPA's math backend, which those transforms differentiate
  (`fspeed.models.attention`).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import functools
import inspect
import types
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from ..pytree import PyTree, tree_flatten_with_paths
from ..remat_blocks import Remat
from .attention import decomposed_attention
from .causal_lm import FusedHead, labels_of, output_head
from .fused_ops import fused_forwards
from .model import LogicalAxes, Model
from .module_tp import MODULE_TP_RULES, explain_failure, logical_axes_of, styles_of, tp_forward, tp_plan_from
from .ops import DENSE

TP_AXES = {axis for axis, _ in MODULE_TP_RULES}

FP32_MODULES: tuple[type, ...] = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
Units = Union[str, Sequence[str], None]


def nested(flat: dict[str, Any]) -> dict:
    """`{"a.b.c": x}` as `{"a": {"b": {"c": x}}}` (the module tree's shape)."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _flat(tree: PyTree, units: bool = True) -> dict[str, Any]:
    """{dotted path: leaf} of `tree`; `units`: a UnitParams is a leaf (a unit's own tensors have none)."""
    paths, leaves, _ = tree_flatten_with_paths(tree, is_leaf=_is_unit if units else None)
    return dict(zip(paths, leaves))


def _is_unit(x: Any) -> bool:
    return hasattr(x, "unit") and hasattr(x, "resident")  # a UnitParams under a plan (models never import it)


def repeated_blocks(module: nn.Module) -> list[str]:
    """Paths of the elements of every ModuleList/Sequential whose elements share one class and
    hold parameters (`transformer.h.0`, `model.layers.3`): FSDP's transformer auto-wrap, by shape."""
    blocks = []
    for path, child in module.named_modules():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) > 1:
            kinds = {type(m) for m in child}
            if len(kinds) == 1 and any(True for _ in child[0].parameters()):
                blocks.extend(f"{path}.{name}" if path else name for name, _ in child.named_children())
    return blocks


def _match(paths: Sequence[str], patterns: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the paths matching any fnmatch pattern, in order; the patterns matching no path)."""
    matched = [p for p in paths if any(fnmatch.fnmatchcase(p, pat) for pat in patterns)]
    unmatched = [pat for pat in patterns if not any(fnmatch.fnmatchcase(p, pat) for p in paths)]
    return matched, unmatched


def unit_of_parameters(module: nn.Module, units: Units = "auto") -> dict[str, str]:
    """Each parameter's unit: the innermost block (or module matching a `units` pattern) that
    contains it, else the module that owns it."""
    modules = dict(module.named_modules())
    if units == "auto" or units is None:
        blocks = set(repeated_blocks(module))
    else:
        patterns = [units] if isinstance(units, str) else list(units)
        matched, unmatched = _match([path for path in modules if path], patterns)
        blocks = set(matched)
        if unmatched:
            raise ValueError(f"functionalize: units pattern(s) {unmatched} match no submodule of "
                             f"{type(module).__name__}; submodules are e.g. {[m for m in modules if m][:6]}")
    out = {}
    for name, _ in module.named_parameters():
        owner = name.rpartition(".")[0]
        parts, unit = owner.split(".") if owner else [], owner or name  # the root's own: a unit each
        for k in range(len(parts), 0, -1):  # the outermost matching block wins over nested ones
            prefix = ".".join(parts[:k])
            if prefix in blocks:
                unit = prefix
        out[name] = unit
    return out


class ModuleLoss:
    """`loss` (and, with `loss_fn=None`, `apply`) of a functionalized module (module docstring)."""

    def __init__(self, module: nn.Module, loss_fn: Optional[Callable], units: dict[str, str],
                 fp32_modules: tuple[type, ...], name: str, tp_styles: Optional[dict[str, str]] = None,
                 fused_ops: bool = True):
        self.module, self.loss_fn, self.units, self.name = module, loss_fn, units, name
        self.fused = fused_forwards(module) if fused_ops else {}  # fspeed.models.fused_ops
        self.tp_styles = dict(tp_styles or {})
        self.fp32_modules = fp32_modules
        self.state_names = set(module.state_dict().keys())
        self.buffer_names = [n for n, _ in module.named_buffers() if n in self.state_names]
        holders: dict[int, list[str]] = {}
        for path, p in module.named_parameters(remove_duplicate=False):
            holders.setdefault(id(p), []).append(path)
        first = {id(p): n for n, p in module.named_parameters()}
        # every name a parameter is held under, by its first (state_dict) name: ties
        self.aliases = {first[i]: names for i, names in holders.items() if len(names) > 1}
        self.devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        self.members: dict[str, list[str]] = {}
        for name, unit in units.items():
            self.members.setdefault(unit, []).append(name)
        self.shapes = {n: p.shape for n, p in module.named_parameters()}
        self.takes_use_cache = "use_cache" in inspect.signature(module.forward).parameters
        self.remat: Any = None  # fspeed.remat_blocks.Remat for the units in remat_units
        self.slots: dict[int, Slots] = {}  # by id of the (sub)module they swap tensors into
        self.modules = dict(module.named_modules())
        # what each module computes when its route calls it: an instance forward set before (e.g. a
        # wrapper of accelerate's hooks), else its class's
        self.forwards = {m: m.__dict__.get("forward") or types.MethodType(type(m).forward, m)
                         for m in self.modules.values()}
        self._holders_of: dict[str, Optional[list[str]]] = {}  # by unit path (`_holders`)
        self._placeholders_of: dict[Optional[torch.dtype], dict[str, torch.Tensor]] = {}
        self._direct_names_of: dict[tuple, list[str]] = {}  # by (unit path, its tree): `_direct_names`
        self._routed_once: set[tuple[str, ...]] = set()  # the unit sets a fully routed forward has run (`_routed`)
        self.hf_layer_paths = [p for p, m in self.modules.items()  # layers that Hugging Face may checkpoint
                               if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]
        self.remat_units: frozenset = frozenset()
        # causal_lm_loss: the output head computes the loss itself (fspeed.models.causal_lm)
        self.head = output_head(module, name) if getattr(loss_fn, "fuses_head", False) else None
        self.head_path = next((p for p, m in self.modules.items() if m is self.head), None)

    def with_remat(self, remat: Any, where: Optional[Sequence[str]] = None) -> "ModuleLoss":
        """A copy whose units matching `where` (default: the repeated blocks) are checkpointed
        with `remat` (`fspeed.rematerialization`): every `remat.every`-th of them in forward order."""
        order = list(dict.fromkeys(self.units.values()))  # units in parameter (= forward) order
        if where is None:
            blocks = set(repeated_blocks(self.module))
            chosen = [u for u in order if u in blocks]
            if not chosen:
                raise ValueError(f"remat: {self.name} has no repeated blocks to checkpoint; name its submodules "
                                 "with where=[path patterns] (each must be a unit: functionalize(..., units=...))")
        else:
            chosen, unmatched = _match(order, [where] if isinstance(where, str) else list(where))
            if unmatched:
                raise ValueError(f"remat: pattern(s) {unmatched} match no unit of {self.name}; its units are e.g. "
                                 f"{order[:6]} (make a submodule a unit with functionalize(..., units=[...]))")
        out = copy.copy(self)
        out.remat = remat
        out.remat_units = frozenset(u for k, u in enumerate(chosen) if remat.chosen(k))
        return out

    def __call__(self, params, batch, *, rng: Optional[torch.Generator] = None, buffers=None, ops=DENSE,
                 train: bool = True) -> torch.Tensor:
        if self.loss_fn is None:
            raise ValueError(f"functionalize({self.name}) was given no loss_fn; pass "
                             "functionalize(module, loss_fn=lambda outputs, batch: ...)")
        # causal_lm_loss: the labels go to the fused head, not to the module
        fused = None if self.head is None else \
            FusedHead(self.head, labels_of(batch), ops, self.tp_styles.get(self.head_path))
        if isinstance(batch, dict):
            dropped = ("targets",) if fused is None else ("targets", "labels")
            inputs = {k: v for k, v in batch.items() if k not in dropped}
        else:
            inputs = batch[0]
        outputs = self.apply(params, inputs, rng=rng, buffers=buffers, ops=ops, train=train, head=fused)
        if fused is not None and fused.installed:
            return fused.loss(outputs, self.name)
        return self.loss_fn(outputs, batch)

    def apply(self, params, inputs, *, rng: Optional[torch.Generator] = None, buffers=None, ops=DENSE,
              train: bool = True, head: Optional[FusedHead] = None) -> Any:
        """The module's output for `inputs` (a tuple: positional arguments; a dict: keywords); with
        `head`, the output head computes `head`'s loss (`causal_lm_loss`) where it can."""
        flat = _flat(params)
        units = {path: u for path, u in flat.items() if _is_unit(u)}
        foreign = [path for path in units if path not in self.members]
        if foreign:  # its modules would run on their own tensors: stale weights, lost gradients
            raise ValueError(f"{self.name}: the state groups its parameters into units {foreign[:3]}, which are not "
                             f"this module's (e.g. {list(self.members)[:3]}); build the state with "
                             "fs.init_train_state(params, opt, ..., model=model), which takes the module's units")
        tensors = {path: t for path, t in flat.items() if not _is_unit(t)}
        dtype = _compute_dtype(tensors, units)
        state = self._buffers(buffers)
        inputs = _cast_floats(inputs, dtype)
        # decomposed_attention: the module's own SDPA calls under forward mode or nested grad (`attention`)
        with self._seeded(rng), self._routed(units, ops, dtype, train, head) as installed, \
                decomposed_attention():
            given = dict(tensors)
            placeholders = self._placeholders(dtype)
            for path, u in units.items():  # a unit's parameters are reached only through its route
                if path in installed.direct:  # or are in place for the whole call (`_routed`)
                    given.update(zip(self._direct_names(path, u, ops), ops.take(u)))
                    continue
                for name in self._unit_parameter_names(path):
                    given[name] = placeholders[name]
            call_args = inputs if isinstance(inputs, tuple) else (() if isinstance(inputs, dict) else (inputs,))
            call_kwargs = inputs if isinstance(inputs, dict) else {}
            if installed.remat and "use_cache" not in call_kwargs and self.takes_use_cache:
                # a recompute would append its keys and values to the cache the forward filled (as
                # Hugging Face's own checkpointing, which turns the cache off in training)
                call_kwargs = {**call_kwargs, "use_cache": False}
            try:
                tensors = {alias: t for name, t in given.items() for alias in self.aliases.get(name, (name,))}
                out = self._slots(self.module).call({**tensors, **state}, call_args, call_kwargs)
                self._routed_once.add(tuple(units))
                return out
            except (RuntimeError, NotImplementedError) as err:
                if units and "meta" in str(err):
                    raise RuntimeError(
                        f"{self.name}: a module read a parameter of another unit directly (its value there is a "
                        "placeholder on the 'meta' device: fspeed hands each unit's parameters to the module that "
                        "owns them, as it runs). Make one unit hold both, e.g. functionalize(..., units=[...]) with "
                        f"the reading module's path. ({err})") from err
                raise

    # -- pieces ---------------------------------------------------------------------------------

    def _slots(self, module: nn.Module) -> "Slots":
        if id(module) not in self.slots:
            self.slots[id(module)] = Slots(module)
        return self.slots[id(module)]

    def _buffers(self, buffers) -> dict[str, torch.Tensor]:
        if buffers is None:
            return {}  # the module's own (a direct call outside train_step)
        flat = _flat(buffers)
        missing = [n for n in self.buffer_names if n not in flat]
        if missing:
            raise ValueError(f"{self.name} has state buffers ({missing[0]!r}, ...) that the state does not carry; "
                             "build it with fs.init_train_state(..., model=model) (or buffers=model.init_buffers())")
        return flat

    @contextlib.contextmanager
    def _seeded(self, rng: Optional[torch.Generator]) -> Iterator[None]:
        if rng is None:
            yield
            return
        with torch.random.fork_rng(devices=self.devices):
            # the generators fork_rng restores (torch.manual_seed would also queue a seed for every
            # other backend, with a stack trace each, on every call)
            seed = rng.initial_seed()
            torch.default_generator.manual_seed(seed)
            if self.devices:
                torch.cuda.manual_seed(seed)
            yield

    def _placeholders(self, dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
        """A 'meta' tensor (no data) in each parameter's shape: what the module holds in place of a
        unit's parameter while it runs, so that a read outside the unit's route fails loudly. Made
        once per dtype (a step of a 12-layer model would otherwise make about 150, some 0.3 ms)."""
        if dtype not in self._placeholders_of:
            self._placeholders_of[dtype] = {name: torch.empty(shape, dtype=dtype, device="meta")
                                            for name, shape in self.shapes.items()}
        return self._placeholders_of[dtype]

    def _direct_names(self, path: str, u: Any, ops) -> list[str]:
        """The names of a direct unit's tensors (`_routed`) in `ops.take(u)`'s order: worked out once."""
        key = (path, u.unit.tree)
        if key not in self._direct_names_of:
            self._direct_names_of[key] = [f"{path}.{rel}" for rel in _flat(ops.param(u), units=False)]
        return self._direct_names_of[key]

    def _unit_parameter_names(self, unit: str) -> list[str]:
        return self.members.get(unit, [])

    def _holders(self, path: str) -> Optional[list[str]]:
        """None when the unit's module can be called (it alone uses its parameters); else the modules
        holding its parameters (ties), which take the unit whole. Fixed by the module's structure:
        worked out once per unit."""
        if path not in self._holders_of:
            names = self._unit_parameter_names(path)
            shared = [a for n in names for a in self.aliases.get(n, [n]) if not _within(a, path)]
            self._holders_of[path] = None if not shared and path and path in self.modules else \
                sorted({_owner(a) for n in names for a in self.aliases.get(n, [n])})
        return self._holders_of[path]

    @contextlib.contextmanager
    def _routed(self, units: dict, ops, dtype: torch.dtype, train: bool,
                head: Optional[FusedHead] = None) -> Iterator[None]:
        """For one forward: every unit's module (and every module sharing one of its parameters)
        computes through ops; tensor-sliced modules (when the ops slice), normalisation layers
        (when computing below fp32) and a fused output head (`head`, but not in fp16)
        compute their own way (`_compute`); the module is in train or eval mode. A unit recomputed
        in backward (remat) installs all of it again for its call."""
        sliced = bool(self.tp_styles) and bool(set(ops.tensor_axes) & TP_AXES)
        modules = self.modules
        hf_layers = self._hf_checkpointed(modules) if train else {}
        hf_remat = None
        if hf_layers:
            hf_remat = Remat()  # Hugging Face's own checkpointing: full, on every flagged layer
        computes = dict(self.fused)
        if sliced or (_below_fp32(dtype) and self.fp32_modules):
            for path, m in modules.items():
                fn = self._compute(path, m, ops, sliced, dtype)
                if fn is not None:
                    computes[m] = fn
        if head is not None and dtype != torch.float16:
            computes[head.head] = head.forward
            head.installed = True
        overrides: dict[nn.Module, Callable] = dict(computes)
        installed = _Installed(self.module, overrides, train, list(hf_layers.values()),
                               remat=bool(hf_layers) or bool(self.remat_units and units),
                               all_modules=list(self.modules.values()))
        taken: dict[str, list[tuple[str, Any, list[str]]]] = {}  # holder module -> the units it takes
        # once a forward with every unit routed has shown that no module reads a parameter of another
        # unit (the placeholders make that an error), units that need no gather or remat go in directly
        direct = getattr(ops, "direct", None) if tuple(units) in self._routed_once else None
        for path, u in units.items():
            holders = self._holders(path)
            if holders is None:
                remat = hf_remat if path in hf_layers else self.remat if path in self.remat_units else None
                if remat is None and direct is not None and direct(u):
                    installed.direct[path] = u  # its tensors go in with the module's call: no route
                    continue
                overrides[modules[path]] = self._call_route(path, u, ops, computes.get(modules[path]), installed,
                                                            remat)
            else:
                if path in self.remat_units or path in hf_layers:
                    raise ValueError(f"remat: unit {path!r} of {self.name} shares parameters with another module, "
                                     "so it is taken whole, not called: it cannot be checkpointed")
                for holder in holders:
                    taken.setdefault(holder, []).append((path, u, self._unit_parameter_names(path)))
        for holder, units_taken in taken.items():
            m = modules[holder]
            overrides[m] = self._take_route(holder, units_taken, ops, computes.get(m))
        try:
            with installed:
                yield installed
        except (RuntimeError, ValueError, TypeError) as err:
            if sliced and type(err) in (RuntimeError, ValueError, TypeError):  # not fspeed's own errors
                raise explain_failure(err) from err
            raise

    def _hf_checkpointed(self, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """Hugging Face layers with `gradient_checkpointing` on (`gradient_checkpointing_enable()`), by
        path: their own torch.utils.checkpoint would recompute outside this forward (on the module's
        own weights), so fspeed's remat (full) takes their place; each must be a unit."""
        flagged = [p for p in self.hf_layer_paths if getattr(modules[p], "gradient_checkpointing", False) is True]
        unit_paths = set(self.members)
        outside = [p for p in flagged if p not in unit_paths]
        if outside:
            raise ValueError(f"{self.name}: gradient checkpointing is on for {outside[:3]}, which fspeed does not run as "
                             "units; call module.gradient_checkpointing_disable() and write "
                             f"fs.remat(fs.functionalize(module, ...), where={outside[:1]!r}) (or functionalize(..., "
                             f"units={outside[:1]!r}) to keep Hugging Face's switch)")
        return {p: modules[p] for p in flagged}

    def _compute(self, path: str, module: nn.Module, ops, sliced: bool, dtype) -> Optional[Callable]:
        """How `module` computes when not as its class says: tensor-sliced, or in fp32."""
        if sliced and path in self.tp_styles:
            return tp_forward(module, self.tp_styles[path], ops, path)
        if _below_fp32(dtype) and isinstance(module, self.fp32_modules):
            return fp32_forward(module, self.forwards[module], self._slots(module))
        return None

    def _call_route(self, path: str, u, ops, compute: Optional[Callable], installed: "_Installed",
                    remat: Any) -> Callable:
        """The unit's module computes through `ops.call`: gathered for this call (ZeRO-3), recomputed
        (remat: `remat`, or zero.recompute_blocks), its gradients handed on as its backward ends."""
        module = self.module.get_submodule(path)
        slots = self._slots(module)
        # `installed` holds this forward among its overrides: a weak reference here, so the two make no
        # reference cycle (one per unit per micro-batch, for the garbage collector); each call's `run`
        # (kept by autograd for a recompute) holds it strongly
        installed_ref = weakref.ref(installed)

        own = compute or self.forwards[module]

        def forward(*args, **kwargs):
            run = functools.partial(_run_unit, installed_ref(), own, slots)
            return ops.call(u, run, *args, _remat=remat, **kwargs)
        return forward

    def _take_route(self, holder: str, units_taken: list, ops, compute: Optional[Callable]) -> Callable:
        """A module holding parameters of units other modules also use (ties), or its own parameters
        as units (the root's): the units are taken once per micro-batch (`ops.param`) and their
        tensors swapped in for this forward."""
        module = self.module.get_submodule(holder)
        slots = self._slots(module)
        own = compute or self.forwards[module]

        def forward(*args, **kwargs):
            params = {}
            for path, u, names in units_taken:
                tree = ops.param(u)
                by_name = {f"{path}.{rel}" if rel else path: t for rel, t in _flat(tree, units=False).items()} \
                    if isinstance(tree, dict) else {names[0]: tree}
                for name in names:
                    for alias in self.aliases.get(name, [name]):
                        if _within(alias, holder):
                            params[alias[len(holder) + 1:] if holder else alias] = by_name[name]
            return slots.call(params, args, kwargs, own)
        return forward


def fp32_forward(module: nn.Module, forward: Callable, slots: "Slots") -> Callable:
    """`forward` of a normalisation module computing in fp32 below fp32 (FSDP's mixed-precision
    policy): fp32 copies of its own parameters (their gradients flow back to the 16-bit ones), its
    floating inputs cast up, its output cast back to its input's dtype."""
    def in_fp32(*args, **kwargs):
        params = {name: p.float() for name, p in module.named_parameters(recurse=False)}
        out_dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()),
                         torch.float32)
        out = slots.call(params, _cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32), forward)
        return _cast_floats(out, out_dtype)
    return in_fp32


def _run_unit(installed: "_Installed", forward: Callable, slots: "Slots", tree: Any, *args: Any, **kwargs: Any) -> Any:
    """A routed unit's `forward` (its module's own, or how it computes instead) on the tensors of
    `tree` (names relative to the module), with the forward's routes installed (a recompute in
    backward runs after the forward has left them)."""
    with installed:
        return slots.call(_flat(tree, units=False), args, kwargs, forward)


class _Installed:
    """One forward's state of the module (module docstring): its mode, the forwards routed or
    overridden, Hugging Face's own checkpointing switched off. Re-entrant: a unit recomputed in
    backward enters it again around its call, after the forward has left it."""

    def __init__(self, module: nn.Module, overrides: dict, train: bool, hf_layers: list, remat: bool,
                 all_modules: list):
        self.module, self.overrides, self.train, self.hf_layers = module, overrides, train, hf_layers
        self.remat = remat  # whether a unit of this forward is checkpointed
        self.all_modules = all_modules  # the module and its submodules
        self.depth = 0
        self.direct: dict = {}  # units whose tensors are in place for the whole forward (`ModuleLoss._routed`)
        self.modes: dict = {}
        self.own: dict = {}  # each overridden module's instance forward before (or _MISSING)

    def __enter__(self) -> "_Installed":
        if self.depth == 0:
            self.modes = {m: m.training for m in self.all_modules}
            if any(mode != self.train for mode in self.modes.values()):
                self.module.train(self.train)
            self.own = set_forwards(self.overrides)
            for layer in self.hf_layers:
                layer.gradient_checkpointing = False
        self.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0:
            restore_forwards(self.own)
            for layer in self.hf_layers:
                layer.gradient_checkpointing = True
            for m, mode in self.modes.items():
                if m.training != mode:
                    m.training = mode


def set_forwards(overrides: Mapping[nn.Module, Callable]) -> dict:
    """Each module's forward set on the instance (as `m.forward = ...` sets it); returns what each
    instance had, for `restore_forwards`."""
    before = {m: m.__dict__.get("forward", _MISSING) for m in overrides}
    for m, forward in overrides.items():
        m.__dict__["forward"] = forward
    return before


def restore_forwards(before: Mapping[nn.Module, Any]) -> None:
    """Undo `set_forwards`: each instance's own forward back, or none."""
    for m, own in before.items():
        if own is _MISSING:
            m.__dict__.pop("forward", None)
        else:
            m.__dict__["forward"] = own


def _within(name: str, path: str) -> bool:
    return not path or name == path or name.startswith(path + ".")


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


class Slots:
    """Where each dotted name of a module's tensors lives (owner module, attribute), looked up once:
    `call` runs the module with some of them replaced, as `torch.func.functional_call(strict=False,
    tie_weights=False)` does, without its per-call lookups (a training step calls a module once per
    unit; functional_call's lookups and tie scan cost more than a small layer's own dispatch)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.slots: dict[tuple[str, ...], list[tuple[dict, str]]] = {}  # by the names a call replaces

    def _slot(self, name: str) -> tuple[dict, str]:
        """(the dict holding `name`, its key): the owner's parameter or buffer table, else the owner's
        attributes (a tensor that is neither is set as an attribute for the call)."""
        parent, _, attr = name.rpartition(".")
        owner = self.module.get_submodule(parent) if parent else self.module
        table = owner._parameters if attr in owner._parameters else \
            owner._buffers if attr in owner._buffers else owner.__dict__
        return table, attr

    def call(self, tensors: dict[str, torch.Tensor], args: tuple, kwargs: dict,
             forward: Optional[Callable] = None) -> Any:
        """The module called (or `forward`: a routed module's own forward, called directly: its
        caller's `__call__` has run the module's hooks) with `tensors` in place for the call."""
        names = tuple(tensors)
        slots = self.slots.get(names)
        if slots is None:
            slots = self.slots[names] = [self._slot(name) for name in names]
        saved: list[Any] = []
        try:
            for (table, attr), tensor in zip(slots, tensors.values()):
                saved.append(table.get(attr, _MISSING))
                table[attr] = tensor
            return (forward or self.module)(*args, **kwargs)
        finally:
            for (table, attr), old in zip(slots[len(saved) - 1::-1] if saved else (), reversed(saved)):
                if old is _MISSING:
                    table.pop(attr, None)
                else:
                    table[attr] = old


_MISSING = object()


def _cast_floats(x: Any, dtype: Optional[torch.dtype]) -> Any:
    """`x` with every floating tensor (in tuples, lists, dicts) cast to `dtype`."""
    if dtype is None:
        return x
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_cast_floats(v, dtype) for v in x)
    if isinstance(x, list):
        return [_cast_floats(v, dtype) for v in x]
    if isinstance(x, dict) and type(x) is dict:
        return {k: _cast_floats(v, dtype) for k, v in x.items()}
    return x


def _below_fp32(dtype: Optional[torch.dtype]) -> bool:
    """A 16-bit compute dtype (fp32 and fp64 modules compute as they are)."""
    return dtype is not None and dtype.is_floating_point and dtype.itemsize < 4


def _compute_dtype(tensors: dict, units: dict) -> Optional[torch.dtype]:
    for t in tensors.values():
        if t.is_floating_point():
            return t.dtype
    for u in units.values():
        for t in (u.shard, *u.resident):
            if t is not None and t.is_floating_point():
                return t.dtype
    return None


def output_loss(outputs: Any, batch: Any) -> torch.Tensor:
    """The loss a module returns: `outputs.loss` (Hugging Face models given labels) or a scalar output."""
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    if loss is None and isinstance(outputs, torch.Tensor):
        loss = outputs
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"the model returned {type(outputs).__name__} without a scalar loss: return a 0-d loss or "
                         "an output with .loss (a Hugging Face model needs labels in the batch), or pass "
                         "loss_fn(outputs, batch) -> loss")
    return loss


def functionalize(
    module: nn.Module,
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
    *,
    logical_axes: Optional[LogicalAxes] = None,
    units: Units = "auto",
    fp32_modules: tuple[type, ...] = FP32_MODULES,
    tp_plan: Union[str, dict, None] = None,
    fused_ops: bool = True,
) -> Model:
    """A Model backed by `module` (see the module docstring).

    `init()` returns detached copies of the module's current parameters (its own initialization
    already ran), nested as the module tree; `init_buffers()` its state buffers. `apply(params,
    inputs)` calls the module with `inputs` (a tuple is unpacked into positional arguments, a dict
    into keyword arguments). `loss(params, batch)` needs `loss_fn(outputs, batch)`; the module is
    called on `batch[0]`, or on a dict batch minus its "targets" key. `units`: "auto" (repeated
    blocks), or submodule path patterns (`"model.layers.*"`). `tp_plan`: submodule patterns ->
    tensor-slicing styles (`fspeed.models.module_tp`), or "auto" for a transformers model's own plan
    (its patterns that match nothing in this configuration skipped);
    it sets the logical axes that `fs.tensor_slicing(fs.models.module_tp_rules)` slices.
    `fused_ops`: Hugging Face's Python tanh-GELUs compute as torch's fused kernel
    (`fspeed.models.fused_ops`: the same function to about one ulp); False runs the module's own code.
    """
    if not any(True for _ in module.parameters()):
        raise ValueError(f"functionalize: {type(module).__name__} has no parameters")
    unit_map = unit_of_parameters(module, units)
    name = type(module).__name__
    own_plan = tp_plan == "auto"
    if own_plan:
        tp_plan = tp_plan_from(module)
        if not tp_plan:
            raise ValueError(f"functionalize: tp_plan='auto' but {name} declares no tensor-parallel plan; pass one "
                             "({submodule pattern: style}, see fspeed.models.module_tp)")
    styles = styles_of(module, tp_plan, skip_unmatched=own_plan) if tp_plan else {}
    axes = {**logical_axes_of(module, styles), **dict(logical_axes or {})}
    core = ModuleLoss(module, loss_fn, unit_map, tuple(fp32_modules), name, styles, fused_ops)

    def init(generator: Optional[torch.Generator] = None) -> dict:
        return nested({n: p.detach().clone() for n, p in module.named_parameters()})

    def init_buffers() -> dict:
        return nested({n: b.detach().clone() for n, b in module.named_buffers() if n in core.state_names})

    return Model(init, core.apply, core, axes, name=name, units=unit_map, init_buffers=init_buffers)


def to_module(params: PyTree, module: nn.Module, buffers: Optional[PyTree] = None) -> nn.Module:
    """Copy trained parameters and state buffers into `module`, by path; a tied parameter is one
    tensor, written once. `params` is a parameter tree (full: `fs.gather_params(state, mesh)` for a
    sharded state) or a one-process TrainState (its fp32 weights and its buffers). Returns the module."""
    if hasattr(params, "master_params") and hasattr(params, "layout"):  # a TrainState (models never import it)
        if not params.layout.is_local:
            raise ValueError("to_module: this state is sharded over ranks; pass fs.gather_params(state, mesh) and "
                             "state.buffers instead")
        params, buffers = params.master_params.tree(), params.buffers if buffers is None else buffers
    values = _flat(params)
    own = dict(module.named_parameters())
    missing = sorted(set(own) - set(values))
    unknown = sorted(set(values) - set(own))
    if missing or unknown:
        raise ValueError(f"to_module: parameters do not match {type(module).__name__}: missing {missing[:5]}, "
                         f"unknown {unknown[:5]}")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(values[name].reshape(p.shape))
        if buffers is not None:
            own_buffers = dict(module.named_buffers())
            for name, b in _flat(buffers).items():
                if name not in own_buffers:
                    raise ValueError(f"to_module: {type(module).__name__} has no buffer {name!r}")
                own_buffers[name].copy_(b)
    return module


__all__ = ["FP32_MODULES", "ModuleLoss", "Slots", "fp32_forward", "functionalize", "nested", "repeated_blocks",
           "restore_forwards", "set_forwards", "to_module", "unit_of_parameters"]
