"""Checkpoints: exact resume across processes, atomicity under SIGKILL, corruption errors."""

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fspeed as fs
from fspeed.checkpoint import CheckpointError, latest_tag, load_checkpoint, save_checkpoint
from fspeed.checkpoint.meta import write_meta

# A tiny but complete training setup shared by this process and the subprocesses below.
SETUP = textwrap.dedent("""
    import sys, torch, fspeed as fs
    from fspeed.checkpoint import save_checkpoint, load_checkpoint
    cfg = fs.models.GPTConfig(vocab_size=31, seq_len=8, n_layer=2, n_head=2, d_model=16, dropout=0.1)
    model = fs.models.gpt(cfg)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.5),
                         fs.optim.adamw(fs.optim.warmup_cosine(3e-2, total_num_steps=12, num_steps=3), weight_decay=0.1))
    step_fn = fs.make_train_step(model.loss, opt, grad_accum=2)

    def batch(i):
        x = torch.randint(0, 31, (4, 9), generator=torch.Generator().manual_seed(1000 + i))
        return {"inputs": x[:, :-1], "targets": x[:, 1:]}

    def fresh(precision=fs.precision.fp32()):
        return fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt, precision=precision, seed=3)

    def run(state, start, stop):
        for i in range(start, stop):
            state, _ = step_fn(state, batch(i))
        return state
""")
exec(SETUP)  # noqa: S102 - defines model, opt, batch, fresh, run in this module too


def python(code: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONHASHSEED="0")
    # the same torch thread count as this process, whose own runs the subprocess's are compared with bit for bit
    threads = f"import torch; torch.set_num_threads({torch.get_num_threads()})\n"
    return subprocess.run([sys.executable, "-c", threads + SETUP + textwrap.dedent(code), *args],
                          capture_output=True, text=True, env=env, check=check, timeout=120)


def assert_states_equal(a, b):
    ta, sa = fs.checkpoint.state_entries(a)
    tb, sb = fs.checkpoint.state_entries(b)
    assert sa == sb
    assert ta.keys() == tb.keys()
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


def test_resume_in_a_new_process_is_bit_exact(tmp_path):
    straight = run(fresh(), 0, 10)
    python("""
        state = run(fresh(), 0, 4)
        save_checkpoint(sys.argv[1], state, client_state={"note": "resume test", "t": torch.arange(3)})
    """, str(tmp_path / "ck"))
    python("""
        state, client = load_checkpoint(sys.argv[1], fresh())
        assert client["note"] == "resume test" and client["t"].tolist() == [0, 1, 2]
        assert state.step == 4, state.step
        state = run(state, 4, 10)
        save_checkpoint(sys.argv[1], state, tag="final")
    """, str(tmp_path / "ck"))
    resumed, _ = load_checkpoint(tmp_path / "ck", fresh(), tag="final")
    assert_states_equal(straight, resumed)


@pytest.mark.parametrize("where", ["writing tensors", "before rename", "before latest"])
def test_a_process_killed_during_save_leaves_the_last_checkpoint(tmp_path, where):
    code = """
        import os, signal
        import fspeed.checkpoint.directory as directory, fspeed.checkpoint.state_io as state_io
        state = run(fresh(), 0, 2)
        save_checkpoint(sys.argv[1], state, tag="good")
        state = run(state, 2, 3)
        die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        where = sys.argv[2]
        if where == "writing tensors":
            real_write = state_io.write_tensor_file
            def half_write(path, tensors, file_format):
                items = list(tensors.items())
                real_write(path, dict(items[: len(items) // 2]), file_format)
                die()
            state_io.write_tensor_file = half_write
        elif where == "before rename":
            directory.fsync_dir = die
        else:
            state_io.write_latest = die
        save_checkpoint(sys.argv[1], state, tag="good" if where == "before rename" else "next")
    """
    proc = python(code, str(tmp_path), where, check=False)
    assert proc.returncode == -9, proc.stderr
    assert latest_tag(tmp_path) == "good"
    state, _ = load_checkpoint(tmp_path, fresh())
    assert state.step == 2
    assert_states_equal(state, run(fresh(), 0, 2))


