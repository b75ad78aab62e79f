"""Layout-free checkpoints: a state saved in one layout (ZeRO 0-3, any data size, tensor slicing,
offload, one process) loads into any other holding exactly the same numbers, and training resumed
there continues as an uninterrupted run would (up to reduction order)."""

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed as fs
import fspeed.checkpoint as ck
from fspeed.checkpoint.slices import Box, range_boxes
from fspeed.parallel import gather_params, tensor_slicing
from tests.parallel_cases import global_batch, gpt_setup, make_opt, offload_plan

ROWS, ACCUM, SEED = 8, 2, 3
# (zero stage, tensor size, offload, world size); None: one process without a plan
LAYOUTS = [None, (0, 1, False, 4), (1, 1, False, 2), (2, 1, True, 2), (3, 1, False, 4), (3, 1, False, 2),
           (1, 2, False, 4), (3, 2, False, 4), (2, 1, False, 4)]


def build(layout, precision="fp32"):
    """A fresh state of the tiny GPT in `layout` on this world, and its train step."""
    cfg, model, params = gpt_setup(SEED)
    opt = make_opt("adamw")
    prec = getattr(fs.precision, precision)()
    if layout is None:
        mesh = plan = None
    else:
        stage, tp, offload, _ = layout
        mesh = fs.Mesh(data=-1, model=tp)
        plan = offload_plan(stage, offload, persistence=20)  # the 16-element norms stay whole under ZeRO-3
        if tp > 1:
            plan = plan | tensor_slicing(fs.models.gpt_rules)
    state = fs.init_train_state(params, opt, precision=prec, plan=plan, mesh=mesh, logical_axes=model.logical_axes)
    step = fs.make_train_step(model.loss, opt, grad_accum=ACCUM, plan=plan, mesh=mesh)
    return cfg, mesh, state, step


