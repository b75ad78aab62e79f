"""Parameter groups: one optimizer, other hyperparameters for some parameters, chosen by path.

    opt = param_groups(adamw(3e-4, weight_decay=0.1), [
        {"params": "blocks.*.attn.*", "lr_scale": 0.1},          # glob over parameter paths
        {"params": ["*.bias", "ln_f.*"], "weight_decay": 0.0},    # paths or patterns
    ])
    opt = param_groups(adamw(3e-4), torch_style_groups, complete=True)   # torch / DeepSpeed groups

A group is a dict: "params" (a path, a glob pattern where `*` also crosses dots, a list of those,
or a predicate `path -> bool`), an optional "name", and overrides of the optimizer's own
hyperparameters (`lr`, `weight_decay`, `eps`, `b1`/`b2` or torch's `betas`, `momentum`, ...: the
names its factory takes), or `lr_scale`, which multiplies the optimizer's lr (a schedule keeps its
shape). A parameter may match one group at most; one that matches none keeps the optimizer's own
settings, unless `complete=True`: torch's and DeepSpeed's rule that every parameter is in exactly
one group (a parameter in none is an error naming it). A group's "lr" replaces the optimizer's lr
(a number or a schedule) for that group, as in torch before any scheduler.

Why overrides of one optimizer rather than Optax's `multi_transform` (a transform per label):
torch and DeepSpeed groups are exactly this (one optimizer class, per-group values), so their
groups map one to one; and a group's transform is the optimizer's own factory called again with
the overrides (`TransformInfo.factory`), so every fspeed optimizer and `from_torch` get groups
and their validation without code of their own, and every group checks its values when built.

Running on flat buffers: groups are decided by path on whatever Flat the optimizer gets, whole
parameters or a ZeRO rank's 1-D pieces of them (named by their parameter's path). Consecutive
segments with the same settings form a run, a contiguous view of the buffers. The runs of one
setting are updated together: one call of its transform on the list of their views (torch's fused
kernels take the whole list in one launch, and so does fspeed's CPU Adam in fp32: one parallel
pass over every run), with one state over that list; backward's own gradient tensors
(`LooseGrads`) are handed on by runs in the same way. Padding pieces (paths ending in ".pad") and a
buffer's tail past its layout belong to no run: they stay zero, get no weight decay, and are cast
into `cast_to` as they are.
Groups are as elementwise as the optimizer; a per-tensor optimizer (LAMB) still sees whole
tensors where the layout holds them. Cost (`benchmarks/torch_optimizers.py`, 10M-parameter GPT,
norms and biases exempt from decay: 42 runs in 2 settings): 1.14x the ungrouped step with fspeed's
CPU Adam (1.45x when it took one parallel dispatch per run), 1.25x with torch's fused kernel.

A group whose patterns match no parameter cannot be seen on one rank's ZeRO partition (it may
hold none of that group); `check_param_groups(opt, paths)` checks against all parameter paths.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from ..flat import Flat, FlatLayout, LooseGrads, flat_list, is_loose
from ..pytree import PyTree, tree_flatten, tree_flatten_with_paths, tree_leaves, tree_unflatten
from .base import Capabilities, GradientTransformation, TransformInfo, optimizer_step, resolve

PAD_SUFFIX = ".pad"
PathSelector = Union[str, Sequence[str], Callable[[str], bool]]
_GLOB = set("*?[")


def is_padding(path: str) -> bool:
    """Whether `path` names a zero padding piece of a partitioned buffer (not a parameter)."""
    return path.endswith(PAD_SUFFIX)


class ParamGroupsState(NamedTuple):
    count: int  # updates applied so far
    lr: float  # the optimizer's own lr for the next update (groups may scale or replace it)
    groups: tuple  # per setting present, in order of its first run: its optimizer's state over its runs


class _Group(NamedTuple):
    name: str
    match: Callable[[str], bool]
    setting: int  # index of this group's transform


class _Run(NamedTuple):
    setting: int  # index of the run's transform (-1: padding, no transform)
    part: int  # which Flat of a list of Flats (0 otherwise)
    first: int  # segments [first, stop)
    stop: int
    start: int  # elements [start, end) of a Flat's buffer
    end: int
    layout: Optional[FlatLayout]  # the run's own layout (Flats only)


class _Plan(NamedTuple):
    """How one layout (or tree) splits into runs."""

    groups: tuple  # ((setting, its runs in buffer order), ...) in order of each setting's first run
    padding: tuple  # the spans of padding pieces (setting -1)
    single: bool  # one Flat (not a list of them)
    treedef: Any  # a plain tree's structure (None for Flats)


# --------------------------------------------------------------------------- rebuilding an optimizer


def with_hparams(optimizer: GradientTransformation, **overrides: Any) -> GradientTransformation:
    """The same optimizer built with some hyperparameters changed (its `TransformInfo.factory`).

    A wrapper (a transform whose hparams hold the "optimizer" it wraps, such as `param_groups`)
    passes the overrides to the optimizer inside it.
    """
    info = optimizer.info
    if info is None or info.factory is None:
        raise TypeError(f"{optimizer!r} cannot be rebuilt with other hyperparameters; parameter groups need an "
                        "optimizer from fspeed.optim (adam, adamw, sgd, lamb, from_torch) or param_groups of one")
    inner = info.hparams.get("optimizer")
    if isinstance(inner, GradientTransformation):
        if not overrides:
            return optimizer
        return info.factory(**{**info.hparams, "optimizer": with_hparams(inner, **overrides)})
    unknown = sorted(set(overrides) - set(info.hparams))
    if unknown:
        raise ValueError(f"{info.name} has no hyperparameter {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(hyperparameter_names(optimizer))}")
    return info.factory(**{**info.hparams, **overrides}) if overrides else optimizer


def hyperparameter_names(optimizer: GradientTransformation) -> tuple[str, ...]:
    """The hyperparameters `with_hparams` (and so a parameter group) may set on `optimizer`."""
    info = optimizer.info
    if info is None or info.factory is None:
        return ()
    inner = info.hparams.get("optimizer")
    return hyperparameter_names(inner) if isinstance(inner, GradientTransformation) else tuple(info.hparams)


def _hyperparameter(optimizer: GradientTransformation, name: str) -> Any:
    inner = optimizer.info.hparams.get("optimizer")
    return _hyperparameter(inner, name) if isinstance(inner, GradientTransformation) else optimizer.info.hparams[name]


# --------------------------------------------------------------------------- groups


def param_groups(optimizer: GradientTransformation, groups: Sequence[Mapping[str, Any]], *,
                 complete: bool = False) -> GradientTransformation:
    """`optimizer` with per-group hyperparameters for the parameters each group selects by path
    (module docstring). `complete=True`: every parameter must be in a group (torch/DeepSpeed)."""
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(f"param_groups: optimizer must be a GradientTransformation, got {type(optimizer).__name__}")
    if optimizer.capabilities.communicates or optimizer.gradient_allreduce is not None:
        raise ValueError(f"param_groups: {optimizer.info.name if optimizer.info else repr(optimizer)} does its own "
                         "compressed communication of whole buffers and cannot be split into groups; "
                         "allowed: adam, adamw, sgd, lamb, from_torch(...)")
    names = hyperparameter_names(optimizer)
    if "lr" not in names:
        raise TypeError(f"param_groups: {optimizer!r} is not an optimizer with an lr built by fspeed.optim "
                        "(clip outside the groups: chain(clip_by_global_norm(1.0), param_groups(adamw(...), groups)))")
    if isinstance(groups, Mapping) or not isinstance(groups, Sequence):
        raise TypeError(f"param_groups: groups must be a list of dicts, got {type(groups).__name__}")
    parsed, settings = _parse_groups(optimizer, groups)
    transforms = [optimizer] + [_build(optimizer, s, g.name) for s, g in zip(settings[1:], _first_of(parsed, settings))]
    base_lr = _hyperparameter(optimizer, "lr")
    plans: dict = {}

    def setting_of(path: str) -> int:
        found = [g for g in parsed if g.match(path)]
        if len(found) > 1:
            raise ValueError(f"parameter {path!r} is in param groups {', '.join(g.name for g in found)}; "
                             "a parameter may be in one group only")
        if not found and complete:
            raise ValueError(f"parameter {path!r} is in no param group; with complete=True (torch's and "
                             "DeepSpeed's rule) every parameter must be in exactly one group")
        return found[0].setting if found else 0

    def plan_for(tree: PyTree) -> _Plan:
        """How `tree` splits into runs; cached per layout (params and grads share one)."""
        flats = flat_list(tree)
        if flats is not None:
            key = tuple(f.layout for f in flats)
            parts, treedef = [(f.layout.paths, f.layout.shapes) for f in flats], None
        else:
            paths, leaves, treedef = tree_flatten_with_paths(tree)
            if not all(isinstance(x, torch.Tensor) for x in leaves):
                raise TypeError("param_groups: params must be a Flat, a list of Flats or a pytree of tensors")
            key, parts = (treedef, tuple(paths)), [(paths, [tuple(x.shape) for x in leaves])]
        if key not in plans:
            if len(plans) > 8:  # a few layouts per optimizer at most; bounded, not a leak
                plans.clear()
            plans[key] = _plan(parts, setting_of, isinstance(tree, Flat), treedef)
        return plans[key]

    def init(params):
        plan, parts = plan_for(params), _parts(params)
        inner = tuple(transforms[k].init(_gather(parts, runs)) for k, runs in plan.groups)
        return ParamGroupsState(0, resolve(base_lr, 0), inner)

    def update(grads, state: ParamGroupsState, params=None):
        plan = plan_for(grads)
        _check_state(state, plan)
        g = _parts(grads)
        p = _parts(params, g) if params is not None else None
        outs, inner = [], []
        for (k, runs), s in zip(plan.groups, state.groups):
            u, s = transforms[k].update(_gather(g, runs), s, _gather(p, runs) if p is not None else None)
            outs.append((runs, u))
            inner.append(s)
        return _assemble(g, outs, plan), _next(state, inner)

    def apply(grads, state: ParamGroupsState, params, *, cast_to=None, grad_sq=None):
        plan = plan_for(params)
        _check_state(state, plan)
        p = _parts(params)
        g = _parts(grads, p)
        c = _parts(cast_to, p) if cast_to is not None else None
        inner = []
        for (k, runs), s in zip(plan.groups, state.groups):
            _, s = optimizer_step(transforms[k], _gather(g, runs), s, _gather(p, runs),
                                  cast_to=_gather(c, runs) if c is not None else None, grad_sq=grad_sq)
            inner.append(s)
        if c is not None:
            _copy_padding(c, p, plan.padding)
        return params, _next(state, inner)

    def _next(state: ParamGroupsState, inner: list) -> ParamGroupsState:
        return ParamGroupsState(state.count + 1, resolve(base_lr, state.count + 1), tuple(inner))

    caps = [t.capabilities for t in transforms]
    capabilities = Capabilities(elementwise=all(c.elementwise for c in caps),
                                whole_tensors=any(c.whole_tensors for c in caps), cpu=all(c.cpu for c in caps),
                                loose_grads=all(c.loose_grads for c in caps),
                                sums_grad_squares=all(c.sums_grad_squares for c in caps))
    info = TransformInfo("param_groups", dict(optimizer=optimizer, groups=tuple(dict(g) for g in groups),
                                              complete=complete),
                         factory=lambda optimizer, groups, complete: param_groups(optimizer, groups, complete=complete))
    return GradientTransformation(init, update, apply, info, capabilities=capabilities)


def check_param_groups(optimizer: GradientTransformation, paths: Sequence[str]) -> None:
    """Raise unless every param group inside `optimizer` (chains and wrappers searched) selects at
    least one of `paths` (all parameter paths), no path is in two groups, and with complete=True
    every path is in one. Nothing to check for an optimizer without groups."""
    for part in _walk(optimizer):
        if part.info is None or part.info.name != "param_groups":
            continue
        parsed, _ = _parse_groups(part.info.hparams["optimizer"], part.info.hparams["groups"])
        real = [p for p in paths if not is_padding(p)]
        for g in parsed:
            if not any(g.match(p) for p in real):
                raise ValueError(f"param group {g.name} selects no parameter; parameters are e.g. {real[:5]}")
        hits = {p: [g.name for g in parsed if g.match(p)] for p in real}
        for path, names in hits.items():
            if len(names) > 1:
                raise ValueError(f"parameter {path!r} is in param groups {', '.join(names)}; a parameter may be "
                                 "in one group only")
            if not names and part.info.hparams["complete"]:
                raise ValueError(f"parameter {path!r} is in no param group; with complete=True every parameter "
                                 "must be in exactly one group")


def _walk(optimizer: GradientTransformation):
    yield optimizer
    for child in optimizer.children:
        yield from _walk(child)
    inner = optimizer.info.hparams.get("optimizer") if optimizer.info is not None else None
    if isinstance(inner, GradientTransformation):
        yield from _walk(inner)


def _parse_groups(optimizer: GradientTransformation, groups: Sequence[Mapping[str, Any]]
                  ) -> tuple[list[_Group], list[dict]]:
    """The groups as (name, matcher, setting index) and the distinct settings (0: no override)."""
    names = hyperparameter_names(optimizer)
    settings: list[dict] = [{}]
    parsed = []
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping):
            raise TypeError(f"param group {i} is {type(group).__name__}; a group is a dict with 'params'")
        name = group.get("name", str(i))
        if not isinstance(name, str):
            raise TypeError(f"param group {i}: name must be a string, got {name!r}")
        if "params" not in group:
            raise ValueError(f"param group {name} has no 'params' (a path, a glob pattern, a list of those, "
                             "or a predicate over paths)")
        overrides = _overrides(optimizer, name, {k: v for k, v in group.items() if k not in ("params", "name")}, names)
        if overrides not in settings:
            settings.append(overrides)
        parsed.append(_Group(name, _selector(group["params"], name), settings.index(overrides)))
    return parsed, settings


def _overrides(optimizer: GradientTransformation, name: str, given: dict, names: tuple[str, ...]) -> dict:
    """A group's hyperparameter overrides in the optimizer's own names (betas, lr_scale resolved)."""
    out = dict(given)
    if "betas" in out and "betas" not in names and {"b1", "b2"} <= set(names):
        betas = out.pop("betas")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"param group {name}: betas={betas!r} must be a pair (beta1, beta2)")
        out.update(b1=betas[0], b2=betas[1])
    if "lr_scale" in out:
        scale = out.pop("lr_scale")
        if "lr" in out:
            raise ValueError(f"param group {name} sets both lr and lr_scale; set one")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
            raise ValueError(f"param group {name}: lr_scale={scale!r} must be a finite number >= 0")
        out["lr"] = _scaled(_hyperparameter(optimizer, "lr"), float(scale))
    unknown = sorted(set(out) - set(names))
    if unknown:
        raise ValueError(f"param group {name}: {', '.join(map(repr, unknown))} is not a setting of "
                         f"{optimizer.info.name}; allowed: params, name, lr_scale, {', '.join(names)}"
                         + (", betas" if {"b1", "b2"} <= set(names) else ""))
    return out


def _scaled(lr: Any, scale: float) -> Any:
    if not callable(lr):
        return lr * scale

    def scaled_lr(count: int) -> float:
        return scale * lr(count)

    return scaled_lr


def _build(optimizer: GradientTransformation, overrides: dict, group: str) -> GradientTransformation:
    try:
        return with_hparams(optimizer, **overrides)
    except (TypeError, ValueError) as e:
        raise type(e)(f"param group {group}: {e}") from e


def _first_of(parsed: list[_Group], settings: list[dict]) -> list[_Group]:
    """For each setting after the first, the first group that uses it (for error messages)."""
    return [next(g for g in parsed if g.setting == i) for i in range(1, len(settings))]


def _selector(spec: PathSelector, group: str) -> Callable[[str], bool]:
    """A predicate over paths from a path, a glob pattern, a list of those, or a predicate."""
    if callable(spec):
        def predicate(path: str) -> bool:
            result = spec(path)
            if not isinstance(result, bool):
                raise TypeError(f"param group {group}: its params predicate returned {result!r} for {path!r}; "
                                "it must return a bool")
            return result
        return predicate
    patterns = [spec] if isinstance(spec, str) else spec
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"param group {group}: params must be a path, a glob pattern, a list of those, or a "
                        f"predicate over paths; got {spec!r} (fspeed.initialize turns torch tensors into paths)")
    exact = {p for p in patterns if not _GLOB & set(p)}
    globs = [p for p in patterns if _GLOB & set(p)]
    return lambda path: path in exact or any(fnmatch.fnmatchcase(path, g) for g in globs)


# --------------------------------------------------------------------------- runs over segments


def _plan(parts: Sequence[tuple[Sequence[str], Sequence[tuple[int, ...]]]], setting_of: Callable[[str], int],
          single: bool, treedef: Any) -> _Plan:
    """Per part (a Flat's paths and shapes, or a tree's), maximal runs of consecutive segments with
    the same setting, grouped by setting; padding pieces (setting -1) belong to no run."""
    every = []
    for part, (paths, shapes) in enumerate(parts):
        spans: list[list[int]] = []  # [setting, first, stop]
        for i, path in enumerate(paths):
            setting = -1 if is_padding(path) else setting_of(path)
            if spans and spans[-1][0] == setting and spans[-1][2] == i:
                spans[-1][2] = i + 1
            else:
                spans.append([setting, i, i + 1])
        offsets = [0]
        for shape in shapes:
            offsets.append(offsets[-1] + math.prod(shape))
        every += [_Run(k, part, a, b, offsets[a], offsets[b],
                       _run_layout(paths[a:b], shapes[a:b]) if treedef is None and k >= 0 else None)
                  for k, a, b in spans]
    by_setting: dict[int, list[_Run]] = {}
    for run in every:
        if run.setting >= 0:
            by_setting.setdefault(run.setting, []).append(run)
    return _Plan(tuple((k, tuple(runs)) for k, runs in by_setting.items()),
                 tuple(r for r in every if r.setting < 0), single, treedef)


def _run_layout(paths: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> FlatLayout:
    """The layout of a run's segments (a list tree of them)."""
    return FlatLayout(tree_flatten(list(range(len(paths))))[1], tuple(paths), tuple(shapes))


