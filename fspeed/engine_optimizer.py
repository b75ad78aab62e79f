"""The optimizer `fs.initialize` trains with, assembled by DeepSpeed's rules.

What a caller may pass:

- `optimizer`: None (the config's `optimizer` block), an fspeed GradientTransformation
  (`fs.optim.adamw(...)`, `fs.optim.from_torch(torch.optim.AdamW, ...)`), a torch optimizer
  instance (`torch.optim.AdamW(model.parameters(), lr=..., weight_decay=...)`, as DeepSpeed takes
  it: its class and hyperparameters run through `fs.optim.from_torch`, its param_groups become
  parameter groups by the module's parameter names), or a callable `optimizer(params)` returning
  such an instance (it gets `model_parameters`, or the module's parameters).
- `lr_scheduler`: None (the config's `scheduler` block), a torch LR scheduler over the torch
  optimizer passed, a callable `lr_scheduler(optimizer)` returning one (DeepSpeed's form: it gets
  the torch optimizer passed, or a stand-in torch optimizer with the groups' lrs), or an fspeed
  schedule (a function of the update count: `fs.optim.warmup(...)`). A client scheduler replaces
  the config's, as in DeepSpeed.

Then, whatever the optimizer:

- `gradient_clipping > 0` clips the global gradient norm (a client optimizer that already leads
  with `clip_by_global_norm` must clip at the same norm, or the config must say 0);
- the config's scheduler sets a client optimizer's lr too, with DeepSpeed's group rules: WarmupLR,
  WarmupDecayLR, OneCycle and LRRangeTest set every group's lr (a group's own lr is not used),
  WarmupCosineLR scales each group's own lr, and warmup_max_lr null warms up to the client's lr.
  OneCycle's momentum cycling is refused for a client optimizer (its betas are the client's).

fspeed's lr schedules are functions of the update count inside the optimizer: a schedule is put
onto an optimizer by rebuilding it with that lr (`fs.optim.with_hparams(opt, lr=schedule)`), and
onto a parameter group as the group's lr, so the fused update paths stay as they are.
"""

from __future__ import annotations

import inspect
import logging
import math
from numbers import Real
from typing import Any, Optional

import torch
from torch import nn

from .optim import (GradientTransformation, Schedule, chain, clip_by_global_norm, from_torch, from_torch_scheduler,
                    param_groups, with_hparams)

log = logging.getLogger("fspeed")

LR_SCHEDULER_FORMS = ("a torch LR scheduler over the torch optimizer passed as optimizer=, a callable "
                      "lr_scheduler(optimizer) returning one (DeepSpeed's form), or a function of the update count "
                      "returning the lr (an fspeed schedule such as fs.optim.warmup(...))")


def engine_optimizer(optimizer: Any, lr_scheduler: Any, module: Optional[nn.Module], model_parameters: Any,
                     run) -> tuple[GradientTransformation, Optional[Schedule]]:
    """(the optimizer `initialize` trains with, the lr schedule of its first group or None when the
    client's optimizer keeps its own lr); see the module docstring. `run`: the composed config
    (its scheduler is "constant" when a client `lr_scheduler` replaces the config's)."""
    from .config.build import build_lr_schedule, build_optimizer  # noqa: PLC0415

    torch_optimizer, from_config = None, optimizer is None
    if from_config:
        clip, core = split_clip(build_optimizer(run))
        base_lr: Optional[float] = run.optimizer.lr
        groups = deepspeed_groups(module, model_parameters)
    elif isinstance(optimizer, GradientTransformation):
        clip, core = split_clip(optimizer)
        base_lr = _lr_of(core)
        groups = deepspeed_groups(module, model_parameters)
    else:
        torch_optimizer = _torch_instance(optimizer, module, model_parameters)
        transform, groups = from_torch_optimizer(torch_optimizer, _names(module, "a torch optimizer instance"))
        clip, core = None, transform
        base_lr = float(torch_optimizer.defaults["lr"])
    sched = run.scheduler
    schedule: Optional[Schedule] = None
    if lr_scheduler is not None:
        if base_lr is None:
            raise ValueError(f"initialize: lr_scheduler= sets the optimizer's lr, and {core!r} already has an lr "
                             "schedule of its own; pass one of them")
        schedules = client_schedules(lr_scheduler, torch_optimizer or _stand_in(groups, base_lr))
        core, groups = _put_schedules(core, groups, schedules)
        schedule = schedules[0]
    elif from_config:
        schedule = build_lr_schedule(run)
    elif sched.name != "constant":
        if base_lr is None:
            raise ValueError(f"initialize: the config's scheduler ({sched.name}) sets the optimizer's lr, and {core!r} "
                             "already has an lr schedule of its own; remove the scheduler block or give the "
                             "optimizer a number")
        if sched.name == "one_cycle" and sched.cycle_momentum:
            raise ValueError("initialize: scheduler OneCycle with cycle_momentum cycles the betas of the config's "
                             "optimizer; a client optimizer keeps its own: set cycle_momentum false in the scheduler "
                             "params, or leave the optimizer to the config")
        _refuse_own_group_lrs(core, sched.name)
        schedule = build_lr_schedule(run, lr=base_lr)
        core = _rebind(core, schedule, f"the config's scheduler ({sched.name})")
    if groups is not None and lr_scheduler is None:
        groups = scheduled_groups(groups, sched.name, base_lr)
    if groups is not None:
        core = param_groups(core, groups, complete=True)
    return _clipped(core, clip, run.train.gradient_clipping), schedule


