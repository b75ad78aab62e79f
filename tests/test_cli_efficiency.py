"""fspeed-train with epochs, a curriculum and progressive layer dropping: metrics, exact resume mid-epoch."""

import csv
import json
import shutil

import pytest
from test_cli import fspeed_train

from fspeed.config import ConfigError
from fspeed.config.compose import compose_run_config

ARGS = ("train.steps=12", "data.max_bytes=60000", "data.epochs=2", "model.seq_len=32", "model.n_layer=2",
        "model.d_model=32", "curriculum.enabled=true", "curriculum.min_difficulty=8", "curriculum.max_difficulty=32",
        "curriculum.total_steps=8", "curriculum.difficulty_step=8", "progressive_layer_drop.enabled=true",
        "progressive_layer_drop.theta=0.5", "progressive_layer_drop.gamma=0.1", "train.eval_every=0",
        "monitor.progress_bar=false")


def _rows(path):
    with open(path) as f:
        return {r["step"]: r for r in csv.DictReader(f)}


def test_epochs_curriculum_and_layer_drop_run_and_resume_exactly_mid_epoch(tmp_path):
    proc = fspeed_train(*ARGS, "checkpoint.save_every=5", f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = _rows(tmp_path / "full" / "metrics.csv")
    assert [full[str(t)]["curriculum_seqlen"] for t in (1, 3, 6, 9, 12)] == ["8", "16", "24", "32", "32"]
    assert float(full["1"]["pld_theta"]) == 1.0 and 0.5 < float(full["12"]["pld_theta"]) < 0.7
    meta = json.loads((tmp_path / "full" / "checkpoints" / "global_step5" / "meta.json").read_text())
    assert meta["client_state"]["loader"]["step"] == 5 and meta["client_state"]["loader"]["epoch"] == 0

    ckpt = tmp_path / "from5"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "global_step5", ckpt / "global_step5")
    (ckpt / "latest").write_text("global_step5")
    proc = fspeed_train(*ARGS, f"checkpoint.dir={ckpt}", "checkpoint.resume=true",
                        f"hydra.run.dir={tmp_path / 'resumed'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = _rows(tmp_path / "resumed" / "metrics.csv")
    for step in range(6, 13):
        got, want = resumed[str(step)], full[str(step)]
        assert (got["loss"], got["curriculum_seqlen"], got["pld_theta"]) == \
            (want["loss"], want["curriculum_seqlen"], want["pld_theta"]), step


@pytest.mark.parametrize("overrides, expected", [
    (["data.shuffle=false"], ["data.shuffle", "data.epochs"]),
    (["curriculum.enabled=true", "curriculum.schedule=fixed_root", "curriculum.total_steps=10",
      "curriculum.difficulty_step=8"], ["curriculum.root_degree", "fixed_root"]),
    (["curriculum.enabled=true", "curriculum.difficulty_type=percentile", "curriculum.total_steps=10",
      "curriculum.difficulty_step=8"], ["curriculum.difficulty_type", "vocab_rarity"]),
    (["progressive_layer_drop.theta=1.5"], ["progressive_layer_drop.theta", "1.5"]),
])
def test_loader_and_curriculum_settings_are_checked(overrides, expected):
    with pytest.raises(ConfigError) as info:
        compose_run_config(None, overrides)
    assert all(e in str(info.value) for e in expected), str(info.value)


def test_data_efficiency_curriculum_caches_its_index_next_to_the_corpus(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat and the dog sat too\nquokka xylophone zebra\n" * 200)
    args = ("train.steps=4", f"data.corpus={corpus}", "model.seq_len=32", "model.n_layer=1", "model.d_model=16",
            "curriculum.enabled=true", "curriculum.curriculum_type=vocab_rarity",
            "curriculum.difficulty_type=percentile",
            "curriculum.min_difficulty=20", "curriculum.max_difficulty=100", "curriculum.total_steps=3",
            "curriculum.difficulty_step=10", "train.eval_every=0", "monitor.progress_bar=false")
    proc = fspeed_train(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "c.txt.fspeed-index" / "windows32" / "vocab_rarity.pt").exists()
    rows = _rows(tmp_path / "run" / "metrics.csv")
    assert [rows[str(t)]["curriculum_difficulty"] for t in (1, 2, 3, 4)] == ["40", "70", "100", "100"]
