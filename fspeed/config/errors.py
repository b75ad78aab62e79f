"""Configuration errors that name the key, the value and what is allowed, all problems at once."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

_NO_VALUE = object()


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to a misspelt `word` (difflib), case-insensitive, or None."""
    candidates = list(candidates)
    by_lower = {c.lower(): c for c in candidates}
    if word.lower() in by_lower:
        return by_lower[word.lower()]
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def show_value(value: Any) -> str:
    """A value as a user would write it in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def allowed_names(names: Iterable[str], limit: int | None = 16) -> str:
    """Sorted names, comma-separated; long lists are cut at `limit` (None: never) with a count of the rest."""
    names = sorted(names)
    if not names:
        return "(none)"
    if limit is None or len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])}, ... ({len(names) - limit} more)"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one key."""

    key: str
    reason: str
    value: Any = _NO_VALUE
    allowed: str | None = None
    hint: str | None = None
    suggestion: str | None = None  # a near-miss key name, rendered as "did you mean '<parent>.<suggestion>'?"

    def under(self, prefix: str) -> Problem:
        """The same problem with its key placed under `prefix` (e.g. "optimizer")."""
        if not prefix:
            return self
        return replace(self, key=f"{prefix}.{self.key}" if self.key else prefix)

    def render(self) -> str:
        head = self.key or "<root>"
        if self.value is not _NO_VALUE:
            head += f" = {show_value(self.value)}"
        text = f"{head}: {self.reason}"
        if self.allowed:
            text += f"; allowed: {self.allowed}"
        if self.suggestion:
            parent = self.key.rsplit(".", 1)[0] + "." if "." in self.key else ""
            text += f"; did you mean '{parent}{self.suggestion}'?"
        if self.hint:
            text += f"; {self.hint}"
        return text


class ConfigError(ValueError):
    """Invalid configuration: every problem found, one per line, each naming key, value and what is allowed."""

    title = "invalid fspeed configuration"

    def __init__(self, problems: Sequence[Problem] | str, *, title: str | None = None):
        if isinstance(problems, str):
            problems = [Problem(key="", reason=problems)]
        self.problems: tuple[Problem, ...] = tuple(problems)
        if title is not None:
            self.title = title
        super().__init__(self.render())

    def render(self) -> str:
        count = len(self.problems)
        lines = [f"{self.title} ({count} problem{'s' if count != 1 else ''}):"]
        for problem in self.problems:
            body = problem.render().replace("\n", "\n    ")
            lines.append(f"  - {body}")
        return "\n".join(lines)

    def under(self, prefix: str) -> ConfigError:
        """The same error with every key placed under `prefix`."""
        return type(self)([p.under(prefix) for p in self.problems], title=self.title)


def unknown_key(key: str, value: Any, allowed: Iterable[str], what: str = "unknown key") -> Problem:
    """A Problem for a key that is not in the schema, with the allowed keys and a did-you-mean."""
    allowed = sorted(allowed)
    return Problem(key=key, value=value, reason=what, allowed=allowed_names(allowed),
                   suggestion=did_you_mean(key.rsplit(".", 1)[-1], allowed))


def unknown_section(key: str, value: Any, sections: Iterable[str], what: str = "unknown key") -> Problem:
    """A Problem for a dotted key whose first part is no top-level key: every top-level key (a short
    list, never cut) and a did-you-mean for the whole key (`trian.steps` -> `train.steps`)."""
    top, dot, rest = key.partition(".")
    guess = did_you_mean(top, sections)
    return Problem(key=key, value=value, reason=what, allowed=allowed_names(sections, limit=None),
                   hint=f"did you mean '{guess}{dot}{rest}'?" if guess else None)


def parse_overrides(overrides: Sequence[str]) -> list:
    """Hydra's parse of command-line overrides; a `ConfigError` when they do not parse."""
    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as err:
        raise ConfigError([Problem("", f"cannot parse the overrides: {err}")],
                          title="invalid command-line overrides") from None
