"""DeepSpeed ds_config.json translation: every key translated or accounted for, CLI wins over the file."""

import copy
import functools
import json
import sys

import pytest
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf

from fspeed.config import (
    ConfigError,
    DeepSpeedConfigError,
    check_overrides,
    expand_deepspeed_config,
    format_override,
    load_deepspeed_config,
    merge_overrides,
    prepare_overrides,
    to_run_config,
    translate_deepspeed_config,
)
from fspeed.config import deepspeed_keys as K
from fspeed.config.schema import (
    GROUPS,
    AdamConfig,
    AdamWConfig,
    Fp16Config,
    LambConfig,
    LRRangeTestConfig,
    OneCycleConfig,
    SGDConfig,
    WarmupConfig,
    WarmupCosineConfig,
    WarmupDecayConfig,
)

CKPT = "checkpoint.dir=/tmp/fspeed-test-ckpt"


@pytest.fixture(autouse=True, scope="module")
def hydra_tree():
    with initialize_config_module("fspeed.conf", version_base=None):
        yield


@functools.lru_cache(maxsize=None)
def composed_options(choices: tuple[str, ...]):
    return compose("train", overrides=[CKPT, *choices])


def quick_compose(overrides: list[str]):
    """Hydra's composition, with the group choices composed once per combination (composing is
    slow) and value overrides applied the way Hydra applies them (OmegaConf.update on the result)."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    cfg = copy.deepcopy(composed_options(tuple(o.input_line for o in parsed if o.key_or_group in GROUPS)))
    for override in parsed:
        if override.key_or_group not in GROUPS:
            OmegaConf.update(cfg, override.key_or_group, override.value(), merge=True)
    return cfg


def run_from(ds: dict, *cli: str, dp_world_size: int = 1):
    """Translate `ds`, check and compose it (file overrides first, then `cli`) and validate."""
    overrides = merge_overrides(translate_deepspeed_config(ds).overrides, cli)
    check_overrides(overrides)  # the translator only emits keys of fspeed's schema
    return to_run_config(quick_compose(overrides), dp_world_size=dp_world_size)


def problems_of(ds: dict) -> str:
    with pytest.raises(DeepSpeedConfigError) as info:
        translate_deepspeed_config(ds)
    return str(info.value)


BASE = {"train_micro_batch_size_per_gpu": 8}


# ------------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize("block, cls, expected", [
    # DeepSpeed gotcha: "Adam" means AdamW because adam_w_mode defaults to true
    ({"type": "Adam", "params": {"lr": 3e-4, "weight_decay": 0.1}}, AdamWConfig, {"lr": 3e-4, "weight_decay": 0.1}),
    ({"type": "adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, AdamConfig,
     {"adam_w_mode": False, "weight_decay": 0.1, "lr": 1e-3}),
    ({"type": "AdamW", "params": {"adam_w_mode": False}}, AdamWConfig, {"weight_decay": 0.0}),  # AdamW wins
    ({"type": "ADAMW", "params": {"betas": [0.8, 0.9], "eps": 1e-6, "bias_correction": False}}, AdamWConfig,
     {"betas": (0.8, 0.9), "eps": 1e-6, "bias_correction": False}),
    ({"type": "AdamW", "params": {"torch_adam": True}}, AdamWConfig, {"weight_decay": 0.01}),  # torch's default
    ({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}, AdamConfig, {"weight_decay": 0.0}),
    ({"type": "Lamb", "params": {"lr": 2e-3, "max_coeff": 0.3, "min_coeff": 0.01, "eps_inside_sqrt": True}}, LambConfig,
     {"lr": 2e-3, "max_coeff": 0.3, "eps_inside_sqrt": True, "weight_decay": 0.0}),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}, SGDConfig,
     {"lr": 0.1, "momentum": 0.9, "nesterov": True, "dampening": 0.0}),
])
def test_each_optimizer_type(block, cls, expected):
    run = run_from({**BASE, "optimizer": block})
    assert type(run.optimizer) is cls
    for key, value in expected.items():
        assert getattr(run.optimizer, key) == pytest.approx(value)


def test_adam_gotcha_is_explained():
    notes = translate_deepspeed_config({"optimizer": {"type": "Adam"}}).notes
    assert any('"Adam" without adam_w_mode is AdamW' in note for note in notes)


@pytest.mark.parametrize("block, expected", [
    ({"type": "Adam", "params": {"max_grad_norm": 1.0}}, "max_grad_norm = 1.0: not supported as an optimizer parameter"),
    ({"type": "Adagrad"}, "a DeepSpeed optimizer fspeed does not translate yet"),
    ({"type": "Adamm"}, "unknown optimizer type; allowed: Adam, AdamW, Lamb, SGD, OneBitAdam, ZeroOneAdam, OneBitLamb "
                        "(case-insensitive); did you mean 'Adam'?"),
    ({"type": "Adam", "params": {"amsgrad": True}}, "optimizer.params.amsgrad = true: not supported by fspeed yet"),
    ({"type": "Adam", "params": {"weight_decy": 0.1}}, "did you mean 'optimizer.params.weight_decay'?"),
    ({"type": "AdamW", "params": {"torch_adam": True, "bias_correction": False}}, "not a parameter of torch.optim"),
    ({"type": "Adam", "params": {"lr": [1e-3, 1e-4]}}, "per-parameter-group values are not supported"),
    ({"params": {}}, "optimizer.type: missing; allowed: Adam, AdamW, Lamb, SGD"),
    ({"type": 3}, "optimizer.type = 3: expected a string"),
])
def test_optimizer_problems(block, expected):
    assert expected in problems_of({"optimizer": block})


def test_optimizer_no_effect_params_are_listed():
    t = translate_deepspeed_config({"optimizer": {"type": "Adam", "params": {"set_grad_none": True, "amsgrad": False}}})
    assert any(item.startswith("optimizer.params.set_grad_none = true") for item in t.no_effect)
    assert any(item.startswith("optimizer.params.amsgrad = false") for item in t.no_effect)


# ------------------------------------------------------------------------------- schedulers


@pytest.mark.parametrize("block, cls, expected", [
    ({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 50,
                                        "lr_range_test_staircase": True}},
     LRRangeTestConfig, {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 50, "lr_range_test_step_rate": 1.0}),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": [1e-3], "cycle_first_step_size": 100}},
     OneCycleConfig, {"cycle_max_lr": 1e-3, "cycle_first_step_size": 100, "cycle_second_step_size": None,
                      "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "cycle_momentum": True}),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 10}}, WarmupConfig,
     {"warmup_max_lr": None, "warmup_min_lr": 0.0, "warmup_type": "log", "warmup_num_steps": 10}),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 500, "warmup_type": "linear"}}, WarmupDecayConfig,
     {"warmup_max_lr": 0.001, "total_num_steps": 500, "warmup_num_steps": 1000, "warmup_type": "linear"}),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 500, "warmup_num_steps": 20, "last_batch_iteration": -1}},
     WarmupCosineConfig, {"cos_min_ratio": 1e-4, "warmup_min_ratio": 0.0, "total_num_steps": 500}),
])
def test_each_scheduler_type(block, cls, expected):
    run = run_from({**BASE, "scheduler": block})
    assert type(run.scheduler) is cls
    for key, value in expected.items():
        actual = getattr(run.scheduler, key)
        assert actual == (pytest.approx(value) if isinstance(value, float) else value)


def test_no_scheduler_block_means_constant_lr():
    assert run_from(BASE).scheduler.name == "constant"


@pytest.mark.parametrize("block, expected", [
    ({"type": "WarmupDecayLR", "params": {}}, "total_num_steps: missing; DeepSpeed's WarmupDecayLR requires it"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}, "cycle_max_lr: missing"),
    ({"type": "WarmupLr"}, "did you mean 'WarmupLR'?"),
    ({"type": "StepLR", "params": {"step_size": 10}}, "not a scheduler fspeed translates"),
    ({"type": "WarmupLR", "params": {"warmup_num_step": 10}}, "did you mean 'scheduler.params.warmup_num_steps'?"),
    ({"type": "WarmupLR", "params": {"last_batch_iteration": 99}}, "last_batch_iteration = 99: not supported"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": [1e-4, 1e-5], "cycle_max_lr": 1e-3}}, "per-parameter-group"),
])
def test_scheduler_problems(block, expected):
    assert expected in problems_of({"scheduler": block})


def test_unknown_warmup_type_falls_back_to_log_like_deepspeed():
    t = translate_deepspeed_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})
    assert "scheduler.warmup_type=log" in t.overrides
    assert any("DeepSpeed warns and uses 'log'" in note for note in t.notes)


# ------------------------------------------------------------------------------- precision


def test_fp16_block():
    run = run_from({**BASE, "fp16": {"enabled": True, "loss_scale_window": 500, "hysteresis": 4, "min_loss_scale": 2,
                                     "initial_scale_power": 12}})
    assert run.precision == Fp16Config(loss_scale_window=500, hysteresis=4, min_loss_scale=2.0, initial_scale_power=12)


@pytest.mark.parametrize("key", ["bf16", "bfloat16"])
def test_bf16_block_and_its_legacy_alias(key):
    run = run_from({**BASE, key: {"enabled": True, "check_grad_overflow": False},
                    "data_types": {"grad_accum_dtype": "bf16"}})
    assert (run.precision.name, run.precision.check_grad_overflow, run.precision.grad_accum_dtype) == ("bf16", False, "bf16")


def test_disabled_or_absent_precision_blocks_mean_fp32():
    t = translate_deepspeed_config({"fp16": {"enabled": False, "loss_scale": 128}})
    assert "precision=fp32" in t.overrides
    assert any(item.startswith("fp16 = {enabled: false") and "block disabled" in item for item in t.no_effect)
    assert run_from(BASE).precision.name == "fp32"


def test_grad_accum_dtype_default_difference_is_noted():
    notes = translate_deepspeed_config({"bf16": {"enabled": True}}).notes
    assert any("DeepSpeed would accumulate gradients in bf16; fspeed accumulates in fp32" in n for n in notes)


@pytest.mark.parametrize("ds, expected", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16 and bf16 cannot both be enabled"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "both bf16 and its legacy alias bfloat16 are set"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast = true: not supported by fspeed yet"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, "did you mean 'fp16.loss_scale_window'?"),
    ({"fp16": {"enabled": "auto"}}, "fp16.enabled = 'auto': unresolved placeholder"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16_optimizer_states = true: not supported"),
    ({"data_types": {"grad_accum_dtype": "fp8"}}, "data_types.grad_accum_dtype = 'fp8': unknown dtype"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "fp32 training accumulates in fp32"),
])
def test_precision_problems(ds, expected):
    assert expected in problems_of(ds)


def test_bad_precision_values_fail_validation_with_fspeed_keys():
    with pytest.raises(ConfigError, match="precision.hysteresis = 0: must be > 0"):
        run_from({**BASE, "fp16": {"enabled": True, "hysteresis": 0}})


# ------------------------------------------------------------------------------- batch triad


@pytest.mark.parametrize("ds, dp, expected", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}, 1, (64, 8, 8)),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 2, (64, 8, 4)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_batch_size": 32}, 1, (32, 32, 1)),
    ({"train_batch_size": 32.0, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}, 1, (32, 8, 4)),
])
def test_batch_triad_combinations(ds, dp, expected):
    assert run_from(ds, dp_world_size=dp).batch[:3] == expected


def test_inconsistent_batch_triad_from_the_file():
    with pytest.raises(ConfigError, match=r"64 != 8 x 3 x 1 = 24"):
        run_from({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3})


def test_without_batch_keys_fspeed_defaults_are_kept():
    t = translate_deepspeed_config({})
    assert not any(o.startswith("train.micro_batch_size") for o in t.overrides)
    assert any("no batch-size keys" in note for note in t.notes)


# --------------------------------------------------------------------- other keys, policy


def test_gradient_clipping_and_steps_per_print():
    assert run_from(BASE).train.gradient_clipping == 1.0  # DeepSpeed's current default, emitted explicitly
    run = run_from({**BASE, "gradient_clipping": 0.0, "steps_per_print": 10})
    assert (run.train.gradient_clipping, run.train.steps_per_print) == (0.0, 10)


def test_unknown_keys_are_all_reported_with_suggestions():
    message = problems_of({"train_batch_sise": 8, "optimiser": {}, "zero_optimization": {"stage": 0, "overlap_com": True}})
    assert "3 problems" in message
    assert "did you mean 'train_batch_size'?" in message
    assert "did you mean 'optimizer'?" in message
    assert "did you mean 'zero_optimization.overlap_comm'?" in message


def test_unsupported_keys_error_only_when_not_default():
    ds = {**BASE, "memory_breakdown": False, "zero_optimization": {"stage": 0, "contiguous_gradients": True},
          "activation_checkpointing": {"partition_activations": False}, "comet": {"enabled": False},
          "zero_allow_untested_optimizer": True, "pipeline": {"stages": "auto"}}
    no_effect = translate_deepspeed_config(ds).no_effect
    for key in ("memory_breakdown", "zero_optimization.contiguous_gradients", "activation_checkpointing",
                "comet", "zero_allow_untested_optimizer", "pipeline"):
        assert any(item.startswith(f"{key} = ") for item in no_effect), key
    message = problems_of({"memory_breakdown": True, "zero_optimization": {"stage": 3, "offload_optimizer":
                           {"device": "nvme"}}, "comet": {"enabled": True}, "prescale_gradients": True})
    assert "4 problems" in message
    for key in ("memory_breakdown = true", "zero_optimization.offload_optimizer.device = 'nvme'",
                "comet.enabled = true", "prescale_gradients = true"):
        assert key in message


def test_zero_and_tensor_parallel_blocks_translate():
    run = run_from({**BASE, "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7, "allgather_bucket_size": 2e8,
                                                  "stage3_param_persistence_threshold": 1e4,
                                                  "stage3_prefetch_bucket_size": 0, "overlap_comm": True},
                    "tensor_parallel": {"autotp_size": 2}})
    assert (run.zero.stage, run.zero.reduce_bucket_size, run.zero.allgather_bucket_size) == (3, 50_000_000, 200_000_000)
    assert run.zero.param_persistence_threshold == 10_000 and run.zero.prefetch is False
    assert run.parallel.tensor == 2
    assert "zero_optimization.stage = 5" in problems_of({"zero_optimization": {"stage": 5}})
    assert "zero_optimization.round_robin_gradients = true" in problems_of(
        {"zero_optimization": {"stage": 2, "round_robin_gradients": True}})


def accepted(ds: dict) -> dict[str, str]:
    """The summary's "accepted, no effect" lines of `ds`, by key: {key: "value (reason)"}."""
    return dict(item.split(" = ", 1) for item in translate_deepspeed_config(ds).no_effect)


