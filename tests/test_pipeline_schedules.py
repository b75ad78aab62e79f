"""Pipeline schedules as data: every built schedule is complete and runnable, check_schedule names what
is wrong with a broken one, the simulator agrees with each schedule's theoretical bubble, and bad
shapes are refused with errors that say what is allowed. Pure Python, no processes: fast."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fspeed.parallel.schedules import (
    SCHEDULES, Action, Schedule, bubble_fraction, build_schedule, check_schedule, early_input_grads, show_schedule,
    simulate, zero_bubble_for_costs,
)


@st.composite
def shapes(draw):
    """(name, stages 1..6, micro_batches 1..12, virtual 1..3 where the schedule allows it)."""
    name = draw(st.sampled_from(SCHEDULES))
    stages = draw(st.integers(1, 6))
    if name == "interleaved_1f1b":   # Megatron's interleaving needs micro_batches % stages == 0
        return name, stages, stages * draw(st.integers(1, 12 // stages)), draw(st.integers(2, 3))
    return name, stages, draw(st.integers(1, 12)), 1


def all_shapes():
    for name in SCHEDULES:
        for stages in range(1, 7):
            for micro in range(1, 13):
                for virtual in (2, 3) if name == "interleaved_1f1b" else (1,):
                    if name != "interleaved_1f1b" or micro % stages == 0:
                        yield name, stages, micro, virtual


def piece(action, stage, stages):
    """The virtual stage (model piece) an action runs: chunk c of stage s is piece c * stages + s."""
    return action.chunk * stages + stage


@settings(max_examples=150, deadline=None)
@given(shapes(), st.booleans())
def test_every_schedule_is_complete_ordered_and_runs(shape, input_grad_first):
    name, stages, micro, virtual = shape
    input_grad_first = input_grad_first or name == "zero_bubble"
    schedule = build_schedule(name, stages, micro, virtual, input_grad_first)
    check_schedule(schedule)
    assert (schedule.stages, schedule.micro_batches, schedule.virtual_stages) == (stages, micro, virtual)
    assert schedule.split_backward == (name == "zero_bubble")
    assert len(schedule.actions) == stages
    kinds = "FBW" if schedule.split_backward else "FB"
    expected = Counter(Action(k, m, c) for k in kinds for m in range(micro) for c in range(virtual))
    for stage, actions in enumerate(schedule.actions):
        assert Counter(actions) == expected, f"stage {stage}: each action exactly once"
        position = {action: i for i, action in enumerate(actions)}
        for action in actions:
            if action.kind == "B":
                assert position[Action("F", action.micro, action.chunk)] < position[action]
            if action.kind == "W":
                assert position[Action("B", action.micro, action.chunk)] < position[action]
        for chunk in range(virtual):
            assert [a.micro for a in actions if a.kind == "B" and a.chunk == chunk] == list(range(micro))
            if schedule.split_backward:   # weight gradients accumulate in micro-batch order too
                assert [a.micro for a in actions if a.kind == "W" and a.chunk == chunk] == list(range(micro))
        if name in ("1f1b", "zero_bubble"):
            assert schedule.in_flight(stage) <= stages - stage
            assert schedule.in_flight(stage) == min(stages - stage, micro)

    # Every send is matched by its receive: the receiver starts only after the sender sends (at its
    # end; an early B's after its input-gradient part), each stage runs its list in order one action
    # at a time, and the simulation finishes.
    timeline = simulate(schedule, forward=1.0, backward=1.5, weight=0.5)
    finished, sent = {}, {}
    for stage, intervals in enumerate(timeline.busy):
        assert [a for _, _, a in intervals] == list(schedule.actions[stage])
        assert all(end0 <= start1 for (_, end0, _), (start1, _, _) in zip(intervals, intervals[1:]))
        early = early_input_grads(schedule, stage)
        for start, end, action in intervals:
            key = (action.kind, action.micro, piece(action, stage, stages))
            finished[key] = (start, end)
            sent[key] = start + 1.5 if (action.kind, action.micro, action.chunk) in {("B", *e) for e in early} else end
            if action.kind == "B" and not schedule.split_backward:
                assert end - start == 2.0   # the whole backward: B + W
    last = stages * virtual - 1
    for (kind, m, k), (start, _) in finished.items():
        if kind == "F" and k > 0:
            assert start >= finished[("F", m, k - 1)][1]
        if kind == "B":
            assert start >= finished[("F", m, k)][1]
            if k < last:
                assert start >= sent[("B", m, k + 1)]
        if kind == "W":
            assert start >= finished[("B", m, k)][1]
    assert timeline.makespan == max(end for _, end in finished.values())


def test_simulated_bubble_equals_the_theory_for_every_shape():
    for name, stages, micro, virtual in all_shapes():
        for first in (True, False) if name != "zero_bubble" else (True,):
            timeline = simulate(build_schedule(name, stages, micro, virtual, first))
            theory = bubble_fraction(name, stages, micro, virtual, first)
            assert abs(timeline.bubble_fraction - theory) < 1e-9, (name, stages, micro, virtual, first)


def test_theory_matches_the_literature():
    # GPipe / 1F1B, each backward whole: (p - 1) / (m + p - 1) of the step idle.
    assert bubble_fraction("1f1b", 4, 8, input_grad_first=False) == pytest.approx(3 / 11)
    assert bubble_fraction("gpipe", 4, 8, input_grad_first=False) == pytest.approx(3 / 11)
    # Megatron: bubble over ideal time (p - 1) / (v m); as a share of the step r / (1 + r).
    ratio = (4 - 1) / (2 * 8)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2, input_grad_first=False) == pytest.approx(ratio / (1 + ratio))
    # ZB-H1: idle per stage (p - 1)(F + B - W) against 1F1B's (p - 1)(F + B + W).
    assert bubble_fraction("zero_bubble", 4, 8) == pytest.approx(3 / (3 * 8 + 3))
    # the input's gradient first in the cooldown: (p - 1)(F + B) idle, between the two
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        assert bubble_fraction(name, 4, 8, v) == pytest.approx(6 / (3 * v * 8 + 6))
    assert bubble_fraction("zero_bubble", 4, 8) < bubble_fraction("1f1b", 4, 8) < \
        bubble_fraction("1f1b", 4, 8, input_grad_first=False)


def test_zero_bubble_beats_1f1b_at_two_stages_four_micro_batches():
    one_f_one_b = simulate(build_schedule("1f1b", 2, 4, input_grad_first=False))
    early = simulate(build_schedule("1f1b", 2, 4))
    zero_bubble = simulate(build_schedule("zero_bubble", 2, 4))
    assert one_f_one_b.makespan == 15.0   # 12 units of work + (p - 1)(F + B + W)
    assert early.makespan == 14.0         # 12 units of work + (p - 1)(F + B): stage 0's last B waits for B only
    assert zero_bubble.makespan == 13.0   # 12 units of work + (p - 1)(F + B - W)
    assert zero_bubble.makespan <= 0.92 * one_f_one_b.makespan


def test_only_the_cooldowns_backwards_send_the_input_gradient_first():
    """The B's after a stage's last forward, on every piece but the first (which sends nothing)."""
    one_f_one_b = build_schedule("1f1b", 3, 4)   # stage s: p - s - 1 warmup F's, so p - s B's after the last F
    assert [sorted(early_input_grads(one_f_one_b, s)) for s in range(3)] == [[], [(2, 0), (3, 0)], [(3, 0)]]
    assert sorted(early_input_grads(build_schedule("1f1b", 4, 8), 1)) == [(5, 0), (6, 0), (7, 0)]
    assert sorted(early_input_grads(build_schedule("gpipe", 2, 3), 1)) == [(0, 0), (1, 0), (2, 0)]
    interleaved = build_schedule("interleaved_1f1b", 2, 2, 2)   # stage 0's chunk 1 is piece 2: it sends
    assert (1, 1) in early_input_grads(interleaved, 0) and all(c == 1 for _, c in early_input_grads(interleaved, 0))
    for schedule in (build_schedule("1f1b", 3, 4, input_grad_first=False), build_schedule("zero_bubble", 3, 4)):
        assert all(not early_input_grads(schedule, s) for s in range(3))
    with pytest.raises(ValueError, match="zero_bubble's B computes the input's gradient alone"):
        build_schedule("zero_bubble", 2, 4, input_grad_first=False)


def test_a_slower_stage_sets_the_pace():
    """Per-stage costs: with the last stage 1.5x slower, 1F1B's step is its 2 x 1.5 x m units plus the
    first stage's F before it and B after it; the idle share grows from 0.2 to 2/7. Sending the input
    gradient first, stage 0's last B waits for the last stage's B part only (0.75 units less)."""
    timeline = simulate(build_schedule("1f1b", 2, 4, input_grad_first=False), [1, 1.5], [0.5, 0.75], [0.5, 0.75])
    assert timeline.makespan == 1 + 2 * 1.5 * 4 + 1 and timeline.bubble_fraction == pytest.approx(2 / 7)
    assert simulate(build_schedule("1f1b", 2, 4), [1, 1.5], [0.5, 0.75], [0.5, 0.75]).makespan == 1 + 12 + 1 - 0.75
    assert simulate(build_schedule("1f1b", 2, 4, input_grad_first=False), [1, 1], 0.5, 0.5).makespan == 10.0
    with pytest.raises(ValueError, match="forward has 3 costs for 2 stages"):
        simulate(build_schedule("1f1b", 2, 4), [1, 1, 1])


def test_orders_are_the_reference_ones():
    def rows(schedule):
        return [" ".join(f"{a.kind}{a.micro}" + (f".{a.chunk}" if schedule.virtual_stages > 1 else "") for a in row)
                for row in schedule.actions]

    assert rows(build_schedule("1f1b", 3, 4)) == [        # PipeDream-flush: p - s - 1 warmup forwards
        "F0 F1 F2 B0 F3 B1 B2 B3", "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"]
    assert rows(build_schedule("gpipe", 2, 3)) == ["F0 F1 F2 B0 B1 B2"] * 2
    # ZB-H1 (the paper's steady state F(x) B(x-p+1+s) W(x-p+1)): on stage s each W trails its B by s.
    assert rows(build_schedule("zero_bubble", 2, 4)) == [
        "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3", "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"]
    assert rows(build_schedule("zero_bubble", 3, 5))[2] == "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 F4 B4 W2 W3 W4"
    # Megatron interleaved, p = 2, v = 2, m = 4: stage 0 warms up (p - 1) * 2 + (v - 1) * p = 4 forwards.
    assert rows(build_schedule("interleaved_1f1b", 2, 4, 2))[0].split()[:5] == ["F0.0", "F1.0", "F0.1", "F1.1", "F2.0"]
    assert rows(build_schedule("interleaved_1f1b", 2, 4, 2))[1].split()[:4] == ["F0.0", "F1.0", "F0.1", "B0.1"]
    # Megatron's warmup (p - s - 1) * 2 + (v - 1) * p, then 1F1B: one more forward in flight.
    interleaved = build_schedule("interleaved_1f1b", 4, 8, 2)
    assert [interleaved.in_flight(s) for s in range(4)] == [11, 9, 7, 5]
    # ... and with m == p every forward first (Megatron's all-warmup case).
    assert build_schedule("interleaved_1f1b", 2, 2, 2).in_flight(1) == 4


def test_show_schedule_prints_rows_and_bubbles():
    text = show_schedule(build_schedule("1f1b", 2, 4))
    rows = [line.split() for line in text.splitlines() if line.startswith("stage")]
    assert rows == ["stage 0 | F0 F1 B0 F2 B1 F3 B2 B3".split(), "stage 1 | F0 B0 F1 B1 F2 B2 F3 B3*".split()]
    assert "B* sends the input's gradient after 1" in text   # the last stage's last B: stage 0 waits for it
    whole = show_schedule(build_schedule("1f1b", 2, 4, input_grad_first=False))
    assert "stage 1 | F0 B0 F1 B1 F2 B2 F3 B3\n" in whole and "B*" not in whole
    assert "theory 0.1429, simulated 0.1429" in text   # 2 (p - 1) / (3 m + 2 (p - 1)): the input's gradient first
    assert "theory 0.2000, simulated 0.2000" in show_schedule(build_schedule("1f1b", 2, 4, input_grad_first=False))
    assert str(build_schedule("1f1b", 2, 4)) == text
    assert "F0.1" in show_schedule(build_schedule("interleaved_1f1b", 2, 2, 2))
    zero_bubble = show_schedule(build_schedule("zero_bubble", 2, 4))
    assert "W0" in zero_bubble and "theory 0.0769, simulated 0.0769" in zero_bubble
    one_f_one_b = build_schedule("1f1b", 2, 2)
    deadlocked = Schedule("1f1b", 2, 2, 1, False, (one_f_one_b.actions[1], one_f_one_b.actions[0]))
    assert "bubble: none (1f1b: deadlock" in show_schedule(deadlocked)


def edited(schedule, stage, actions):
    """`schedule` with `stage`'s action list replaced."""
    rows = list(schedule.actions)
    rows[stage] = tuple(actions)
    return Schedule(schedule.name, schedule.stages, schedule.micro_batches, schedule.virtual_stages,
                    schedule.split_backward, tuple(rows))


