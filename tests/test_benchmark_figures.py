"""benchmarks/figures.py: a benchmark's `name=value` lines become benchmarks/results/<name>.json when
the run completes, its printed output unchanged; and every benchmark that prints figures records them."""

import contextlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def figures(monkeypatch, tmp_path):
    """The module, loaded from its file (benchmarks/ is a folder of scripts, not a package), with
    FSPEED_RESULTS_DIR pointing at a temporary folder."""
    spec = importlib.util.spec_from_file_location("benchmark_figures", BENCHMARKS / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv(module.RESULTS_DIR_ENV, str(tmp_path / "results"))
    return module


def test_figure_lines_parse_to_numbers_text_and_notes(figures):
    assert figures.parse_figure("pipeline_step_time_vs_torch=0.981") == ("pipeline_step_time_vs_torch", 0.981, "")
    assert figures.parse_figure("tp_families_equal=37") == ("tp_families_equal", 37, "")
    assert figures.parse_figure("hf_step_time_vs_eager=1.005  # 0.998") == ("hf_step_time_vs_eager", 1.005, "0.998")
    assert figures.parse_figure("hf_step_time_vs_deepspeed=nan  (DeepSpeed not installed)") == (
        "hf_step_time_vs_deepspeed", None, "(DeepSpeed not installed)")
    assert figures.parse_figure("disk_full_mode=tmpfs") == ("disk_full_mode", "tmpfs", "")
    for line in ("  fspeed ZeRO-3   412.1 ms", "GPT: 8 layers, d_model=256", "Step=3", "x = 1", ""):
        assert figures.parse_figure(line) is None, line


def test_a_completed_run_writes_its_figures_and_prints_what_it_printed(figures, tmp_path, capsys):
    printed = "a table\n  row  1.0\nzero3_comm_over_theory=0.967\nhf_step_time_vs_eager=1.005  # 0.998\n"
    with figures.recorded("zero_comm", command="python benchmarks/zero_comm.py --small"):
        print("a table\n  row  1.0")
        print("zero3_comm_over_theory=0.967", flush=True)
        sys.stdout.write("hf_step_time_vs_eager=1.0")  # a line written in pieces
        sys.stdout.write("05  # 0.998\n")
    out = capsys.readouterr()
    assert out.out == printed
    path = tmp_path / "results" / "zero_comm.json"
    assert f"figures written to {path}" in out.err
    content = json.loads(path.read_text())
    assert content["benchmark"] == "zero_comm" and content["command"] == "python benchmarks/zero_comm.py --small"
    assert content["figures"] == {"zero3_comm_over_theory": 0.967, "hf_step_time_vs_eager": 1.005}
    assert content["notes"] == {"hf_step_time_vs_eager": "0.998"}
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", content["date"])
    assert re.fullmatch(r"([0-9a-f]{40}(-dirty)?|unknown)", content["commit"])
    assert "cores" in content["machine"] and "torch " in content["machine"]

    with figures.recorded("zero_comm", command="python benchmarks/zero_comm.py"):  # a second run replaces it
        print("zero3_comm_over_theory=0.950")
    content = json.loads(path.read_text())
    assert content["figures"] == {"zero3_comm_over_theory": 0.95} and "notes" not in content
    assert [p.name for p in path.parent.iterdir()] == ["zero_comm.json"]  # no temporary file left


@pytest.mark.parametrize("ending", ["exception", "exit 1", "disabled", "no figures"])
def test_a_failed_disabled_or_figureless_run_writes_nothing(figures, tmp_path, ending):
    with pytest.raises((RuntimeError, SystemExit)) if ending in ("exception", "exit 1") else contextlib.nullcontext():
        with figures.recorded("pipeline", enabled=ending != "disabled"):
            if ending != "no figures":
                print("pipeline_step_time_vs_torch=0.981")
            if ending == "exception":
                raise RuntimeError("a rank failed")
            if ending == "exit 1":
                sys.exit(1)
    assert not (tmp_path / "results").exists()
    assert sys.stdout is not None and not isinstance(sys.stdout, figures.FigureTee)


def test_exit_status_zero_counts_as_completed(figures, tmp_path):
    with pytest.raises(SystemExit):
        with figures.recorded("pipeline", command="python benchmarks/pipeline.py"):
            print("pipeline_step_time_vs_torch=0.981")
            sys.exit(0)
    assert json.loads((tmp_path / "results" / "pipeline.json").read_text())["figures"] == {
        "pipeline_step_time_vs_torch": 0.981}


def test_the_commit_is_heads_sha_and_dirty_when_a_tracked_file_changed(figures, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "a.txt").write_text("one")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (repo / "untracked.txt").write_text("new")
    assert figures.git_commit(repo) == sha
    (repo / "a.txt").write_text("two")
    assert figures.git_commit(repo) == sha + "-dirty"
    assert figures.git_commit(tmp_path / "not-a-repo") == "unknown"


def test_the_command_is_the_script_from_the_repository_root(figures):
    line = figures.command_line([str(BENCHMARKS / "pipeline.py"), "--steps", "8", "--name", "a b"])
    assert line == "python benchmarks/pipeline.py --steps 8 --name 'a b'"


def test_every_benchmark_that_prints_figures_records_them():
    """A script under benchmarks/ that prints `name=value` lines runs its main under `recorded`."""
    figure_print = re.compile(r"""print\(f?["'][a-z{][a-z0-9_{}\[\]'"]*=|lines\.append\(f["'][a-z]""")
    missing = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        text = script.read_text()
        if figure_print.search(text) and f'recorded("{script.stem}"' not in text:
            missing.append(script.name)
    assert not missing, f"benchmarks printing figures without writing benchmarks/results/: {missing}"
