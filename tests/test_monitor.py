"""Monitors: TensorBoard event files read back with TensorBoard's own reader, the W&B offline run's
records, the CSV file, the fan-out, a missing package's error, and fspeed-train writing them all."""

import builtins
import csv
import glob
import json
import struct
import time

import pytest

from fspeed.monitor import (TAGS, CSVMonitor, MissingExtraError, Monitors, TensorBoardMonitor, WandbMonitor,
                            comm_scalars)
from fspeed.parallel import CommLog
from tests.test_cli import fspeed_train

pytest.importorskip("tensorboard", reason="pip install 'fspeed[monitor]' (the test extra has it)")
pytest.importorskip("wandb", reason="pip install 'fspeed[monitor]' (the test extra has it)")

ROWS = [{"step": 0, "samples": 0, "val_loss": 5.0},
        {"step": 1, "samples": 8, "loss": 4.5, "lr": 1e-3, "grad_norm": 2.0, "loss_scale": 1.0, "skipped": False,
         "tokens_per_s": 1000.0, "fwd_ms": 3.0, "bwd_ms": 6.0},
        {"step": 2, "samples": 16, "loss": 4.0, "lr": 2e-3, "grad_norm": 1.5, "loss_scale": 1.0, "skipped": True,
         "val_loss": 4.2}]


def tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in `log_dir`, read with TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_history(directory) -> dict[int, dict[str, float]]:
    """The history rows of the one offline W&B run under `directory` (its .wandb file is a
    LevelDB-style log of protobuf records: 7-byte header, 32 KiB blocks, chunks of crc/len/type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{directory}/wandb/offline-run-*/run-*.wandb")
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    history, pos, pending = {}, 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                step = int(items.get("_step", record.history.step.num))
                history.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return history


def test_tensorboard_events_hold_the_scalars_at_their_steps(tmp_path):
    monitor = TensorBoardMonitor(tmp_path / "tb")
    for row in ROWS:
        monitor.write(row)
    monitor.write_scalars({"Comm/all_reduce/bytes": 1024.0}, 2)
    monitor.close()
    got = tensorboard_scalars(tmp_path / "tb")
    assert got[TAGS["loss"]] == [(1, 4.5), (2, 4.0)]
    assert got[TAGS["val_loss"]] == [(0, 5.0), (2, pytest.approx(4.2))]
    assert got[TAGS["skipped"]] == [(1, 0.0), (2, 1.0)]
    assert got["Train/elapsed_time_ms_forward"] == [(1, 3.0)] and got["Comm/all_reduce/bytes"] == [(2, 1024.0)]
    assert "step" not in got and len(got[TAGS["lr"]]) == 2


def test_wandb_offline_run_holds_the_scalars(tmp_path):
    monitor = WandbMonitor(tmp_path, project="p", team=None, group="g", name="job", config={"lr": 1e-3})
    for row in ROWS:
        monitor.write(row)
    monitor.close()
    deadline = time.monotonic() + 60  # under load wandb's service process can append the rows after finish()
    while sorted(history := wandb_history(tmp_path)) != [0, 1, 2] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sorted(history) == [0, 1, 2], history
    assert history[1][TAGS["loss"]] == 4.5 and history[2][TAGS["loss"]] == 4.0
    assert history[0][TAGS["val_loss"]] == 5.0 and history[2][TAGS["val_loss"]] == 4.2
    assert history[1]["Train/elapsed_time_ms_backward"] == 6.0
    with pytest.raises(ValueError, match="allowed: offline, online"):
        WandbMonitor(tmp_path, project="p", mode="cloud")


def test_fan_out_and_comm_summary(tmp_path):
    log = CommLog()
    log.record("all_reduce", "data", 4096, 0.002, 2)
    log.record("all_reduce", "data", 4096, 0.004, 2)
    assert comm_scalars(log) == {"Comm/all_reduce/bytes": 8192.0, "Comm/all_reduce/count": 2.0,
                                 "Comm/all_reduce/latency_ms": pytest.approx(6.0)}
    monitors = Monitors([CSVMonitor(tmp_path / "m.csv", ("step", "samples", "loss", "val_loss", "lr", "grad_norm",
                                                          "loss_scale", "skipped", "tokens_per_s", "fwd_ms",
                                                          "bwd_ms")),
                         TensorBoardMonitor(tmp_path / "tb")])
    for row in ROWS:
        monitors.write(row)
    monitors.write_scalars(comm_scalars(log), 2)  # the CSV file has fixed columns: not written there
    monitors.close()
    with open(tmp_path / "m.csv") as f:
        assert [r["loss"] for r in csv.DictReader(f)] == ["", "4.5", "4"]
    assert tensorboard_scalars(tmp_path / "tb")["Comm/all_reduce/count"] == [(2, 2.0)]


def test_a_missing_package_names_the_extra(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb" or name.startswith("torch.utils.tensorboard"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(MissingExtraError, match=r"pip install 'fspeed\[monitor\]'"):
        WandbMonitor(tmp_path, project="p")
    with pytest.raises(MissingExtraError, match="tensorboard"):
        TensorBoardMonitor(tmp_path)


def test_every_rank_checks_the_monitor_packages_before_training(monkeypatch):
    import importlib.util
    from dataclasses import replace

    from fspeed.cli.observe import check_monitor_packages
    from fspeed.config import ConfigError
    from fspeed.config.compose import compose_run_config

    run, _ = compose_run_config(None, [])
    run = replace(run, monitor=replace(run.monitor, tensorboard=True, wandb=True))
    check_monitor_packages(run)  # both installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"monitor.wandb = true: needs the 'wandb' package.*fspeed\[monitor\]"):
        check_monitor_packages(run)


def test_fspeed_train_writes_every_monitor_and_the_breakdown(tmp_path):
    run_dir = tmp_path / "run"
    proc = fspeed_train("train.steps=6", "train.eval_every=3", "train.log_every=2", "data.max_bytes=200000",
                        "model.n_layer=1", "model.d_model=32", "model.seq_len=32", "train.micro_batch_size=4",
                        "train.grad_accum=2", "monitor.tensorboard=true", "monitor.wandb=true",
                        "wall_clock_breakdown=true", "curriculum.enabled=true", "curriculum.min_difficulty=8",
                        "curriculum.max_difficulty=32", "curriculum.total_steps=4", "curriculum.difficulty_step=8",
                        "progressive_layer_drop.enabled=true", "progressive_layer_drop.theta=0.5",
                        "activation_checkpointing.policy=full", "activation_checkpointing.profile=true",
                        f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = proc.stdout + proc.stderr
    assert "wall-clock breakdown over" in logs and "| time (ms) | fwd: " in logs
    assert "\r" not in proc.stderr  # not a terminal: plain lines, no progress-bar redraws
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(float(r["fwd_ms"]) > 0 and float(r["step_ms"]) > 0 for r in rows[1:])
    tb = tensorboard_scalars(run_dir / "tensorboard")
    assert [s for s, _ in tb[TAGS["loss"]]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in tb[TAGS["val_loss"]]] == [0, 3, 6]
    assert [v for _, v in tb[TAGS["loss"]]] == pytest.approx([float(r["loss"]) for r in rows[1:]])
    assert len(tb["Train/elapsed_time_ms_step"]) == 6
    for key in ("curriculum_seqlen", "pld_theta", "remat_recompute_ms"):  # the data path's and remat's metrics
        assert [v for _, v in tb[TAGS[key]]] == pytest.approx([float(r[key]) for r in rows[1:]], rel=1e-4), key
    history = wandb_history(run_dir)
    assert sorted(s for s, h in history.items() if TAGS["loss"] in h) == [1, 2, 3, 4, 5, 6]
    assert history[6][TAGS["val_loss"]] == pytest.approx(float(rows[6]["val_loss"]), rel=1e-5)


def test_a_resumed_run_sets_aside_the_rows_an_earlier_attempt_wrote_after_its_step(tmp_path):
    """Steps trained after the last checkpoint and lost to a failure are trained again on resume:
    metrics.csv keeps one row per step, the lost attempt's rows go to metrics.redone.csv."""
    import csv

    path = tmp_path / "metrics.csv"
    with CSVMonitor(path, ("step", "loss")) as first:
        for step in range(5):
            first.write({"step": step, "loss": 1.0 + step})
    with CSVMonitor(path, ("step", "loss"), resumed_at=2) as second:
        for step in (3, 4, 5):
            second.write({"step": step, "loss": 0.5 + step})
    rows = list(csv.DictReader(open(path)))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4", "5"]
    assert [r["loss"] for r in rows[3:]] == ["3.5", "4.5", "5.5"]
    redone = list(csv.DictReader(open(tmp_path / "metrics.redone.csv")))
    assert [(r["step"], r["loss"]) for r in redone] == [("3", "4"), ("4", "5")]
    with CSVMonitor(path, ("step", "loss"), resumed_at=5):  # nothing after the step: the file stays
        pass
    assert len(list(csv.DictReader(open(path)))) == 6
