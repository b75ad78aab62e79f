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