def zero(stage: int, **keys) -> dict:
    return {**BASE, "zero_optimization": {"stage": stage, **keys}}


# ------------------------------------------------------------------------- zero_optimization


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), (None, None)])
def test_overlap_comm_translates(value, expected):
    run = run_from(zero(2, overlap_comm=value))
    assert run.zero.overlap_comm is expected and run.zero.to_library().overlap_comm is expected
    assert f"zero_optimization.overlap_comm -> zero.overlap_comm={format_override('x', value)[2:]}" \
        in translate_deepspeed_config(zero(2, overlap_comm=value)).summary()
    assert run_from(zero(3)).zero.overlap_comm is None  # absent: DeepSpeed's stage-dependent default


@pytest.mark.parametrize("spelling", ["stage3_model_persistence_threshold", "model_persistence_threshold"])
def test_model_persistence_threshold_translates_from_both_spellings(spelling):
    run = run_from(zero(3, **{spelling: 1e6}))
    assert run.zero.model_persistence_threshold == 1_000_000
    assert run.zero.to_library().model_persistence_threshold == 1_000_000
    default = run_from(zero(3, **{spelling: sys.maxsize})).zero
    assert default.model_persistence_threshold == sys.maxsize == run_from(zero(3)).zero.model_persistence_threshold
    assert "zero_optimization.model_persistence_threshold = 5: set together with " \
           "zero_optimization.stage3_model_persistence_threshold" in problems_of(
               zero(3, stage3_model_persistence_threshold=5, model_persistence_threshold=5))


