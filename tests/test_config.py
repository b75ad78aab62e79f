"""The Hydra tree, strict validation of composed configs and overrides, and the builders."""

import copy
import dataclasses
import functools
import importlib.resources
import logging
import sys

import pytest
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from hydra.errors import MissingConfigException
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf

from fspeed.config import ConfigError, check_overrides, run_config_from_mapping, to_run_config
from fspeed.config.fields import config_fields
from fspeed.config.schema import (
    GROUPS,
    KINDS,
    AdamWConfig,
    LambConfig,
    ModelConfig,
    OneCycleConfig,
    RunConfig,
    ZeroSection,
)
from fspeed.config.validate import CONFIG_KEYS, packaged_default_choices

CKPT = "checkpoint.dir=/tmp/fspeed-test-ckpt"  # ${hydra:runtime.output_dir} only resolves inside the app


@pytest.fixture(autouse=True, scope="module")
def hydra_tree():
    """Hydra initialised once for the module on the packaged tree (pkg://fspeed.conf)."""
    with initialize_config_module("fspeed.conf", version_base=None):
        yield


def compose_cfg(*overrides: str):
    return compose("train", overrides=[CKPT, *overrides])


def compose_run(*overrides: str, dp_world_size: int = 1) -> RunConfig:
    return to_run_config(compose_cfg(*overrides), dp_world_size=dp_world_size)