def test_overwriting_a_tag_and_recovering_an_interrupted_overwrite(tmp_path):
    save_checkpoint(tmp_path, run(fresh(), 0, 1), tag="t")
    save_checkpoint(tmp_path, run(fresh(), 0, 2), tag="t")
    assert load_checkpoint(tmp_path, fresh())[0].step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t"]
    # simulate a crash between moving the old copy aside and renaming the new one in
    aside = tmp_path / ".t.old-crash"
    aside.mkdir()
    os.rename(tmp_path / "t", aside / "t")
    assert load_checkpoint(tmp_path, fresh())[0].step == 2


def test_corrupted_and_truncated_files_name_the_file(tmp_path):
    path = save_checkpoint(tmp_path, run(fresh(), 0, 1))
    tensors = path / "tensors.safetensors"
    data = tensors.read_bytes()

    tensors.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="tensors.safetensors is truncated"):
        load_checkpoint(tmp_path, fresh())

    flipped = bytearray(data)
    flipped[-100] ^= 0xFF
    tensors.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="tensors.safetensors is corrupted"):
        load_checkpoint(tmp_path, fresh())

    tensors.write_bytes(data)
    meta = path / "meta.json"
    meta.write_text(meta.read_text()[:50])
    with pytest.raises(CheckpointError, match="meta.json is truncated or corrupted"):
        load_checkpoint(tmp_path, fresh())


def test_unreadable_safetensors_header_names_the_file(tmp_path):
    path = save_checkpoint(tmp_path, run(fresh(), 0, 1))
    tensors = path / "tensors.safetensors"
    garbage = b"\xff" * tensors.stat().st_size
    tensors.write_bytes(garbage)
    meta = fs.checkpoint.read_meta(tmp_path)
    meta["files"]["tensors.safetensors"]["sha256"] = fs.checkpoint.tensor_file.sha256_of(tensors)  # pass the checksum
    write_meta(path, meta)
    with pytest.raises(CheckpointError, match="cannot be read as safetensors"):
        load_checkpoint(tmp_path, fresh())


def test_missing_checkpoint_and_mismatched_state(tmp_path):
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        load_checkpoint(tmp_path, fresh())
    save_checkpoint(tmp_path, run(fresh(), 0, 1))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path, fresh(), tag="nope")
    sgd_state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), fs.optim.sgd(0.1, 0.9))
    with pytest.raises(CheckpointError, match="tensors missing"):
        load_checkpoint(tmp_path, sgd_state)
    weights, _ = load_checkpoint(tmp_path, sgd_state, load_optimizer_states=False)
    assert torch.equal(weights.params.buffer, run(fresh(), 0, 1).params.buffer)
    with pytest.raises(ValueError, match="tag"):
        save_checkpoint(tmp_path, fresh(), tag="../escape")
    with pytest.raises(TypeError, match="client_state value"):
        save_checkpoint(tmp_path, fresh(), client_state={"f": object()})


def test_checkpoints_move_between_precisions(tmp_path, caplog):
    """Loading a checkpoint saved under another precision is an explicit, logged conversion."""
    bf16 = run(fresh(fs.precision.bf16()), 0, 2)
    save_checkpoint(tmp_path / "bf16", bf16)
    with caplog.at_level(logging.WARNING, logger="fspeed"):
        as_fp32, _ = load_checkpoint(tmp_path / "bf16", fresh())
    assert torch.equal(as_fp32.params.buffer, bf16.master.buffer)  # fp32 masters are preferred
    assert "saved with precision bf16; converting it to this state's fp32" in caplog.text
    as_fp16, _ = load_checkpoint(tmp_path / "bf16", fresh(fs.precision.fp16()))
    assert torch.equal(as_fp16.params.buffer, bf16.master.buffer.half())  # cast from the masters, not bf16

    fp32 = run(fresh(), 0, 2)
    save_checkpoint(tmp_path / "fp32", fp32)
    as_fp16, _ = load_checkpoint(tmp_path / "fp32", fresh(fs.precision.fp16()))
    assert torch.equal(as_fp16.master.buffer, fp32.params.buffer)
    assert torch.equal(as_fp16.params.buffer, fp32.params.buffer.half())
    assert as_fp16.loss_scale.scale == 2.0**16  # the fp32 run had no scaler to restore


