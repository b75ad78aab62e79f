"""Hydra override strings: writing values in the override grammar and merging override lists.

The DeepSpeed-config translator produces override strings; they go *before* the command-line
overrides so that anything the user sets explicitly wins over the file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override

from .schema import GROUPS


def _quote(text: str) -> str:
    """`text` as a single-quoted Hydra string.

    In Hydra's grammar a backslash escapes only a quote or the backslashes right before a quote,
    so quotes are escaped and runs of backslashes are doubled where a quote follows them
    (including the closing quote).
    """
    out: list[str] = []
    run = 0
    for char in text:
        if char == "\\":
            run += 1
            continue
        out.append("\\" * (2 * run if char == "'" else run))
        out.append("\\'" if char == "'" else char)
        run = 0
    out.append("\\" * (2 * run))
    return "'" + "".join(out) + "'"


_BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-./]*")


def _reads_back_bare(text: str) -> bool:
    """True if Hydra parses `text` unquoted back to the same string (e.g. adamw, log, fp32)."""
    if not _BARE.fullmatch(text):
        return False
    parsed = OverridesParser.create().parse_override(f"k={text}").value()
    return isinstance(parsed, str) and parsed == text


def format_value(value: Any) -> str:
    """`value` (None, bool, int, float, str, or a list/tuple of those) in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return value if _reads_back_bare(value) else _quote(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as a Hydra override value")


def format_override(key: str, value: Any) -> str:
    """``key=value`` in Hydra's override grammar."""
    return f"{key}={format_value(value)}"


def _explicit_keys(override: Override) -> set[str]:
    """Keys an override sets; a mapping value on a section sets each of its keys (Hydra merges it)."""
    key = override.key_or_group
    value = None if override.is_sweep_override() or override.is_delete() else override.value()
    if isinstance(value, Mapping) and key not in GROUPS:
        return {f"{key}.{k}" for k in value}
    return {key}


def split_superseded(file_overrides: Sequence[str], cli_overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(kept, superseded): the file overrides the command line does not override.

    A file override is superseded when the command line sets the same key, or chooses a
    different option for the group the key lives in (e.g. ``optimizer=lamb`` on the command line
    drops the file's ``optimizer=adamw`` and all of its ``optimizer.*`` values).
    """
    parser = OverridesParser.create()
    cli = parser.parse_overrides(list(cli_overrides))
    cli_keys = set().union(*(_explicit_keys(o) for o in cli)) if cli else set()
    cli_choices = {o.key_or_group: o for o in cli if o.key_or_group in GROUPS}
    parsed = parser.parse_overrides(list(file_overrides))
    file_choices = {o.key_or_group: o for o in parsed if o.key_or_group in GROUPS}

    def choice_changed(group: str) -> bool:
        if group not in cli_choices:
            return False
        mine = file_choices.get(group)
        return mine is None or cli_choices[group].get_value_element_as_str() != mine.get_value_element_as_str() \
            if not cli_choices[group].is_sweep_override() else True

    kept, superseded = [], []
    for text, override in zip(file_overrides, parsed):
        key = override.key_or_group
        group = key.split(".", 1)[0]
        if key in cli_keys or (group in GROUPS and "." in key and choice_changed(group)):
            superseded.append(text)
        else:
            kept.append(text)
    return kept, superseded


def override_value(overrides: Sequence[str], key: str) -> str | None:
    """The text the last ``key=...`` among `overrides` gives `key` (as written), or None."""
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    return values[-1] if values else None


def merge_overrides(file_overrides: Sequence[str], cli_overrides: Sequence[str]) -> list[str]:
    """The file's overrides the command line leaves alone, followed by the command line's."""
    kept, _ = split_superseded(file_overrides, cli_overrides)
    return [*kept, *cli_overrides]