ZERO_PLUS_PLUS = {"zero_quantized_weights": False, "zero_quantized_gradients": False,
                  "zero_quantized_nontrainable_weights": False, "zero_hpz_partition_size": 1, "mics_shard_size": -1}


def test_zero_plus_plus_and_mics_keys_are_accepted_at_deepspeed_defaults():
    lines = accepted(zero(3, **ZERO_PLUS_PLUS))
    for key, value in ZERO_PLUS_PLUS.items():
        assert "as in fspeed" in lines[f"zero_optimization.{key}"], key
    non_default = {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                   "zero_quantized_nontrainable_weights": True, "zero_hpz_partition_size": 8, "mics_shard_size": 4}
    message = problems_of(zero(3, **non_default))
    assert "5 problems" in message
    assert "zero_optimization.zero_quantized_weights = true: ZeRO++ quantized weight gathers (qwZ) are not " \
           "implemented; allowed: false (DeepSpeed's default)" in message
    assert "zero_optimization.zero_hpz_partition_size = 8: ZeRO++ hierarchical partitioning (hpZ) is not " \
           "implemented; allowed: 1 (DeepSpeed's default)" in message
    assert "zero_optimization.mics_shard_size = 4: MiCS (sharding within sub-groups) is not implemented; " \
           "allowed: -1 (DeepSpeed's default)" in message
    # DeepSpeed reads them only at stage 3: at stage 2 any value is DeepSpeed's "no effect" too
    lines = accepted(zero(2, **non_default))
    assert lines["zero_optimization.mics_shard_size"] == \
        "4 (DeepSpeed reads it only at stage 3; this config is stage 2)"


