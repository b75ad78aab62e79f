"""Autotune trials: real short fspeed-train runs measured, failures and hangs recorded, results resumable,
and the memory model's prediction against a run's measured peak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fspeed.autotune.memory_model import calibrated_baseline, predict_memory
from fspeed.autotune.profiling import build_job, profile_job
from fspeed.autotune.space import Candidate
from fspeed.autotune.trials import (
    FAILED, OK, OUT_OF_MEMORY, TIMEOUT, ResultsFile, TrialResult, TrialSettings, _failure, candidate_key,
    run_fingerprint, run_trial, step_measurements,
)
from fspeed.config.compose import compose_run_config
from fspeed.fault_injection import descendants

TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=32", "data.max_bytes=40000",
        "train.train_batch_size=8"]


def test_a_trial_on_two_ranks_reports_step_time_throughput_and_each_ranks_peak(tmp_path):
    c = Candidate(1, 2, 2, data=2)
    result = run_trial(c, TINY, tmp_path / candidate_key(c), TrialSettings(warm_steps=1, measured_steps=2,
                                                                           timeout_s=180))
    assert result.status == OK, result.reason
    times, tokens_per_sample = step_measurements(tmp_path / candidate_key(c) / "metrics.csv", 1)
    assert len(times) == 2 and result.step_s == pytest.approx(sorted(times)[0] / 2 + sorted(times)[1] / 2)
    assert result.samples_per_s == pytest.approx(8 / result.step_s)
    assert tokens_per_sample == pytest.approx(32, rel=1e-3) and result.tokens_per_s == pytest.approx(
        result.samples_per_s * tokens_per_sample)
    assert sorted(result.peak_bytes) == [0, 1] and all(b > 50 << 20 for b in result.peak_bytes.values())


def test_a_crashing_trial_is_recorded_with_its_reason(tmp_path):
    c = Candidate(0, 4, 1, data=1)
    result = run_trial(c, [*TINY, "data.corpus=/nonexistent/corpus.txt"], tmp_path / "crash",
                       TrialSettings(timeout_s=120))
    assert result.status == FAILED and "exit code 2" in result.reason and "data.corpus" in result.reason
    assert result.step_s is None and not result.ok


def test_a_hanging_trial_is_killed_at_its_timeout_with_every_process_of_it(tmp_path):
    c = Candidate(0, 4, 1, data=2)
    result = run_trial(c, [*TINY, "train.steps=100000"], tmp_path / "hang", TrialSettings(timeout_s=4, poll_s=0.05))
    assert result.status == TIMEOUT and "no end within 4 s" in result.reason
    assert 4 <= result.wall_s < 60
    assert not [p for p in descendants(1) if f"hydra.run.dir={tmp_path / 'hang'}" in _cmdline(p)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_failures_are_told_apart():
    assert _failure(-9, "")[0] == OUT_OF_MEMORY
    assert _failure(1, "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried... out of memory")[0] \
        == OUT_OF_MEMORY
    status, reason = _failure(2, "starting\nfspeed-train: invalid fspeed configuration (1 problem):\n  - x")
    assert status == FAILED and reason == "exit code 2: fspeed-train: invalid fspeed configuration (1 problem): - x"


def test_results_file_resumes_finished_trials_and_refuses_another_tuning(tmp_path):
    settings = TrialSettings()
    results = ResultsFile(tmp_path / "results.jsonl", run_fingerprint(TINY, 2, settings))
    assert results.load() == {}
    done = [TrialResult(candidate_key(c), c, OK, step_s=0.5, samples_per_s=16.0, peak_bytes={0: 1, 1: 2})
            for c in (Candidate(0, 4, 1, data=2), Candidate(1, 2, 2, data=2))]
    failed = TrialResult(candidate_key(Candidate(3, 1, 4, data=2)), Candidate(3, 1, 4, data=2), TIMEOUT, "hang")
    for r in [*done, failed]:
        results.append(r)
    loaded = results.load()
    assert loaded == {r.key: r for r in [*done, failed]}
    with open(results.path, "a") as f:  # a write cut short by an interruption
        f.write('{"fingerprint": "')
    assert results.load() == loaded
    other = ResultsFile(tmp_path / "results.jsonl", run_fingerprint([*TINY, "zero.stage=1"], 2, settings))
    with pytest.raises(ValueError, match="results of another tuning"):
        other.load()
    lines = results.path.read_text().splitlines()
    results.path.write_text("\n".join(["not json", *lines]) + "\n")
    with pytest.raises(ValueError, match="results.jsonl:1 is not a JSON line"):
        results.load()
    assert json.loads(lines[0])["result"]["candidate"]["zero_stage"] == 0


def test_predicted_peak_matches_the_measured_peak_of_a_real_run(tmp_path):
    """Two single-rank runs that differ only in how the global batch of 16 is split (1 x 16 and 16 x 1):
    the baseline (interpreter, libraries, data) is calibrated on the first, then the second's peak is
    predicted. The tolerance, 10% of the measured peak, is the autotuner's target; the model's part
    here is about 120 MiB of a 500-600 MiB process (its activations grow 16-fold), so a prediction that
    ignored the activations would miss by about 20% and fail."""
    overrides = ["model.n_layer=2", "model.n_head=4", "model.d_model=256", "model.seq_len=128",
                 "data.max_bytes=200000", "train.train_batch_size=16"]
    base = compose_run_config(overrides=overrides)[0]
    profile = profile_job(build_job(base), base, (1, 16), [("none", 1)], repeats=1)
    settings = TrialSettings(warm_steps=1, measured_steps=1, timeout_s=240)
    small, large = Candidate(0, 1, 16, data=1), Candidate(0, 16, 1, data=1)
    measured = {}
    for c in (small, large):
        result = run_trial(c, overrides, tmp_path / candidate_key(c), settings)
        assert result.status == OK, result.reason
        measured[c] = result.max_peak_bytes
    baseline = calibrated_baseline(predict_memory(small, profile, base), measured[small])
    predicted = predict_memory(large, profile, base, baseline).peak_bytes
    assert abs(predicted - measured[large]) <= 0.10 * measured[large], (predicted / 2**20, measured[large] / 2**20)
    without_activations = predicted - predict_memory(large, profile, base).activations
    miss = abs(without_activations - measured[large]) / measured[large]
    assert miss > 0.10, miss  # the tolerance discriminates


def test_on_cuda_a_trials_peaks_are_what_its_ranks_allocators_recorded(tmp_path):
    """fspeed-train on CUDA writes each rank's allocator peaks (`record_device_peak`); a trial takes
    those over the processes' resident high-water marks (host memory)."""
    from fspeed.autotune.trials import _measured, device_peaks
    from fspeed.cli.observe import DEVICE_PEAKS_DIR

    (tmp_path / "metrics.csv").write_text("step,elapsed_s\n1,0.5\n2,0.75\n3,1.0\n")
    c = Candidate(0, 4, 1, data=2)
    common = dict(key="k", candidate=c, peak_bytes={0: 300 << 20, 1: 310 << 20}, wall_s=3.0, run_dir=str(tmp_path))
    assert _measured(c, tmp_path, TrialSettings(warm_steps=1, measured_steps=2), dict(common)).peak_bytes == {
        0: 300 << 20, 1: 310 << 20}  # on the CPU: the processes' own peaks
    folder = tmp_path / DEVICE_PEAKS_DIR
    folder.mkdir()
    for rank, reserved in ((0, 2 << 30), (1, 3 << 30)):
        (folder / f"rank{rank}.json").write_text(json.dumps({"max_reserved": reserved, "max_allocated": 1 << 30}))
    assert device_peaks(tmp_path) == {0: 2 << 30, 1: 3 << 30}
    result = _measured(c, tmp_path, TrialSettings(warm_steps=1, measured_steps=2), dict(common))
    assert result.ok and result.step_s == 0.25 and result.max_peak_bytes == 3 << 30
