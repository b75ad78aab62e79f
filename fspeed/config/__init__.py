"""Configuration: dataclass schema, strict validation, DeepSpeed-config translation.

The builders that turn a `RunConfig` into library objects live in `fspeed.config.build`
(imported on demand, so validating a config does not import torch-heavy modules).
"""

from .deepspeed import DeepSpeedConfigError, DeepSpeedTranslation, translate_deepspeed_config
from .command_line import expand_deepspeed_config, load_deepspeed_config, prepare_overrides
from .errors import ConfigError, Problem
from .overrides import format_override, merge_overrides
from .schema import RunConfig
from .validate import check_overrides, run_config_from_mapping, to_run_config

__all__ = [
    "ConfigError",
    "DeepSpeedConfigError",
    "DeepSpeedTranslation",
    "Problem",
    "RunConfig",
    "check_overrides",
    "expand_deepspeed_config",
    "format_override",
    "load_deepspeed_config",
    "merge_overrides",
    "prepare_overrides",
    "run_config_from_mapping",
    "to_run_config",
    "translate_deepspeed_config",
]
