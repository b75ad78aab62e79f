"""Pipeline schedules as data: per stage, the list of forward/backward actions it runs, in order.

    s = build_schedule("1f1b", stages=2, micro_batches=4)
    print(s)          # stage 0 | F0 F1 B0 F2 B1 F3 B2 B3 ... and the bubble, theory and simulated

The model is cut into `stages * virtual_stages` consecutive pieces; piece k lives on stage
`k % stages` as chunk `k // stages` (Megatron's interleaving). An `Action` is F (forward), B
(backward; with `split_backward` only the input-gradient pass) or W (the weight-gradient pass,
zero_bubble only) of one micro-batch on one chunk. The runtime executes each stage's list in
order, blocking only on receives; `check_schedule` proves a list can run that way and
`simulate` times it with unit costs, communication free. Pure Python: no torch here.

Schedules (p stages, m micro-batches, v virtual stages):
- gpipe: all forwards, then all backwards (GPipe).
- 1f1b: PipeDream-flush, DeepSpeed's TrainSchedule: p - s - 1 warmup forwards on stage s, then
  one forward one backward, then the cooldown backwards; at most p - s micro-batches in flight.
- interleaved_1f1b: Megatron's interleaved schedule (Narayanan et al. 2021): micro-batches go
  through the chunks in groups of p; warmup (p - s - 1) * 2 + (v - 1) * p, all of them
  when m == p; needs m % p == 0.
- zero_bubble: ZB-H1 (Qi et al. 2023): 1F1B's order of F and B with B split from W; on stage s
  each W trails its B by s micro-batches, so the shorter B chain shrinks the warmup bubble and
  the last s W's fill the cooldown one. Same in-flight bound as 1F1B (F's whose B has not run).
  `zero_bubble_for_costs` places the W's for given per-stage costs instead (what the runtime
  re-plans to after a first step with ZB-H1): where W is cheaper than B, W's that fill the waits
  beat trailing each B by s of them.

Input gradient first (`input_grad_first`, the default for the unsplit schedules): a B that the
previous stage waits for with nothing else to run, the B's after a stage's last forward (the
cooldown; all of gpipe's) on every piece but the first, sends its input's gradient before it
computes its weights' (the runtime defers the linears' weight GEMMs to the end of the B). Same
actions, order and in-flight bound, the same gradients up to rounding (each weight gradient is
added into its sum by one GEMM); the cooldown's chain of B's shortens by the W's, so the
theoretical bubble is 2(p - 1) / (3 v m + 2(p - 1)) instead of (p - 1) / (v m + p - 1)
(`bubble_fraction`). Only the cooldown's B's: the others' upstream stage has forwards to run, and
the deferral costs a B a few percent on small layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence, Union

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


class Action(NamedTuple):
    """One pass of one micro-batch through one chunk of a stage."""

    kind: str    # "F" forward; "B" backward (input gradient only if split_backward); "W" weight gradient
    micro: int   # micro-batch index, 0..micro_batches-1
    chunk: int   # model chunk on this stage, 0..virtual_stages-1


@dataclass(frozen=True)
class Schedule:
    """Each stage's actions in execution order, with the shape they were built for."""

    name: str
    stages: int
    micro_batches: int
    virtual_stages: int
    split_backward: bool
    actions: tuple[tuple[Action, ...], ...]
    input_grad_first: bool = True  # unsplit schedules: the cooldown's B's send the input's gradient first

    def in_flight(self, stage: int) -> int:
        """The most forwards on `stage` whose B has not run yet: its activation memory, in micro-batches
        (zero_bubble's pending W's hold a smaller part, the inputs and output gradients W needs)."""
        live = peak = 0
        for action in self.actions[stage]:
            live += {"F": 1, "B": -1}.get(action.kind, 0)
            peak = max(peak, live)
        return peak

    def __str__(self) -> str:
        return show_schedule(self)


@dataclass(frozen=True)
class Timeline:
    """A simulated run: per stage its busy intervals (start, end, action), the makespan, and the idle share."""

    busy: tuple[tuple[tuple[float, float, Action], ...], ...]
    makespan: float
    bubble_fraction: float   # 1 - (busy time over all stages) / (stages * makespan)


