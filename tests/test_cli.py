"""fspeed-train end to end, in subprocesses: a short run, resume, config errors, --cfg job, DeepSpeed configs."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

EXE = shutil.which("fspeed-train") or ""


def fspeed_train(*args: str, cwd, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run fspeed-train; a user error is then one message and exit code 2 (HYDRA_FULL_ERROR is unset)."""
    cmd = [EXE, *args] if EXE else [sys.executable, "-m", "fspeed.cli.train", *args]
    full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full_env.update(env or {})
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


def test_short_run_writes_metrics_and_checkpoint_then_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc = fspeed_train("train.steps=20", "train.eval_every=10", "data.max_bytes=400000",
                        f"hydra.run.dir={run_dir}", "monitor.progress_bar=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == [str(i) for i in range(21)]  # step 0 = validation before training
    assert rows[10]["val_loss"] and rows[20]["val_loss"] and not rows[5]["val_loss"]
    assert float(rows[20]["val_loss"]) < float(rows[0]["val_loss"])
    assert all(float(r["tokens_per_s"]) > 0 for r in rows[1:])
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text() == "global_step20"
    assert "metrics:" in proc.stdout and "checkpoint:" in proc.stdout and str(ckpt) in proc.stdout

    proc = fspeed_train("train.steps=24", "train.eval_every=0", "data.max_bytes=400000", f"checkpoint.dir={ckpt}",
                        "checkpoint.resume=true", f"hydra.run.dir={tmp_path / 'resumed'}",
                        "monitor.progress_bar=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = proc.stdout + proc.stderr  # Hydra routes logging to stdout
    assert "resumed from" in logs and "at step 20" in logs
    assert (ckpt / "latest").read_text() == "global_step24"
    with open(tmp_path / "resumed" / "metrics.csv") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["20", "21", "22", "23", "24"]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.stepz=5", ["train.stepz", "steps"]),
        ("+typo=1", ["typo"]),
        ("optimizer.lr=-0.1", ["optimizer.lr", "-0.1"]),
        ("optimizer=adamz", ["adamz", "adamw", "lamb", "sgd"]),
        ("train.train_batch_size=100", ["100", "divisible"]),
        ("train.device=tpu", ["train.device", "tpu", "cuda"]),
        pytest.param("train.device=cuda", ["train.device", "needs a CUDA GPU", "cpu"],
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    ],
)
def test_bad_config_fails_before_training_with_a_clear_message(tmp_path, override, expected):
    proc = fspeed_train(override, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    for text in expected:
        assert text in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_cfg_job_prints_the_composed_config_with_a_deepspeed_file(tmp_path):
    ds = {
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 16, "gradient_clipping": 0.5,
        "optimizer": {"type": "Lamb", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20}},
        "bf16": {"enabled": True},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    proc = fspeed_train(f"deepspeed_config={path}", "optimizer.lr=1e-3", "--cfg", "job", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "name: lamb" in out and "lr: 0.001" in out  # the command line wins over the file
    assert "name: bf16" in out and "train_batch_size: 64" in out and "gradient_clipping: 0.5" in out
    assert "DeepSpeed config translated" in proc.stderr

    ds["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "nvme"}}
    ds["gradient_clippping"] = 1.0
    path.write_text(json.dumps(ds))
    proc = fspeed_train(f"deepspeed_config={path}", "--cfg", "job", cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "zero_optimization" in proc.stderr and "gradient_clippping" in proc.stderr
    assert "gradient_clipping" in proc.stderr  # did-you-mean


def test_launch_runs_zero3_on_two_ranks(tmp_path):
    proc = fspeed_train("--launch", "zero.stage=3", "zero.param_persistence_threshold=1000", "parallel.data=2",
                        "train.steps=4", "train.eval_every=2", "data.max_bytes=300000", "model.n_layer=2",
                        f"hydra.run.dir={tmp_path / 'run'}", "monitor.progress_bar=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "zero(stage=3)" in proc.stdout + proc.stderr and "data=2" in proc.stdout + proc.stderr
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4"]  # rank 0 alone writes
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text() == "global_step4"
    assert sorted(p.name for p in (ckpt / "global_step4").iterdir()) == [
        "meta.json", "rank_00000.safetensors", "rank_00001.safetensors"]

    # resumed in another layout (ZeRO-1 on 2 pipeline stages), then its weights exported and a one-process
    # run started from them
    proc = fspeed_train("--launch", "zero.stage=1", "parallel.pipe=2", "pipeline.micro_batches=2",
                        "pipeline.partition=profile",
                        "train.steps=6", "train.eval_every=2", "data.max_bytes=300000", "model.n_layer=2",
                        "checkpoint.resume=true", f"checkpoint.dir={ckpt}", f"hydra.run.dir={tmp_path / 'resumed'}",
                        "monitor.progress_bar=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr and "at step 4" in proc.stdout + proc.stderr
    assert re.search(r"pipeline\(micro_batches=2, schedule='1f1b', partition=\(\d+, \d+\)\)", proc.stdout + proc.stderr)
    with open(tmp_path / "resumed" / "metrics.csv") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["4", "5", "6"]
    export = subprocess.run([shutil.which("fspeed-export") or "fspeed-export", str(ckpt / "latest"),
                             str(tmp_path / "model.safetensors"), "--dtype", "bf16"], capture_output=True, text=True)
    assert export.returncode == 0 and "model.safetensors" in export.stdout, export.stderr
    proc = fspeed_train("train.steps=1", "train.eval_every=0", "data.max_bytes=300000", "model.n_layer=2",
                        f"checkpoint.init_from={tmp_path / 'model.safetensors'}", f"hydra.run.dir={tmp_path / 'tuned'}",
                        "monitor.progress_bar=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "weights from" in proc.stdout + proc.stderr

    proc = fspeed_train("--launch", "zero.stage=1", "train.steps=2", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "--launch needs the number of data-parallel ranks" in proc.stderr


TINY = ("model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=32", "train.micro_batch_size=4",
        "train.eval_every=0", "train.eval_batches=1", "monitor.progress_bar=false", "monitor.csv=false")


def test_resume_without_a_checkpoint_says_so_and_required_refuses_and_the_padded_vocabulary_is_named(tmp_path):
    from safetensors import safe_open

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)  # 28 characters: 32 rows
    run = tmp_path / "run"
    proc = fspeed_train(*TINY, f"data.corpus={corpus}", "train.steps=2", "checkpoint.resume=true",
                        f"hydra.run.dir={run}", cwd=tmp_path)
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0, logs[-3000:]
    assert (f"checkpoint.resume=true, but there is no checkpoint in {run / 'checkpoints'} (no 'latest' file): "
            "training starts from step 0; checkpoint.dir is this run's own new directory (the default)") in logs
    assert "vocab 28 (char; the embedding has 32 rows, padded to a multiple of 8)" in logs
    assert "scheduler.warmup_num_steps=50 is longer than the run (train.steps=2)" in logs
    assert "UserWarning" not in logs and "build.py" not in logs
    export = subprocess.run([shutil.which("fspeed-export") or "fspeed-export", str(run / "checkpoints"),
                             str(tmp_path / "model.safetensors")], capture_output=True, text=True)
    assert export.returncode == 0 and "wte written with 28 rows, the model's 32 less its padding" in export.stderr
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.get_slice("wte").get_shape() == [28, 32]
        assert json.loads(f.metadata()["fspeed_vocab"])["padded_size"] == 32

    none = tmp_path / "none"
    proc = fspeed_train(*TINY, f"data.corpus={corpus}", "checkpoint.resume=required", f"checkpoint.dir={none}",
                        f"hydra.run.dir={tmp_path / 'required'}", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"checkpoint.resume = 'required': there is no checkpoint in {none} (no 'latest' file)" in proc.stderr
    assert "Traceback" not in proc.stderr and "val_loss" not in proc.stdout + proc.stderr
    nope = tmp_path / "nope.safetensors"
    proc = fspeed_train(*TINY, f"data.corpus={corpus}", f"checkpoint.init_from={nope}",
                        f"hydra.run.dir={tmp_path / 'init'}", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and f"  - checkpoint.init_from: {nope} does not exist" in proc.stderr, proc.stderr


def test_help_names_fspeed_trains_flags_then_hydras_help(tmp_path):
    proc = fspeed_train("--help", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("usage: fspeed-train [--launch] [--debug]")
    for text in ("--launch ", "--debug ", "--hydra-help", "--cfg job", "== Configuration groups ==",
                 "optimizer: adam, adamw", "== Config ==", "fspeed-train is powered by Hydra"):
        assert text in out, text


@pytest.mark.parametrize("parallel, world, expected", [
    ({"pipe": 2}, 1, "parallel.pipe = 2: needs 2 ranks per model replica, and the world size 1 is not a multiple of 2; "
                     "start the ranks with fspeed-train --launch"),
    ({"tensor": 2}, 3, "parallel.tensor = 2: needs 2 ranks per model replica, and the world size 3 is not a multiple "
                       "of 2; launch a multiple of 2 ranks"),
    ({"tensor": 2, "pipe": 2}, 2, "parallel.tensor = 2: needs 4 ranks per model replica (parallel.tensor=2 x "
                                  "parallel.pipe=2), and the world size 2"),
    ({"data": 2, "pipe": 2}, 1, "parallel.data = 2: parallel.data=2 x parallel.pipe=2 = 4 ranks, but the world size "
                                "is 1; start the ranks with fspeed-train --launch"),
    ({"data": 1, "pipe": 2}, 4, "parallel.data = 1: parallel.data=1 x parallel.pipe=2 = 2 ranks, but the world size "
                                "is 4; allowed: 2 or -1"),
])
def test_a_parallel_layout_that_does_not_fit_the_world_names_its_own_key(monkeypatch, parallel, world, expected):
    from omegaconf import OmegaConf

    from fspeed.cli.train import data_parallel_size
    from fspeed.config import ConfigError

    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError) as info:
        data_parallel_size(OmegaConf.create({"parallel": {"data": -1, "tensor": 1, "pipe": 1, **parallel}}))
    assert expected in str(info.value)


@pytest.mark.parametrize("clipping, advice", [
    (1.0, "Lower optimizer.lr, lower train.gradient_clipping (now 1), or set train.on_nonfinite=skip"),
    (0.0, "Lower optimizer.lr, enable train.gradient_clipping (e.g. 1.0; it is 0, off), or set "
          "train.on_nonfinite=skip"),
])
def test_the_divergence_advice_follows_the_clipping_in_use(clipping, advice):
    from fspeed.cli.user_errors import message
    from fspeed.train_step import NonFiniteError

    text = message(NonFiniteError(7, float("nan"), float("nan"), "fp32"), clipping)
    assert text.endswith(advice + " to skip such steps")


def test_a_ranks_error_is_left_where_torchrun_reads_it_for_the_launchers_summary(tmp_path, monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from fspeed.cli.user_errors import exit_with_user_error
    from fspeed.launcher.agent import _worker_message
    from fspeed.train_step import NonFiniteError

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    error = NonFiniteError(7, float("nan"), float("nan"), "fp32")
    error.final_checkpoint = "ck/global_step6"
    with pytest.raises(SystemExit) as info:
        exit_with_user_error(error, rank=1, gradient_clipping=0.5)  # rank 0 prints it; every rank records it
    assert info.value.code == 2 and capsys.readouterr().err == ""
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file=str(tmp_path / "error.json"))
    assert _worker_message(failure) == (f"{error}. Lower optimizer.lr, lower train.gradient_clipping (now 0.5), or set "
                                        "train.on_nonfinite=skip to skip such steps\n"
                                        "the last good step is saved: ck/global_step6")
    assert _worker_message(ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "none"))) is None
