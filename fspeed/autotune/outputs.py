"""What a tuning leaves behind for fspeed-train and DeepSpeed users: the best layout three ways.

    paths = write_best(Path("autotune"), base_overrides, best_candidate)
    # fspeed-train $(cat autotune/best.overrides)
    # fspeed-train --config-dir autotune --config-name best
    # autotune/ds_config.json: its DeepSpeed-shaped part (the batch triad and zero_optimization)

`best.overrides` is the base's overrides and the candidate's, one per line; `best.yaml` the whole
composed configuration (fspeed-train's primary config); `ds_config.json` the part a DeepSpeed
config can say, which fspeed's translator turns back into the same keys (the rest, the remat policy
and the tensor and pipeline sizes, stays in the overrides and the YAML file). When the base holds a
`deepspeed_config=`, ds_config.json is that file with the tuned keys in place (DeepSpeed's
ds_config_optimal.json), ready for a training run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from .space import Candidate


def ds_config(candidate: Candidate) -> dict[str, Any]:
    """The DeepSpeed config of `candidate`'s batch split and ZeRO settings (DeepSpeed's
    `activation_checkpointing` block configures checkpointing a model's own code turns on, and has
    no policy key: the remat stays in the overrides and the YAML file)."""
    c = candidate
    zero: dict[str, Any] = {"stage": c.zero_stage, "reduce_bucket_size": c.reduce_bucket_size,
                            "allgather_bucket_size": c.allgather_bucket_size}
    if c.overlap_comm is not None:
        zero["overlap_comm"] = c.overlap_comm
    if c.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if c.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {"train_batch_size": c.global_batch, "train_micro_batch_size_per_gpu": c.micro_batch,
                              "gradient_accumulation_steps": c.grad_accum, "zero_optimization": zero}
    return config


def merged_ds_config(base_overrides: Sequence[str], candidate: Candidate) -> dict[str, Any]:
    """`ds_config(candidate)` over the base's deepspeed_config file, if it has one."""
    from ..config.command_line import load_deepspeed_config  # noqa: PLC0415
    from ..config.overrides import override_value  # noqa: PLC0415

    tuned = ds_config(candidate)
    path = override_value(base_overrides, "deepspeed_config")
    if path is None:
        return tuned
    merged = load_deepspeed_config(path)
    merged.pop("autotuning", None)
    zero = dict(merged.get("zero_optimization") or {})
    chosen = tuned.pop("zero_optimization")
    for key in ("offload_optimizer", "offload_param"):  # the candidate says whether it offloads; the file, how
        if key not in chosen:
            zero.pop(key, None)
        elif isinstance(zero.get(key), dict) and zero[key].get("device") in ("cpu", "nvme"):
            chosen.pop(key)
    zero.update(chosen)
    return {**merged, **tuned, "zero_optimization": zero}


def best_yaml(base_overrides: Sequence[str], candidate: Candidate) -> str:
    """The whole configuration of the base with `candidate`, as fspeed-train's primary config file."""
    from hydra import compose, initialize_config_module  # noqa: PLC0415 (Hydra only where configs are written)
    from omegaconf import OmegaConf  # noqa: PLC0415

    from ..config.command_line import prepare_overrides  # noqa: PLC0415

    overrides, _ = prepare_overrides([*base_overrides, *candidate.to_overrides()])
    with initialize_config_module("fspeed.conf", version_base=None):
        cfg = compose("train", overrides=overrides)
    return "# the autotuner's best layout: fspeed-train --config-dir <this directory> --config-name best\n" + \
        OmegaConf.to_yaml(cfg)


def write_best(directory: Path, base_overrides: Sequence[str], candidate: Candidate) -> dict[str, Path]:
    """best.overrides, best.yaml and ds_config.json of `candidate` in `directory`; their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"overrides": directory / "best.overrides", "yaml": directory / "best.yaml",
             "ds_config": directory / "ds_config.json"}
    paths["overrides"].write_text("\n".join([*base_overrides, *candidate.to_overrides()]) + "\n")
    paths["yaml"].write_text(best_yaml(base_overrides, candidate))
    paths["ds_config"].write_text(json.dumps(merged_ds_config(base_overrides, candidate), indent=2) + "\n")
    return paths


__all__ = ["best_yaml", "ds_config", "merged_ds_config", "write_best"]
