"""fspeed-train with a user's model and data: `model._target_` / `data._target_` (Hydra's instantiate),
checked as strictly as fspeed's own keys, trained by the same loop (resume, ZeRO on --launch)."""

import csv

import pytest

from fspeed.config import ConfigError
from fspeed.config.compose import compose_run_config
from fspeed.config.targets import TargetConfig
from tests.test_cli import fspeed_train

GPT2 = ["model._target_=tests.hf_models.hf_gpt2", "data._target_=tests.hf_models.lm_datasets"]


def test_a_target_opens_its_section_for_the_callables_arguments():
    run, _ = compose_run_config(None, [*GPT2, "model.layers=3", "model.dropout=0.1", "data.size=64"])
    assert run.model == TargetConfig("tests.hf_models.hf_gpt2", {"layers": 3, "dropout": 0.1})
    assert run.data == TargetConfig("tests.hf_models.lm_datasets", {"size": 64})
    module = run.model.instantiate()
    assert len(module.transformer.h) == 3 and module.config.resid_pdrop == 0.1
    train, val = run.data.instantiate()
    assert len(train) == 64 and len(val) == 32
    run, _ = compose_run_config(None, ["model=custom", "data=custom", *GPT2])  # the option chosen explicitly
    assert isinstance(run.model, TargetConfig)


def test_a_pipeline_that_also_slices_builds_a_llamas_own_layers_and_refuses_other_modules():
    from fspeed.cli.user_job import build_user_model

    sliced = ["parallel.pipe=2", "parallel.tensor=2"]
    run, _ = compose_run_config(None, ["model._target_=tests.hf_models.hf_llama", GPT2[1], *sliced])
    model = build_user_model(run)
    assert model.name == "LlamaForCausalLM-layers" and model.logical_axes["1.layer.self_attn.q_proj.weight"] == \
        ("tp_out", None)
    run, _ = compose_run_config(None, [*GPT2, *sliced])
    with pytest.raises(ConfigError, match="parallel.pipe.*decoder_layers builds for Hugging Face model types"):
        build_user_model(run)


@pytest.mark.parametrize("overrides, expected", [
    (["model._target_=tests.hf_models.hf_gpt3", GPT2[1]], ["model._target_", "no attribute 'hf_gpt3' in module tests.hf_models",
                                                              "did you mean 'hf_gpt2'"]),
    (["model._target_=tests.nowhere.build", GPT2[1]], ["model._target_", "no module", "installed"]),
    ([*GPT2, "model.layer=3"], ["model.layer", "not an argument of tests.hf_models.hf_gpt2",
                                "did you mean 'model.layers'"]),
    ([*GPT2, "model.layers=three"], ["model.layers", "expected integer"]),
    ([*GPT2, "data.corpus=my.txt"], ["data.corpus", "not an argument", "seed, size"]),
    (["model._target_=tests.hf_models.split", GPT2[1]], ["model.batch: missing", "model.parts: missing"]),
    ([GPT2[0]], ["data._target_", "is needed with model._target_"]),
    (["model=gpt_10m", *GPT2], ["model._target_ replaces the packaged model options", "drop model=gpt_10m"]),
    (["model=custom", GPT2[1]], ["model._target_", "Missing mandatory value", "model._target_=my_pkg.build_model"]),
])
def test_target_mistakes_are_named_before_anything_runs(overrides, expected):
    with pytest.raises(ConfigError) as info:
        compose_run_config(None, overrides)
    for text in expected:
        assert text in str(info.value)


def losses(run_dir) -> dict[int, float]:
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f) if r["loss"]}


def test_cli_trains_a_hugging_face_model_resumes_exactly_and_runs_zero3_and_pipeline_stages_on_two_ranks(tmp_path):
    common = [*GPT2, "train.train_batch_size=8", "train.micro_batch_size=4", "train.eval_every=3", "train.eval_batches=2",
              "monitor.progress_bar=false", "scheduler=constant", "optimizer.lr=3e-3"]
    env = {"PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])}
    straight = fspeed_train(*common, "train.steps=6", f"hydra.run.dir={tmp_path / 'straight'}",
                            f"checkpoint.dir={tmp_path / 'ck_straight'}", cwd=tmp_path, env=env)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "GPT2LMHeadModel" in straight.stdout + straight.stderr and "samples/s" in straight.stdout + straight.stderr
    first = fspeed_train(*common, "train.steps=3", f"hydra.run.dir={tmp_path / 'first'}",
                         f"checkpoint.dir={tmp_path / 'ck'}", cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = fspeed_train(*common, "train.steps=6", f"hydra.run.dir={tmp_path / 'resumed'}",
                           f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.resume=true", cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = losses(tmp_path / "straight")
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert {**losses(tmp_path / "first"), **losses(tmp_path / "resumed")} == reference  # bit-exact resume

    zero3 = fspeed_train(*common, "train.steps=6", "zero.stage=3", "parallel.data=2", "--launch",
                         f"hydra.run.dir={tmp_path / 'zero3'}", f"checkpoint.dir={tmp_path / 'ck3'}",
                         cwd=tmp_path, env=env)
    assert zero3.returncode == 0, zero3.stderr[-3000:]
    sharded = losses(tmp_path / "zero3")
    assert sharded.keys() == reference.keys()
    for step, loss in reference.items():  # the same global batches: the same run up to reduction order
        assert sharded[step] == pytest.approx(loss, rel=1e-5), step

    # two pipeline stages: the module traced on the first micro-batch and cut before each block
    piped = fspeed_train(*common, "train.steps=6", "parallel.pipe=2", "parallel.data=1", "--launch",
                         f"hydra.run.dir={tmp_path / 'pipe'}", f"checkpoint.dir={tmp_path / 'ckp'}",
                         cwd=tmp_path, env=env)
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert "traced" in piped.stdout + piped.stderr
    staged = losses(tmp_path / "pipe")
    assert staged.keys() == reference.keys()
    for step, loss in reference.items():
        assert staged[step] == pytest.approx(loss, rel=1e-5), step
