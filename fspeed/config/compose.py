"""A validated `RunConfig` from a DeepSpeed config and/or overrides, composed as fspeed-train does.

    run, translation = compose_run_config({"zero_optimization": {"stage": 3}, ...}, dp_world_size=4)

The DeepSpeed config (a dict, or a path to its JSON) is translated into overrides placed first,
the explicit `overrides` after (they win), composed with the packaged Hydra config
(`fspeed.conf`) and validated: every key the translator accepts takes effect or is reported.
`checkpoint.dir` defaults to `checkpoints` (fspeed-train's default is its Hydra run directory).
`defaults` are overrides that the file and `overrides` may both replace (a caller's own defaults,
such as `fs.initialize`'s monitors off); `run_dir` stands for fspeed-train's run directory
(`${hydra:runtime.output_dir}`, which only resolves inside the fspeed-train app) in the values.
"""

from __future__ import annotations

from dataclasses import replace
from os import PathLike
from typing import Any, Mapping, Optional, Sequence, Union

from hydra.core.override_parser.overrides_parser import OverridesParser

from .command_line import load_deepspeed_config, prepare_overrides
from .deepspeed import DeepSpeedTranslation, translate_deepspeed_config
from .overrides import format_value, split_superseded
from .schema import RunConfig
from .targets import targeted_overrides
from .validate import check_overrides, packaged_default_choices, to_run_config

DeepSpeedConfig = Union[Mapping[str, Any], str, PathLike, None]


def compose_run_config(deepspeed_config: DeepSpeedConfig = None, overrides: Sequence[str] = (), *,
                       dp_world_size: int = 1, defaults: Sequence[str] = (),
                       run_dir: Optional[str] = None) -> tuple[RunConfig, Optional[DeepSpeedTranslation]]:
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
    composed = [*split_superseded(list(defaults), composed)[0], *composed]
    if run_dir is not None:
        composed = [_in_run_dir(text, run_dir) for text in composed]
    with initialize_config_module("fspeed.conf", version_base=None):
        cfg = compose("train", overrides=composed)
    return to_run_config(cfg, dp_world_size=dp_world_size), translation


RUN_DIR = "${hydra:runtime.output_dir}"


def _in_run_dir(override: str, run_dir: str) -> str:
    """`override` with fspeed-train's run directory in its value replaced by `run_dir`."""
    if RUN_DIR not in override:
        return override
    parsed = OverridesParser.create().parse_override(override)
    value = parsed.value()
    if not isinstance(value, str):
        return override
    return f"{parsed.key_or_group}={format_value(value.replace(RUN_DIR, run_dir))}"


__all__ = ["compose_run_config"]
