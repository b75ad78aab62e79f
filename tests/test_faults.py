"""Faults injected into real fspeed-train runs, and every user error as one message with exit code 2.

A few trials each (benchmarks/fault_injection.py runs many, with the same `fspeed.fault_injection`
harness): kill -9 during training and saving (one process; a 2-rank ZeRO-3 rank), the torchrun
agent or the launcher killed, a full disk, a stopped rank. Each guarantee is tested here end to end
and in its module's own tests: the checkpoint directory checked before training (test_checkpoint),
no orphaned workers, an interrupted overwrite recovered on resume and crashed saves cleaned up with
keep_last (test_checkpoint), user errors as one message (test_config), divergence stopped and never
checkpointed (test_train_step, test_checkpoint), verified checkpoints (test_checkpoint), binary
corpora refused (test_data), and files readable under the umask (test_checkpoint).
"""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fspeed import fault_injection as fi
from fspeed.checkpoint import latest_tag, read_meta


def train(*overrides: str, cwd: Path, launch: bool = False, **popen) -> subprocess.Popen:
    return subprocess.Popen(fi.train_command(overrides, launch=launch), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, **popen)


# ------------------------------------------------------------------------------ user errors

def test_every_user_error_is_one_message_and_exit_2_before_training(tmp_path):
    """An unwritable checkpoint.dir, a config error, a checkpoint that cannot be loaded and a binary
    corpus each end fspeed-train before training with one message and exit code 2 (an empty or
    directory corpus and a file as checkpoint.dir take the same paths: test_data, test_checkpoint)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    (tmp_path / "short.txt").write_text("too short\n")
    (tmp_path / "binary.bin").write_bytes(b"hello\xff\xfe world " * 300)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "latest").write_bytes(b"\x89PNG\x00\xff")
    base = (*fi.TINY_RUN, "train.steps=200", f"data.corpus={corpus}")
    cases = {  # name: (overrides, --launch, expected exit code, texts the output must hold)
        "unwritable dir": (["checkpoint.dir=/proc/fspeed-ck"], False, 2,
                           ["checkpoint.dir: cannot create the checkpoint directory '/proc/fspeed-ck'"]),
        "missing corpus": ([f"data.corpus={tmp_path / 'nope.txt'}"], False, 2,
                           [f"data.corpus = '{tmp_path / 'nope.txt'}': does not exist"]),
        "seq_len": ([f"data.corpus={tmp_path / 'short.txt'}"], False, 2, ["too short for model.seq_len=32"]),
        "binary corpus": ([f"data.corpus={tmp_path / 'binary.bin'}"], False, 2,
                          ["is not valid UTF-8: the first bad byte is 0xff at byte offset 5", "data.errors=replace"]),
        "group option": (["optimizer=adamx"], False, 2, ["unknown optimizer option", "did you mean optimizer=adam?"]),
        "bad checkpoint": ([f"checkpoint.dir={broken}", "checkpoint.resume=true"], False, 2,
                           [f"checkpoint error: {broken / 'latest'} is corrupted: it is not text"]),
        "launch value": (["parallel.data=2", "optimizer.lr=-1"], True, 2, ["optimizer.lr = -1: must be > 0"]),
        "debug": (["--debug", f"data.corpus={tmp_path / 'nope.txt'}"], False, 1, ["Traceback", "does not exist"]),
        "byte tokenizer reads a binary corpus": (
            [f"data.corpus={tmp_path / 'binary.bin'}", "data.tokenizer=byte", "train.steps=2",
             f"hydra.run.dir={tmp_path / 'bytes'}"], False, 0, ["vocab 256 (byte)"]),
    }
    procs = {name: train(*base, *overrides, cwd=tmp_path, launch=launch)
             for name, (overrides, launch, _, _) in cases.items()}
    outputs = {name: proc.communicate(timeout=300)[0] for name, proc in procs.items()}
    for name, proc in procs.items():
        output, (_, _, code, texts) = outputs[name], cases[name]
        assert proc.returncode == code, f"{name}: exit {proc.returncode}\n{output[-3000:]}"
        for text in texts:
            assert text in output, f"{name}: {text!r} missing from\n{output[-3000:]}"
        if code == 2:
            assert "Traceback" not in output and "Error executing job" not in output, f"{name}:\n{output[-3000:]}"
            assert "val_loss" not in output, f"{name} trained:\n{output[-3000:]}"
    # with --launch a value error was printed once per rank; now once, before any rank starts
    assert outputs["launch value"].count("must be > 0") == 1 and "world size" not in outputs["launch value"]


# ------------------------------------------------------------------------- nothing is lost

def test_kill9_during_training_and_saving_then_resume_is_bit_identical(tmp_path):
    reference, window = fi.reference_run(fi.ONE_PROCESS, tmp_path / "reference")
    for seed in (18, 19):  # a second draw only if the first landed after the last save
        trial = fi.kill9_trial(fi.ONE_PROCESS, tmp_path / f"trial{seed}", reference, window / 2, random.Random(seed))
        if trial.numbers.get("counted"):
            break
    assert trial.ok and trial.numbers.get("counted"), trial.detail


def test_kill9_of_a_zero3_rank_then_resume(tmp_path):
    trial = fi.kill9_trial(fi.ZERO3, tmp_path, None, 1.0, random.Random(18))  # well before its last save
    assert trial.ok and trial.numbers.get("counted"), trial.detail


def test_a_full_disk_stops_the_run_naming_the_path_and_keeps_latest(tmp_path):
    """'A failed save never loses the run': ENOSPC on a real tmpfs where the machine allows."""
    trial = fi.disk_full_trial(fi.ONE_PROCESS, tmp_path, None)
    assert trial.ok, trial.detail


def test_a_stopped_rank_is_named_and_no_worker_is_left(tmp_path):
    trial = fi.sigstop_trial(fi.ZERO3_SHORT_TIMEOUT, tmp_path, random.Random(18), resume=False, shutdown_s=3)
    assert trial.ok, trial.detail


SLEEPER = textwrap.dedent("""
    import time
    time.sleep(600)
