"""Sharded checkpoints (fspeed.checkpoint with a mesh): every rank writes its part, a resume is bit
exact, another layout loads the same weights, a failed save keeps the last checkpoint."""

import pytest
import torch

import fspeed as fs
from fspeed.parallel import gather_params, tensor_slicing, zero
from tests.parallel_cases import global_batch, gpt_setup, make_opt


def run_steps(state, step, cfg, seed, rows, dp, rank, start, stop):
    for i in range(start, stop):
        batch = global_batch(cfg, rows, seed, i)
        state, _ = step(state, {k: v[rank * rows // dp:(rank + 1) * rows // dp] for k, v in batch.items()})
    return state


def checkpoint_case(directory, stage, tp, precision, fail_rank=None):
    """Train 4 steps straight; and 2 steps, save, load into a fresh state, 2 more: equal bits."""
    import fspeed.checkpoint as ck
    mesh = fs.Mesh(data=-1, model=tp)
    seed, dp, rank = 3, mesh.size("data"), mesh.coordinate("data")
    rows = 2 * dp
    cfg, model, params = gpt_setup(seed)
    opt = make_opt("adamw")
    plan = zero(stage, param_persistence_threshold=0) | (tensor_slicing(fs.models.gpt_rules) if tp > 1 else fs.Plan())

    def fresh():
        return fs.init_train_state(params, opt, precision=getattr(fs.precision, precision)(), plan=plan, mesh=mesh,
                                   logical_axes=model.logical_axes)
    step = fs.make_train_step(model.loss, opt, grad_accum=2, plan=plan, mesh=mesh)
    straight = run_steps(fresh(), step, cfg, seed, rows, dp, rank, 0, 4)
    state = run_steps(fresh(), step, cfg, seed, rows, dp, rank, 0, 2)
    path = ck.save_checkpoint(directory, state, mesh=mesh, client_state={"note": "x", "t": torch.arange(3)})
    failure = None
    if fail_rank is not None:  # a later save that fails on one rank must leave this one in place
        import fspeed.checkpoint.state_io as state_io
        real = state_io.write_tensor_file
        if mesh.rank == fail_rank:
            state_io.write_tensor_file = lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device"))
        try:
            ck.save_checkpoint(directory, run_steps(state, step, cfg, seed, rows, dp, rank, 2, 3), mesh=mesh,
                               tag="global_step2")
        except ck.CheckpointError as e:
            failure = str(e)
        finally:
            state_io.write_tensor_file = real
        return failure, sorted(p.name for p in path.iterdir()), ck.latest_tag(directory)
    resumed, client = ck.load_checkpoint(directory, fresh(), mesh=mesh)
    resumed = run_steps(resumed, step, cfg, seed, rows, dp, rank, 2, 4)
    same = all(torch.equal(a, b) for a, b in zip(ck.state_entries(straight)[0].values(),
                                                   ck.state_entries(resumed)[0].values()))
    scalars = ck.state_entries(straight)[1] == ck.state_entries(resumed)[1]
    # another layout loads the same weights (tests/test_checkpoint_universal.py covers the rest)
    other = zero(1 if stage != 1 else 2) | (tensor_slicing(fs.models.gpt_rules) if tp > 1 else fs.Plan())
    moved, _ = ck.load_checkpoint(directory, fs.init_train_state(params, opt, plan=other, mesh=mesh,
                                                                 logical_axes=model.logical_axes), mesh=mesh)
    moved_same = torch.equal(fs.Flat.from_tree(gather_params(moved, mesh)).buffer,
                             fs.Flat.from_tree(gather_params(state, mesh)).buffer) and moved.step == 2
    return same, scalars, client["note"], client["t"].tolist(), sorted(p.name for p in path.iterdir()), moved_same


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "bf16"), (2, "fp16"), (3, "bf16")])
def test_sharded_checkpoint_resumes_bit_exact_on_2_ranks(world2, tmp_path, stage, precision):
    results = world2.run(checkpoint_case, str(tmp_path), stage, 1, precision)
    for same, scalars, note, t, files, moved_same in results:
        assert same and scalars and note == "x" and t == [0, 1, 2]
        assert files == ["meta.json", "rank_00000.safetensors", "rank_00001.safetensors"]
        assert moved_same


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_checkpoint_with_tensor_slicing_on_4_ranks(world4, tmp_path, stage):
    for same, scalars, *_ in world4.run(checkpoint_case, str(tmp_path), stage, 2, "fp32"):
        assert same and scalars


def test_a_save_failing_on_one_rank_keeps_the_last_checkpoint(world2, tmp_path):
    results = world2.run(checkpoint_case, str(tmp_path), 2, 1, "fp32", 1)
    for failure, files, latest in results:
        assert "rank 1: " in failure and "rank_00001.safetensors': No space left on device (ENOSPC)" in failure
        assert "'latest' still names global_step2 (untouched)" in failure
        assert latest == "global_step2" and "rank_00001.safetensors" in files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left




def preflight_case(directory):
    """Rank 1's filesystem is too full for the checkpoint: every rank stops with the same message."""
    import shutil

    import fspeed.checkpoint.preflight_checks as checks
    mesh = fs.Mesh(data=-1)
    _, model, params = gpt_setup(0)
    opt = make_opt("adamw")
    state = fs.init_train_state(params, opt, plan=zero(3, param_persistence_threshold=0), mesh=mesh,
                                logical_axes=model.logical_axes)
    fs.checkpoint.preflight(directory, state, mesh=mesh)
    if mesh.rank == 1:
        checks.shutil.disk_usage = lambda p: shutil._ntuple_diskusage(total=100, used=99, free=1)
    try:
        fs.checkpoint.preflight(directory, state, mesh=mesh)
    except fs.checkpoint.CheckpointError as e:
        return str(e), e.on_every_rank
    finally:
        checks.shutil.disk_usage = shutil.disk_usage


def test_preflight_of_a_sharded_state_is_collective(world2, tmp_path):
    for message, on_every_rank in world2.run(preflight_case, str(tmp_path)):
        assert message.startswith(f"rank 1: checkpoint directory '{tmp_path}' has 1 B free; one checkpoint")
        assert "(all ranks' files together)" in message and on_every_rank
