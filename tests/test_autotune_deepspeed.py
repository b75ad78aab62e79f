"""DeepSpeed's autotuning block run by fspeed's tuner: what each key becomes, the base every trial
starts from, fspeed-train's hand-over, and the tuned ds_config."""

from __future__ import annotations

import json

import pytest

import fspeed.autotune.command as command
from fspeed.autotune.deepspeed_block import BLOCK_KEYS, translate_block, tuner_argv
from fspeed.autotune.outputs import merged_ds_config
from fspeed.autotune.space import Candidate, SearchSpace, enumerate_candidates
from fspeed.config import translate_deepspeed_config

DS = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
      "zero_optimization": {"stage": [1, 2], "reduce_bucket_size": 1000000, "offload_optimizer": {"device": "cpu"}},
      "autotuning": {"enabled": True}}
TINY = ("model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=32", "data.max_bytes=40000")


def test_the_blocks_defaults_are_deepspeeds_fast_mode():
    tuner, space, summary, base = translate_block(DS)
    assert tuner == {"strategy": "fast", "fast_micro_batches": 3, "metric": "throughput", "max_trials": 50,
                     "patience": 5, "dir": "autotuning_results", "resume": False, "warm_steps": 2,
                     "measured_steps": 3}
    # the offload stays the file's; the fast mode searches stage x micro-batch only
    assert space == {"tensor": [1], "offload_optimizer": [True], "offload_param": [False], "remat": ["none"],
                     "pipe": [1], "zero_stage": [1, 2], "micro_batch_min": 2}
    # the tuner chooses the stage, the micro-batch and (at a fixed global batch) the accumulation
    assert "autotuning" not in base and "stage" not in base["zero_optimization"]
    assert "train_micro_batch_size_per_gpu" not in base and "gradient_accumulation_steps" not in base
    assert base["train_batch_size"] == 16 and base["zero_optimization"]["reduce_bucket_size"] == 1000000
    assert any(line.startswith("zero_optimization.stage=[1, 2] -> autotune.space.zero_stage") for line in summary)


def test_each_key_of_the_block_takes_effect():
    block = {"enabled": True, "fast": False, "tuner_type": "model_based", "tuner_num_trials": 7,
             "tuner_early_stopping": 2, "results_dir": "tuned", "overwrite": False, "metric": "latency",
             "start_profile_step": 2, "end_profile_step": 6, "max_train_micro_batch_size_per_gpu": 8,
             "min_train_micro_batch_size_per_gpu": 4, "mp_size": 2, "num_tuning_micro_batch_sizes": 3}
    tuner, space, summary, base = translate_block({"train_batch_size": 32, "zero_optimization": {"stage": 3},
                                                   "autotuning": block})
    assert tuner == {"strategy": "model", "metric": "latency", "max_trials": 7, "patience": 2, "dir": "tuned",
                     "resume": True, "warm_steps": 1, "measured_steps": 5}
    assert space == {"slow": True, "tensor": [2], "offload_optimizer": [False], "offload_param": [False],
                     "zero_stage": [3], "micro_batch_min": 4, "micro_batch_max": 8}
    assert len(summary) == len(block)  # every key but enabled, and the stage
    assert set(BLOCK_KEYS) >= set(block)
    assert translate_block({"autotuning": {"enabled": True, "fast": False, "tuner_type": "gridsearch"}})[0][
        "strategy"] == "grid"
    assert translate_block({"autotuning": {"enabled": True, "metric": "flops"}})[0]["metric"] == "throughput"
    # no global batch: the accumulation stays (DeepSpeed keeps it and lets the global batch follow)
    assert translate_block({"gradient_accumulation_steps": 4, "autotuning": {"enabled": True}})[3] == {
        "gradient_accumulation_steps": 4}


@pytest.mark.parametrize("block, message", [
    ({"tuner": "x"}, r"autotuning.tuner: not a key of DeepSpeed's autotuning block; allowed: enabled, fast"),
    ({"metric_path": "m.json"}, r"autotuning.metric_path='m.json': null only"),
    ({"arg_mappings": {"a": "b"}}, r"autotuning.arg_mappings=.*fspeed-train reads the batch keys itself"),
    ({"model_info": {"num_params": 10}}, r"autotuning.model_info=.*profiling pass"),
    ({"fast": False, "tuner_type": "xgb"}, r"autotuning.tuner_type='xgb': allowed: gridsearch, random, model_based"),
    ({"metric": "speed"}, r"autotuning.metric='speed': allowed: throughput, latency, flops"),
    ({"start_profile_step": 5, "end_profile_step": 3}, r"1 <= start_profile_step <= end_profile_step"),
    ({"fast": "yes"}, r"autotuning.fast='yes': allowed: true, false"),
])
def test_what_fspeed_cannot_honour_is_an_error_naming_the_key(block, message):
    with pytest.raises(ValueError, match=message):
        translate_block({"autotuning": {"enabled": True, **block}})