""")


@pytest.mark.parametrize("target", ["agent", "launcher"])
def test_no_worker_outlives_its_agent_or_the_launcher(tmp_path, target):
    """Killing the torchrun agent or the launcher with SIGKILL leaves no worker running."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    command = [sys.executable, "-m", "fspeed.cli.launch", "--num_gpus", "2", str(script)]
    trial = fi.orphan_trial(command, tmp_path, target, world_size=2)
    assert trial.ok and trial.orphans == 0, trial.detail


def test_resume_recovers_an_interrupted_overwrite_cleans_up_and_keeps_the_last_n(tmp_path):
    """Resume goes through the checkpoint directory's protocol (an interrupted overwrite is restored
    from its old copy, not read half-written), leftovers of crashed saves are removed, keep_last keeps
    the newest, and the files are readable by others (0644 under the default umask)."""
    ck = tmp_path / "ck"
    common = (*fi.TINY_RUN, "checkpoint.save_every=1", f"checkpoint.dir={ck}")
    first = train(*common, "train.steps=3", f"hydra.run.dir={tmp_path / 'first'}", cwd=tmp_path)
    output, _ = first.communicate(timeout=300)
    assert first.returncode == 0, output[-3000:]
    os.mkdir(ck / ".global_step3.old-crash")  # an overwrite of global_step3 interrupted between its renames
    os.rename(ck / "global_step3", ck / ".global_step3.old-crash" / "global_step3")
    (ck / ".global_step9.tmp-dead").mkdir()
    (ck / ".global_step9.tmp-dead" / "tensors.safetensors").write_bytes(b"\0" * 100_000)
    resumed = train(*common, "train.steps=5", "checkpoint.resume=true", "checkpoint.keep_last=2",
                    f"hydra.run.dir={tmp_path / 'resumed'}", cwd=tmp_path, preexec_fn=lambda: os.umask(0o022))
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output[-3000:]
    assert "restored its previous copy from .global_step3.old-crash" in output
    assert "removed .global_step9.tmp-dead, left by an interrupted save" in output
    assert "resumed from" in output and "at step 3" in output
    assert sorted(p.name for p in ck.iterdir()) == ["global_step4", "global_step5", "latest"]
    assert stat.S_IMODE((ck / "global_step5").stat().st_mode) == 0o755
    assert stat.S_IMODE((ck / "global_step5" / "tensors.safetensors").stat().st_mode) == 0o644


def test_divergence_stops_naming_the_step_and_latest_stays_finite(tmp_path):
    """lr=1e6 without clipping diverges: the run stops with exit code 2 and a message naming the step,
    and `latest` names a checkpoint whose tensors are all finite."""
    ck = tmp_path / "ck"
    proc = train(*fi.TINY_RUN, "optimizer.lr=1000000", "scheduler=constant", "train.gradient_clipping=0",
                 "train.steps=50", f"checkpoint.dir={ck}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, output[-3000:]
    assert "training diverged. The step was not applied" in output and "train.on_nonfinite=skip" in output
    step = read_meta(ck)["step"]
    assert f"the last good step is saved: {ck / latest_tag(ck)}" in output and f"step {step + 1}: the loss" in output
    assert all(bool(torch.isfinite(t).all()) for t in fi.checkpoint_tensors(ck).values() if t.is_floating_point())