@pytest.mark.parametrize("ds_key, value, needle", [
    ("reduce_scatter", False, "fspeed always reduce-scatters gradients to their owners"),
    ("contiguous_gradients", False, "fspeed always accumulates gradients in one contiguous flat buffer"),
    ("round_robin_gradients", True, "round-robin gradient partitioning is not implemented"),
    ("ignore_unused_parameters", False, "fspeed gives unused parameters zero gradients and does not raise"),
    ("use_multi_rank_bucket_allreduce", False, "per-owner reduce is not implemented"),
    ("load_from_fp32_weights", False, "fspeed always restores the fp32 masters"),
    ("elastic_checkpoint", True, "same plan and mesh sizes"),
])
def test_stage_1_2_keys_only_at_deepspeed_defaults(ds_key, value, needle):
    default = K.ZERO_FIXED[ds_key].default
    assert f"zero_optimization.{ds_key}" in accepted(zero(2, **{ds_key: default}))
    message = problems_of(zero(2, **{ds_key: value}))
    assert f"zero_optimization.{ds_key} = {str(value).lower()}: " in message and needle in message
    assert f"allowed: {str(default).lower()} (DeepSpeed's default)" in message
    assert "this config is stage 0" in accepted(zero(0, **{ds_key: value}))[f"zero_optimization.{ds_key}"]