def test_files_store_tensors_by_parameter_path(tmp_path):
    from safetensors import safe_open

    path = save_checkpoint(tmp_path, run(fresh(), 0, 1))
    with safe_open(str(path / "tensors.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert "params/blocks.1.attn.wqkv" in keys and "opt_state.1.mu/wte" in keys
        assert list(f.get_tensor("params/wte").shape) == [31, 16]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["scalars"]["step"] == 1 and meta["scalars"]["opt_state.1.count"] == 1
    assert Path(path).name == "global_step1"


# ------------------------------------------------------------------------------------------------
# a checkpoint is verified whole, a failed save loses nothing, crashed saves are cleaned up


def resign(path, meta):
    """Rewrite meta.json with a valid checksum (what a buggy or hostile writer could produce)."""
    meta.pop("meta_sha256", None)
    write_meta(path, meta)


def test_meta_json_has_a_schema_and_a_checksum_and_errors_name_the_file_and_field(tmp_path):
    """A wrongly typed field (`"step": "five"`) or a missing one (client_state) is an error naming the
    file and the field."""
    path = save_checkpoint(tmp_path, run(fresh(), 0, 1))
    meta_file = path / "meta.json"
    good = json.loads(meta_file.read_text())
    meta_file.write_text(meta_file.read_text().replace('"step": 1', '"step": 2', 1))  # an edit without re-signing
    with pytest.raises(CheckpointError, match=r"meta.json is corrupted: its content does not match the checksum"):
        load_checkpoint(tmp_path, fresh())
    for field, value, message in [("step", "five", r"field 'step' must be an integer >= 0, got str \"five\""),
                                  ("client_state", None, "field 'client_state' is missing"),
                                  ("files", {"../x": {"bytes": 1, "sha256": "0" * 64}}, "field 'files' must be")]:
        meta = dict(good)
        if value is None:
            del meta[field]
        else:
            meta[field] = value
        resign(path, meta)
        with pytest.raises(CheckpointError, match=f"{meta_file}: {message}"):
            load_checkpoint(tmp_path, fresh())


@pytest.mark.parametrize("key, dtype", [("params/wte", torch.int64), ("opt_state.1.mu/wte", torch.bfloat16)])
def test_a_tensor_of_another_dtype_is_refused_even_with_a_valid_checksum(tmp_path, key, dtype):
    """A tensor of another dtype than the state's (int64 for fp32 params) is refused, even when the
    checksum is valid."""
    from fspeed.checkpoint.tensor_file import file_info, write_tensor_file

    path = save_checkpoint(tmp_path, run(fresh(), 0, 1))
    tensors, _ = fs.checkpoint.state_entries(run(fresh(), 0, 1))
    tensors[key] = tensors[key].to(dtype)
    write_tensor_file(path / "tensors.safetensors", tensors, fs.checkpoint.FORMAT)
    meta = fs.checkpoint.read_meta(tmp_path)
    meta["files"]["tensors.safetensors"] = file_info(path / "tensors.safetensors")
    resign(path, meta)
    with pytest.raises(CheckpointError, match=f"tensors.safetensors: tensor '{key}' is {dtype}, the state's"):
        load_checkpoint(tmp_path, fresh())


def test_a_binary_latest_and_a_file_as_directory_are_named(tmp_path):
    """A binary `latest` file and a regular file given as the checkpoint directory are named in the error."""
    save_checkpoint(tmp_path, run(fresh(), 0, 1))
    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'latest'} is corrupted: it is not text"):
        load_checkpoint(tmp_path, fresh())
    (tmp_path / "file").write_text("x")
    for call in (lambda: save_checkpoint(tmp_path / "file", fresh()), lambda: fs.checkpoint.preflight(tmp_path / "file", fresh())):
        with pytest.raises(CheckpointError, match="'.*file' is a regular file, not a directory"):
            call()


def test_a_failed_save_names_the_path_and_the_cause_and_keeps_latest(tmp_path, monkeypatch):
    """A failed save (ENOSPC) names the path and the cause, and `latest` still names the previous
    checkpoint: a failed save never loses the run."""
    import fspeed.checkpoint.state_io as state_io

    save_checkpoint(tmp_path, run(fresh(), 0, 1))
    def full_disk(path, tensors, file_format):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(state_io, "write_tensor_file", full_disk)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, run(fresh(), 0, 2))
    text = str(info.value)
    assert f"saving checkpoint {tmp_path / 'global_step2'} failed: '{tmp_path}/.global_step2.tmp-" in text
    assert "No space left on device (ENOSPC); 'latest' still names global_step1 (untouched)" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step1", "latest"]  # no temporary left


