"""The autotuner's search end to end on 2 gloo ranks with a small space, and its resume."""

from __future__ import annotations

import csv
import json

import pytest

import fspeed.autotune.tuner as tuner
from fspeed.autotune.cost_model import CommCosts, LinkCost
from fspeed.autotune.space import SearchSpace
from fspeed.autotune.trials import TrialSettings
from fspeed.autotune.tuner import TuneSettings, tune

TINY = ("model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=32", "data.max_bytes=40000",
        "train.train_batch_size=8")
LINKS = CommCosts({axis: {op: LinkCost(1e-4, 1e-9) for op in ("all_reduce", "all_gather", "reduce_scatter", "send")}
                   for axis in ("data", "model", "pipe")})


def small_settings(workdir, **changes):
    space = SearchSpace(zero_stage=(0, 1), micro_batch=(2, 4), remat=("none",), offload_optimizer=(False,),
                        offload_param=(False,), tensor=(1, 2), pipe=(1,))
    values = dict(world=2, base_overrides=TINY, workdir=workdir, space=space, max_trials=2, memory_per_rank=1 << 40,
                  trial=TrialSettings(warm_steps=1, measured_steps=2, timeout_s=180))
    values.update(changes)
    return TuneSettings(**values)


def test_end_to_end_on_two_ranks_then_resumed_without_rerunning(tmp_path):
    settings = small_settings(tmp_path)
    report = tune(settings, links=LINKS, baseline=300 << 20, progress=lambda line: None)
    ran = [row for row in report.rows if row.result is not None]
    assert report.trials_run == len(ran) == 2 and report.trials_resumed == 0
    assert report.best is not None and report.best.result.ok
    assert report.best.result.step_s == min(r.result.step_s for r in ran if r.result.ok)
    by_status = {row.status for row in report.rows}
    assert "not run" in by_status and "ok" in by_status
    tensor = [row for row in report.rows if row.candidate.tensor == 2]
    assert tensor and all(row.status in ("not run", "ok", "failed") for row in tensor)
    # the trials ran in the cost model's order: the two cheapest predictions
    predicted = sorted((row for row in report.rows if row.predicted_s is not None), key=lambda r: r.predicted_s)
    assert {row.candidate for row in ran} == {row.candidate for row in predicted[:2]}
    table = report.table()
    assert "<- best" in table and report.best.candidate.label() in table
    paths = report.write(tmp_path / "out")
    rows = json.loads(paths["json"].read_text())
    assert len(rows) == len(report.rows) and {r["configuration"] for r in rows} == {
        row.candidate.label() for row in report.rows}
    with open(paths["csv"]) as f:
        assert len(list(csv.DictReader(f))) == len(report.rows)

    def no_trial(*args, **kwargs):
        raise AssertionError("a finished trial ran again")

    original = tuner.run_trial
    tuner.run_trial = no_trial
    try:
        again = tune(settings, links=LINKS, baseline=300 << 20, progress=lambda line: None)
    finally:
        tuner.run_trial = original
    assert again.trials_run == 0 and again.trials_resumed == 2
    assert (tmp_path / "predictions.json").exists()  # the same predictions: the same path through the space
    assert [(r.candidate, r.predicted_s) for r in again.rows] == [(r.candidate, r.predicted_s) for r in report.rows]
    assert again.best.candidate == report.best.candidate


def test_bad_settings_are_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="autotune.strategy='best'; allowed: model, grid, random, fast"):
        small_settings(tmp_path, strategy="best")
    with pytest.raises(ValueError, match="autotune.max_trials=0"):
        small_settings(tmp_path, max_trials=0)


def test_a_hugging_face_model_through_model_target(tmp_path):
    """A transformers GPT-2 (tests.hf_models): a pipeline cuts its traced forward, tensor slicing is left out
    with the reason (GPT-2 declares no tensor-parallel plan), and its best layout is a real trial."""
    hf = ("model._target_=tests.hf_models.hf_gpt2", "data._target_=tests.hf_models.lm_datasets",
          "train.train_batch_size=8")
    space = SearchSpace(zero_stage=(1,), micro_batch=(2, 4), remat=("none",), offload_optimizer=(False,),
                        offload_param=(False,), tensor=(1, 2), pipe=(1, 2))
    settings = small_settings(tmp_path, base_overrides=hf, space=space, max_trials=1)
    report = tune(settings, links=LINKS, baseline=300 << 20, progress=lambda line: None)
    tensor = [row for row in report.rows if row.candidate.tensor == 2 and row.candidate.pipe == 1]
    assert tensor and all(row.status == "skipped" and "declares no tensor-parallel plan" in row.reason
                          for row in tensor)
    assert any(row.candidate.pipe == 2 and row.status != "skipped" for row in report.rows)
    assert report.trials_run == 1 and report.best is not None and report.best.result.ok, \
        [(r.candidate.label(), r.reason) for r in report.rows if r.result is not None]
    assert report.best.result.tokens_per_s is None and report.best.result.samples_per_s > 0  # a user's samples