@pytest.mark.parametrize("ds_key, value", [
    ("stage3_max_live_parameters", 2e8), ("max_live_parameters", 2e8), ("stage3_max_reuse_distance", 0),
    ("sub_group_size", 1e8), ("stage3_gather_16bit_weights_on_model_save", True), ("memory_efficient_linear", False),
    ("stage3_module_granularity_threshold", 1000), ("stage3_allgather_sequential", True),
])
def test_stage_3_keys_only_at_deepspeed_defaults(ds_key, value):
    default = K.ZERO_FIXED[ds_key].default
    assert accepted(zero(3, **{ds_key: default}))[f"zero_optimization.{ds_key}"].endswith(
        f"({K.ZERO_FIXED[ds_key].why})")
    message = problems_of(zero(3, **{ds_key: value}))
    assert f"zero_optimization.{ds_key} = " in message and "(DeepSpeed's default)" in message
    assert K.ZERO_FIXED[ds_key].refused in message
    assert "reads it only at stage 3" in accepted(zero(1, **{ds_key: value}))[f"zero_optimization.{ds_key}"]


def test_prefetch_bucket_size_is_on_or_off():
    assert run_from(zero(3, stage3_prefetch_bucket_size=0)).zero.prefetch is False
    translation = translate_deepspeed_config(zero(3, prefetch_bucket_size=5e7))
    assert "zero.prefetch=true" in translation.overrides
    assert any("fspeed prefetches one block ahead" in note for note in translation.notes)
    message = problems_of(zero(3, stage3_prefetch_bucket_size=5e8))
    assert "zero_optimization.stage3_prefetch_bucket_size = 500000000.0: fspeed prefetches exactly one block ahead" \
           in message and "allowed: 0 (no prefetch) or 50000000 (DeepSpeed's default: prefetch on)" in message
    assert "reads it only at stage 3" in accepted(zero(2, stage3_prefetch_bucket_size=5e8))[
        "zero_optimization.stage3_prefetch_bucket_size"]


def test_allgather_partitions_is_ignored_by_deepspeed_too():
    for value in (True, False):
        line = accepted(zero(2, allgather_partitions=value))["zero_optimization.allgather_partitions"]
        assert "nothing uses it" in line


def test_every_zero_key_is_translated_or_accounted_for():
    samples = {**{k: f.default for k, f in K.ZERO_FIXED.items()}, **{k: True for k in K.ZERO_NO_EFFECT},
               "reduce_bucket_size": 1e8, "allgather_bucket_size": 1e8, "param_persistence_threshold": 10,
               "model_persistence_threshold": 10**9, "overlap_comm": True, "prefetch_bucket_size": 0,
               "offload_optimizer": {"device": "cpu"}, "offload_param": None, "cpu_offload": False,
               "cpu_offload_param": False, "cpu_offload_use_pin_memory": True}
    firsts = {first: samples.pop(first, 0) for first, _ in K.ZERO_ALIASES}  # one spelling per config
    assert set(K.ZERO_KEYS) == {"stage", *samples, *firsts}

    def reported(ds: dict) -> set[str]:
        t = translate_deepspeed_config(ds)
        return {key for key, _ in t.mapping} | {item.split(" = ")[0] for item in t.no_effect}

    keys = reported(zero(3, **samples))
    for key in samples:
        assert any(k == f"zero_optimization.{key}" or k.startswith(f"zero_optimization.{key}.") for k in keys), key
    for first, value in firsts.items():
        assert f"zero_optimization.{first}" in reported(zero(3, **{first: value})), first


def test_recompute_blocks_is_fspeeds_own_key_not_deepspeeds():
    message = problems_of(zero(3, recompute_blocks=True))
    assert "zero_optimization.recompute_blocks = true: not a DeepSpeed key" in message
    assert "set zero.recompute_blocks=true on the fspeed-train command line" in message
    assert "recompute_blocks" not in K.ZERO_KEYS


# ------------------------------------------------------------------ other known keys