def test_check_schedule_names_what_is_broken():
    good = build_schedule("1f1b", 2, 2)   # stage 0: F0 F1 B0 B1; stage 1: F0 B0 F1 B1
    F, B = (lambda m: Action("F", m, 0)), (lambda m: Action("B", m, 0))
    with pytest.raises(ValueError, match=r"stage 1: B0\.0 runs before its F"):
        check_schedule(edited(good, 1, [B(0), F(0), F(1), B(1)]))
    with pytest.raises(ValueError, match=r"deadlock.*stage 0 at B0\.0.*stage 1 at F1\.0"):
        # stage 0 waits for B0 from stage 1, which first waits for F1 that stage 0 sends only after B0
        check_schedule(edited(edited(good, 0, [F(0), B(0), F(1), B(1)]), 1, [F(0), F(1), B(0), B(1)]))
    with pytest.raises(ValueError, match=r"stage 0 is missing 1 action\(s\): B1\.0"):
        check_schedule(edited(good, 0, [F(0), F(1), B(0)]))
    with pytest.raises(ValueError, match="appears twice"):
        check_schedule(edited(good, 0, [F(0), F(1), B(0), B(1), B(1)]))
    with pytest.raises(ValueError, match="out of micro-batch order"):
        check_schedule(edited(good, 0, [F(0), F(1), B(1), B(0)]))
    with pytest.raises(ValueError, match=r"F2\.0 is not an action of this schedule.*micro 0\.\.1"):
        check_schedule(edited(good, 0, [F(0), F(1), F(2), B(0), B(1)]))
    with pytest.raises(ValueError, match=r"W0\.0 is not an action.*kinds F, B\)?"):
        check_schedule(edited(good, 0, [F(0), F(1), B(0), Action("W", 0, 0), B(1)]))
    zero_bubble = build_schedule("zero_bubble", 2, 2)
    with pytest.raises(ValueError, match=r"missing 1 action\(s\): W0\.0"):
        check_schedule(edited(zero_bubble, 1, [a for a in zero_bubble.actions[1] if a != Action("W", 0, 0)]))
    with pytest.raises(ValueError, match=r"W1\.0 runs before its B"):
        row = list(zero_bubble.actions[0])
        row.insert(0, row.pop(row.index(Action("W", 1, 0))))
        check_schedule(edited(zero_bubble, 0, row))
    with pytest.raises(ValueError, match="1 action lists for 2 stages"):
        check_schedule(Schedule("1f1b", 2, 2, 1, False, good.actions[:1]))


