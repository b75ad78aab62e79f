"""TEMPORARY stand-in (the helper's module replaces it)."""
from dataclasses import dataclass
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


class Action(NamedTuple):
    kind: str
    micro: int
    chunk: int


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int
    micro_batches: int
    virtual_stages: int
    split_backward: bool
    actions: tuple


def build_schedule(name, stages, micro_batches, virtual_stages=1):
    out = []
    for s in range(stages):
        if name == "gpipe":
            acts = [Action("F", m, 0) for m in range(micro_batches)] + [Action("B", m, 0) for m in range(micro_batches)]
        else:
            w = min(stages - s - 1, micro_batches)
            acts = [Action("F", m, 0) for m in range(w)]
            for i in range(micro_batches - w):
                acts += [Action("F", w + i, 0), Action("B", i, 0)]
                if name == "zero_bubble":
                    acts.append(Action("W", i, 0))
            for i in range(micro_batches - w, micro_batches):
                acts.append(Action("B", i, 0))
                if name == "zero_bubble":
                    acts.append(Action("W", i, 0))
        out.append(tuple(acts))
    return Schedule(name, stages, micro_batches, virtual_stages, name == "zero_bubble", tuple(out))
