"""DeepSpeed's training-efficiency blocks in the ds_config translator: `curriculum_learning`
(legacy, curriculum_type seqlen) -> the `curriculum` section, `progressive_layer_drop` -> the
`progressive_layer_drop` section. A disabled block has no effect, as in DeepSpeed; an enabled
`data_efficiency` block is an error naming fspeed's own data-efficiency curriculum."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .deepspeed_keys import ENABLED_BLOCK_REASON
from .errors import Problem

CURRICULUM_TOP = {"enabled", "curriculum_type", "min_difficulty", "max_difficulty", "schedule_type", "schedule_config"}
SCHEDULE_KEYS = {  # schedule_config keys each schedule reads (DeepSpeed's CurriculumScheduler)
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
}
TO_FSPEED = {"total_curriculum_step": "total_steps", "difficulty_step": "difficulty_step",
             "root_degree": "root_degree", "difficulty": "difficulty", "max_step": "max_step"}
PLD_KEYS = {"enabled": False, "theta": 1.0, "gamma": 0.001}


def translate_curriculum_learning(ds: Mapping[str, Any], w: Any) -> None:
    """`curriculum_learning` -> curriculum.* (`w` is the translator's ledger)."""
    block = w.known_block("curriculum_learning", ds["curriculum_learning"], CURRICULUM_TOP)
    if block is None:
        return
    if not block.get("enabled", False):
        w.accept("curriculum_learning", dict(block), ENABLED_BLOCK_REASON)
        return
    missing = [k for k in ("curriculum_type", "min_difficulty", "max_difficulty", "schedule_type") if k not in block]
    if missing:
        w.problems.append(Problem(f"curriculum_learning.{missing[0]}", "is required when enabled (DeepSpeed asserts "
                                  "it)", hint="curriculum_type seqlen, min_difficulty, max_difficulty, schedule_type"))
        return
    if block["curriculum_type"] != "seqlen":
        w.unsupported("curriculum_learning.curriculum_type", block["curriculum_type"], "seqlen",
                      "DeepSpeed's engine acts on seqlen only (other types pass nothing to the model)")
        return
    kind = block["schedule_type"]
    if kind not in SCHEDULE_KEYS:
        w.unsupported("curriculum_learning.schedule_type", kind, ", ".join(SCHEDULE_KEYS),
                      "not supported ('custom' needs a Python callback: fspeed.data.CurriculumSchedule)"
                      if kind == "custom" else "not a curriculum schedule")
        return
    w.emit("curriculum_learning.enabled", "curriculum.enabled", True)
    w.emit("curriculum_learning.curriculum_type", "curriculum.curriculum_type", "seqlen")
    for key in ("min_difficulty", "max_difficulty"):
        w.emit(f"curriculum_learning.{key}", f"curriculum.{key}", block[key])
    w.emit("curriculum_learning.schedule_type", "curriculum.schedule", kind)
    config = w.block("curriculum_learning.schedule_config", block.get("schedule_config", {}))
    if config is None:
        return
    for key, value in config.items():
        name = f"curriculum_learning.schedule_config.{key}"
        if key not in TO_FSPEED:
            w.unknown(name, value, sorted(TO_FSPEED))
        elif key in SCHEDULE_KEYS[kind]:
            w.emit(name, f"curriculum.{TO_FSPEED[key]}", value)
        else:
            w.accept(name, value, f"DeepSpeed's {kind} schedule does not read it")
    for key in SCHEDULE_KEYS[kind]:
        if key not in config:
            w.problems.append(Problem(f"curriculum_learning.schedule_config.{key}", f"is required by {kind} "
                                      "(DeepSpeed asserts it)"))


def translate_progressive_layer_drop(ds: Mapping[str, Any], w: Any) -> None:
    """`progressive_layer_drop` -> progressive_layer_drop.* (enabled, theta, gamma)."""
    block = w.known_block("progressive_layer_drop", ds["progressive_layer_drop"], PLD_KEYS)
    if block is None:
        return
    if not block.get("enabled", False):
        w.accept("progressive_layer_drop", dict(block), ENABLED_BLOCK_REASON)
        return
    for key in PLD_KEYS:
        if key in block or key == "enabled":
            w.emit(f"progressive_layer_drop.{key}", f"progressive_layer_drop.{key}", block.get(key, True))


def translate_data_efficiency(ds: Mapping[str, Any], w: Any) -> None:
    """`data_efficiency`: accepted disabled; enabled, an error pointing to fspeed's own form of it."""
    block = ds["data_efficiency"]
    enabled = isinstance(block, Mapping) and (block.get("enabled", False) or any(
        isinstance(v, Mapping) and v.get("enabled", False) for v in block.values()))
    if block is None or (isinstance(block, Mapping) and not enabled):
        w.accept("data_efficiency", block, ENABLED_BLOCK_REASON)
        return
    w.unsupported("data_efficiency.enabled", True, "false", "reads DeepSpeed's offline-analysis index files, which "
                  "fspeed does not; fspeed's data-efficiency curriculum builds and caches its own index: "
                  "curriculum.enabled=true curriculum.curriculum_type=vocab_rarity (and the schedule keys)")