def test_fewer_micro_batches_than_stages_degenerates():
    for name in ("1f1b", "zero_bubble"):
        schedule = build_schedule(name, 4, 2)
        assert [schedule.in_flight(s) for s in range(4)] == [2, 2, 2, 1]
    assert build_schedule("1f1b", 4, 1).actions == ((Action("F", 0, 0), Action("B", 0, 0)),) * 4


@pytest.mark.parametrize("args, message", [
    (("pipedream", 2, 4), r"unknown pipeline schedule 'pipedream'; known: gpipe, 1f1b, interleaved_1f1b, zero_bubble"),
    (("1f1b", 0, 4), r"stages must be an integer >= 1, got 0"),
    (("1f1b", 2, 0), r"micro_batches must be an integer >= 1, got 0"),
    (("gpipe", 2, 4, 0), r"virtual_stages must be an integer >= 1, got 0"),
    (("1f1b", 2, 4, 2), r"virtual_stages=2 needs schedule 'interleaved_1f1b'; '1f1b' runs one chunk"),
    (("zero_bubble", 2, 4, 3), r"virtual_stages=3 needs schedule 'interleaved_1f1b'"),
    (("interleaved_1f1b", 2, 4, 1), r"interleaved_1f1b needs virtual_stages >= 2.*got 1"),
    (("interleaved_1f1b", 4, 6, 2), r"multiple of stages.*micro_batches=6, stages=4; use 4 or 8"),
    (("interleaved_1f1b", 4, 2, 2), r"micro_batches=2, stages=4; use 4$"),
])
def test_bad_shapes_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)
    with pytest.raises(ValueError, match=message):
        bubble_fraction(*args)


