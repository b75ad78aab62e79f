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