class FakeTrials:
    """run_trial's stand-in: each candidate's 'measured' step is its predicted one times `ratio`, except the
    `failing` ones (a crash) and `hanging` ones (a timeout); records the order trials ran in."""

    def __init__(self, ratio=0.5, failing=(), hanging=(), peak=100 << 20):
        self.ratio, self.failing, self.hanging, self.peak, self.ran = ratio, set(failing), set(hanging), peak, []

    def __call__(self, candidate, base, run_dir, settings, key=None, cwd=None):
        from fspeed.autotune.trials import FAILED, OK, TIMEOUT, TrialResult

        self.ran.append(candidate)
        if candidate in self.failing:
            return TrialResult(key, candidate, FAILED, "exit code 1: RuntimeError: boom")
        if candidate in self.hanging:
            return TrialResult(key, candidate, TIMEOUT, "no end within 5 s")
        step = self.predicted[candidate] * self.ratio
        return TrialResult(key, candidate, OK, step_s=step, samples_per_s=candidate.global_batch / step,
                           peak_bytes={0: self.peak, 1: self.peak})


def synthetic_prepared(predicted, memory_per_rank=1 << 40):
    """A Prepared search over `predicted` (candidate -> predicted seconds), each predicted to need 50 MiB
    of states and a 10 MiB baseline."""
    states = {c: 50 << 20 for c in predicted}
    rows = {c: tuner.Row(c, "not run", "", 60 << 20, s) for c, s in predicted.items()}
    return tuner.Prepared((), states, dict(predicted), rows, memory_per_rank, baseline=10 << 20)


def run_search(tmp_path, monkeypatch, predicted, fake, **changes):
    fake.predicted = predicted
    limit = changes.get("memory_per_rank") or 1 << 40
    monkeypatch.setattr(tuner, "prepare", lambda *a, **k: synthetic_prepared(predicted, limit))
    monkeypatch.setattr(tuner, "run_trial", fake)
    values = dict(world=2, workdir=tmp_path, max_trials=10)
    values.update(changes)
    return tune(TuneSettings(**values), links=LINKS, baseline=0, progress=lambda line: None)


def layouts(n, stage=1):
    from fspeed.autotune.space import Candidate

    return [Candidate(stage, 2 ** k, 2 ** (n - k), data=2) for k in range(n)]


def test_the_model_strategy_runs_in_predicted_order_and_stops_when_nothing_left_can_win(tmp_path, monkeypatch):
    cs = layouts(5)
    predicted = dict(zip(cs, [3.0, 1.0, 2.0, 10.0, 1.04]))
    fake = FakeTrials(ratio=0.5)
    report = run_search(tmp_path, monkeypatch, predicted, fake)
    # predicted order 1.0, 1.04, 2.0: after two trials the calibrated 2.0 x 0.5 cannot beat 0.5 by 5%
    assert fake.ran == [cs[1], cs[4]] and report.best.candidate == cs[1]
    assert {row.status for row in report.rows if row.candidate in (cs[0], cs[2], cs[3])} == {"not run"}


def test_a_crash_and_a_hang_are_recorded_and_the_search_goes_on(tmp_path, monkeypatch):
    cs = layouts(4)
    predicted = dict(zip(cs, [1.0, 1.1, 1.2, 1.3]))
    fake = FakeTrials(failing={cs[0]}, hanging={cs[1]})
    report = run_search(tmp_path, monkeypatch, predicted, fake, strategy="grid")
    assert fake.ran == cs
    statuses = {row.candidate: (row.status, row.reason) for row in report.rows}
    assert statuses[cs[0]] == ("failed", "exit code 1: RuntimeError: boom")
    assert statuses[cs[1]] == ("timeout", "no end within 5 s")
    assert report.best.candidate == cs[2]
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["result"]["status"] == "failed"


def test_the_first_trial_calibrates_the_memory_baseline_and_the_rest_are_pruned_again(tmp_path, monkeypatch):
    cs = layouts(3)
    predicted = dict(zip(cs, [1.0, 1.1, 1.2]))
    fake = FakeTrials(peak=500 << 20)  # the first trial measures 500 MiB, predicted 60 MiB
    report = run_search(tmp_path, monkeypatch, predicted, fake, strategy="grid", memory_per_rank=200 << 20)
    assert fake.ran == [cs[0]]
    for row in report.rows[1:]:
        assert row.status == "over memory" and "baseline measured by the first trial" in row.reason
        assert row.predicted_bytes == 500 << 20


