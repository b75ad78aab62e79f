"""Preparing command-line overrides before Hydra composes them.

`prepare_overrides` is what the CLI calls on its override arguments: it finds
``deepspeed_config=<path>``, translates that file (`fspeed.config.deepspeed`) into overrides
placed before the command line's (so explicit overrides win over the file), then checks the
whole list against fspeed's schema (`check_overrides`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from os import PathLike
from pathlib import Path
from typing import Any

from .deepspeed import DeepSpeedConfigError, DeepSpeedTranslation, translate_deepspeed_config
from .errors import ConfigError, Problem, parse_overrides
from .overrides import split_superseded
from .targets import targeted_overrides
from .validate import check_overrides, packaged_default_choices


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:  # DeepSpeed loads with a hook that raises on duplicate keys, too
        raise ValueError(f"duplicate keys: {', '.join(duplicates)}")
    return dict(pairs)


def load_deepspeed_config(path: str | PathLike[str]) -> dict[str, Any]:
    """Read a ds_config.json; a missing file, bad JSON or duplicate keys is a `DeepSpeedConfigError`."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise DeepSpeedConfigError([Problem("deepspeed_config", f"cannot read the file: {err.strerror or err}", where)]) from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except ValueError as err:
        raise DeepSpeedConfigError([Problem("deepspeed_config", f"not valid JSON: {err}", where)]) from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError([Problem("deepspeed_config", f"expected a JSON object, got {type(data).__name__}", where)])
    return data


def expand_deepspeed_config(overrides: Sequence[str]) -> tuple[list[str], DeepSpeedTranslation | None]:
    """Translate the ``deepspeed_config=<path>`` among `overrides`, if any, into overrides placed first.

    Returns the override list to compose (the file's overrides the command line does not
    replace, then `overrides` unchanged) and the translation (None without a deepspeed_config).
    Explicit overrides win: a key set on the command line, or a group switched to another
    option there, supersedes the file's overrides for it (listed in `translation.superseded`).
    """
    parsed = parse_overrides(overrides)
    path: Any = None
    for override in parsed:
        if override.key_or_group != "deepspeed_config":
            continue
        if override.is_sweep_override():
            raise ConfigError([Problem("deepspeed_config", "cannot be swept; run one DeepSpeed config per job",
                                       override.get_value_string())])
        path = None if override.is_delete() else override.value()
    if path is None:
        return list(overrides), None
    if not isinstance(path, str):
        raise ConfigError([Problem("deepspeed_config", "expected a path to a JSON file", path)])
    translation = translate_deepspeed_config(load_deepspeed_config(path))
    kept, superseded = split_superseded(translation.overrides, overrides)
    return [*kept, *overrides], replace(translation, superseded=tuple(superseded))


def prepare_overrides(cli_overrides: Sequence[str], *,
                      check_group_options: bool = True) -> tuple[list[str], DeepSpeedTranslation | None]:
    """The override list Hydra should compose, and the DeepSpeed translation if a file was given.

    Expands ``deepspeed_config=<path>`` (`expand_deepspeed_config`), then checks the result with
    `check_overrides`, so that command-line keys are judged against the group options the file
    chose (a file choosing SGD makes ``optimizer.momentum=0.5`` valid). `check_group_options=False`
    leaves group options to Hydra (the CLI passes it when --config-dir adds options). Raises
    `ConfigError` (or its subclass `DeepSpeedConfigError`) naming every problem. A `model._target_`
    or `data._target_` opens that section for the user's callable (`targets.targeted_overrides`).
    """
    overrides, translation = expand_deepspeed_config(cli_overrides)
    overrides = targeted_overrides(overrides, packaged_default_choices())
    check_overrides(overrides, check_group_options=check_group_options)
    return overrides, translation