def run(state, step, cfg, mesh, start, stop):
    """Steps [start, stop) on the same global batches whatever the layout; the losses."""
    dp, rank = (mesh.size("data"), mesh.coordinate("data")) if mesh else (1, 0)
    losses = []
    for i in range(start, stop):
        batch = global_batch(cfg, ROWS, SEED, i)
        state, metrics = step(state, {k: v[rank * ROWS // dp:(rank + 1) * ROWS // dp] for k, v in batch.items()})
        losses.append(float(metrics["loss"]))
    return state, losses


def full_params(state, mesh):
    return fs.Flat.from_tree(gather_params(state, mesh) if mesh else state.master_params.tree()).buffer


def train_and_save(directory, layout, steps, precision="fp32"):
    cfg, mesh, state, step = build(layout, precision)
    state, losses = run(state, step, cfg, mesh, 0, steps)
    ck.save_checkpoint(directory, state, mesh=mesh, client_state={"epoch": 1, "t": torch.arange(3)})
    return losses, full_params(state, mesh)


def load_and_save(source, target, layout, precision="fp32"):
    """Load `source` into `layout` and save it again to `target`, without a step."""
    _, mesh, state, _ = build(layout, precision)
    state, client = ck.load_checkpoint(source, state, mesh=mesh)
    ck.save_checkpoint(target, state, mesh=mesh, client_state=client)
    return client["epoch"], client["t"].tolist()


def resume_and_train(directory, layout, start, stop):
    cfg, mesh, state, step = build(layout)
    state, _ = ck.load_checkpoint(directory, state, mesh=mesh)
    assert state.step == start
    state, losses = run(state, step, cfg, mesh, start, stop)
    return losses, full_params(state, mesh), ck.state_entries(state)[1]


def on(worlds, layout, fn, *args):
    """Run `fn(*args)` where `layout` lives: this process, or every rank of its world (rank 0's result)."""
    if layout is None:
        return fn(*args)
    return worlds[layout[3]].run(fn, *args)[0]


def one_process_state(directory, precision):
    _, _, state, _ = build(None, precision)
    return ck.load_checkpoint(directory, state)[0]


@pytest.fixture(scope="module")
def worlds(world2, world4):
    return {2: world2, 4: world4}


@settings(max_examples=6, deadline=None)
@given(pair=st.tuples(st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS)).filter(lambda p: p[0] != p[1]),
       precision=st.sampled_from(["fp32", "bf16"]))
def test_a_state_moved_to_another_layout_holds_exactly_the_same_numbers(worlds, pair, precision):
    """A (trained 2 steps) -> B -> one process equals A -> one process, bit for bit, every tensor and counter."""
    a, b = pair
    with tempfile.TemporaryDirectory() as tmp:
        first, second = Path(tmp, "a"), Path(tmp, "b")
        on(worlds, a, train_and_save, str(first), a, 2, precision)
        assert on(worlds, b, load_and_save, str(first), str(second), b, precision) == (1, [0, 1, 2])
        direct, moved = one_process_state(first, precision), one_process_state(second, precision)
        t1, s1 = ck.state_entries(direct)
        t2, s2 = ck.state_entries(moved)
        assert s1 == s2 and s1["step"] == 2
        assert t1.keys() == t2.keys()
        for key in t1:
            assert torch.equal(t1[key], t2[key]), key
        # and B's files hold every box once: no padding, no duplicates
        index = ck.read_meta(second)["index"] if b is not None else None
        if index is not None:
            for key, entry in index.items():
                covered = sum(torch.Size(c[3]).numel() for c in entry["chunks"])
                assert covered == torch.Size(entry["shape"]).numel(), key


@pytest.mark.parametrize("a, b", [((3, 1, False, 4), (1, 2, False, 4)), ((2, 1, True, 2), None),
                                  (None, (3, 1, False, 2)), ((1, 2, False, 4), (2, 1, False, 2))])
def test_training_resumed_in_another_layout_continues_the_run(worlds, tmp_path, a, b):
    """A for 2 steps, B for 2 more: the losses and weights of an uninterrupted run in B (up to
    reduction order) and the counters of an exact one."""
    on(worlds, a, train_and_save, str(tmp_path), a, 2)
    losses, params, scalars = on(worlds, b, resume_and_train, str(tmp_path), b, 2, 4)
    straight = on(worlds, b, straight_run, b, 4)
    assert losses == pytest.approx(straight[0][2:], rel=1e-5)
    # reduction order differs in the first 2 steps; a misplaced slice would move weights by ~lr = 3e-3
    torch.testing.assert_close(params, straight[1], rtol=1e-4, atol=2e-5)
    assert scalars == straight[2]


def straight_run(layout, steps):
    cfg, mesh, state, step = build(layout)
    state, losses = run(state, step, cfg, mesh, 0, steps)
    return losses, full_params(state, mesh), ck.state_entries(state)[1]


def test_range_boxes_cover_a_flat_range_exactly():
    shape = (3, 4, 5)
    for lo in range(0, 60, 7):
        for hi in range(lo, 61, 11):
            marks = torch.zeros(shape, dtype=torch.int64)
            for box in range_boxes(shape, lo, hi):
                marks[tuple(slice(s, s + n) for s, n in zip(box.start, box.shape))] += 1
            flat = marks.reshape(-1)
            assert flat[lo:hi].eq(1).all() and flat[:lo].eq(0).all() and flat[hi:].eq(0).all(), (lo, hi)
    assert len(range_boxes(shape, 3, 57)) <= 2 * len(shape) - 1
    assert Box((0, 2), (2, 2)).intersect(Box((1, 3), (5, 5))) == Box((1, 3), (1, 1))
    assert Box((0,), (2,)).intersect(Box((2,), (2,))) is None


def onebit_run(directory, steps, save, world_size=None):
    """1-bit Adam (stage 0) on this world: `steps` steps, then save (or load `directory` first)."""
    cfg, model, params = gpt_setup(SEED)
    mesh = fs.Mesh(data=-1) if world_size else None
    opt = fs.optim.onebit_adam(1e-2, freeze_step=1, world_size=world_size)
    plan = fs.zero(0) if mesh else None
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh)
    step = fs.make_train_step(model.loss, opt, grad_accum=1, plan=plan, mesh=mesh)
    start = 0
    if not save:
        state, _ = ck.load_checkpoint(directory, state, mesh=mesh)
        start = state.step
    state, _ = run(state, step, cfg, mesh, start, start + steps)
    if save:
        ck.save_checkpoint(directory, state, mesh=mesh)
    return ([t.clone() for t in ck.state_entries(state)[0].values()], ck.state_entries(state)[1],
            state.opt_state.worker_error.clone(), state.params.buffer.clone())


def test_state_of_one_rank_resumes_exactly_in_its_layout_and_is_reset_with_a_warning_in_another(worlds, tmp_path,
                                                                                               caplog):
    """1-bit Adam's error buffers differ per rank: the same layout restores each rank's own; one
    process restarts them at zero and says so."""
    straight = worlds[2].run(onebit_run, str(tmp_path / "straight"), 4, True, 2)
    saved = worlds[2].run(onebit_run, str(tmp_path), 2, True, 2)
    assert not torch.equal(saved[0][2], saved[1][2])  # the error buffers are per rank
    resumed = worlds[2].run(onebit_run, str(tmp_path), 2, False, 2)
    for a, b in zip(straight, resumed):  # bit exact, error buffers included
        assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1] == b[1]
    with caplog.at_level("WARNING", logger="fspeed"):
        _, scalars, error, params = onebit_run(str(tmp_path), 0, False)
    assert "opt_state.worker_error, opt_state.server_error restart from their initial values" in caplog.text
    assert scalars["step"] == 2 and torch.equal(error, torch.zeros_like(error))
    assert torch.equal(params, saved[0][3])  # the weights are shared by every rank


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_rank_file_is_named_when_loading_into_another_layout(worlds, tmp_path, damage):
    on(worlds, (2, 1, False, 2), train_and_save, str(tmp_path), (2, 1, False, 2), 1)
    file = tmp_path / "global_step1" / "rank_00001.safetensors"
    data = bytearray(file.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF
    file.write_bytes(bytes(data) if damage == "flip" else bytes(data[:-100]))
    expected = "is corrupted: its sha256 does not match" if damage == "flip" else "is truncated or corrupted"
    with pytest.raises(ck.CheckpointError, match=f"rank_00001.safetensors {expected}"):
        one_process_state(tmp_path, "fp32")


def zero_one_save(directory):
    """0/1 Adam (stage 0) for 4 steps, the last a local step: each rank's weights differ; saved."""
    cfg, model, params = gpt_setup(SEED)
    mesh = fs.Mesh(data=-1)
    opt = fs.optim.zero_one_adam(1e-2, var_freeze_step=2, var_update_scaler=1, local_step_scaler=1,
                                 local_step_clipper=2, world_size=2)
    state = fs.init_train_state(params, opt, plan=fs.zero(0), mesh=mesh)
    state, _ = run(state, fs.make_train_step(model.loss, opt, plan=fs.zero(0), mesh=mesh), cfg, mesh, 0, 4)
    ck.save_checkpoint(directory, state, mesh=mesh)
    return state.params.buffer.clone()


def test_zero_one_adams_local_weights_take_the_lowest_ranks_copy_in_another_layout(worlds, tmp_path, caplog):
    per_rank = worlds[2].run(zero_one_save, str(tmp_path))
    assert not torch.equal(per_rank[0], per_rank[1])  # a local step: the ranks' weights differ
    _, model, params = gpt_setup(SEED)
    template = fs.init_train_state(params, fs.optim.zero_one_adam(1e-2, var_freeze_step=2, var_update_scaler=1,
                                                                   local_step_scaler=1, local_step_clipper=2))
    with caplog.at_level("WARNING", logger="fspeed"):
        state, _ = ck.load_checkpoint(tmp_path, template)
    assert torch.equal(state.params.buffer, per_rank[0]) and state.step == 4
    assert "opt_state.worker_error" in caplog.text and "restart from their initial values" in caplog.text
    differing = sum(not torch.equal(a, b) for a, b in zip(state.params.layout.segments(per_rank[0]),
                                                            state.params.layout.segments(per_rank[1])))
    assert differing > 20  # nearly every tensor: each rank stepped on its own gradient
    assert f"params/* ({differing} tensors) take" in caplog.text and "take the lowest saving rank's copy" in caplog.text
