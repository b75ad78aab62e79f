"""fs.initialize's engine writes fspeed-train's monitors (CSV, TensorBoard, W&B) from a ds_config's
blocks, with the wall-clock breakdown, and prints the progress line every steps_per_print steps;
nothing is written unless a block asks."""

import csv
import time

import pytest

import fspeed as fs
from tests.hf_models import cnn_batch, cnn_loss, small_cnn

pytest.importorskip("tensorboard", reason="pip install 'fspeed[monitor]' (the test extra has it)")
pytest.importorskip("wandb", reason="pip install 'fspeed[monitor]' (the test extra has it)")

from tests.test_monitor import tensorboard_scalars, wandb_history  # noqa: E402

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05,
                                                       "warmup_num_steps": 4, "warmup_type": "linear"}}}


def train(config: dict, steps: int = 3) -> tuple:
    """`steps` steps of DeepSpeed's loop (micro-batch by micro-batch); the engine and each step's metrics."""
    engine, *_ = fs.initialize(model=small_cnn(), config=config, loss_fn=cnn_loss)
    metrics = []
    for s in range(steps):
        for i in range(2):
            engine.backward(engine(cnn_batch(2, 10 * s + i)))
            engine.step()
        metrics.append(dict(engine.metrics))
    engine.close()
    return engine, metrics


def test_a_csv_monitor_block_writes_a_row_per_step_and_steps_per_print_prints(tmp_path, capsys):
    config = {**CONFIG, "steps_per_print": 2, "wall_clock_breakdown": True,
              "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
    _, metrics = train(config)
    with open(tmp_path / "job" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert [float(r["loss"]) for r in rows] == [pytest.approx(m["loss"], rel=1e-5) for m in metrics]
    assert [float(r["lr"]) for r in rows] == [pytest.approx(lr) for lr in (0.01, 0.01, 0.02)]  # WarmupLR
    assert [int(r["samples"]) for r in rows] == [4, 8, 12] and all(float(r["fwd_ms"]) > 0 for r in rows)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith("step 2 | loss ") and "time (ms) | fwd: " in printed[0]


def test_tensorboard_and_wandb_blocks_write_their_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # W&B's run goes in the engine's run directory, ./DeepSpeedJobName
    config = {**CONFIG, "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"},
              "wandb": {"enabled": True, "project": "engine"}}
    _, metrics = train(config, steps=2)
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["Train/train_loss"] == [(s + 1, pytest.approx(m["loss"])) for s, m in enumerate(metrics)]
    assert [step for step, _ in scalars["Train/lr"]] == [1, 2]
    deadline = time.monotonic() + 60  # under load wandb's service process can append the rows after finish()
    while sorted(history := wandb_history(tmp_path / "DeepSpeedJobName")) != [1, 2] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert history[2]["Train/train_loss"] == pytest.approx(metrics[1]["loss"])


def test_monitors_are_off_unless_a_block_turns_them_on(tmp_path, monkeypatch, capsys):
    """DeepSpeed's defaults: no files without a monitor block; csv_monitor without output_path writes
    in ./<job_name>, DeepSpeed's place; the progress line every 10 steps by default."""
    monkeypatch.chdir(tmp_path)
    train(CONFIG, steps=2)
    assert list(tmp_path.iterdir()) == [] and capsys.readouterr().out == ""
    train({**CONFIG, "csv_monitor": {"enabled": True}}, steps=1)
    assert (tmp_path / "DeepSpeedJobName" / "metrics.csv").exists()
    train({**CONFIG, "csv_monitor": {"enabled": True, "job_name": "mine"}}, steps=1)
    assert (tmp_path / "mine" / "metrics.csv").exists()
    with pytest.raises(fs.config.ConfigError, match="flops_profiler.enabled.*fs.profile.flops"):
        fs.initialize(model=small_cnn(), config={**CONFIG, "flops_profiler": {"enabled": True}}, loss_fn=cnn_loss)
    with pytest.raises(fs.config.ConfigError, match="monitor.progress_bar.*does not know"):
        fs.initialize(model=small_cnn(), config=CONFIG, loss_fn=cnn_loss, overrides=["monitor.progress_bar=true"])
