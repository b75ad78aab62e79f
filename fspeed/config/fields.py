"""Typed, range-checked fields for frozen config dataclasses.

A config class subclasses `ValidatedConfig` and declares fields with `setting(default, *checks)`.
Construction coerces values the way a config file means them (an int where a float is expected,
an integral float such as DeepSpeed's ``5e8`` where an int is expected, a list where a tuple is
expected), rejects wrong types (bools are never numbers) and runs the checks, collecting every
problem into one `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from .errors import ConfigError, Problem, did_you_mean, show_value, unknown_key


@dataclass(frozen=True)
class Check:
    """A value constraint: `test(value)` must hold; `allowed` says what is allowed, for messages."""

    test: Callable[[Any], bool]
    allowed: str


POSITIVE = Check(lambda v: v > 0, "> 0")
NON_NEGATIVE = Check(lambda v: v >= 0, ">= 0")
UNIT_INTERVAL = Check(lambda v: 0 <= v < 1, "in [0, 1)")
OPEN_UNIT_INTERVAL = Check(lambda v: 0 < v < 1, "in (0, 1)")
NON_EMPTY = Check(lambda v: len(v) > 0, "non-empty")


def at_least(low: float) -> Check:
    return Check(lambda v: v >= low, f">= {low}")


def at_most(high: float) -> Check:
    return Check(lambda v: v <= high, f"<= {high}")


def each(check: Check) -> Check:
    """Apply `check` to every element of a tuple value."""
    return Check(lambda vs: all(check.test(v) for v in vs), f"each {check.allowed}")


def setting(default: Any, *checks: Check) -> Any:
    """A dataclass field with a default and value checks."""
    return dataclasses.field(default=default, metadata={"checks": checks})


def required(*checks: Check) -> Any:
    """A dataclass field without a default (the config must set it), with value checks."""
    return dataclasses.field(metadata={"checks": checks})


class _Mismatch(Exception):
    def __init__(self, expected: str, allowed: str | None = None, hint: str | None = None):
        super().__init__(expected)
        self.expected, self.allowed, self.hint = expected, allowed, hint


def describe_type(tp: Any) -> str:
    """A type as a user reads it: 'integer', 'number or null', "one of 'log', 'linear'"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [describe_type(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" or null" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(show_value(a) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"list of {describe_type(args[0])}s"
    if origin is tuple:
        return f"list of {len(args)} {describe_type(args[0])}s"
    return {bool: "boolean (true/false)", int: "integer", float: "number", str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _enumerable(options: list[Any]) -> tuple[Any, ...] | None:
    """Every value a union of bools and Literals allows, in order; None if some option is open-ended."""
    values: list[Any] = []
    for option in options:
        if option is bool:
            values += [True, False]
        elif typing.get_origin(option) is Literal:
            values += typing.get_args(option)
        else:
            return None
    return tuple(values)


def coerce(value: Any, tp: Any) -> Any:
    """`value` converted to type `tp` as a config file means it, or `_Mismatch`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            try:
                return coerce(value, option)
            except _Mismatch as err:
                if len(options) == 1:
                    raise _Mismatch(describe_type(tp), err.allowed, err.hint) from None
        choices = _enumerable(options)
        if choices is not None:  # e.g. bool or Literal["required"]: list every allowed value
            guess = did_you_mean(value, [str(c) for c in choices if isinstance(c, str)]) if isinstance(value, str) \
                else None
            raise _Mismatch("an allowed value", ", ".join(show_value(c) for c in choices),
                            f"did you mean {show_value(guess)}?" if guess else None)
        raise _Mismatch(describe_type(tp))
    if origin is Literal:
        if value in args and type(value) is type(args[0]):
            return value
        guess = did_you_mean(value, [str(a) for a in args]) if isinstance(value, str) else None
        raise _Mismatch("an allowed value", ", ".join(show_value(a) for a in args),
                        f"did you mean {show_value(guess)}?" if guess else None)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(describe_type(tp))
        try:
            return tuple(coerce(v, args[0]) for v in value)
        except _Mismatch:
            raise _Mismatch(describe_type(tp)) from None
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise _Mismatch(describe_type(tp))
        try:
            return tuple(coerce(v, a) for v, a in zip(value, args))
        except _Mismatch:
            raise _Mismatch(describe_type(tp)) from None
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)  # DeepSpeed configs write sizes like 5e8
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise _Mismatch("finite number")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _Mismatch(describe_type(tp))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def config_fields(cls: type) -> list[dataclasses.Field]:
    """The fields a config file may set (init fields)."""
    return [f for f in dataclasses.fields(cls) if f.init]


def is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@dataclass(frozen=True, kw_only=True)
class ValidatedConfig:
    """Base of every config dataclass: coerces and checks its fields on construction.

    Subclasses add cross-field rules by overriding `relation_problems`.
    """

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        hints = _hints(type(self))
        for f in config_fields(type(self)):
            value = getattr(self, f.name)
            nested = hints[f.name]
            if isinstance(nested, type) and issubclass(nested, ValidatedConfig):  # a sub-section
                if isinstance(value, Mapping):
                    try:
                        object.__setattr__(self, f.name, from_mapping(nested, value))
                    except ConfigError as err:
                        problems += err.under(f.name).problems
                elif not isinstance(value, nested):
                    problems.append(Problem(f.name, f"expected a mapping of {f.name} keys, got {type(value).__name__}",
                                            value))
                continue
            try:
                coerced = coerce(value, hints[f.name])
            except _Mismatch as err:
                if err.allowed is not None:
                    problems.append(Problem(f.name, "not allowed", value, err.allowed, err.hint))
                else:
                    problems.append(Problem(f.name, f"expected {err.expected}, got {type(value).__name__}", value))
                continue
            if coerced is not value:
                object.__setattr__(self, f.name, coerced)
            if coerced is None:
                continue
            for check in f.metadata.get("checks", ()):
                if not check.test(coerced):
                    problems.append(Problem(f.name, f"must be {check.allowed}", value))
        if not problems:
            problems = self.relation_problems()
        if problems:
            raise ConfigError(problems)

    def relation_problems(self) -> list[Problem]:
        """Problems involving several fields (checked once every field is valid on its own)."""
        return []


def from_mapping(cls: type, data: Any, **extra: Any) -> Any:
    """Build config class `cls` from a plain mapping: unknown keys, missing required keys, wrong
    types and bad values are all reported together as one `ConfigError` (keys relative to `data`).
    `extra` supplies non-config constructor arguments."""
    if not isinstance(data, Mapping):
        raise ConfigError([Problem("", f"expected a mapping of {cls.__name__} keys, got {type(data).__name__}", data)])
    names = [f.name for f in config_fields(cls) if f.name not in extra]
    problems = [unknown_key(str(k), v, names) for k, v in data.items() if k not in names]
    missing = [f.name for f in config_fields(cls) if is_required(f) and f.name not in data and f.name not in extra]
    problems += [Problem(name, "missing required key") for name in missing]
    if not missing:
        try:
            built = cls(**{k: v for k, v in data.items() if k in names}, **extra)
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)
    return built
