"""A validated `RunConfig` from a DeepSpeed config and/or overrides, composed as fspeed-train does.

    run, translation = compose_run_config({"zero_optimization": {"stage": 3}, ...}, dp_world_size=4)

The DeepSpeed config (a dict, or a path to its JSON) is translated into overrides placed first,
the explicit `overrides` after (they win), composed with the packaged Hydra config
(`fspeed.conf`) and validated: every key the translator accepts takes effect or is reported.
`checkpoint.dir` defaults to `checkpoints` (fspeed-train's default is its Hydra run directory).
"""

from __future__ import annotations

from dataclasses import replace
from os import PathLike
from typing import Any, Mapping, Optional, Sequence, Union

from .command_line import load_deepspeed_config, prepare_overrides
from .deepspeed import DeepSpeedTranslation, translate_deepspeed_config
from .overrides import split_superseded
from .schema import RunConfig
from .targets import targeted_overrides
from .validate import check_overrides, packaged_default_choices, to_run_config

DeepSpeedConfig = Union[Mapping[str, Any], str, PathLike, None]


def compose_run_config(deepspeed_config: DeepSpeedConfig = None, overrides: Sequence[str] = (), *,
                       dp_world_size: int = 1) -> tuple[RunConfig, Optional[DeepSpeedTranslation]]:
    """(the run's config, the DeepSpeed translation or None); see the module docstring."""
    from hydra import compose, initialize_config_module  # noqa: PLC0415 (Hydra only where configs are composed)

    # outside the fspeed-train app there is no Hydra run directory for the default checkpoint.dir
    overrides = ["checkpoint.dir=checkpoints", *overrides]
    if deepspeed_config is None:
        composed, translation = prepare_overrides(list(overrides))
    else:
        source = dict(deepspeed_config) if isinstance(deepspeed_config, Mapping) \
            else load_deepspeed_config(deepspeed_config)
        translation = translate_deepspeed_config(source)
        kept, superseded = split_superseded(translation.overrides, list(overrides))
        composed = targeted_overrides([*kept, *overrides], packaged_default_choices())
        translation = replace(translation, superseded=tuple(superseded))
        check_overrides(composed)
    with initialize_config_module("fspeed.conf", version_base=None):
        cfg = compose("train", overrides=composed)
    return to_run_config(cfg, dp_world_size=dp_world_size), translation


__all__ = ["compose_run_config"]
