"""A user's own model or data in the run config: a `_target_` node, built by Hydra's `instantiate`.

    fspeed-train model._target_=my_pkg.build_model model.n_layer=4 data._target_=my_pkg.build_dataset

A `model` or `data` node with `_target_` holds the dotted path of a callable; every other key of
the node is a keyword argument for it. Such a node is checked before anything runs, as strictly
as fspeed's own keys: the target must import and be callable, an argument it does not take is
refused with the ones it does and a did-you-mean, a required argument that is missing is named,
and an argument annotated with a plain type (bool, int, float, str, or an Optional, Literal or
tuple of them) must have that type. On the command line `model._target_=...` chooses the
group option `custom` and lets the node take any argument (`targeted_overrides`).
"""

from __future__ import annotations

import importlib
import inspect
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union


from .errors import ConfigError, Problem, did_you_mean, parse_overrides, unknown_key
from .fields import _Mismatch, coerce

TARGET_OPTION = "custom"
"""The option of the `model` and `data` groups for a user's callable (conf/<group>/custom.yaml)."""

TARGET_SECTIONS = ("model", "data")

_PLAIN = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class TargetConfig:
    """A validated `_target_` node: the callable's dotted path and its keyword arguments."""

    target: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> TargetConfig:
        """Check a `{_target_: path, **kwargs}` node (module docstring); ConfigError with keys relative to it."""
        target = node.get("_target_")
        kwargs = {str(k): v for k, v in node.items() if k != "_target_"}
        if not isinstance(target, str) or not target.strip():
            raise ConfigError([Problem("_target_", "expected the dotted path of a callable", target,
                                       hint="e.g. _target_=my_pkg.models.build_model")])
        reserved = [k for k in kwargs if k.startswith("_") and k.endswith("_")]
        problems = [Problem(k, "Hydra's instantiate options are not taken here (fspeed calls the target with its "
                               "keyword arguments)", kwargs[k]) for k in reserved]
        try:
            fn = _locate(target)
        except ImportError as err:
            hint = "is its package installed or in the current directory?" if "no module" in str(err) else None
            raise ConfigError([Problem("_target_", f"cannot import it: {err}", target, hint=hint)]) from None
        if not callable(fn):
            raise ConfigError([Problem("_target_", f"is a {type(fn).__name__}, not a callable", target)])
        problems += _argument_problems(fn, target, {k: v for k, v in kwargs.items() if k not in reserved})
        if problems:
            raise ConfigError(problems)
        return cls(target, kwargs)

    def instantiate(self) -> Any:
        """Call the target with its keyword arguments (Hydra's `instantiate`, nested targets included)."""
        from hydra.utils import instantiate  # noqa: PLC0415

        return instantiate({"_target_": self.target, **self.kwargs}, _convert_="all")

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.target}({args})"


def _locate(path: str) -> Any:
    """The object at dotted `path`: the longest importable module prefix, then attributes.
    ImportError naming the part that is missing (with a did-you-mean among the module's names)."""
    parts = path.strip().split(".")
    obj, found = None, 0
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        try:
            obj, found = importlib.import_module(name), n
            break
        except ModuleNotFoundError as err:
            if err.name is not None and not name.startswith(err.name):
                raise ImportError(f"importing {name} failed: {err}") from None  # a missing import inside it
    if obj is None:
        raise ImportError(f"no module named {parts[0]!r}")
    for attr in parts[found:]:
        if not hasattr(obj, attr):
            names = [n for n in dir(obj) if not n.startswith("_")]
            guess = did_you_mean(attr, names)
            what = f"no module or attribute {attr!r} in package" if hasattr(obj, "__path__") else "no attribute " \
                f"{attr!r} in module"
            raise ImportError(f"{what} {'.'.join(parts[:found])}" + (f"; did you mean {guess!r}?" if guess else ""))
        obj = getattr(obj, attr)
        found += 1
    return obj


def _argument_problems(fn: Any, target: str, kwargs: Mapping[str, Any]) -> list[Problem]:
    """What is wrong with calling `fn(**kwargs)`: unknown, missing and mistyped arguments."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []  # a callable without a signature (some builtins): its own call reports errors
    params = signature.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    problems: list[Problem] = []
    if not takes_any:
        problems += [unknown_key(k, v, named, f"not an argument of {target}") for k, v in kwargs.items()
                     if k not in named]
    for name, p in params.items():
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in kwargs:
            problems.append(Problem(name, f"missing: {target} requires it"))
        elif p.default is p.empty and p.kind is p.POSITIONAL_ONLY:
            problems.append(Problem(name, f"{target} takes it by position only, which a config cannot pass"))
    hints = _hints(fn)
    for name, value in kwargs.items():
        tp = hints.get(name)
        if tp is None or not _plain(tp) or (isinstance(value, Mapping) and "_target_" in value):
            continue
        try:
            coerce(value, tp)
        except _Mismatch as err:
            problems.append(Problem(name, f"expected {err.expected}, got {type(value).__name__}", value, err.allowed,
                                    err.hint))
    return problems


def _hints(fn: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
    except Exception:  # unresolvable forward references: no type checks
        return {}


def _plain(tp: Any) -> bool:
    """Whether `tp` is an annotation of config-file values only (see the module docstring)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return all(isinstance(a, _PLAIN) for a in args)
    if origin in (Union, tuple) or str(origin) == "<class 'types.UnionType'>":
        return all(a is Ellipsis or _plain(a) for a in args)
    return tp in _PLAIN


def targeted_overrides(overrides: Sequence[str], choices: Mapping[str, str]) -> list[str]:
    """The command line with each `_target_` section made open: `model._target_=...` chooses the
    group option `custom` (unless the command line chose a group option itself) and the node's other
    keys become arguments (`model.n_layer=4` is passed as `++model.n_layer=4`, which Hydra adds).
    `choices` are the defaults list's group options. Other overrides are returned unchanged."""
    parsed = parse_overrides(overrides)
    targeted: set[str] = set()
    chosen: dict[str, str] = {}
    for o in parsed:
        if o.is_hydra_override():
            continue
        path = o.key_or_group.split(".")
        if path[0] in TARGET_SECTIONS and path[1:] == ["_target_"] and not o.is_delete():
            targeted.add(path[0])
        elif o.key_or_group in TARGET_SECTIONS and not o.is_sweep_override() and not o.is_delete():
            chosen[o.key_or_group] = str(o.value())
    for section in TARGET_SECTIONS:
        if chosen.get(section, choices.get(section)) == TARGET_OPTION:
            targeted.add(section)
    problems = [Problem(section, f"{section}._target_ replaces the packaged {section} options; drop "
                        f"{section}={chosen[section]}", chosen[section], TARGET_OPTION)
                for section in sorted(targeted) if chosen.get(section, TARGET_OPTION) != TARGET_OPTION]
    if problems:
        raise ConfigError(problems, title="invalid command-line overrides")
    if not targeted:
        return list(overrides)
    out = [f"{section}={TARGET_OPTION}" for section in sorted(targeted) if section not in chosen]
    for text, o in zip(overrides, parsed):
        path = o.key_or_group.split(".")
        if not o.is_hydra_override() and path[0] in targeted and len(path) > 1 and path[1] != "_target_" \
                and not (o.is_add() or o.is_force_add() or o.is_delete()):
            text = "++" + text
        out.append(text)
    return out


__all__ = ["TARGET_OPTION", "TARGET_SECTIONS", "TargetConfig", "targeted_overrides"]