def test_comms_logger_translates_enabled_and_verbose():
    run = run_from({**BASE, "comms_logger": {"enabled": True, "verbose": True, "prof_all": True, "debug": False,
                                             "prof_ops": ["all_reduce"]}})
    assert run.comms_logger.enabled is True and run.comms_logger.verbose is True
    lines = accepted({**BASE, "comms_logger": {"enabled": True, "prof_all": True, "debug": False, "prof_ops": []}})
    assert lines["comms_logger.prof_all"] == "true (every collective is logged, as in fspeed)"
    assert lines["comms_logger.debug"] == "false (records are named by op, as in fspeed)"
    assert "prof_all is true" in lines["comms_logger.prof_ops"]
    assert run_from({**BASE, "comms_logger": {"enabled": False}}).comms_logger.enabled is False
    assert any("DeepSpeed 0.19 turns its comms logger on whenever" in note
               for note in translate_deepspeed_config({"comms_logger": {"enabled": False}}).notes)
    message = problems_of({"comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"],
                                            "debug": True, "verbos": True}})
    assert "3 problems" in message
    assert "comms_logger.prof_all = false: fspeed logs every collective; choosing ops (prof_ops) is not " \
           "implemented; allowed: true (DeepSpeed's default)" in message
    assert "comms_logger.debug = true: caller names in records are not implemented; allowed: false" in message
    assert "did you mean 'comms_logger.verbose'?" in message


def test_timers_only_at_deepspeed_defaults():
    lines = accepted({**BASE, "timers": {"throughput": {"enabled": True, "synchronized": True}}})
    assert "fspeed's log lines report tokens/s" in lines["timers"]
    message = problems_of({"timers": {"throughput": {"enabled": False, "synchronised": True}}})
    assert "timers.throughput.enabled = false: not supported by fspeed yet; allowed: true (DeepSpeed's default)" \
           in message
    assert "timers.throughput.synchronised = true: unknown DeepSpeed key" in message


@pytest.mark.parametrize("opt_type", ["Lamb", "SGD"])
def test_untested_zero_optimizer_needs_the_flag_as_in_deepspeed(opt_type):
    ds = {**zero(1), "optimizer": {"type": opt_type, "params": {"lr": 0.01}}}
    message = problems_of(ds)
    assert f"zero_allow_untested_optimizer = false: optimizer '{opt_type}' is not one of DeepSpeed's tested ZeRO " \
           "optimizers; DeepSpeed refuses it at zero_optimization.stage 1 unless this is true" in message
    assert run_from({**ds, "zero_optimization": {"stage": 0}}).zero.stage == 0  # no ZeRO: no check
    adam = {**zero(2), "optimizer": {"type": "AdamW"}, "zero_allow_untested_optimizer": True}
    assert "not the case here" in accepted(adam)["zero_allow_untested_optimizer"]
    allowed = {**ds, "zero_allow_untested_optimizer": True}
    if opt_type == "SGD":
        assert run_from(allowed).zero.stage == 1
        assert accepted(allowed)["zero_allow_untested_optimizer"] == "true (lets SGD run under ZeRO, as fspeed does)"
    else:  # fspeed's Lamb needs whole tensors: refused under ZeRO even where DeepSpeed would run it
        assert "fspeed cannot run Lamb under ZeRO even with this flag" in message
        assert "optimizer.type = 'Lamb': Lamb's per-tensor trust ratio needs whole tensors" in problems_of(allowed)


def test_top_level_keys_accepted_only_at_deepspeed_defaults():
    lines = accepted({**BASE, **{key: fixed.default for key, fixed in K.SCALAR_DEFAULTS.items()}})
    for key, fixed in K.SCALAR_DEFAULTS.items():
        assert lines[key].endswith(f"({fixed.why})"), key
    message = problems_of({"log_level": "debug", "communication_data_type": "fp32", "sequence_parallel_size": 2})
    assert "log_level = 'debug': fspeed logs through Hydra; use hydra.verbose=fspeed for debug output; allowed: null" \
           in message
    assert "communication_data_type = 'fp32': a separate reduction dtype is not implemented; set " \
           "data_types.grad_accum_dtype; allowed: null (DeepSpeed's default)" in message
    assert "sequence_parallel_size = 2" in message


def test_keys_deepspeed_ignores_are_accepted_at_any_value():
    lines = accepted({**BASE, "vocabulary_size": 50257, "aio": {"block_size": 262144}, "disable_allgather": True,
                      "zero_force_ds_cpu_optimizer": False, "seq_parallel_communication_data_type": "bf16"})
    assert "multiple of 8" in lines["vocabulary_size"] and "NVMe" in lines["aio"]
    assert "nothing uses it" in lines["disable_allgather"]
    assert "client optimizer" in lines["zero_force_ds_cpu_optimizer"]
    assert "sequence_parallel_size > 1" in lines["seq_parallel_communication_data_type"]


def test_every_no_effect_reason_is_given():
    tables = [K.NO_EFFECT, K.ZERO_NO_EFFECT, *K.OFFLOAD_NO_EFFECT.values()]
    assert all(reason.strip() for table in tables for reason in table.values())
    fixed = [*K.SCALAR_DEFAULTS.values(), *K.ZERO_FIXED.values(), *K.COMMS_LOGGER_FIXED.values()]
    assert all(f.why.strip() and f.refused.strip() for f in fixed)
    assert all(reason.strip() for _, reason in K.BLOCK_DEFAULTS.values())