def test_a_state_holding_nan_is_never_saved(tmp_path):
    """A state holding NaN is refused by save, and `latest` is left as it was."""
    save_checkpoint(tmp_path, run(fresh(), 0, 1))
    broken = run(fresh(), 0, 2)
    broken.params.buffer[3] = float("nan")
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) hold inf or NaN \(e.g. params/.*never published; "
                                              "'latest' still names global_step1"):
        save_checkpoint(tmp_path, broken)
    assert latest_tag(tmp_path) == "global_step1" and not (tmp_path / "global_step2").exists()


def test_crashed_saves_are_cleaned_up_and_keep_last_retains_the_newest(tmp_path, caplog):
    """Leftovers of crashed saves are removed (a save still in progress, holding its lock, is left
    alone), an overwrite interrupted between its renames is restored, and keep_last keeps the newest."""
    save_checkpoint(tmp_path, run(fresh(), 0, 1), tag="best")
    (tmp_path / ".global_step9.tmp-dead").mkdir()
    (tmp_path / ".global_step9.tmp-dead" / "tensors.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / ".latest.tmp-dead").write_text("global_step9")
    os.mkdir(tmp_path / ".best.old-crash")  # an overwrite of `best` interrupted between its two renames
    os.rename(tmp_path / "best", tmp_path / ".best.old-crash" / "best")
    (tmp_path / ".global_step8.tmp-live").mkdir()  # a save in progress in another process: it holds the lock
    live = fs.checkpoint.directory.lock(tmp_path / ".global_step8.tmp-live")
    state = fresh()
    with caplog.at_level(logging.INFO, logger="fspeed"):
        for i in range(4):
            state = run(state, i, i + 1)
            save_checkpoint(tmp_path, state, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".global_step8.tmp-live", "best", "global_step3", "global_step4", "latest"]
    fs.checkpoint.directory.unlock(live)  # that process died: its leftover goes at the next load
    load_checkpoint(tmp_path, fresh())
    assert not (tmp_path / ".global_step8.tmp-live").exists()
    assert "restored its previous copy from .best.old-crash" in caplog.text
    assert "removed .global_step9.tmp-dead, left by an interrupted save" in caplog.text
    assert "keep_last=2: removed the checkpoint" in caplog.text and "global_step2" in caplog.text
    assert load_checkpoint(tmp_path, fresh(), tag="best")[0].step == 1


def test_checkpoints_are_created_with_the_umask(tmp_path):
    """Checkpoint directories and files follow the umask (not mkdtemp's 0700), so other accounts can
    read a team's checkpoints."""
    old = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path, run(fresh(), 0, 1))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in [*path.iterdir(), tmp_path / "latest"]} == {0o644}


def test_preflight_finds_an_unwritable_or_full_directory_before_training(tmp_path, monkeypatch):
    """An unwritable or full checkpoint.dir is found by the preflight check, before training starts."""
    import fspeed.checkpoint.preflight_checks as preflight_module

    state = fresh()
    fs.checkpoint.preflight(tmp_path / "new" / "dir", state)  # creates it, leaves nothing behind
    assert list((tmp_path / "new" / "dir").iterdir()) == []
    with pytest.raises(CheckpointError, match="cannot create the checkpoint directory '/proc/fspeed-ck'"):
        fs.checkpoint.preflight("/proc/fspeed-ck", state)
    needed = fs.checkpoint.checkpoint_bytes(state)
    monkeypatch.setattr(preflight_module.shutil, "disk_usage", lambda p: shutil_usage(free=needed - 1))
    with pytest.raises(CheckpointError, match=r"has .* free; one checkpoint of this state needs"):
        fs.checkpoint.preflight(tmp_path, state)


def shutil_usage(free):
    import shutil

    return shutil._ntuple_diskusage(total=10 * free, used=9 * free, free=free)