def test_grid_random_and_fast_strategies(tmp_path, monkeypatch):
    cs = layouts(4, stage=1) + layouts(4, stage=2)
    predicted = {c: 1.0 + i / 10 for i, c in enumerate(cs)}
    grid = FakeTrials()
    run_search(tmp_path / "grid", monkeypatch, predicted, grid, strategy="grid", max_trials=3)
    assert grid.ran == cs[:3]
    sampled = FakeTrials()
    run_search(tmp_path / "random", monkeypatch, predicted, sampled, strategy="random", max_trials=3, seed=1)
    assert len(sampled.ran) == 3 and len(set(sampled.ran)) == 3 and sampled.ran != cs[:3]
    fast = FakeTrials()
    run_search(tmp_path / "fast", monkeypatch, predicted, fast, strategy="fast")
    # per stage the three largest micro-batches, largest first (DeepSpeed's fast mode)
    assert [(c.zero_stage, c.micro_batch) for c in fast.ran] == [(1, 8), (1, 4), (1, 2), (2, 8), (2, 4), (2, 2)]


def test_the_base_micro_batch_fixes_that_axis_and_a_base_accumulation_is_refused(tmp_path):
    from fspeed.autotune.tuner import base_space

    fixed = base_space(TuneSettings(world=2, base_overrides=(*TINY, "train.micro_batch_size=2")))
    assert fixed.micro_batch == (2,)
    with pytest.raises(ValueError, match=r"both fix the micro-batch; keep one"):
        base_space(TuneSettings(world=2, base_overrides=(*TINY, "train.micro_batch_size=2"),
                                space=SearchSpace(micro_batch=(4,))))
    with pytest.raises(ValueError, match=r"train.grad_accum=2 in the base: with a fixed global batch"):
        base_space(TuneSettings(world=2, base_overrides=(*TINY, "train.grad_accum=2")))
    assert base_space(TuneSettings(world=2, base_overrides=TINY)).micro_batch is None


def test_throughput_compares_samples_per_second_and_latency_step_time(tmp_path, monkeypatch):
    from fspeed.autotune.space import Candidate

    small, large = Candidate(1, 2, 1, data=2), Candidate(1, 8, 1, data=2)  # global batches 4 and 16
    predicted = {small: 1.0, large: 2.0}  # the large batch: twice the step time, twice the samples per second
    fast = FakeTrials()
    report = run_search(tmp_path / "throughput", monkeypatch, predicted, fast)
    assert fast.ran[0] == large and report.best.candidate == large
    slow = FakeTrials()
    report = run_search(tmp_path / "latency", monkeypatch, predicted, slow, metric="latency")
    assert slow.ran[0] == small and report.best.candidate == small
    with pytest.raises(ValueError, match="autotune.metric='speed'; allowed: throughput, latency"):
        small_settings(tmp_path, metric="speed")


def test_patience_stops_after_that_many_trials_without_a_better_one(tmp_path, monkeypatch):
    cs = layouts(6)
    predicted = {c: 1.0 + i / 10 for i, c in enumerate(cs)}  # grid order: each slower than the first
    fake = FakeTrials()
    run_search(tmp_path, monkeypatch, predicted, fake, strategy="grid", patience=2)
    assert fake.ran == cs[:3]


def test_a_tuning_that_does_not_resume_keeps_the_earlier_files_as_previous(tmp_path, monkeypatch):
    cs = layouts(2)
    predicted = dict(zip(cs, [1.0, 1.1]))
    run_search(tmp_path, monkeypatch, predicted, FakeTrials(), strategy="grid")
    first = (tmp_path / "results.jsonl").read_text()
    again = FakeTrials()
    report = run_search(tmp_path, monkeypatch, predicted, again, strategy="grid", resume=False)
    assert again.ran == cs and report.trials_run == 2 and report.trials_resumed == 0
    assert (tmp_path / "results.jsonl.previous").read_text() == first


def test_a_remat_layout_is_predicted_with_what_remat_imports(tmp_path, monkeypatch):
    from fspeed.autotune.space import Candidate

    plain, remat = Candidate(1, 2, 1, data=2), Candidate(1, 2, 1, data=2, remat="full")
    prepared = synthetic_prepared({plain: 1.0, remat: 1.0})
    prepared.remat_baseline = 80 << 20
    assert prepared.peak(remat) - prepared.peak(plain) == 80 << 20
    again = tuner.Prepared.from_json(prepared.to_json("key"), "key", ())
    assert again.peak(remat) == prepared.peak(remat)
    # a first trial under remat calibrates the plain baseline without remat's part
    tuner._recalibrate_memory(prepared, remat, 200 << 20)
    assert prepared.baseline == (200 << 20) - (50 << 20) - (80 << 20)
