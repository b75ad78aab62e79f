"""Strict validation of a composed Hydra config and of command-line overrides.

Hydra's YAML tree has no types, and ``+key=value`` adds keys that ``OmegaConf.to_object``
would later drop silently. So fspeed checks every key of the composed config against the
dataclasses in `schema` (`to_run_config`), and pre-checks the command line before Hydra
composes (`check_overrides`) so a typo gets a message naming the key, the value, the allowed
keys and a did-you-mean rather than Hydra's "not in struct".
"""

from __future__ import annotations

import functools
import importlib.resources
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError, Problem, did_you_mean, parse_overrides, unknown_key, unknown_section
from .fields import ValidatedConfig, config_fields, from_mapping
from .schema import GROUPS, KINDS, RUNTIME_FIELDS, SECTIONS, RunConfig, option_schema
from .targets import TARGET_OPTION, TARGET_SECTIONS, TargetConfig

CONFIG_KEYS = tuple(f.name for f in config_fields(RunConfig) if f.name not in RUNTIME_FIELDS)
"""Top-level keys of the run config."""


# ------------------------------------------------------------------------ composed config


def _resolve(cfg: DictConfig) -> tuple[dict[str, Any], list[Problem]]:
    """Plain containers of every top-level key but `hydra`, interpolations resolved.

    A key that fails to resolve is left out and reported as a Problem; the rest is still
    returned so that every other problem can be reported in the same error.
    """
    data: dict[str, Any] = {}
    problems: list[Problem] = []

    def resolved(node: Any, key: Any, full_key: str) -> Any:
        try:
            value = node[key]
            return OmegaConf.to_container(value, resolve=True, throw_on_missing=True) \
                if OmegaConf.is_config(value) else value
        except OmegaConfBaseException as err:
            message = str(err).splitlines()[0]
            hint = None
            if full_key.endswith("._target_") and "Missing mandatory value" in message:
                hint = f"set it to the dotted path of your callable, e.g. {full_key}=my_pkg.build_{full_key.split('.')[0]}"
            if "HydraConfig was not set" in message:
                hint = ("${hydra:...} only resolves inside the fspeed-train app; set this key explicitly "
                        f"(e.g. {full_key}=/some/path)")
            problems.append(Problem(full_key, f"cannot resolve: {message}", hint=hint))
            return _UNRESOLVED

    for key in cfg.keys():
        if key == "hydra":
            continue
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_missing() and not node._is_interpolation():
            section = {str(sub): resolved(node, sub, f"{key}.{sub}") for sub in node.keys()}
            data[str(key)] = {k: v for k, v in section.items() if v is not _UNRESOLVED}
        else:
            value = resolved(cfg, key, str(key))
            if value is not _UNRESOLVED:
                data[str(key)] = value
    return data, problems


_UNRESOLVED = object()


def run_config_from_mapping(data: Mapping[str, Any], *, dp_world_size: int = 1) -> RunConfig:
    """Validate a plain nested mapping (e.g. a resolved Hydra config) into a `RunConfig`.

    Unknown keys anywhere, missing sections, wrong types and bad values are all reported in one
    `ConfigError`; group nodes (optimizer, scheduler, precision) are checked against the class
    their `name` selects. The batch triad is resolved for `dp_world_size`.
    """
    problems: list[Problem] = [unknown_section(str(k), v, CONFIG_KEYS) for k, v in data.items()
                               if k not in CONFIG_KEYS]
    sections: dict[str, Any] = {}
    for section in (*SECTIONS, *KINDS):
        if section not in data:
            problems.append(Problem(section, "missing section"))
            continue
        node = data[section]
        cls = SECTIONS.get(section)
        if section in TARGET_SECTIONS and isinstance(node, Mapping) and "_target_" in node:
            try:
                sections[section] = TargetConfig.from_node(node)
            except ConfigError as err:
                problems += err.under(section).problems
            continue
        if section in KINDS:
            names = list(KINDS[section])
            kind = node.get("name") if isinstance(node, Mapping) else None
            if not isinstance(node, Mapping):
                problems.append(Problem(section, "expected a mapping", node))
                continue
            if kind is None:
                problems.append(Problem(f"{section}.name", f"missing: it says which {section} this is",
                                        allowed=", ".join(names)))
                continue
            if kind not in KINDS[section]:
                guess = did_you_mean(str(kind), names)
                problems.append(Problem(f"{section}.name", f"unknown {section}", kind, ", ".join(names),
                                        f"did you mean {guess!r}?" if guess else None))
                continue
            cls = KINDS[section][kind]
        try:
            sections[section] = from_mapping(cls, node)
        except ConfigError as err:
            problems += err.under(section).problems
    breakdown = data.get("wall_clock_breakdown", False)
    if not isinstance(breakdown, bool):
        problems.append(Problem("wall_clock_breakdown", "expected boolean", breakdown, "true, false"))
    if problems:
        raise ConfigError(problems)
    return RunConfig(**sections, deepspeed_config=data.get("deepspeed_config"), dp_world_size=dp_world_size,
                     wall_clock_breakdown=breakdown)