def split_clip(optimizer: GradientTransformation) -> tuple[Optional[float], GradientTransformation]:
    """(the norm a leading `clip_by_global_norm` clips at or None, the rest of the optimizer)."""
    children = optimizer.children
    if children and children[0].capabilities.clip_norm is not None:
        rest = children[1:]
        return children[0].capabilities.clip_norm, rest[0] if len(rest) == 1 else chain(*rest)
    return None, optimizer


def _clipped(core: GradientTransformation, client_clip: Optional[float], clipping: float) -> GradientTransformation:
    """`core` behind DeepSpeed's `gradient_clipping` (0: none), or the client's own leading clip."""
    if client_clip is not None:
        if clipping > 0 and not math.isclose(clipping, client_clip):
            raise ValueError(f"initialize: the optimizer clips the gradient norm at {client_clip:g} and the config's "
                             f"gradient_clipping is {clipping:g} (DeepSpeed's default 1.0 when unset); set "
                             f"gradient_clipping to {client_clip:g}, or to 0 to keep the optimizer's clip alone")
        clipping = client_clip
    return chain(clip_by_global_norm(clipping), core) if clipping > 0 else core


def _lr_of(optimizer: GradientTransformation) -> Optional[float]:
    """The optimizer's lr when it is a number (None: a schedule, or no lr fspeed can find)."""
    info = optimizer.info
    while info is not None and isinstance(info.hparams.get("optimizer"), GradientTransformation):
        info = info.hparams["optimizer"].info
    lr = info.hparams.get("lr") if info is not None else None
    return float(lr) if isinstance(lr, Real) else None


def _rebind(optimizer: GradientTransformation, schedule: Schedule, source: str) -> GradientTransformation:
    """`optimizer` rebuilt with `schedule` as its lr."""
    try:
        return with_hparams(optimizer, lr=schedule)
    except (TypeError, ValueError) as err:
        raise ValueError(f"initialize: {source} sets the optimizer's lr, and {optimizer!r} cannot be rebuilt with "
                         f"another lr ({err}); pass an optimizer from fspeed.optim (adam, adamw, sgd, lamb, "
                         "from_torch(...), param_groups of one) or a torch optimizer") from None


def _refuse_own_group_lrs(optimizer: GradientTransformation, scheduler: str) -> None:
    """A client `fs.optim.param_groups` group with its own lr would keep it under the config's scheduler."""
    info = optimizer.info
    while info is not None:
        if info.name == "param_groups":
            own = [str(g.get("name", i)) for i, g in enumerate(info.hparams["groups"]) if "lr" in g]
            if own:
                raise ValueError(f"initialize: the config's scheduler ({scheduler}) sets the lr, and the optimizer's "
                                 f"param group(s) {', '.join(own)} set their own lr, which would stay fixed; give "
                                 "them lr_scale (a multiple of the scheduled lr) instead")
        inner = info.hparams.get("optimizer")
        info = inner.info if isinstance(inner, GradientTransformation) else None


# --------------------------------------------------------------------------- parameter groups


def _names(module: Optional[nn.Module], what: str) -> dict[int, str]:
    """Each parameter's name by identity (a tied parameter under its first name)."""
    if module is None:
        raise ValueError(f"initialize: {what} names nn.Module parameters; an fspeed Model's optimizer takes "
                         "fs.optim.param_groups(...) by path")
    return {id(p): n for n, p in module.named_parameters()}


def _paths(tensors, names: dict[int, str], where: str) -> list[str]:
    paths = []
    for p in tensors:
        if id(p) not in names:
            raise ValueError(f"initialize: {where} holds a tensor of shape {list(p.shape)} that is not a parameter of "
                             "the model")
        paths.append(names[id(p)])
    return paths