def error_of(*overrides: str, dp_world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        compose_run(*overrides, dp_world_size=dp_world_size)
    return str(info.value)


def shipped_options() -> dict[str, list[str]]:
    root = importlib.resources.files("fspeed.conf")
    return {g: sorted(p.name[:-5] for p in root.joinpath(g).iterdir() if p.name.endswith(".yaml")) for g in GROUPS}


# ------------------------------------------------------------------------------ the Hydra tree


def test_shipped_options_match_the_schema():
    options = shipped_options()
    for group, kinds in KINDS.items():
        assert options[group] == sorted(kinds)
    assert options["model"] == ["char_gpt", "custom", "gpt_10m"]  # custom: model._target_ (test_cli_targets)
    assert options["data"] == ["corpus", "custom"]
    assert packaged_default_choices() == {"model": "char_gpt", "data": "corpus", "optimizer": "adamw",
                                          "scheduler": "warmup_cosine", "precision": "fp32"}


@pytest.mark.parametrize("group, option", [(g, o) for g, opts in shipped_options().items() for o in opts
                                           if o != "custom"])
def test_every_group_option_composes_and_validates(group, option):
    cfg = compose_cfg(f"{group}={option}")
    run = to_run_config(cfg)
    section = getattr(run, group)
    assert getattr(section, "name", option) == option
    # every key of the schema is spelled out in the YAML, so `--cfg job` shows all of them
    assert sorted(cfg[group].keys()) == sorted(f.name for f in config_fields(type(section)))


def test_default_job():
    run = compose_run()
    assert isinstance(run.optimizer, AdamWConfig) and 1e-3 <= run.optimizer.lr <= 3e-3
    assert run.scheduler.name == "warmup_cosine" and run.scheduler.warmup_type == "linear"
    assert run.precision.name == "fp32" and run.model == ModelConfig(name="char_gpt", n_layer=4, n_head=4, d_model=128,
                                                                      seq_len=128)
    assert run.batch[:4] == (16, 16, 1, 1)
    assert run.train.gradient_clipping == 1.0 and run.deepspeed_config is None
    assert dataclasses.is_dataclass(run) and run.__dataclass_params__.frozen


def test_changing_dp_re_resolves_the_batch_triad():
    run = compose_run("train.train_batch_size=64", "train.micro_batch_size=8")
    assert run.batch[:3] == (64, 8, 8)
    assert dataclasses.replace(run, dp_world_size=4).batch[:4] == (64, 8, 2, 4)
    with pytest.raises(ConfigError, match="dp=3"):
        dataclasses.replace(run, dp_world_size=3)


def test_gpt_10m_has_about_ten_million_parameters():
    m = compose_run("model=gpt_10m").model
    d_ff = m.d_ff or 4 * m.d_model
    block_params = m.n_layer * (4 * m.d_model**2 + 2 * m.d_model * d_ff)
    assert 9e6 < block_params < 12e6 and m.seq_len == 256


def test_a_lamb_bf16_one_cycle_override_line_validates_and_composes():
    line = ["optimizer=lamb", "precision=bf16", "scheduler=one_cycle", "train.steps=500", "train.grad_accum=4"]
    check_overrides(line)
    run = compose_run(*line)
    assert isinstance(run.optimizer, LambConfig) and isinstance(run.scheduler, OneCycleConfig)
    assert run.precision.name == "bf16" and run.train.steps == 500
    assert run.batch[:3] == (64, 16, 4)


def test_checkpoint_dir_defaults_under_the_hydra_run_dir():
    cfg = compose("train", overrides=["hydra.runtime.output_dir=/tmp/run-7"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        assert to_run_config(cfg).checkpoint.dir == "/tmp/run-7/checkpoints"
    finally:
        HydraConfig.instance().cfg = None
    with pytest.raises(ConfigError, match=r"checkpoint.dir: cannot resolve.*only resolves inside the fspeed-train app"):
        to_run_config(compose("train"))


# ------------------------------------------------------------------------------- bad values


def test_negative_lr():
    message = error_of("optimizer.lr=-0.001")
    assert "optimizer.lr = -0.001: must be > 0" in message


def test_unknown_optimizer_lists_the_available_ones():
    with pytest.raises(MissingConfigException) as info:
        compose_cfg("optimizer=adamm")
    for name in ("adam", "adamw", "lamb", "sgd"):
        assert name in str(info.value)


def test_inconsistent_batch_triad():
    message = error_of("train.train_batch_size=100", "train.micro_batch_size=32")
    assert "100 is not divisible by 32 x 1" in message and "consistent choices" in message
    message = error_of("train.train_batch_size=64", dp_world_size=3)
    assert "dp=3" in message


@functools.lru_cache(maxsize=None)
def default_mapping() -> dict:
    return OmegaConf.to_container(compose_cfg(), resolve=True)


def mapping_error(section: str, key: str, value) -> str:
    data = copy.deepcopy(default_mapping())
    data[section][key] = value
    with pytest.raises(ConfigError) as info:
        run_config_from_mapping(data)
    return str(info.value)


@pytest.mark.parametrize("section, key, value, expected", [
    ("train", "steps", "abc", "train.steps = 'abc': expected integer, got str"),
    ("train", "steps", 2.5, "train.steps = 2.5: expected integer"),
    ("train", "seed", True, "train.seed = true: expected integer"),
    ("optimizer", "betas", [0.9], "optimizer.betas = [0.9]: expected list of 2 numbers"),
    ("optimizer", "betas", [0.9, 1.0], "must be each in [0, 1)"),
    ("optimizer", "eps", 0, "optimizer.eps = 0: must be > 0"),
    ("model", "d_model", 130, "model.d_model = 130: must be divisible by n_head=4"),
    ("data", "tokenizer", "word", "data.tokenizer = 'word': not allowed; allowed: 'char', 'byte'"),
    ("data", "val_fraction", 1.0, "must be in (0, 1)"),
    ("scheduler", "warmup_type", "cosin", "allowed: 'log', 'linear'"),
    ("train", "steps", 0, "train.steps = 0: must be > 0"),
    ("monitor", "csv", "yes", "monitor.csv = 'yes': expected boolean"),
    ("checkpoint", "dir", "", "checkpoint.dir = '': must be non-empty"),
])
def test_bad_values_name_key_value_and_what_is_allowed(section, key, value, expected):
    assert expected in mapping_error(section, key, value)


def test_command_line_values_reach_validation_typed_as_hydra_parses_them():
    assert "train.steps = 'abc': expected integer, got str" in error_of("train.steps=abc")
    assert "train.seed = true: expected integer" in error_of("train.seed=true")


def test_enumerations_list_what_is_allowed():
    assert "allowed: 'fp32', 'bf16'" in error_of("precision=bf16", "precision.grad_accum_dtype=fp16")
    assert "did you mean 'linear'" in error_of("scheduler.warmup_type=linar")


def test_all_problems_are_reported_at_once():
    message = error_of("optimizer.lr=0", "train.steps=-1", "+data.foo=1", "model.dropout=1.5")
    assert "4 problems" in message
    for key in ("optimizer.lr", "train.steps", "data.foo", "model.dropout"):
        assert key in message


def test_warmup_to_the_optimizer_lr_must_start_below_it():
    message = error_of("scheduler=warmup", "scheduler.warmup_min_lr=0.01", "optimizer.lr=0.001")
    assert "scheduler.warmup_min_lr = 0.01: must be <= the lr it warms up to" in message


def test_integral_floats_are_accepted_where_ints_are_expected():
    assert compose_run("train.steps=5e2").train.steps == 500


# -------------------------------------------------------------------------- unknown keys


def test_typo_key_on_the_command_line():
    with pytest.raises(ConfigError) as info:
        check_overrides(["train.stepz=5"])
    message = str(info.value)
    assert "train.stepz = 5: unknown key for train" in message
    assert "allowed: " in message and "steps" in message
    assert "did you mean 'train.steps'?" in message


def test_a_typo_in_a_top_level_key_lists_every_section_and_suggests_the_whole_key():
    with pytest.raises(ConfigError) as info:
        check_overrides(["trian.steps=5", "chekpoint.dir=x"])
    message = str(info.value)
    sections = ", ".join(sorted(CONFIG_KEYS))
    assert f"trian.steps = 5: unknown key; allowed: {sections}; did you mean 'train.steps'?" in message
    assert f"chekpoint.dir = 'x': unknown key; allowed: {sections}; did you mean 'checkpoint.dir'?" in message
    assert "more)" not in message and "zero" in sections
    assert f"trian = 1: unknown key; allowed: {sections}; did you mean 'train'?" in error_of("+trian=1")


def test_resume_takes_true_false_or_required():
    for value, expected in (("true", True), ("false", False), ("required", "required")):
        assert compose_run(f"checkpoint.resume={value}").checkpoint.resume == expected
    assert "checkpoint.resume = 'requird': not allowed; allowed: true, false, 'required'; did you mean " \
           "'required'?" in error_of("checkpoint.resume=requird")


def test_plus_typo_is_caught_by_both_checks():
    with pytest.raises(ConfigError, match=r"typo = 1: unknown key \(\+ cannot add keys"):
        check_overrides(["+typo=1"])
    cfg = compose_cfg("+typo=1", "+optimizer.lrr=3")  # Hydra lets both through silently
    assert OmegaConf.select(cfg, "typo") == 1
    with pytest.raises(ConfigError) as info:
        to_run_config(cfg)
    assert "typo = 1: unknown key" in str(info.value)
    assert "optimizer.lrr = 3: unknown key; allowed: betas, bias_correction, eps, lr, name, weight_decay; " \
           "did you mean 'optimizer.lr'?" in str(info.value)


def test_group_choice_decides_which_keys_are_valid():
    check_overrides(["optimizer=sgd", "optimizer.momentum=0.9"])
    with pytest.raises(ConfigError, match="unknown key for optimizer option 'adamw'"):
        check_overrides(["optimizer.momentum=0.9"])
    with pytest.raises(ConfigError, match="unknown key for optimizer option 'sgd'"):
        check_overrides(["optimizer.betas=[0.9,0.95]", "optimizer=sgd"])
    check_overrides(["optimizer.momentum=0.9"], default_choices={"optimizer": "sgd"})


@pytest.mark.parametrize("override, expected", [
    ("~train.steps", "keys cannot be deleted"),
    ("~optimizer", "the optimizer group cannot be removed"),
    ("+optimizer=adam", "use optimizer=<option> (without '+')"),
    ("optimizer.name=sgd", "choose the optimizer with optimizer=<option>"),
    ("optimizer.lr.x=1", "optimizer.lr has no sub-keys"),
    ("train={steps:5,stepz:6}", "train.stepz = 6: unknown key"),
    ("model.vocab_size=100", "model.vocab_size = 100: unknown key for model"),
    ("train.steps=[", "cannot parse the overrides"),
])
def test_check_overrides_refusals(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        check_overrides([override])


def test_check_overrides_passes_hydra_keys_and_valid_lines():
    check_overrides(["hydra.run.dir=/tmp/x", "hydra/job_logging=disabled", "hydra.job.chdir=false"])
    check_overrides(["train={steps:5}", "deepspeed_config=ds.json", "++train.steps=5", "model=gpt_10m"])
    # an option outside the packaged tree is left to Hydra when the search path is extended (--config-dir)
    check_overrides(["optimizer=mine", "optimizer.anything=1"], check_group_options=False)
    check_overrides(["hydra.searchpath=[file:///my/conf]", "optimizer=mine"])


def test_an_unknown_group_option_gets_the_options_and_a_did_you_mean():
    """`optimizer=adamx` is a ConfigError listing the allowed options with a did-you-mean."""
    with pytest.raises(ConfigError) as info:
        check_overrides(["optimizer=adamx", "model=gpt10m"])
    text = str(info.value)
    assert "optimizer = 'adamx': unknown optimizer option; allowed: adam, adamw, lamb" in text
    assert "did you mean optimizer=adam" in text and "did you mean model=gpt_10m?" in text


def test_run_config_from_a_plain_mapping():
    data = OmegaConf.to_container(compose_cfg(), resolve=True)
    assert run_config_from_mapping(data) == compose_run()
    del data["train"]
    data["optimizer"]["name"] = "adamx"
    with pytest.raises(ConfigError) as info:
        run_config_from_mapping(data)
    assert "train: missing section" in str(info.value)
    assert "optimizer.name = 'adamx': unknown optimizer; allowed: adam, adamw, lamb, sgd, onebit_adam, zero_one_adam, " \
           "onebit_lamb; did you mean 'adam'?" \
        in str(info.value)


@given(lr=st.floats(1e-6, 1.0), b1=st.floats(0.0, 0.99), b2=st.floats(0.0, 0.9999), wd=st.floats(0.0, 1.0))
def test_valid_adamw_values_round_trip(lr, b1, b2, wd):
    cfg = AdamWConfig(lr=lr, betas=[b1, b2], weight_decay=wd)
    assert cfg.betas == (b1, b2) and cfg.lr == lr


@given(st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not 0 < x < float("inf")))
def test_non_positive_or_non_finite_lr_is_rejected(lr):
    with pytest.raises(ConfigError, match="lr"):
        AdamWConfig(lr=lr)


def test_required_fields_are_reported_missing():
    with pytest.raises(ConfigError, match="scheduler.cycle_max_lr: missing required key"):
        run_config_from_mapping({**OmegaConf.to_container(compose_cfg(), resolve=True),
                                 "scheduler": {"name": "one_cycle", "cycle_min_lr": 0.1}})


# ----------------------------------------------------------------------------------- zero


def test_zero_overlap_comm_and_model_persistence_threshold_from_the_command_line():
    default = compose_run().zero
    assert default.overlap_comm is None and default.model_persistence_threshold == sys.maxsize
    line = ["zero.stage=3", "zero.overlap_comm=true", "zero.model_persistence_threshold=1000"]
    check_overrides(line)
    zero = compose_run(*line).zero
    assert zero.overlap_comm is True and zero.model_persistence_threshold == 1000
    library = zero.to_library()
    assert (library.stage, library.overlap_comm, library.model_persistence_threshold) == (3, True, 1000)
    assert compose_run("zero.overlap_comm=false").zero.to_library().overlap_comm is False
    assert "zero.overlap_comm = 'yes': expected boolean (true/false) or null" in error_of("zero.overlap_comm=yes")
    assert "zero.model_persistence_threshold = -1: must be >= 0" in error_of("zero.model_persistence_threshold=-1")


def test_zero_library_errors_are_reported_under_the_key_they_name(monkeypatch):
    import fspeed

    def refuse(**options):
        raise ValueError("zero.recompute_blocks=True needs zero stage 3 (it recomputes sharded blocks); got stage 2")

    monkeypatch.setattr(fspeed, "ZeroConfig", refuse)
    with pytest.raises(ConfigError) as info:
        ZeroSection(stage=2, recompute_blocks=True)
    assert [p.key for p in info.value.problems] == ["recompute_blocks"]
    assert "zero.recompute_blocks: zero.recompute_blocks=True needs zero stage 3" in error_of(
        "zero.stage=2", "zero.recompute_blocks=true")


def test_recompute_blocks_needs_zero_stage_3():
    message = error_of("zero.stage=2", "zero.recompute_blocks=true")
    assert "zero.recompute_blocks: zero.recompute_blocks=True needs zero stage 3" in message
    assert compose_run("zero.stage=3", "zero.recompute_blocks=true").zero.recompute_blocks is True


# ------------------------------------------------------------------------------- builders


def test_build_default_optimizer_precision_and_model():
    from fspeed.config.build import build_model_config, build_optimizer, build_precision

    run = compose_run()
    opt = build_optimizer(run)
    clip, adamw = opt.info.children
    assert clip.info.hparams["max_norm"] == 1.0
    assert adamw.info.name == "adamw" and adamw.info.hparams["weight_decay"] == run.optimizer.weight_decay
    lr = adamw.info.hparams["lr"]  # warmup_cosine: base = optimizer.lr, total_num_steps null = train.steps
    base, steps = run.optimizer.lr, run.train.steps
    assert lr(0) == 0.0 and lr(25) == pytest.approx(base * 24 / 50)  # linear warm-up over 50 steps
    assert lr(steps - 1) > lr(steps) == pytest.approx(base * run.scheduler.cos_min_ratio)
    assert build_precision(run).name == "fp32"
    gpt = build_model_config(run, vocab_size=97)  # the vocabulary is padded to a multiple of 8 x parallel.tensor
    assert (gpt.vocab_size, gpt.n_layer, gpt.d_model, gpt.seq_len) == (104, 4, 128, 128)


def test_build_without_clipping_and_with_each_precision():
    from fspeed.config.build import build_optimizer, build_precision

    assert build_optimizer(compose_run("train.gradient_clipping=0")).info.name == "adamw"
    fp16 = build_precision(compose_run("precision=fp16", "precision.initial_scale_power=12"))
    assert fp16.name == "fp16" and fp16.loss_scale.initial_scale_power == 12
    assert build_precision(compose_run("precision=bf16")).name == "bf16"


def test_one_cycle_drives_beta1_and_forces_beta2(caplog):
    from fspeed.config.build import build_optimizer
    from fspeed.optim import ONE_CYCLE_BETA2

    with caplog.at_level(logging.INFO, logger="fspeed.config.build"):
        opt = build_optimizer(compose_run("scheduler=one_cycle", "train.gradient_clipping=0", "train.steps=100"))
    hp = opt.info.hparams
    assert hp["b2"] == ONE_CYCLE_BETA2 and "forces beta2" in caplog.text
    assert hp["b1"](0) == 0.85 and hp["b1"](50) == pytest.approx(0.85)  # first half-cycle = steps // 2
    assert hp["lr"](50) == pytest.approx(0.002)


def test_one_cycle_on_sgd_disables_momentum_cycling(caplog):
    from fspeed.config.build import build_optimizer

    with caplog.at_level(logging.WARNING, logger="fspeed.config.build"):
        opt = build_optimizer(compose_run("optimizer=sgd", "scheduler=one_cycle", "train.gradient_clipping=0"))
    assert opt.info.hparams["momentum"] == 0.9
    assert "cycle_momentum is disabled" in caplog.text


@pytest.mark.parametrize("scheduler, count, expected", [
    ("constant", 7, 0.002),
    ("warmup", 1000, 0.002),  # warmup_max_lr null -> optimizer.lr
    ("warmup_decay", 601, 0.0),  # total_num_steps null -> train.steps (0 from it = total, count = it + 1)
    ("lr_range_test", 20, 0.0002),
])
def test_lr_schedules_follow_the_config(scheduler, count, expected):
    from fspeed.config.build import build_lr_schedule

    assert build_lr_schedule(compose_run(f"scheduler={scheduler}"))(count) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("overrides, expected", [
    (("pipeline.micro_batches=4",), "pipeline.micro_batches = 4: applies to pipeline stages, and parallel.pipe is 1"),
    (("parallel.pipe=2", "zero.stage=3"), "zero.stage = 3: 3 cannot run with pipeline stages"),
    (("parallel.pipe=2", "pipeline.micro_batches=4", "train.grad_accum=2"), "is the gradient accumulation"),
    (("parallel.pipe=2", "activation_checkpointing.policy=full"), "pipeline stages do not run"),
    (("parallel.pipe=2", "pipeline.activation_checkpoint_interval=1", "activation_checkpointing.policy=full",
      "activation_checkpointing.every=2"), "activation_checkpointing.every = 2: is not used by pipeline stages"),
    (("pipeline.input_grad_first=false",), "pipeline.input_grad_first = false: applies to pipeline stages"),
    (("parallel.pipe=2", "pipeline.schedule=zero_bubble", "pipeline.input_grad_first=false"),
     "pipeline.input_grad_first = false: must be true with schedule zero_bubble"),
])
def test_pipeline_relations_are_checked(overrides, expected):
    assert expected in error_of(*overrides)


def test_a_pipeline_with_checkpointed_groups_composes():
    run = compose_run("parallel.pipe=2", "pipeline.micro_batches=4", "pipeline.activation_checkpoint_interval=2",
                      "activation_checkpointing.policy=full")
    assert run.batch.grad_accum == 4 and run.pipeline.activation_checkpoint_interval == 2


def test_the_input_gradient_first_switch_reaches_the_plan():
    from fspeed.parallel.schedules import build_schedule, early_input_grads
    for value, expected in (("true", True), ("false", False)):
        run = compose_run("parallel.pipe=2", "pipeline.micro_batches=4", f"pipeline.input_grad_first={value}")
        pipe = run.pipeline.to_library(4).find("pipeline")
        assert pipe.input_grad_first is expected
        assert bool(early_input_grads(build_schedule("1f1b", 2, 4, 1, pipe.input_grad_first), 1)) is expected
