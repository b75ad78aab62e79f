"""DeepSpeed's `autotuning` block, run by fspeed's tuner.

    fspeed-autotune deepspeed_config=ds_config.json --nproc 8     # the block's keys set the tuning
    fspeed-train --launch deepspeed_config=ds_config.json         # the same, when the block is enabled

An enabled block becomes `autotune.*` keys (what each DeepSpeed key becomes is in `BLOCK_KEYS`
and printed with the tuning). The offload stays the ds_config's, as DeepSpeed's tuner never
changes it. The rest of the ds_config is the base every trial starts from, written to
`<autotune.dir>/ds_config_base.json` without the block and without what the tuner chooses:
`zero_optimization.stage` (an int, a list or "all": the stages searched, as DeepSpeed's tuner reads
it), `train_micro_batch_size_per_gpu` (the smallest micro-batch tried, as in DeepSpeed) and, with a
`train_batch_size`, `gradient_accumulation_steps` (fspeed keeps the global batch and derives the
accumulation; without one, the accumulation stays fixed and the global batch follows, as in
DeepSpeed). Keys given on the command line win over the block's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

DS_TUNER_TYPES = {"gridsearch": "grid", "random": "random", "model_based": "model"}
DS_METRICS = {"throughput": "throughput", "latency": "latency", "flops": "throughput"}
BLOCK_KEYS = {  # DeepSpeed key: (DeepSpeed's default, what it becomes)
    "enabled": (False, "runs the tuner"),
    "fast": (True, "true: autotune.strategy=fast (ZeRO stage x micro-batch); false: tuner_type's strategy with "
                   "autotune.space.slow=true (bucket sizes and overlap_comm searched too)"),
    "tuner_type": ("gridsearch", "with fast=false: gridsearch -> grid, random -> random, model_based -> model "
                                 "(fspeed's cost model, not XGBoost)"),
    "tuner_num_trials": (50, "autotune.max_trials"),
    "tuner_early_stopping": (5, "autotune.patience"),
    "results_dir": ("autotuning_results", "autotune.dir"),
    "exps_dir": ("autotuning_exps", "its default only: each trial's files are kept under results_dir/<trial>"),
    "overwrite": (True, "true: autotune.resume=false (earlier results kept as *.previous); false: resume"),
    "metric": ("throughput", "throughput and flops -> autotune.metric=throughput (for one model, flops per "
                             "second is proportional to samples per second), latency -> latency"),
    "metric_path": (None, "null only: the metrics go to results_dir (results.json)"),
    "start_profile_step": (3, "autotune.warm_steps = start_profile_step - 1"),
    "end_profile_step": (5, "autotune.measured_steps = end_profile_step - start_profile_step + 1"),
    "arg_mappings": (None, "null only: fspeed-train reads the batch keys itself"),
    "max_train_batch_size": (None, "null only: fspeed tunes at the config's train_batch_size"),
    "min_train_batch_size": (1, "1 only: fspeed tunes at the config's train_batch_size"),
    "max_train_micro_batch_size_per_gpu": (1024, "autotune.space.micro_batch_max (when set)"),
    "min_train_micro_batch_size_per_gpu": (1, "autotune.space.micro_batch_min"),
    "num_tuning_micro_batch_sizes": (3, "autotune.fast_micro_batches"),
    "mp_size": (1, "autotune.space.tensor"),
    "model_info": (None, "null only: fspeed measures the model in its profiling pass"),
    "model_info_path": (None, "null only: fspeed measures the model in its profiling pass"),
}


def autotuning_enabled(ds: Mapping[str, Any]) -> bool:
    block = ds.get("autotuning")
    return isinstance(block, Mapping) and block.get("enabled") is True


def translate_block(ds: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str], dict[str, Any]]:
    """(autotune keys, space restrictions, summary lines, the base ds_config) of a ds_config whose
    `autotuning` block is enabled. ValueError naming the first key fspeed cannot honour."""
    block = dict(ds["autotuning"])
    unknown = sorted(set(block) - set(BLOCK_KEYS))
    if unknown:
        raise ValueError(f"autotuning.{unknown[0]}: not a key of DeepSpeed's autotuning block; allowed: "
                         f"{', '.join(BLOCK_KEYS)}")
    get = lambda key: block.get(key, BLOCK_KEYS[key][0])  # noqa: E731
    for key in ("metric_path", "arg_mappings", "max_train_batch_size", "min_train_batch_size", "model_info",
                "model_info_path", "exps_dir"):
        if get(key) != BLOCK_KEYS[key][0]:
            raise ValueError(f"autotuning.{key}={get(key)!r}: {BLOCK_KEYS[key][1]}")
    tuner: dict[str, Any] = {}
    space: dict[str, Any] = {}
    if not isinstance(get("fast"), bool):
        raise ValueError(f"autotuning.fast={get('fast')!r}: allowed: true, false")
    if get("fast"):
        tuner["strategy"] = "fast"
        tuner["fast_micro_batches"] = get("num_tuning_micro_batch_sizes")
    else:
        kind = get("tuner_type")
        if kind not in DS_TUNER_TYPES:
            raise ValueError(f"autotuning.tuner_type={kind!r}: allowed: {', '.join(DS_TUNER_TYPES)}")
        tuner["strategy"] = DS_TUNER_TYPES[kind]
        space["slow"] = True
    if get("metric") not in DS_METRICS:
        raise ValueError(f"autotuning.metric={get('metric')!r}: allowed: {', '.join(DS_METRICS)}")
    start, end = get("start_profile_step"), get("end_profile_step")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)) or not 1 <= start <= end:
        raise ValueError(f"autotuning.start_profile_step={start!r}, end_profile_step={end!r}: allowed: integers "
                         "with 1 <= start_profile_step <= end_profile_step")
    if not isinstance(get("overwrite"), bool):
        raise ValueError(f"autotuning.overwrite={get('overwrite')!r}: allowed: true, false")
    tuner.update(metric=DS_METRICS[get("metric")], max_trials=get("tuner_num_trials"),
                 patience=get("tuner_early_stopping"), dir=get("results_dir"), resume=not get("overwrite"),
                 warm_steps=start - 1, measured_steps=end - start + 1)
    space["tensor"] = [get("mp_size")]
    base = {k: v for k, v in ds.items() if k != "autotuning"}
    zero = dict(base.get("zero_optimization") or {})
    for key in ("offload_optimizer", "offload_param"):  # DeepSpeed's tuner never changes the offload
        device = zero.get(key, {}).get("device") if isinstance(zero.get(key), Mapping) else None
        space[key] = [device in ("cpu", "nvme")]
    if get("fast"):  # stage x micro-batch only, as DeepSpeed's fast mode (and nothing else to profile)
        space.update(remat=["none"], pipe=[1])
    stage = zero.pop("stage", "all")
    space["zero_stage"] = [0, 1, 2, 3] if stage == "all" else list(stage) if isinstance(stage, list) else [stage]
    if "zero_optimization" in base:
        base["zero_optimization"] = zero
    smallest = base.pop("train_micro_batch_size_per_gpu", None)
    if "train_batch_size" in base:
        base.pop("gradient_accumulation_steps", None)
    space["micro_batch_min"] = block.get("min_train_micro_batch_size_per_gpu", smallest or 1)
    if "max_train_micro_batch_size_per_gpu" in block:
        space["micro_batch_max"] = block["max_train_micro_batch_size_per_gpu"]
    became = {"fast": "autotune.strategy" + ("=fast" if get("fast") else f"={tuner['strategy']}, autotune.space.slow"
                                              "=true"),
              "tuner_type": f"autotune.strategy={tuner['strategy']}" if not get("fast") else "not used (fast=true)",
              "tuner_num_trials": "autotune.max_trials", "tuner_early_stopping": "autotune.patience",
              "results_dir": "autotune.dir", "overwrite": f"autotune.resume={str(tuner['resume']).lower()}",
              "metric": f"autotune.metric={tuner['metric']}", "start_profile_step": f"autotune.warm_steps={start - 1}",
              "end_profile_step": f"autotune.measured_steps={end - start + 1}",
              "max_train_micro_batch_size_per_gpu": "autotune.space.micro_batch_max",
              "min_train_micro_batch_size_per_gpu": "autotune.space.micro_batch_min",
              "num_tuning_micro_batch_sizes": "autotune.fast_micro_batches" if get("fast") else "not used (fast=false)",
              "mp_size": "autotune.space.tensor"}
    summary = [f"autotuning.{k}={json.dumps(v)} -> {became.get(k, 'its default')}" for k, v in block.items()
               if k != "enabled"]
    summary.append(f"zero_optimization.stage={json.dumps(stage)} -> autotune.space.zero_stage={space['zero_stage']}")
    if smallest is not None:
        summary.append(f"train_micro_batch_size_per_gpu={smallest} -> the smallest micro-batch tried")
    return tuner, space, summary, base


def tuner_argv(overrides: list[str], launch: bool) -> list[str] | None:
    """fspeed-train's hand-over: the fspeed-autotune command line for `overrides` when their
    deepspeed_config has an enabled autotuning block (else None). The world is what `--launch`
    would start (parallel.data x parallel.tensor x parallel.pipe; one rank without --launch); the
    tuner chooses the layout within it, so the parallel.* keys do not go to the base."""
    from ..config.command_line import load_deepspeed_config  # noqa: PLC0415
    from ..config.deepspeed import DeepSpeedConfigError  # noqa: PLC0415
    from ..config.overrides import override_value  # noqa: PLC0415

    path = override_value(overrides, "deepspeed_config")
    try:
        if path is None or not autotuning_enabled(load_deepspeed_config(path)):
            return None
    except DeepSpeedConfigError:
        return None  # fspeed-train's own checks report the file
    sizes = {key: value for key in ("parallel.data", "parallel.tensor", "parallel.pipe")
             if (value := override_value(overrides, key)) is not None}
    world = 1
    if launch:
        try:
            for key in ("parallel.data", "parallel.tensor", "parallel.pipe"):
                world *= int(sizes.get(key, "1"))
        except ValueError:
            world = 0
        if "parallel.data" not in sizes or world < 1:
            raise ValueError("--launch with an autotuning block tunes for the world it would start: give it as "
                             "positive sizes, e.g. parallel.data=8 (the tuner then chooses the tensor and pipeline "
                             f"sizes within it); got {sizes or 'none'}")
    rest = [o for o in overrides if o.split("=", 1)[0] not in sizes]
    return ["--nproc", str(world), *rest]


def write_base(base: Mapping[str, Any], directory: Path) -> Path:
    """The base ds_config (no autotuning block) as `directory`/ds_config_base.json, for every trial."""
    directory.mkdir(parents=True, exist_ok=True)
    path = (directory / "ds_config_base.json").resolve()
    path.write_text(json.dumps(base, indent=1))
    return path


__all__ = ["BLOCK_KEYS", "autotuning_enabled", "translate_block", "tuner_argv", "write_base"]
