"""A torch LR scheduler object as fspeed schedules: one function of the step per parameter group.

    scheduler = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda s: min(1.0, (s + 1) / 100))
    lr_of_group = from_torch_scheduler(scheduler)        # [schedule of group 0, schedule of group 1, ...]
    opt = fs.optim.adamw(lr_of_group[0])

fspeed's optimizers take the lr as a function of the number of applied updates (`schedules`);
a torch scheduler writes each group's lr into its optimizer, and is stepped once after each
applied update (as DeepSpeed's engine does). Update `count` therefore runs at the lr the
scheduler holds after `count` more `step()` calls from where it was handed over: the lr in
its optimizer's groups now is update 0's.

The schedules replay a private copy of the scheduler and of its optimizer (without the
optimizer's parameters and state: nothing of the model is copied), stepped forward as far as a
schedule is asked and remembered, so any step can be asked again. The scheduler passed in is
never stepped. Refused, with the reason: `ReduceLROnPlateau` (it steps on a validation metric,
not on the update count), and schedulers that cycle momentum (OneCycleLR or CyclicLR with
`cycle_momentum=True`: fspeed would keep the optimizer's momentum fixed).
"""

from __future__ import annotations

import collections
import copy
import warnings
from typing import Any

from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from .schedules import Schedule


def from_torch_scheduler(scheduler: Any) -> list[Schedule]:
    """One schedule per parameter group of `scheduler`'s optimizer (module docstring)."""
    if isinstance(scheduler, ReduceLROnPlateau):
        raise ValueError("from_torch_scheduler: ReduceLROnPlateau steps on a validation metric, not on the update "
                         "count; pass a scheduler of the step (LambdaLR, LinearLR, CosineAnnealingLR, SequentialLR, "
                         "...) or an fspeed schedule (fs.optim.warmup_cosine(...))")
    if not isinstance(scheduler, LRScheduler):
        raise TypeError(f"from_torch_scheduler takes a torch.optim.lr_scheduler.LRScheduler, got "
                        f"{type(scheduler).__name__}")
    for part in _parts(scheduler):
        if getattr(part, "cycle_momentum", False):
            raise ValueError(f"from_torch_scheduler: {type(part).__name__} cycles the optimizer's momentum, which "
                             "fspeed keeps at the optimizer's value; build it with cycle_momentum=False")
    replay = _Replay(_detached_copy(scheduler))
    return [TorchSchedule(replay, group) for group in range(replay.groups)]


def _parts(scheduler: LRScheduler) -> list[LRScheduler]:
    """The scheduler and those it composes (SequentialLR, ChainedScheduler), recursively."""
    out = [scheduler]
    for inner in getattr(scheduler, "_schedulers", ()):
        out += _parts(inner)
    return out


def _detached_copy(scheduler: LRScheduler) -> LRScheduler:
    """A deep copy of `scheduler` and its optimizer, made while the optimizer's groups hold no
    parameters and it has no state (composed schedulers keep sharing the one copied optimizer)."""
    optimizer = scheduler.optimizer
    held, state = [group["params"] for group in optimizer.param_groups], optimizer.state
    try:
        for group in optimizer.param_groups:
            group["params"] = []
        optimizer.state = collections.defaultdict(dict)
        return copy.deepcopy(scheduler)
    finally:
        for group, params in zip(optimizer.param_groups, held):
            group["params"] = params
        optimizer.state = state


class TorchSchedule:
    """The lr of one parameter group of a torch scheduler, as a function of the update count."""

    def __init__(self, replay: "_Replay", group: int):
        self.replay, self.group = replay, group
        self.__qualname__ = f"{type(replay.scheduler).__name__}[group {group}]"  # how TransformInfo shows it

    def __call__(self, count: int) -> float:
        return self.replay.lr(self.group, count)

    def __repr__(self) -> str:
        return self.__qualname__


class _Replay:
    """The copied scheduler, stepped forward on demand; `lrs[k]` holds each group's lr after k steps."""

    def __init__(self, scheduler: LRScheduler):
        self.scheduler = scheduler
        self.groups = len(scheduler.optimizer.param_groups)
        self.fixed = self._others()
        self.lrs = [self._current()]

    def _current(self) -> list[float]:
        return [float(group["lr"]) for group in self.scheduler.optimizer.param_groups]

    def _others(self) -> list[dict]:
        return [{k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
                for group in self.scheduler.optimizer.param_groups]

    def lr(self, group: int, count: int) -> float:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise TypeError(f"a schedule takes the number of applied updates (an int >= 0), got {count!r}")
        while len(self.lrs) <= count:
            with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": the copy never steps one
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
            if self._others() != self.fixed:
                raise ValueError(f"{type(self.scheduler).__name__} changed more than the lr of its optimizer's groups "
                                 f"at step {len(self.lrs)} (momentum or betas); fspeed takes only the lr from a "
                                 "torch scheduler")
            self.lrs.append(self._current())
        return self.lrs[count][group]


__all__ = ["TorchSchedule", "from_torch_scheduler"]