def runs_without_deadlock(schedule):
    """An independent oracle: the graph of data dependencies plus each stage's order has no cycle."""
    stages, last = schedule.stages, schedule.stages * schedule.virtual_stages - 1
    where = {(a.kind, a.micro, piece(a, s, stages)): (s, i) for s, row in enumerate(schedule.actions)
             for i, a in enumerate(row)}
    edges = {node: [] for node in where}
    for (kind, m, k), (s, i) in where.items():
        inputs = {"F": [("F", m, k - 1)] if k > 0 else [],
                  "B": [("F", m, k)] + ([("B", m, k + 1)] if k < last else []),
                  "W": [("B", m, k)]}[kind]
        if i > 0:
            a = schedule.actions[s][i - 1]
            inputs.append((a.kind, a.micro, piece(a, s, stages)))
        if any(node not in where for node in inputs):
            return False
        edges[(kind, m, k)] = inputs
    state = {}

    def acyclic(node):
        stack = [(node, iter(edges[node]))]
        state[node] = "open"
        while stack:
            current, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[current] = "done"
                stack.pop()
            elif state.get(child) == "open":
                return False
            elif child not in state:
                state[child] = "open"
                stack.append((child, iter(edges[child])))
        return True

    return all(state.get(node) == "done" or acyclic(node) for node in edges)


