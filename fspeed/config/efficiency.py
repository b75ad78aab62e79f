"""Config sections of DeepSpeed's training-efficiency features: `curriculum` (legacy
`curriculum_learning`, by sequence length) and `progressive_layer_drop`."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal, Optional

from ..data.curriculum import CurriculumSchedule, schedule_problems
from .errors import Problem
from .fields import NON_NEGATIVE, POSITIVE, ValidatedConfig, at_most, each, setting

_TO_DEEPSPEED = {"schedule": "schedule_type", "total_steps": "total_curriculum_step"}


@dataclass(frozen=True, kw_only=True)
class CurriculumSection(ValidatedConfig):
    """DeepSpeed's `curriculum_learning` (curriculum_type seqlen): each step's batch is cut to the
    schedule's sequence length (`fspeed.data.curriculum`). total_steps is total_curriculum_step.
    curriculum_type vocab_rarity is the data-efficiency curriculum instead (`fspeed.data.difficulty`):
    batches drawn from the samples the schedule admits by their cached vocabulary-rarity index."""

    enabled: bool = False
    curriculum_type: Literal["seqlen", "vocab_rarity"] = "seqlen"
    difficulty_type: Literal["value", "percentile"] = "value"  # vocab_rarity: admit by value or easiest percent
    index_dir: Optional[str] = None  # vocab_rarity: where the metric index is cached (None: next to the data)
    min_difficulty: int = setting(8, POSITIVE)
    max_difficulty: int = setting(256, POSITIVE)
    schedule: Literal["fixed_linear", "fixed_root", "fixed_discrete"] = "fixed_linear"
    total_steps: Optional[int] = setting(None, POSITIVE)  # fixed_linear, fixed_root
    difficulty_step: Optional[int] = setting(None, POSITIVE)  # fixed_linear, fixed_root
    root_degree: Optional[int] = setting(None, POSITIVE)  # fixed_root
    difficulty: Optional[tuple[int, ...]] = setting(None, each(POSITIVE))  # fixed_discrete
    max_step: Optional[tuple[int, ...]] = setting(None, each(NON_NEGATIVE))  # fixed_discrete

    def relation_problems(self) -> list[Problem]:
        if not self.enabled:
            return []
        if self.curriculum_type == "seqlen" and self.difficulty_type != "value":
            return [Problem("difficulty_type", "applies to curriculum_type=vocab_rarity; seqlen difficulties are "
                            "lengths", self.difficulty_type, "value")]
        if self.difficulty_type == "percentile" and self.max_difficulty > 100:
            return [Problem("max_difficulty", "is a percent with difficulty_type=percentile", self.max_difficulty,
                            "<= 100")]
        reverse = {v: k for k, v in _TO_DEEPSPEED.items()}
        return [Problem(reverse.get(key, key), reason, getattr(self, reverse.get(key, key), None))
                for key, reason in schedule_problems(SimpleNamespace(**self._schedule_fields()))]

    def _schedule_fields(self) -> dict:
        return {"min_difficulty": self.min_difficulty, "max_difficulty": self.max_difficulty,
                "schedule_type": self.schedule, "total_curriculum_step": self.total_steps,
                "difficulty_step": self.difficulty_step, "root_degree": self.root_degree,
                "difficulty": self.difficulty, "max_step": self.max_step}

    def to_schedule(self) -> Optional[CurriculumSchedule]:
        """The library schedule, or None when disabled."""
        return CurriculumSchedule(**self._schedule_fields()) if self.enabled else None


@dataclass(frozen=True, kw_only=True)
class ProgressiveLayerDropSection(ValidatedConfig):
    """DeepSpeed's `progressive_layer_drop`: keep ratio theta(t) = (1 - theta) exp(-gamma t) + theta,
    deeper blocks dropped more (`fspeed.models.layer_drop`)."""

    enabled: bool = False
    theta: float = setting(1.0, POSITIVE, at_most(1.0))  # DeepSpeed's code default; 0.5 is its recommendation
    gamma: float = setting(0.001, NON_NEGATIVE)