def _check_shape(name: str, stages: int, micro_batches: int, virtual_stages: int) -> None:
    """Raise ValueError for a shape `name` cannot be built for, naming the value and what is allowed."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    for field, value in (("stages", stages), ("micro_batches", micro_batches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"pipeline {field} must be an integer >= 1, got {value!r}")
    if name == "interleaved_1f1b":
        if virtual_stages < 2:
            raise ValueError(f"interleaved_1f1b needs virtual_stages >= 2 (model chunks per stage), "
                             f"got {virtual_stages}; with 1 use '1f1b'")
        if micro_batches % stages:
            lower = micro_batches // stages * stages
            fits = f"{lower} or {lower + stages}" if lower else f"{stages}"
            raise ValueError(f"interleaved_1f1b needs micro_batches to be a multiple of stages (Megatron's "
                             f"groups of one micro-batch per stage): got micro_batches={micro_batches}, "
                             f"stages={stages}; use {fits}")
    elif virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule 'interleaved_1f1b'; {name!r} "
                         f"runs one chunk per stage (virtual_stages=1)")


def _one_f_one_b(stages: int, micro_batches: int, stage: int) -> list[Action]:
    """PipeDream-flush on one stage: warmup forwards, then alternate F and B, then the cooldown B's."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [Action("F", m, 0) for m in range(warmup)]
    for m in range(micro_batches - warmup):
        order += [Action("F", warmup + m, 0), Action("B", m, 0)]
    return order + [Action("B", m, 0) for m in range(micro_batches - warmup, micro_batches)]


def _gpipe(stages: int, micro_batches: int, stage: int) -> list[Action]:
    """All forwards, then all backwards in micro-batch order."""
    return [Action("F", m, 0) for m in range(micro_batches)] + [Action("B", m, 0) for m in range(micro_batches)]


def _zero_bubble_h1(stages: int, micro_batches: int, stage: int) -> list[Action]:
    """ZB-H1 on one stage: 1F1B's F/B order; stage s runs W(j) right after B(j + s), so s W's wait
    while the B's hurry up the pipeline, and its last s W's fill the cooldown where 1F1B idles.
    W's stay in micro-batch order, so weight gradients accumulate in the order of the reference."""
    order: list[Action] = []
    for action in _one_f_one_b(stages, micro_batches, stage):
        order.append(action)
        if action.kind == "B" and action.micro >= stage:
            order.append(Action("W", action.micro - stage, 0))
    return order + [Action("W", m, 0) for m in range(max(0, micro_batches - stage), micro_batches)]


def _zero_bubble_filling(stages: int, micro_batches: int, cost: dict[str, list[float]], cap: int,
                         fit: float) -> list[list[Action]]:
    """Zero bubble by list scheduling on these per-stage costs: every stage keeps 1F1B's order of F
    and B (so its in-flight bound) and runs its oldest pending W where the next F or B would wait
    (`fit` > 0: only a wait of at least `fit` W's), or before a B that would leave more than `cap` W's
    pending (the inputs and output gradients each W keeps); the W's left run at the end."""
    p = stages
    orders = [_one_f_one_b(p, micro_batches, s) for s in range(p)]
    nxt, free = [0] * p, [0.0] * p
    done: dict[tuple[str, int, int], float] = {}
    pending: list[list[int]] = [[] for _ in range(p)]
    out: list[list[Action]] = [[] for _ in range(p)]

    def ready(s: int, action: Action):
        needs = _needs(action, s, p, p)
        return None if any(key not in done for key in needs) else max((done[key] for key in needs), default=0.0)
    while True:
        best = None  # (start, stage, the action; None: a W)
        for s in range(p):
            choice = None
            if nxt[s] < len(orders[s]):
                action = orders[s][nxt[s]]
                at = ready(s, action)
                if at is not None and not (action.kind == "B" and len(pending[s]) >= cap):
                    wait = at - free[s]
                    fill = pending[s] and wait > 0 and wait >= fit * cost["W"][s]
                    choice = (free[s], s, None) if fill else (max(free[s], at), s, action)
                elif pending[s]:
                    choice = (free[s], s, None)
            elif pending[s]:
                choice = (free[s], s, None)
            if choice is not None and (best is None or choice[:2] < best[:2]):
                best = choice
        if best is None:
            return out
        start, s, action = best
        if action is None:
            action = Action("W", pending[s].pop(0), 0)
        else:
            nxt[s] += 1
            if action.kind == "B":
                pending[s].append(action.micro)
        free[s] = start + cost[action.kind][s]
        done[(action.kind, action.micro, s)] = free[s]
        out[s].append(action)