def _parts(tree: PyTree, like: Optional[list] = None) -> list:
    """The Flats of `tree` (checked against `like`'s layouts), its LooseGrads (one or a list, of
    `like`'s layouts), or [its list of leaves]."""
    if is_loose(tree):  # one, or a list of them (an outer param_groups' runs)
        loose = [tree] if isinstance(tree, LooseGrads) else list(tree)
        if like is None or [x.layout for x in loose] != [getattr(f, "layout", None) for f in like]:
            raise ValueError("param_groups: loose gradients must have the layouts of the Flats of params")
        return loose
    flats = flat_list(tree)
    if flats is None:
        return [tree_flatten_with_paths(tree)[1]]
    if like is not None and [f.layout for f in flats] != [f.layout for f in like]:
        raise ValueError("param_groups: grads, params and cast_to must share one flat layout")
    return flats


def _gather(parts: list, runs: Sequence[_Run]) -> list:
    """The views of `runs`: one Flat (or LooseGrads) per run in Flats, the runs' leaves of a plain tree."""
    if isinstance(parts[0], LooseGrads):
        return [LooseGrads(parts[r.part].tensors[r.first:r.stop], r.layout) for r in runs]
    if isinstance(parts[0], Flat):
        return [Flat(parts[r.part].buffer[r.start:r.end], r.layout) for r in runs]
    return [leaf for r in runs for leaf in parts[0][r.first:r.stop]]


