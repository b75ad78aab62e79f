"""Checkpoints saved in the background (`save_checkpoint(..., blocking=False)`): the same bytes as a
blocking save while training goes on, failures reported by `wait()` with `latest` untouched, a
kill -9 during the save leaves `latest` complete, and the interpreter waits for a save in flight.
Also: the checksum a save records is computed from memory and equals the file's."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

import fspeed as fs
from fspeed.checkpoint import AsyncSave, CheckpointError, latest_tag, load_checkpoint, save_checkpoint
from fspeed.checkpoint.tensor_file import SAFETENSORS_DTYPES, file_info, write_tensor_file
from fspeed.parallel import zero
from tests.parallel_cases import global_batch, gpt_setup, make_opt
from tests.test_checkpoint import assert_states_equal, fresh, python, run


def files_of(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@given(shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=5),
       dtypes=st.lists(st.sampled_from(sorted(SAFETENSORS_DTYPES, key=str)), min_size=5, max_size=5),
       seed=st.integers(0, 2**16))
def test_the_recorded_checksum_is_the_written_files(tmp_path_factory, shapes, dtypes, seed):
    generator = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": (torch.rand(shape, generator=generator) * 100).to(dtype)
               for i, (shape, dtype) in enumerate(zip(shapes, dtypes))}
    path = tmp_path_factory.mktemp("file") / "x.safetensors"
    assert write_tensor_file(path, tensors, "test") == file_info(path)


def test_a_background_save_writes_the_bytes_of_a_blocking_save_while_training_goes_on(tmp_path):
    state = run(fresh(), 0, 2)
    save_checkpoint(tmp_path / "blocking", state, client_state={"note": "x", "t": torch.arange(3)})
    client = {"note": "x", "t": torch.arange(3)}
    pending = save_checkpoint(tmp_path / "background", state, client_state=client, blocking=False)
    assert isinstance(pending, AsyncSave)
    client["t"].add_(10)  # the save holds its own copies: later changes do not reach it
    state = run(state, 2, 4)  # donates the saved state's buffers while the thread writes
    path = pending.wait()
    assert pending.done() and not pending.failed() and path == tmp_path / "background" / "global_step2"
    assert files_of(path) == files_of(tmp_path / "blocking" / "global_step2")
    assert latest_tag(tmp_path / "background") == "global_step2"
    resumed, saved_client = load_checkpoint(tmp_path / "background", fresh())
    assert saved_client["t"].tolist() == [0, 1, 2]
    assert_states_equal(run(resumed, 2, 4), state)


def test_a_failed_background_save_is_raised_by_wait_and_latest_stays(tmp_path):
    save_checkpoint(tmp_path, run(fresh(), 0, 1))
    broken = run(fresh(), 0, 2)
    broken.params.buffer[0] = float("nan")
    pending = save_checkpoint(tmp_path, broken, blocking=False)
    with pytest.raises(CheckpointError, match="hold inf or NaN.*'latest' still names global_step1"):
        pending.wait()
    assert pending.failed() and latest_tag(tmp_path) == "global_step1"
    with pytest.raises(TypeError, match="client_state value at 'x' is a object"):  # refused before any copy
        save_checkpoint(tmp_path, fresh(), client_state={"x": object()}, blocking=False)


def test_a_process_killed_during_a_background_save_leaves_latest_complete(tmp_path):
    proc = python("""
        import os, signal, time
        import fspeed.checkpoint.directory as directory
        state = run(fresh(), 0, 2)
        save_checkpoint(sys.argv[1], state, tag="good")
        directory.fsync_dir = lambda path: os.kill(os.getpid(), signal.SIGKILL)
        pending = save_checkpoint(sys.argv[1], run(state, 2, 3), tag="next", blocking=False)
        time.sleep(60)
    """, str(tmp_path), check=False)
    assert proc.returncode == -9, proc.stderr
    assert latest_tag(tmp_path) == "good"
    state, _ = load_checkpoint(tmp_path, fresh())
    assert_states_equal(state, run(fresh(), 0, 2))


def test_the_interpreter_waits_for_a_save_in_flight(tmp_path):
    python("""
        import time
        import fspeed.checkpoint.state_io as state_io
        real = state_io.write_tensor_file
        def slow(*args):
            time.sleep(1.0)
            return real(*args)
        state_io.write_tensor_file = slow
        save_checkpoint(sys.argv[1], run(fresh(), 0, 2), blocking=False)
    """, str(tmp_path))  # the script ends without waiting
    assert latest_tag(tmp_path) == "global_step2"
    state, _ = load_checkpoint(tmp_path, fresh())
    assert_states_equal(state, run(fresh(), 0, 2))


def background_sharded_case(directory, stage):
    """A sharded background save (its collectives on their own group) while the ranks train on and
    run their own collectives: the same files as a blocking save."""
    import fspeed.checkpoint.state_io as state_io
    mesh = fs.Mesh(data=-1)
    seed, dp, rank = 3, mesh.size("data"), mesh.coordinate("data")
    rows = 2 * dp
    cfg, model, params = gpt_setup(seed)
    opt = make_opt("adamw")
    plan = zero(stage, param_persistence_threshold=0)
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh, logical_axes=model.logical_axes)
    step = fs.make_train_step(model.loss, opt, grad_accum=2, plan=plan, mesh=mesh)

    def steps(state, start, stop):
        for i in range(start, stop):
            batch = global_batch(cfg, rows, seed, i)
            state, _ = step(state, {k: v[rank * rows // dp:(rank + 1) * rows // dp] for k, v in batch.items()})
        return state
    state = steps(state, 0, 2)
    save_checkpoint(Path(directory) / "blocking", state, mesh=mesh)
    real = state_io.write_tensor_file
    state_io.write_tensor_file = lambda *args: (__import__("time").sleep(0.5), real(*args))[1]
    try:
        pending = save_checkpoint(Path(directory) / "background", state, mesh=mesh, blocking=False)
        state = steps(state, 2, 4)  # training's collectives while the save's run on the other group
        path = pending.wait()
    finally:
        state_io.write_tensor_file = real
    return str(path)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_sharded_background_save_equals_a_blocking_one(world2, tmp_path, stage):
    results = world2.run(background_sharded_case, str(tmp_path), stage)
    for path in results:
        assert path == str(tmp_path / "background" / "global_step2")
    assert files_of(tmp_path / "background" / "global_step2") == files_of(tmp_path / "blocking" / "global_step2")
    assert latest_tag(tmp_path / "background") == "global_step2"


@pytest.mark.parametrize("launch", [False, True], ids=["one process", "ZeRO-3 on 2 ranks"])
def test_fspeed_train_with_async_saves_writes_the_checkpoints_of_blocking_saves(tmp_path, launch):
    """checkpoint.async_save=true: every periodic checkpoint and the final one have the tensor files of
    a blocking run's, byte for byte, and its metadata but for the run's timings (the periodic ones
    written while training went on)."""
    from fspeed import fault_injection as fi
    parallel = fi.ZERO3_TWO_RANKS if launch else ()
    runs = {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        command = fi.train_command((*fi.TINY_RUN, *parallel, "train.steps=6", "checkpoint.save_every=2",
                                    f"checkpoint.async_save={mode}", f"hydra.run.dir={out}"), launch=launch)
        code, output = fi.run(command, cwd=tmp_path, log=tmp_path / f"{mode}.log", timeout_s=300)
        assert code == 0, output[-3000:]
        runs[mode] = (out / "checkpoints", output)
    (blocking, _), (background, log) = runs["false"], runs["true"]
    assert "written in the background" in log
    tags = sorted(p.name for p in blocking.iterdir() if p.name.startswith("global_step"))
    assert tags == ["global_step2", "global_step4", "global_step6"]
    assert sorted(p.name for p in background.iterdir() if p.name.startswith("global_step")) == tags
    for tag in tags:
        saved, expected = files_of(background / tag), files_of(blocking / tag)
        metas = [json.loads(files.pop("meta.json")) for files in (saved, expected)]
        for meta in metas:  # the run's own timings (goodput's useful seconds) differ between any two runs
            del meta["client_state"]["goodput"], meta["meta_sha256"]
        assert saved == expected and metas[0] == metas[1], tag