def deepspeed_groups(module: Optional[nn.Module], model_parameters) -> Optional[list[dict]]:
    """DeepSpeed's `model_parameters` as fspeed parameter groups by path, with their settings as
    given (None: no model_parameters, or every parameter in one group without settings, DeepSpeed's
    common `model.parameters()`). Tied parameters go under their first name."""
    if model_parameters is None:
        return None
    names = _names(module, "model_parameters (parameter groups)")
    given = list(model_parameters)
    if not any(isinstance(g, dict) for g in given):
        if {id(p) for p in given} == set(names):
            return None
        given = [{"params": given}]
    groups = []
    for i, group in enumerate(given):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"initialize: model_parameters[{i}] must be a dict with 'params' (torch's groups), "
                             f"got {type(group).__name__}")
        settings = {k: v for k, v in group.items() if k != "params"}
        groups.append({"params": _paths(group["params"], names, f"model_parameters[{i}]"),
                       "name": str(group.get("name", i)), **settings})
    return groups


def scheduled_groups(groups: list[dict], scheduler: str, base_lr: Optional[float]) -> list[dict]:
    """`groups` with their "lr" as DeepSpeed's scheduler treats it: WarmupLR, WarmupDecayLR, OneCycle
    and LRRangeTest set every group's lr themselves (a group's own lr is not used); WarmupCosineLR
    scales each group's own lr (an `lr_scale` against the optimizer's lr `base_lr`); without a
    scheduler the group's lr is its lr."""
    out = []
    for group in groups:
        settings = dict(group)
        if "lr" in settings and scheduler != "constant":
            lr = settings.pop("lr")
            if scheduler == "warmup_cosine":
                settings["lr_scale"] = lr / base_lr
            else:
                log.info("initialize: parameter group %s's lr=%g is not used: DeepSpeed's %s scheduler sets every "
                         "group's lr", group["name"], lr, scheduler)
        out.append(settings)
    return out


# --------------------------------------------------------------------------- torch optimizer objects