def to_run_config(cfg: DictConfig | Mapping[str, Any], *, dp_world_size: int = 1) -> RunConfig:
    """Validate a composed config (a Hydra `DictConfig` or a plain mapping) into a `RunConfig`.

    Interpolations are resolved first (a failure names the key). Raises `ConfigError` listing
    every problem: unknown keys (with allowed keys and a did-you-mean), missing keys, wrong
    types, out-of-range values and an inconsistent batch triad for `dp_world_size`.
    """
    if not isinstance(cfg, DictConfig):
        return run_config_from_mapping({k: v for k, v in cfg.items() if k != "hydra"}, dp_world_size=dp_world_size)
    data, unresolved = _resolve(cfg)
    try:
        run = run_config_from_mapping(data, dp_world_size=dp_world_size)
    except ConfigError as err:
        failed = {p.key for p in unresolved}
        rest = [p for p in err.problems if not (p.key in failed and p.reason == "missing required key")]
        raise ConfigError([*unresolved, *rest]) from None
    if unresolved:
        raise ConfigError(unresolved)
    return run


# ---------------------------------------------------------------------- command-line check


@functools.cache
def packaged_default_choices() -> dict[str, str]:
    """Group -> option chosen by the defaults list of the packaged ``train.yaml``."""
    text = importlib.resources.files("fspeed.conf").joinpath("train.yaml").read_text(encoding="utf-8")
    choices: dict[str, str] = {}
    for entry in OmegaConf.create(text).get("defaults", []):
        if isinstance(entry, Mapping):
            for group, option in entry.items():
                choices[str(group)] = str(option)
    return choices


def _value_text(override: Override) -> Any:
    if override.is_sweep_override():
        return override.get_value_string()
    return override.value()


def _group_choices(override: Override) -> list[str] | None:
    """The options an override of a group selects; None if they cannot be listed (glob sweep)."""
    if override.is_sweep_override():
        try:
            return [str(v) for v in override.sweep_iterator()]
        except HydraException:
            return None
    return [str(override.value())]