def test_auto_values_are_refused_with_a_hint():
    message = problems_of({"train_batch_size": "auto", "gradient_clipping": "auto",
                           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}})
    assert message.count("unresolved placeholder") == 4
    assert "Hugging Face Trainer" in message


def test_csv_monitor_enabled_is_translated():
    assert run_from({**BASE, "csv_monitor": {"enabled": False}}).monitor.csv is False
    run = run_from({**BASE, "csv_monitor": {"enabled": True, "output_path": "logs/", "job_name": "bert"}})
    assert run.monitor.csv and run.monitor.csv_dir == "logs/bert"


def test_monitoring_blocks_translate():
    ds = {**BASE, "wall_clock_breakdown": True,
          "tensorboard": {"enabled": True, "output_path": "out/ds_logs", "job_name": "train_bert"},
          "wandb": {"enabled": True, "team": "my_team", "group": "my_group"},
          "flops_profiler": {"enabled": True, "profile_step": 3, "module_depth": 2, "top_modules": 4,
                             "detailed": False, "output_file": "flops.txt", "recompute_fwd_factor": 1.0}}
    run = run_from(ds)
    m = run.monitor
    assert run.wall_clock_breakdown and m.tensorboard and m.tensorboard_dir == "out/ds_logs/train_bert"
    assert m.wandb and (m.wandb_team, m.wandb_group, m.wandb_project) == ("my_team", "my_group", "deepspeed")
    assert m.wandb_mode == "offline" and "W&B offline" in translate_deepspeed_config(ds).summary()
    f = run.flops_profiler
    assert (f.enabled, f.profile_step, f.module_depth, f.top_modules, f.detailed, f.output_file,
            f.recompute_fwd_factor) == (True, 3, 2, 4, False, "flops.txt", 1.0)
    # job_name alone: a sub-directory of where fspeed writes by default (the run directory)
    tb = translate_deepspeed_config({"tensorboard": {"enabled": True, "job_name": "j"}}).overrides
    assert "monitor.tensorboard_dir='${hydra:runtime.output_dir}/tensorboard/j'" in tb
    assert not run_from({**BASE, "tensorboard": {"enabled": False}}).monitor.tensorboard


@pytest.mark.parametrize("ds, needle", [
    ({"wandb": {"enabled": True, "entity": "x"}}, "wandb.entity"),
    ({"tensorboard": {"enabled": True, "output_path": 3}}, "tensorboard.output_path/job_name"),
    ({"flops_profiler": {"enabled": True, "profile_stepz": 3}}, "did you mean"),
])
def test_monitoring_blocks_refuse_unknown_keys(ds, needle):
    assert needle in problems_of(ds)


def test_summary_accounts_for_every_key():
    ds = {"train_batch_size": 16, "optimizer": {"type": "Adam"}, "wall_clock_breakdown": False}
    text = translate_deepspeed_config(ds).summary()
    for needle in ("optimizer.type -> optimizer=adamw", "train_batch_size -> train.train_batch_size=16",
                   "wall_clock_breakdown -> wall_clock_breakdown=false", "notes:"):
        assert needle in text


# ------------------------------------------------------------------- the file and the CLI


def write(tmp_path, ds) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    return str(path)


DS_FILE = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.05}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}


def test_cli_overrides_beat_the_file(tmp_path):
    cli = [f"deepspeed_config={write(tmp_path, DS_FILE)}", "optimizer.lr=0.01", "train.grad_accum=8"]
    overrides, translation = expand_deepspeed_config(cli)
    assert overrides[-3:] == cli and "optimizer.lr=0.0001" in translation.superseded
    run = to_run_config(compose("train", overrides=[CKPT, *overrides]))
    assert run.optimizer.lr == 0.01 and run.optimizer.weight_decay == 0.05  # explicit lr wins, the rest stays
    assert run.batch[:3] == (64, 8, 8) and run.scheduler.warmup_num_steps == 10
    assert run.deepspeed_config.endswith("ds_config.json")


def test_cli_group_switch_drops_the_file_values_for_that_group(tmp_path):
    overrides, translation = expand_deepspeed_config([f"deepspeed_config={write(tmp_path, DS_FILE)}", "optimizer=sgd"])
    assert "optimizer=adamw" in translation.superseded and "optimizer.weight_decay=0.05" in translation.superseded
    run = to_run_config(compose("train", overrides=[CKPT, *overrides]))
    assert isinstance(run.optimizer, SGDConfig) and run.scheduler.name == "warmup"