def _torch_instance(optimizer: Any, module: Optional[nn.Module], model_parameters: Any) -> torch.optim.Optimizer:
    """The client's torch optimizer: the instance, or what the callable `optimizer(params)` builds."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if model_parameters is not None:
            _check_same_parameters(optimizer, module, model_parameters)
        return optimizer
    if not callable(optimizer):
        raise TypeError(f"initialize: optimizer= takes an fspeed GradientTransformation (fs.optim.adamw(...)), a "
                        f"torch optimizer instance, or a callable optimizer(params) returning one; got "
                        f"{type(optimizer).__name__}")
    params = model_parameters if model_parameters is not None else _module(module, "a callable optimizer").parameters()
    made = optimizer(params)
    if not isinstance(made, torch.optim.Optimizer):
        raise TypeError(f"initialize: the callable optimizer= returned {type(made).__name__}; it must return a torch "
                        "optimizer instance (DeepSpeed's form: optimizer(params) -> torch.optim.Optimizer)")
    return made


def _module(module: Optional[nn.Module], what: str) -> nn.Module:
    if module is None:
        raise ValueError(f"initialize: {what} takes nn.Module parameters; for an fspeed Model pass a "
                         "GradientTransformation (fs.optim.from_torch(torch.optim.AdamW, lr=...))")
    return module


def _check_same_parameters(optimizer: torch.optim.Optimizer, module: Optional[nn.Module], model_parameters) -> None:
    """model_parameters next to an optimizer instance (DeepSpeed does not use them then) must be its
    own parameters, ungrouped: anything else would be a choice that does not happen."""
    given = list(model_parameters)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if any(isinstance(g, dict) for g in given) or {id(p) for p in given} != held:
        raise ValueError("initialize: model_parameters and a torch optimizer instance: the instance's param_groups "
                         "are the groups (DeepSpeed does not use model_parameters then); leave model_parameters out")


def from_torch_optimizer(optimizer: torch.optim.Optimizer,
                         names: dict[int, str]) -> tuple[GradientTransformation, Optional[list[dict]]]:
    """A torch optimizer instance as (`fs.optim.from_torch` of its class and defaults, its
    param_groups by path with the settings each group changes; None when one group holds every
    parameter). `names`: parameter name by `id(parameter)`."""
    cls = type(optimizer)
    if optimizer.state:
        raise ValueError(f"initialize: the {cls.__name__} optimizer has already stepped (it holds state for "
                         f"{len(optimizer.state)} parameters); pass a fresh one: fspeed starts its state from zero")
    signature = inspect.signature(cls).parameters
    taken = {k: v for k, v in optimizer.defaults.items() if k in signature}
    implied = {k: v for k, v in optimizer.defaults.items() if k not in signature}  # e.g. AdamW's decoupled decay
    defaults = {k: v for k, v in taken.items()
                if k == "lr" or signature[k].default is inspect.Parameter.empty or not _same(v, signature[k].default)}
    transform = from_torch(cls, **defaults)
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        fixed = [k for k in implied if k in group and not _same(group[k], implied[k])]
        if fixed:
            raise ValueError(f"initialize: {cls.__name__} param group {i} sets {', '.join(fixed)}, which its "
                             "class fixes (not a constructor argument); fspeed runs the class as constructed")
        settings = {k: v for k, v in group.items() if k in taken and not _same(v, taken[k])}
        groups.append({"params": _paths(group["params"], names, f"{cls.__name__} param group {i}"),
                       "name": str(i), **settings})
    if len(groups) == 1 and len(groups[0]) == 2 and set(groups[0]["params"]) == set(names.values()):
        return transform, None
    return transform, groups


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors of several elements
        return a is b


def client_schedules(lr_scheduler: Any, torch_optimizer: Any) -> list[Schedule]:
    """The client's `lr_scheduler` as schedules, one per group of `torch_optimizer` (a function of
    the step: one for every group). `torch_optimizer`: the client's torch optimizer, or a stand-in
    (`_stand_in`) handed to a callable `lr_scheduler(optimizer)`."""
    if isinstance(lr_scheduler, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        if getattr(lr_scheduler, "optimizer", None) is not torch_optimizer:
            raise ValueError("initialize: lr_scheduler= schedules a torch optimizer that is not the optimizer= passed; "
                             "pass the scheduler of that optimizer, a callable lr_scheduler(optimizer) (DeepSpeed's "
                             "form) or an fspeed schedule (a function of the update count)")
        return _converted(lr_scheduler)
    if not callable(lr_scheduler):
        raise TypeError(f"initialize: lr_scheduler= takes {LR_SCHEDULER_FORMS}; got {type(lr_scheduler).__name__}")
    try:
        value = lr_scheduler(0)
    except (TypeError, AttributeError, ValueError) as err:
        as_step = f"called with the update count 0 it raised {type(err).__name__}: {err}"
    else:
        if isinstance(value, Real) or (isinstance(value, torch.Tensor) and value.dim() == 0):
            return [lr_scheduler]
        as_step = f"called with the update count 0 it returned {type(value).__name__}"
    try:
        made = lr_scheduler(torch_optimizer)
    except (TypeError, AttributeError, ValueError) as err:
        as_factory = f"called with a torch optimizer it raised {type(err).__name__}: {err}"
    else:
        if isinstance(made, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            return _converted(made)
        as_factory = f"called with a torch optimizer it returned {type(made).__name__}"
    raise TypeError(f"initialize: lr_scheduler= takes {LR_SCHEDULER_FORMS}; the callable given is neither ({as_step}; "
                    f"{as_factory})")


def _converted(scheduler: Any) -> list[Schedule]:
    try:
        return from_torch_scheduler(scheduler)
    except ValueError as err:
        raise ValueError(f"initialize: lr_scheduler={type(scheduler).__name__}: {err}") from None


def _stand_in(groups: Optional[list[dict]], base_lr: float) -> torch.optim.Optimizer:
    """A torch optimizer with one group per parameter group and its lr, for `lr_scheduler(optimizer)`."""
    lrs = [g.get("lr", base_lr) for g in groups] if groups else [base_lr]
    return torch.optim.SGD([{"params": [torch.zeros(1)], "lr": lr} for lr in lrs], lr=base_lr)


def _put_schedules(core: GradientTransformation, groups: Optional[list[dict]],
                   schedules: list[Schedule]) -> tuple[GradientTransformation, Optional[list[dict]]]:
    """The optimizer's lr becomes the first schedule; with several, group i's lr the i-th."""
    if len(schedules) == 1:
        own = [g["name"] for g in groups or () if "lr" in g]
        if own:
            raise ValueError(f"initialize: parameter group(s) {', '.join(own)} set their own lr, and lr_scheduler= "
                             "gives one lr for every group; leave the groups' lr out, give them lr_scale, or pass a "
                             "torch scheduler (one lr per group)")
        return _rebind(core, schedules[0], "lr_scheduler="), groups
    if groups is None or len(groups) != len(schedules):
        raise ValueError(f"initialize: lr_scheduler= schedules {len(schedules)} parameter groups and the optimizer "
                         f"has {len(groups or [None])}")
    return (_rebind(core, schedules[0], "lr_scheduler="),
            [{**g, "lr": s} for g, s in zip(groups, schedules)])


__all__ = ["client_schedules", "deepspeed_groups", "engine_optimizer", "from_torch_optimizer", "scheduled_groups",
           "split_clip"]