@functools.cache
def packaged_options(group: str) -> tuple[str, ...]:
    """The options of a config group in the packaged tree (its ``conf/<group>/*.yaml`` files)."""
    folder = importlib.resources.files("fspeed.conf").joinpath(group)
    return tuple(sorted(entry.name[:-len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml")))


def _check_group_override(override: Override, check_options: bool) -> list[Problem]:
    group = override.key_or_group
    if override.is_delete():
        return [Problem(f"~{group}", f"the {group} group cannot be removed; choose another option with {group}=...")]
    if override.is_add() or override.is_force_add():
        return [Problem(override.get_key_element(), f"{group} is always chosen by the defaults list; "
                        f"use {group}=<option> (without '+')")]
    if not check_options:
        return []
    options = packaged_options(group)
    problems = []
    for choice in _group_choices(override) or []:
        if choice not in options:
            guess = did_you_mean(choice, options)
            problems.append(Problem(group, f"unknown {group} option", choice, ", ".join(options),
                                    f"did you mean {group}={guess}?" if guess else None))
    return problems


def _check_value_override(override: Override, choices: Mapping[str, list[str] | None]) -> list[Problem]:
    key = override.key_or_group
    value = None if override.is_delete() else _value_text(override)
    path = key.split(".")
    top = path[0]
    if top not in CONFIG_KEYS:
        what = "unknown key (+ cannot add keys: fspeed's config has a fixed schema)" if override.is_add() \
            or override.is_force_add() else "unknown key"
        return [unknown_section(key, value, CONFIG_KEYS, what)]
    if override.is_delete():
        return [Problem(key, "keys cannot be deleted; set a value instead (null where the key allows it)")]
    if top == "deepspeed_config":
        if len(path) > 1:
            return [Problem(key, "deepspeed_config is a path, not a mapping", value)]
        return []
    if top == "wall_clock_breakdown":  # a top-level switch, as in DeepSpeed
        return [Problem(key, "wall_clock_breakdown is true or false, not a mapping", value)] if len(path) > 1 else []
    if len(path) == 1:  # a whole section, e.g. train={steps: 5}
        options = choices.get(top) or [None]
        fields = {f.name for cls in (option_schema(top, o) for o in options) if cls for f in config_fields(cls)}
        if not isinstance(value, Mapping):
            return [Problem(key, "expected a mapping of keys; set single keys with section.key=value", value)]
        return [unknown_key(f"{top}.{k}", v, sorted(fields)) for k, v in value.items() if fields and k not in fields]
    problems: list[Problem] = []
    for option in choices.get(top) or [None]:
        if top in TARGET_SECTIONS and option == TARGET_OPTION:
            continue  # a user's callable: its arguments are checked against its signature once composed
        cls = option_schema(top, option) if option is not None else SECTIONS.get(top)
        if cls is None:
            continue  # an option fspeed does not know: Hydra or to_run_config will report it
        names = [f.name for f in config_fields(cls)]
        leaf = path[1]
        label = f"{top} option '{option}'" if top in KINDS else top
        if leaf not in names:
            problems.append(unknown_key(f"{top}.{leaf}", value, names, f"unknown key for {label}"))
        elif len(path) > 2 and _sub_section(cls, leaf) is not None:  # e.g. zero.offload_optimizer.device
            sub_names = [f.name for f in config_fields(_sub_section(cls, leaf))]
            if path[2] not in sub_names:
                problems.append(unknown_key(f"{top}.{leaf}.{path[2]}", value, sub_names, f"unknown key for {top}.{leaf}"))
            elif len(path) > 3:
                problems.append(Problem(key, f"{top}.{leaf}.{path[2]} has no sub-keys; set it whole", value))
        elif len(path) > 2:
            problems.append(Problem(key, f"{top}.{leaf} has no sub-keys; set it whole", value))
        elif leaf == "name" and top in KINDS:
            problems.append(Problem(key, f"choose the {top} with {top}=<option>, not by setting its name",
                                    value, ", ".join(KINDS[top])))
    return problems[:1]


def _sub_section(cls: type, name: str) -> type | None:
    """The config class of field `name` of `cls` when it is a nested section, else None."""
    tp = typing.get_type_hints(cls).get(name)
    return tp if isinstance(tp, type) and issubclass(tp, ValidatedConfig) else None


def check_overrides(overrides: Sequence[str], *, default_choices: Mapping[str, str] | None = None,
                    check_group_options: bool = True) -> None:
    """Check command-line overrides against fspeed's schema before Hydra composes them.

    Refuses unknown keys (including ``+key=...``, which Hydra would add silently), deleting keys
    or groups, and choosing a group option by setting its ``name``. A group choice in the same
    list (``optimizer=sgd``) decides which keys are valid under that group; otherwise
    `default_choices` (default: the packaged ``train.yaml`` defaults list). Keys under
    ``hydra.`` / ``hydra/`` pass through. A group option must be one of the packaged tree's (an
    unknown one gets the list and a did-you-mean) unless `check_group_options` is False or the
    overrides extend the search path (``hydra.searchpath``): then Hydra reports it. Values are
    checked later by `to_run_config`. Raises `ConfigError`.
    """
    parsed = parse_overrides(overrides)
    choices: dict[str, list[str] | None] = {g: [o] for g, o in (default_choices or packaged_default_choices()).items()}
    searchpath = any(o.is_hydra_override() and o.key_or_group == "hydra.searchpath" for o in parsed)
    problems: list[Problem] = []
    for override in parsed:
        if override.is_hydra_override():
            continue
        if override.package is not None:
            problems.append(Problem(override.get_key_element(), "package overrides (group@package) are not supported"))
        elif override.key_or_group in GROUPS:
            problems += _check_group_override(override, check_group_options and not searchpath)
            if not override.is_delete():
                choices[override.key_or_group] = _group_choices(override)
    for override in parsed:
        if override.is_hydra_override() or override.package is not None or override.key_or_group in GROUPS:
            continue
        problems += _check_value_override(override, choices)
    if problems:
        raise ConfigError(problems, title="invalid command-line overrides")