def test_prepare_checks_cli_keys_against_the_options_the_file_chose(tmp_path):
    path = write(tmp_path, {**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    overrides, translation = prepare_overrides([f"deepspeed_config={path}", "optimizer.momentum=0.5"])
    assert translation is not None and overrides[-1] == "optimizer.momentum=0.5"
    assert to_run_config(quick_compose(overrides)).optimizer == SGDConfig(lr=0.1, momentum=0.5)
    with pytest.raises(ConfigError, match="unknown key for optimizer option 'sgd'"):
        prepare_overrides([f"deepspeed_config={path}", "optimizer.betas=[0.9,0.99]"])
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        prepare_overrides(["train.stepz=3"])


def test_quick_compose_agrees_with_hydra(tmp_path):
    overrides, _ = expand_deepspeed_config([f"deepspeed_config={write(tmp_path, DS_FILE)}", "train.steps=7"])
    assert quick_compose(overrides) == compose("train", overrides=[CKPT, *overrides])


def test_expansion_is_idempotent(tmp_path):
    once, _ = expand_deepspeed_config([f"deepspeed_config={write(tmp_path, DS_FILE)}", "optimizer.lr=0.5"])
    twice, _ = expand_deepspeed_config(once)
    assert compose("train", overrides=[CKPT, *once]) == compose("train", overrides=[CKPT, *twice])


def test_no_deepspeed_config_leaves_overrides_alone():
    assert expand_deepspeed_config(["train.steps=5"]) == (["train.steps=5"], None)
    assert expand_deepspeed_config(["deepspeed_config=null"]) == (["deepspeed_config=null"], None)


def test_file_errors(tmp_path):
    with pytest.raises(DeepSpeedConfigError, match="cannot read the file"):
        load_deepspeed_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,}')
    with pytest.raises(DeepSpeedConfigError, match="not valid JSON"):
        load_deepspeed_config(bad)
    bad.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(DeepSpeedConfigError, match="duplicate keys: train_batch_size"):
        load_deepspeed_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(DeepSpeedConfigError, match="expected a JSON object"):
        load_deepspeed_config(bad)
    with pytest.raises(ConfigError, match="cannot be swept"):
        expand_deepspeed_config(["deepspeed_config=a.json,b.json"])


scalars = (st.none() | st.booleans() | st.integers(-10**12, 10**12)
           | st.floats(allow_nan=False) | st.text(st.characters(exclude_categories=["Cs"]), max_size=12))


@given(st.one_of(scalars, st.lists(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False), max_size=4)))
def test_override_values_read_back_exactly(value):
    parsed = OverridesParser.create().parse_override(format_override("train.x", value)).value()
    assert parsed == value and type(parsed) is type(value)


def test_activation_checkpointing_block_translates():
    run = run_from({**BASE, "activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 4,
                                                         "profile": True, "synchronize_checkpoint_boundary": True}})
    ac = run.activation_checkpointing
    assert (ac.policy, ac.cpu_checkpointing, ac.profile, ac.partition_activations) == ("full", True, True, False)
    assert ac.synchronize_checkpoint_boundary and ac.to_library().synchronize
    run = run_from({**BASE, "activation_checkpointing": {"partition_activations": False}})
    assert run.activation_checkpointing.policy == "none"  # DeepSpeed's defaults turn nothing on
    with pytest.raises(ConfigError, match="partition_activations.*parallel.tensor is 1"):
        run_from({**BASE, "activation_checkpointing": {"partition_activations": True}})
    run = run_from({**BASE, "activation_checkpointing": {"partition_activations": True},
                    "tensor_parallel": {"autotp_size": 2}}, dp_world_size=1)
    assert run.activation_checkpointing.partition_activations and run.parallel.tensor == 2


def test_pipeline_block_translates():
    run = run_from({**BASE, "gradient_accumulation_steps": 4,
                    "pipeline": {"stages": 2, "partition": "type:Block", "activation_checkpoint_interval": 2,
                                 "seed_layers": True, "pipe_partitioned": True}})
    assert (run.parallel.pipe, run.pipeline.partition, run.pipeline.activation_checkpoint_interval) == \
        (2, "type:Block", 2)
    assert run.batch.grad_accum == 4
    t = translate_deepspeed_config({"pipeline": {"stages": 2, "seed_layers": False}})
    assert "pipeline.seed_layers" in t.summary() and "pipeline.stages" in t.summary()
    assert run_from({**BASE, "pipeline": {"stages": "auto"}}).parallel.pipe == 1  # DeepSpeed's defaults
    with pytest.raises(ConfigError, match="pipeline.partition"):
        run_from({**BASE, "pipeline": {"stages": 2, "partition": "random"}})
    # the checkpointing block turns checkpointing on: under stages, one layer per checkpointed group
    run = run_from({**BASE, "activation_checkpointing": {"cpu_checkpointing": True}, "pipeline": {"stages": 2}})
    assert (run.activation_checkpointing.policy, run.pipeline.activation_checkpoint_interval) == ("full", 1)