def zero_bubble_for_costs(stages: int, micro_batches: int, forward: "Cost" = 1.0, backward: "Cost" = 1.0,
                          weight: "Cost" = 1.0) -> Schedule:
    """The zero-bubble schedule whose simulated step is shortest for these per-stage costs of F, B
    (input gradient) and W (weight gradient): ZB-H1, or a W placement found by list scheduling
    (`_zero_bubble_filling`, at most 2 * stages W's pending on a stage). With F = B = W it is ZB-H1; where
    W is cheaper than B (a transformer's weight pass is its linears' GEMMs only), filling waits
    with W's instead of trailing each B by s of them shortens the step (2 stages, 4 micro-batches,
    F, B, W = 62, 73, 45 ms: 802 against ZB-H1's 830). Same F/B order as 1F1B, W's in micro-batch
    order: the weight gradients sum in the order of the reference."""
    h1 = build_schedule("zero_bubble", stages, micro_batches)
    costs = {"F": _per_stage(forward, "forward", stages), "B": _per_stage(backward, "backward", stages),
             "W": _per_stage(weight, "weight", stages)}
    best, shortest = h1, simulate(h1, *costs.values()).makespan
    for cap in (stages + 1, 2 * stages):
        for fit in (0.0, 0.5, 1.0):
            candidate = Schedule("zero_bubble", stages, micro_batches, 1, True,
                                 tuple(tuple(a) for a in _zero_bubble_filling(stages, micro_batches, costs, cap, fit)))
            check_schedule(candidate)
            makespan = simulate(candidate, *costs.values()).makespan
            if makespan < shortest * (1 - 1e-9):
                best, shortest = candidate, makespan
    return best