def _copy_padding(cast_to: list, params: list, padding: Sequence[_Run]) -> None:
    """Cast what no run updates (padding pieces, a buffer's tail) too: `cast_to` stays the image of params."""
    if isinstance(params[0], Flat):
        for span in padding:
            cast_to[span.part].buffer[span.start:span.end].copy_(params[span.part].buffer[span.start:span.end])
        for c, p in zip(cast_to, params):
            n, end = p.layout.numel, min(p.buffer.numel(), c.buffer.numel())
            c.buffer[n:end].copy_(p.buffer[n:end])
        return
    for span in padding:
        for i in range(span.first, span.stop):
            cast_to[0][i].copy_(params[0][i])


def _assemble(g: list, outs: Sequence[tuple[Sequence[_Run], list]], plan: _Plan) -> PyTree:
    """Each setting's updates (over the list of its runs) put in place; zeros where no run is."""
    dtype = next((tree_leaves(u)[0].dtype for _, u in outs if tree_leaves(u)), None)
    if isinstance(g[0], Flat):
        result = [f.with_buffer(torch.zeros_like(f.buffer, dtype=dtype)) for f in g]
        for runs, u in outs:
            for run, piece in zip(runs, u):
                result[run.part].buffer[run.start:run.end].copy_(piece.buffer)
        return result[0] if plan.single else result
    leaves = [torch.zeros_like(x, dtype=dtype) for x in g[0]]
    for runs, u in outs:
        for i, leaf in zip((i for r in runs for i in range(r.first, r.stop)), u):
            leaves[i] = leaf
    return tree_unflatten(plan.treedef, leaves)


def _check_state(state: Any, plan: _Plan) -> None:
    """The state must come from this optimizer's init for params of this layout: one inner state
    per setting, whose flat buffers have its runs' layouts, in order (a nested param_groups' state
    checks its own)."""
    own = lambda x: isinstance(x, (Flat, ParamGroupsState))  # noqa: E731
    matches = isinstance(state, ParamGroupsState) and len(state.groups) == len(plan.groups) and all(
        leaf.layout == runs[i % len(runs)].layout
        for (_, runs), s in zip(plan.groups, state.groups) if plan.treedef is None
        for i, leaf in enumerate(x for x in tree_leaves(s, is_leaf=own) if isinstance(x, Flat)))
    if not matches:
        got = f"{len(state.groups)} settings" if isinstance(state, ParamGroupsState) else type(state).__name__
        raise ValueError(f"param_groups: the state ({got}) was not made by this optimizer's init for params of this "
                         f"layout ({len(plan.groups)} settings); pass the state its init/update returned")


__all__ = ["PAD_SUFFIX", "ParamGroupsState", "PathSelector", "check_param_groups", "hyperparameter_names",
           "is_padding", "param_groups", "with_hparams"]
