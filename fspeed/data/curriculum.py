"""Curriculum learning by sequence length: DeepSpeed's legacy `curriculum_learning` pacing, exactly.

    schedule = CurriculumSchedule(min_difficulty=64, max_difficulty=1024, schedule_type="fixed_linear",
                                  total_curriculum_step=2000, difficulty_step=8)
    seqlen = difficulty_at(schedule, state.step)        # what DeepSpeed's engine would pass at this step
    batch = truncate_to_seqlen(batch, seqlen)           # the model sees the first `seqlen` positions

DeepSpeed's pacing functions (`CurriculumScheduler.get_difficulty(global_steps)`):

    fixed_root:     d = floor((t / total_curriculum_step) ** (1 / root_degree) * (max - min) + min)
                    d -= d % difficulty_step;  d = min(d, max)
    fixed_linear:   fixed_root with root_degree = 1
    fixed_discrete: difficulty[i] for the first i with t <= max_step[i]; difficulty[-1] past max_step[-1]

Its engine calls `update_difficulty(global_steps + 1)` in every training forward, where
`global_steps` counts the optimizer steps taken, and the update only happens while the current
difficulty is below the maximum (it starts at `min_difficulty`). `difficulty_at` replays that, so
the difficulty of step ``t`` is a pure function of ``t`` and resume is exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from optree import tree_map

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete")


@dataclass(frozen=True)
class CurriculumSchedule:
    """DeepSpeed's `curriculum_learning` (curriculum_type seqlen) and its `schedule_config`."""

    min_difficulty: int
    max_difficulty: int
    schedule_type: str = "fixed_linear"
    total_curriculum_step: Optional[int] = None  # fixed_linear, fixed_root
    difficulty_step: Optional[int] = None  # fixed_linear, fixed_root
    root_degree: Optional[int] = None  # fixed_root
    difficulty: Optional[Sequence[int]] = None  # fixed_discrete
    max_step: Optional[Sequence[int]] = None  # fixed_discrete: one fewer than difficulty

    def __post_init__(self) -> None:
        problems = schedule_problems(self)
        if problems:
            raise ValueError("CurriculumSchedule: " + "; ".join(f"{key} {reason}" for key, reason in problems))
        for key in ("difficulty", "max_step"):
            if getattr(self, key) is not None:
                object.__setattr__(self, key, tuple(getattr(self, key)))

    def get_difficulty(self, global_steps: int) -> int:
        """DeepSpeed's `get_difficulty(global_steps)` (module docstring)."""
        if self.schedule_type == "fixed_discrete":
            if global_steps > self.max_step[-1]:
                return self.difficulty[-1]
            return next(d for d, limit in zip(self.difficulty, self.max_step) if global_steps <= limit)
        root = 1 if self.schedule_type == "fixed_linear" else self.root_degree
        value = (float(global_steps) / self.total_curriculum_step) ** (1.0 / root)
        value = math.floor(value * (self.max_difficulty - self.min_difficulty) + self.min_difficulty)
        value -= value % self.difficulty_step
        return min(value, self.max_difficulty)

    @property
    def lowest(self) -> int:
        """The smallest difficulty the schedule can give (rounding down to difficulty_step may go below min)."""
        if self.schedule_type == "fixed_discrete":
            return min(self.min_difficulty, *self.difficulty)
        return min(self.min_difficulty, self.get_difficulty(0))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def schedule_problems(s: Any) -> list[tuple[str, str]]:
    """(key, what is wrong) for each invalid setting of ``s`` (a `CurriculumSchedule`'s fields, as
    attributes): DeepSpeed's asserts, and what makes no sense."""
    out: list[tuple[str, str]] = []
    for key in ("min_difficulty", "max_difficulty"):
        if not _positive_int(getattr(s, key)):
            out.append((key, f"must be a positive integer, got {getattr(s, key)!r}"))
    if s.schedule_type not in SCHEDULE_TYPES:
        out.append(("schedule_type", f"is {s.schedule_type!r}; allowed: {', '.join(SCHEDULE_TYPES)} (DeepSpeed's "
                                     "'custom' needs a Python callback, fspeed.data.CurriculumSchedule subclasses)"))
        return out
    if s.schedule_type == "fixed_discrete":
        if not s.difficulty or not s.max_step:
            out.append(("difficulty", "and max_step are required by fixed_discrete"))
        elif len(s.difficulty) != len(s.max_step) + 1:
            out.append(("difficulty", f"must hold one more value than max_step (the last one holds for the rest): "
                                      f"got {len(s.difficulty)} and {len(s.max_step)}"))
        elif not all(_positive_int(d) for d in s.difficulty) or not all(
                isinstance(m, int) and not isinstance(m, bool) and m >= 0 for m in s.max_step):
            out.append(("difficulty", "values must be positive integers and max_step values non-negative integers"))
        return out
    for key in ("total_curriculum_step", "difficulty_step") + (("root_degree",) if s.schedule_type == "fixed_root"
                                                               else ()):
        if not _positive_int(getattr(s, key)):
            out.append((key, f"must be a positive integer with {s.schedule_type}, got {getattr(s, key)!r}"))
    return out


def difficulty_at(schedule: CurriculumSchedule, step: int) -> int:
    """The difficulty DeepSpeed's engine uses in the forward of optimizer step ``step`` (0-based):
    `update_difficulty(global_steps + 1)` applied at every step so far, which stops updating once
    the difficulty reaches the maximum."""
    if schedule.min_difficulty >= schedule.max_difficulty:
        return schedule.min_difficulty  # never updated
    if schedule.schedule_type != "fixed_discrete":
        return schedule.get_difficulty(step + 1)  # non-decreasing, capped at max: the replay is the last value
    # fixed_discrete may go down again after reaching the max, and then the first value >= max stays.
    # Its value changes only where global_steps passes a max_step, so those points are all to look at.
    changes = sorted({1, *(m + 1 for m in schedule.max_step if m + 1 <= step + 1)})
    for global_steps in changes:
        value = schedule.get_difficulty(global_steps)
        if value >= schedule.max_difficulty:
            return value
    return schedule.get_difficulty(step + 1)


def truncate_to_seqlen(batch: Any, seqlen: int, full_length: Optional[int] = None) -> Any:
    """``batch`` with every tensor dimension after the first that is ``full_length`` long (the
    batch's sequence length: dim 1 of its first tensor of two or more dims, by default) cut to
    ``seqlen``: tokens and targets ``[B, S]``, masks ``[B, S]`` or ``[B, 1, S, S]`` alike. Views, no
    copies. What DeepSpeed leaves to the model (`curriculum_seqlen`), fspeed does to the batch."""
    if not _positive_int(seqlen):
        raise ValueError(f"seqlen must be a positive integer, got {seqlen!r}")
    if full_length is None:
        full_length = _sequence_length(batch)
    if seqlen >= full_length:
        return batch

    def cut(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() < 2:
            return leaf
        index = tuple(slice(None, seqlen) if d > 0 and n == full_length else slice(None)
                      for d, n in enumerate(leaf.shape))
        return leaf[index]

    return tree_map(cut, batch, none_is_leaf=True)


def _sequence_length(batch: Any) -> int:
    from optree import tree_leaves  # noqa: PLC0415

    for leaf in tree_leaves(batch, none_is_leaf=True):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2:
            return leaf.shape[1]
    raise ValueError("curriculum by sequence length needs a batch with a [batch, sequence, ...] tensor; this one has "
                     "none")


__all__ = ["SCHEDULE_TYPES", "CurriculumSchedule", "difficulty_at", "schedule_problems", "truncate_to_seqlen"]