@settings(max_examples=150, deadline=None)
@given(shapes(), st.data())
def test_check_schedule_agrees_with_a_graph_oracle_on_swapped_orders(shape, data):
    schedule = build_schedule(*shape)
    stage = data.draw(st.integers(0, schedule.stages - 1))
    row = list(schedule.actions[stage])
    i, j = data.draw(st.integers(0, len(row) - 1)), data.draw(st.integers(0, len(row) - 1))
    row[i], row[j] = row[j], row[i]
    broken = edited(schedule, stage, row)
    in_micro_order = all(
        [a.micro for a in r if a.kind == "B" and a.chunk == c] == list(range(schedule.micro_batches))
        for r in broken.actions for c in range(schedule.virtual_stages))
    try:
        check_schedule(broken)
        accepted = True
    except ValueError:
        accepted = False
    assert accepted == (runs_without_deadlock(broken) and in_micro_order)


@pytest.mark.parametrize("forward, backward, weight", [(1, 1, 1), (1, 1.2, 0.8), (1, 1, 0.5), (1, 2, 0)])
def test_zero_bubble_idles_the_papers_bound_at_any_costs(forward, backward, weight):
    # Qi et al. 2023, Table 2: ZB-H1 idles (p - 1)(T_F + T_B - T_W) per stage, 1F1B (p - 1)(T_F + T_B + T_W).
    for stages, micro in [(2, 4), (3, 3), (4, 8), (5, 7), (6, 12)]:
        idle = (stages - 1) * (forward + backward - weight)
        work = micro * (forward + backward + weight)
        timeline = simulate(build_schedule("zero_bubble", stages, micro), forward, backward, weight)
        assert timeline.makespan == pytest.approx(work + idle)
        one_f_one_b = simulate(build_schedule("1f1b", stages, micro, input_grad_first=False), forward, backward, weight)
        assert one_f_one_b.makespan == pytest.approx(work + (stages - 1) * (forward + backward + weight))
        early = simulate(build_schedule("1f1b", stages, micro), forward, backward, weight)
        assert early.makespan == pytest.approx(work + (stages - 1) * (forward + backward))


