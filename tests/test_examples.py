"""The example scripts run as documented: the Python-API loop on one process and on two ranks."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt_api.py"


def run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_api_example_on_one_process(tmp_path):
    out = run([sys.executable, str(EXAMPLE), "--steps", "3", "--batch", "4", "--checkpoint-dir", "ck"], tmp_path)
    assert "val loss at start" in out and "step 3:" in out
    assert (tmp_path / "ck" / "latest").read_text() == "global_step3"


@pytest.mark.skipif(shutil.which("fspeed") is None, reason="the fspeed launcher is not on PATH")
def test_api_example_with_zero3_on_two_ranks(tmp_path):
    out = run(["fspeed", "--num_gpus", "2", str(EXAMPLE), "--steps", "3", "--batch", "4", "--zero-stage", "3",
               "--checkpoint-dir", "ck"], tmp_path)
    assert "step 3:" in out and "gpt_weights.pt" in out
    assert sorted(p.name for p in (tmp_path / "ck" / "global_step3").iterdir()) == [
        "meta.json", "rank_00000.safetensors", "rank_00001.safetensors"]