def _interleaved(stages: int, micro_batches: int, virtual_stages: int, stage: int) -> list[Action]:
    """Megatron's interleaved 1F1B on one stage: the k-th forward takes micro-batch group k // (p v),
    chunk (k mod p v) // p; backwards walk the chunks in reverse. Warmup as Megatron counts it."""
    p, v = stages, virtual_stages
    total = micro_batches * v
    warmup = total if micro_batches == p else min((p - stage - 1) * 2 + (v - 1) * p, total)

    def nth(kind: str, k: int) -> Action:
        group, position = divmod(k, p * v)
        chunk = position // p
        return Action(kind, group * p + position % p, chunk if kind == "F" else v - 1 - chunk)

    order = [nth("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [nth("F", warmup + k), nth("B", k)]
    return order + [nth("B", k) for k in range(total - warmup, total)]


def build_schedule(name: str, stages: int, micro_batches: int, virtual_stages: int = 1,
                   input_grad_first: bool = True) -> Schedule:
    """The schedule `name` for this shape, checked (ValueError naming the bad value otherwise).
    `input_grad_first` (unsplit schedules; module docstring): the cooldown's B's send the input's
    gradient before computing the weights'. zero_bubble's B is the input's gradient alone."""
    _check_shape(name, stages, micro_batches, virtual_stages)
    if name == "zero_bubble" and not input_grad_first:
        raise ValueError("zero_bubble's B computes the input's gradient alone (its W the weights'): it always sends "
                         "the input's gradient first; input_grad_first=False applies to gpipe, 1f1b and "
                         "interleaved_1f1b")
    if name == "interleaved_1f1b":
        per_stage = [_interleaved(stages, micro_batches, virtual_stages, s) for s in range(stages)]
    else:
        build = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zero_bubble": _zero_bubble_h1}[name]
        per_stage = [build(stages, micro_batches, s) for s in range(stages)]
    schedule = Schedule(name, stages, micro_batches, virtual_stages, name == "zero_bubble",
                        tuple(tuple(actions) for actions in per_stage), input_grad_first)
    check_schedule(schedule)
    return schedule


def _label(action: Action, chunked: bool) -> str:
    """F3, or F3.1 (micro 3, chunk 1) when stages hold several chunks."""
    return f"{action.kind}{action.micro}.{action.chunk}" if chunked else f"{action.kind}{action.micro}"


def _needs(action: Action, stage: int, stages: int, pieces: int) -> list[tuple[str, int, int]]:
    """What `action` on `stage` waits for, as (kind, micro, virtual stage) keys."""
    piece = action.chunk * stages + stage
    if action.kind == "F":
        return [("F", action.micro, piece - 1)] if piece > 0 else []
    if action.kind == "B":
        upstream = [("B", action.micro, piece + 1)] if piece < pieces - 1 else []
        return [("F", action.micro, piece)] + upstream
    return [("B", action.micro, piece)]


def early_input_grads(schedule: Schedule, stage: int) -> frozenset[tuple[int, int]]:
    """The (micro, chunk) of the unsplit B's on `stage` that send their input's gradient before
    computing their weights' (module docstring): with `input_grad_first`, the B's after the stage's
    last forward, on pieces after the first (the first piece sends no gradient)."""
    if schedule.split_backward or not schedule.input_grad_first:
        return frozenset()
    actions = schedule.actions[stage]
    last_forward = max((i for i, a in enumerate(actions) if a.kind == "F"), default=-1)
    return frozenset((a.micro, a.chunk) for a in actions[last_forward + 1:]
                     if a.kind == "B" and a.chunk * schedule.stages + stage > 0)


def _execute(schedule: Schedule, cost: dict[str, list[float]]) -> tuple[tuple[tuple[float, float, Action], ...], ...]:
    """Run every stage's list in order, each action once its inputs are done; ValueError on deadlock.
    `cost`: per stage, F, B (the input's gradient) and W (the weights'); an unsplit B takes B + W,
    and its gradient is sent after B + W, or after B where it goes first (`early_input_grads`)."""
    stages, pieces = schedule.stages, schedule.stages * schedule.virtual_stages
    early = [early_input_grads(schedule, s) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    next_index, free_at = [0] * stages, [0.0] * stages
    busy: list[list[tuple[float, float, Action]]] = [[] for _ in range(stages)]
    progressed = True
    while progressed:
        progressed = False
        for stage, actions in enumerate(schedule.actions):
            while next_index[stage] < len(actions):
                action = actions[next_index[stage]]
                needs = _needs(action, stage, stages, pieces)
                if any(key not in done for key in needs):
                    break
                start = max([free_at[stage]] + [done[key] for key in needs])
                unsplit = action.kind == "B" and not schedule.split_backward
                free_at[stage] = start + cost[action.kind][stage] + (cost["W"][stage] if unsplit else 0.0)
                sent = start + cost["B"][stage] if unsplit and (action.micro, action.chunk) in early[stage] else \
                    free_at[stage]
                done[(action.kind, action.micro, action.chunk * stages + stage)] = sent
                busy[stage].append((start, free_at[stage], action))
                next_index[stage] += 1
                progressed = True
    stuck = [f"stage {s} at {_label(a[i], True)}" for s, (a, i) in enumerate(zip(schedule.actions, next_index))
             if i < len(a)]
    if stuck:
        raise ValueError(f"{schedule.name}: deadlock, no stage can go on: " + "; ".join(stuck))
    return tuple(tuple(intervals) for intervals in busy)


def _check_stage(schedule: Schedule, stage: int) -> None:
    """Each (kind, micro, chunk) once, B after its F, W after its B, a chunk's B's in micro order."""
    kinds = "FBW" if schedule.split_backward else "FB"
    expected = {Action(k, m, c) for k in kinds for m in range(schedule.micro_batches)
                for c in range(schedule.virtual_stages)}
    seen: set[Action] = set()
    last_backward: dict[int, int] = {}
    for action in schedule.actions[stage]:
        where = f"{schedule.name} stage {stage}: {_label(action, True)}"
        if action not in expected:
            raise ValueError(f"{where} is not an action of this schedule (kinds {', '.join(kinds)}; micro "
                             f"0..{schedule.micro_batches - 1}; chunk 0..{schedule.virtual_stages - 1})")
        if action in seen:
            raise ValueError(f"{where} appears twice")
        before = {"B": "F", "W": "B"}.get(action.kind)
        if before and Action(before, action.micro, action.chunk) not in seen:
            raise ValueError(f"{where} runs before its {before}")
        if action.kind == "B":
            if last_backward.get(action.chunk, -1) > action.micro:
                raise ValueError(f"{where}: backwards of chunk {action.chunk} out of micro-batch order "
                                 f"(after B{last_backward[action.chunk]})")
            last_backward[action.chunk] = action.micro
        seen.add(action)
    missing = sorted(expected - seen, key=lambda a: ("FBW".index(a.kind), a.chunk, a.micro))
    if missing:
        labels = " ".join(_label(a, True) for a in missing[:8])
        raise ValueError(f"{schedule.name} stage {stage} is missing {len(missing)} action(s): {labels}")


def check_schedule(schedule: Schedule) -> None:
    """Raise ValueError naming the first violation: a stage count that does not match, an action
    missing, repeated or out of range, a B before its F or a W before its B, a chunk's backwards
    out of micro-batch order, or an order that deadlocks when stages block on receives."""
    if len(schedule.actions) != schedule.stages:
        raise ValueError(f"{schedule.name}: {len(schedule.actions)} action lists for {schedule.stages} stages")
    for stage in range(schedule.stages):
        _check_stage(schedule, stage)
    _execute(schedule, {k: [1.0] * schedule.stages for k in "FBW"})


Cost = Union[float, Sequence[float]]


def _per_stage(cost: Cost, name: str, stages: int) -> list[float]:
    """A cost per stage: one number for every stage, or one per stage (stages of unequal work)."""
    if isinstance(cost, (int, float)):
        return [float(cost)] * stages
    if len(cost) != stages:
        raise ValueError(f"{name} has {len(cost)} costs for {stages} stages")
    return [float(c) for c in cost]


def simulate(schedule: Schedule, forward: Cost = 1.0, backward: Cost = 1.0, weight: Cost = 1.0) -> Timeline:
    """Time `schedule` with these per-chunk costs (an unsplit B costs backward + weight, its input's
    gradient sent after backward where it goes first), free communication. A cost is one number for
    every stage or one per stage (stages of unequal work)."""
    f, b, w = (_per_stage(c, f"simulate: {name}", schedule.stages)
               for c, name in ((forward, "forward"), (backward, "backward"), (weight, "weight")))
    busy = _execute(schedule, {"F": f, "B": b, "W": w})
    makespan = max((intervals[-1][1] for intervals in busy if intervals), default=0.0)
    work = sum(end - start for intervals in busy for start, end, _ in intervals)
    idle = 1.0 - work / (schedule.stages * makespan) if makespan > 0 else 0.0
    return Timeline(busy, makespan, idle)


def bubble_fraction(name: str, stages: int, micro_batches: int, virtual_stages: int = 1,
                    input_grad_first: bool = True) -> float:
    """The theoretical idle share of a step, 1 - busy / (stages * makespan), with F = B = W (one unit
    each; an unsplit backward is B + W, two units) and free communication.

    This is idle over total time, not Megatron's bubble-over-ideal ratio r = (p - 1) / (v m); the two
    relate by fraction = r / (1 + r). gpipe and 1f1b: (p - 1) / (m + p - 1); interleaved:
    (p - 1) / (v m + p - 1), Megatron's bubble shrunk by v; zero_bubble (ZB-H1): each stage idles
    (p - 1)(F + B - W) = p - 1 units against 3m busy (1F1B: (p - 1)(F + B + W)), so
    (p - 1) / (3 m + p - 1) for m >= p. With m < p the last stage alternates F and B, so the B's
    leave it two units apart and the step takes p - m units longer: idle = (2p - m - 1) units.
    With `input_grad_first` (the default; gpipe, 1f1b, interleaved) each of the cooldown's p - 1
    hops up the pipeline waits for B alone, not B + W: 2(p - 1) idle units against 3 v m busy,
    2(p - 1) / (3 v m + 2(p - 1)).
    """
    _check_shape(name, stages, micro_batches, virtual_stages)
    p, m, v = stages, micro_batches, virtual_stages
    if name == "zero_bubble":
        idle = p - 1 + max(0, p - m)
        return idle / (3 * m + idle)
    if input_grad_first:
        return 2 * (p - 1) / (3 * v * m + 2 * (p - 1))
    return (p - 1) / (v * m + p - 1)


def show_schedule(schedule: Schedule) -> str:
    """A per-stage table `stage 0 | F0 F1 B0 ...` and a line with the theoretical and simulated bubble;
    B* marks a B that sends its input's gradient before computing the weights' (`early_input_grads`)."""
    chunked = schedule.virtual_stages > 1
    early = [{("B", *e) for e in early_input_grads(schedule, s)} for s in range(schedule.stages)]
    cells = [[_label(a, chunked) + ("*" if tuple(a) in early[s] else "") for a in actions]
             for s, actions in enumerate(schedule.actions)]
    width = max((len(c) for row in cells for c in row), default=1)
    head = len(f"stage {schedule.stages - 1}")
    rows = [f"{f'stage {s}':<{head}} | " + " ".join(c.ljust(width) for c in row).rstrip()
            for s, row in enumerate(cells)]
    try:
        theory = bubble_fraction(schedule.name, schedule.stages, schedule.micro_batches, schedule.virtual_stages,
                                 schedule.input_grad_first)
        bubble = f"bubble: theory {theory:.4f}, simulated {simulate(schedule).bubble_fraction:.4f}"
    except ValueError as error:   # a hand-made schedule still prints, with what is wrong with it
        bubble = f"bubble: none ({error})"
    title = (f"{schedule.name}: {schedule.stages} stages x {schedule.micro_batches} micro-batches"
             + (f" x {schedule.virtual_stages} chunks" if chunked else "")
             + (", backward split into B (input grad) and W (weight grad)" if schedule.split_backward else ""))
    unsplit = "" if schedule.split_backward else "; B here is B + W, 2 units" + (
        ", B* sends the input's gradient after 1" if any(early) else "")
    return "\n".join([title, *rows, f"{bubble} (F = B = W = 1 unit{unsplit})"])