def test_fspeed_autotune_takes_the_block_and_the_command_line_wins(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    monkeypatch.chdir(tmp_path)
    settings = command.parse_command([f"deepspeed_config={path}", *TINY, "--nproc", "2", "autotune.max_trials=3",
                                      "autotune.space.zero_stage=[2]"])
    assert (settings.world, settings.strategy, settings.max_trials, settings.patience) == (2, "fast", 3, 5)
    assert settings.space.zero_stage == (2,) and settings.space.micro_batch_min == 2 and not settings.resume
    written = tmp_path / "autotuning_results" / "ds_config_base.json"
    assert settings.base_overrides[0] == f"deepspeed_config={written.resolve()}"
    assert "autotuning" not in json.loads(written.read_text())
    # the base every trial composes: translated without complaint, the tuner's keys left to the candidates
    translation = translate_deepspeed_config(json.loads(written.read_text()))
    assert {"train.micro_batch_size=null", "train.grad_accum=null"} <= set(translation.overrides)
    # a disabled block leaves the file as it is
    path.write_text(json.dumps({**DS, "zero_optimization": {"stage": 1}, "autotuning": {"enabled": False}}))
    plain = command.parse_command([f"deepspeed_config={path}", *TINY, "--nproc", "2"])
    assert plain.base_overrides[0] == f"deepspeed_config={path}" and plain.strategy == "model"


def test_micro_batch_bounds_restrict_the_enumeration():
    from fspeed.autotune.space import ModelFacts
    from fspeed.autotune.tuner import TuneSettings, base_config

    base = base_config(TuneSettings(world=2, base_overrides=(*TINY, "train.train_batch_size=32")))
    facts = ModelFacts()
    found = enumerate_candidates(SearchSpace(micro_batch_min=2, micro_batch_max=8, remat=("none",),
                                             offload_optimizer=(False,), offload_param=(False,), tensor=(1,),
                                             pipe=(1,), zero_stage=(0,)), base, 2, facts)
    assert sorted(c.micro_batch for c in found.candidates) == [2, 4, 8]
    with pytest.raises(ValueError, match="micro_batch_max=2 is below autotune.space.micro_batch_min=4"):
        SearchSpace(micro_batch_min=4, micro_batch_max=2)


def test_fspeed_train_hands_an_enabled_block_to_the_tuner(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    overrides = [f"deepspeed_config={path}", "parallel.data=4", *TINY]
    assert tuner_argv(overrides, launch=True) == ["--nproc", "4", f"deepspeed_config={path}", *TINY]
    assert tuner_argv(overrides, launch=False)[:2] == ["--nproc", "1"]
    assert tuner_argv([*TINY], launch=True) is None
    with pytest.raises(ValueError, match="needs|tunes for the world it would start"):
        tuner_argv([f"deepspeed_config={path}", *TINY], launch=True)
    seen = {}

    def fake_tune(settings, progress=print):
        seen["settings"] = settings
        raise SystemExit(0)

    monkeypatch.setattr(command, "tune", fake_tune)
    monkeypatch.chdir(tmp_path)
    from fspeed.cli.train import main as train_main

    with pytest.raises(SystemExit) as stop:
        train_main(["--launch", *overrides])
    assert stop.value.code == 0
    assert seen["settings"].world == 4 and seen["settings"].strategy == "fast"


def test_the_translator_points_an_enabled_block_to_the_tuner():
    from fspeed.config.deepspeed import DeepSpeedConfigError

    with pytest.raises(DeepSpeedConfigError, match="fspeed-autotune deepspeed_config=<file>"):
        translate_deepspeed_config({"train_batch_size": 8, "autotuning": {"enabled": True}})
    translate_deepspeed_config({"train_batch_size": 8, "autotuning": {"enabled": False}})


def test_the_tuned_ds_config_is_the_users_file_with_the_tuned_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    merged = merged_ds_config([f"deepspeed_config={path}"], Candidate(2, 4, 2, data=2))
    assert merged["optimizer"] == DS["optimizer"] and "autotuning" not in merged
    assert (merged["train_batch_size"], merged["train_micro_batch_size_per_gpu"],
            merged["gradient_accumulation_steps"]) == (16, 4, 2)
    zero = merged["zero_optimization"]
    assert zero["stage"] == 2 and "offload_optimizer" not in zero  # this layout does not offload
    assert translate_deepspeed_config(merged).overrides  # a training run takes it
    pinned = {**DS, "zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    path.write_text(json.dumps(pinned))
    offloading = merged_ds_config([f"deepspeed_config={path}"], Candidate(2, 4, 2, data=2, offload_optimizer=True))
    assert offloading["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