@settings(max_examples=60, deadline=None)
@given(stages=st.integers(1, 6), micro=st.integers(1, 16), costs=st.lists(
    st.tuples(st.floats(0.2, 2.0), st.floats(0.2, 2.0), st.floats(0.05, 2.0)), min_size=1, max_size=1),
    skew=st.floats(1.0, 1.2))
def test_zero_bubble_for_costs_is_never_slower_than_zb_h1_and_keeps_its_order(stages, micro, costs, skew):
    """The cost-aware placement of the W's: a valid schedule (check_schedule), 1F1B's F/B order on
    every stage (so its in-flight bound), W's in micro-batch order, at most 2 p W's pending, and a
    simulated step no longer than ZB-H1's at those costs (the last stage's F heavier by `skew`)."""
    (f, b, w), = costs
    forward = [f] * (stages - 1) + [f * skew]
    schedule = zero_bubble_for_costs(stages, micro, forward, b, w)
    check_schedule(schedule)
    h1 = build_schedule("zero_bubble", stages, micro)
    for stage in range(stages):
        rows = [[a for a in actions if a.kind in kinds] for actions in (schedule.actions[stage], h1.actions[stage])
                for kinds in ("FB", "W")]
        assert rows[0] == rows[2] and [a.micro for a in rows[1]] == list(range(micro))
        pending = peak = 0
        for action in schedule.actions[stage]:
            pending += {"B": 1, "W": -1}.get(action.kind, 0)
            peak = max(peak, pending)
        assert peak <= 2 * stages
    assert simulate(schedule, forward, b, w).makespan <= simulate(h1, forward, b, w).makespan * (1 + 1e-9)


def test_zero_bubble_for_costs_fills_the_waits_where_w_is_cheap():
    """Unit costs: ZB-H1 itself. The benchmark's measured costs (F, B, W = 62/67, 73, 45 ms): the W's
    fill the waits, 802 against ZB-H1's 830 and 1F1B's 920 (875 sending the input gradient first)."""
    for stages, micro in [(2, 4), (3, 5), (4, 8)]:
        assert zero_bubble_for_costs(stages, micro) == build_schedule("zero_bubble", stages, micro)
    costs = ([62.0, 67.0], 73.0, 45.0)
    schedule = zero_bubble_for_costs(2, 4, *costs)
    assert [" ".join(f"{a.kind}{a.micro}" for a in row) for row in schedule.actions] == [
        "F0 F1 B0 F2 W0 B1 F3 B2 W1 W2 B3 W3", "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3"]
    assert simulate(schedule, *costs).makespan == 802.0
    assert simulate(build_schedule("zero_bubble", 2, 4), *costs).makespan == 830.0
    assert simulate(build_schedule("1f1b", 2, 4, input_grad_first=False), *costs).makespan == 920.0
    assert simulate(build_schedule("1f1b", 2, 4), *costs).makespan == 875.0   # stage 0's last B waits 45 less


def test_1f1b_is_deepspeeds_train_schedule():
    # DeepSpeed's TrainSchedule runs 2 (m + p - 1) steps; at step t stage s computes a forward when t and s
    # have the same parity (micro t // 2 - s // 2), else a backward (micro (t + 1) // 2 - p + (s + 1) // 2),
    # skipping micro-batch ids outside 0..m-1.
    for stages in range(1, 7):
        for micro in range(1, 13):
            schedule = build_schedule("1f1b", stages, micro)
            for stage in range(stages):
                steps = []
                for t in range(2 * (micro + stages - 1)):
                    forward = t % 2 == stage % 2
                    m = t // 2 - stage // 2 if forward else (t + 1) // 2 - stages + (stage + 1) // 2
                    if 0 <= m < micro:
                        steps.append(Action("F" if forward else "B", m, 0))
                assert tuple(steps) == schedule.actions[stage], (stages, micro, stage)
