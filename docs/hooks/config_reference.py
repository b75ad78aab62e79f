"""The configuration reference page, generated from the schema (`fspeed.config.schema`) and the
packaged Hydra tree (`conf/`).

Each key's type and allowed values come from its annotation and `setting(...)` checks, its default
from the packaged YAML (what `fspeed-train` and `fs.initialize` start from; the schema's default
where the YAML does not set it), and its meaning from the comment beside it in the schema, else
the one beside it in the YAML.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import re
import tokenize
import typing
from pathlib import Path
from typing import Any

import yaml

from fspeed.config import schema
from fspeed.config.fields import ValidatedConfig, config_fields, describe_type, is_required

CONF = Path(schema.__file__).resolve().parents[2] / "conf"
RUN_DIR = "${hydra:runtime.output_dir}"


# ------------------------------------------------------------------------------ comments in the sources


@functools.cache
def _field_comments(cls: type) -> dict[str, str]:
    """{field: comment} for the fields `cls` itself declares: the comment at the end of the
    field's line, else the comment lines right above it."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[int, str] = {}  # 1-based line -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    found: dict[str, str] = {}
    body_indent = None
    for number, line in enumerate(lines, start=1):
        match = re.match(r"^(\s+)([A-Za-z_]\w*)\s*:", line)
        if not match:
            continue
        indent = len(match.group(1))
        body_indent = indent if body_indent is None else body_indent
        if indent != body_indent:
            continue
        name = match.group(2)
        if number in comments and not line.strip().startswith("#"):
            found[name] = comments[number]
            continue
        above = []
        k = number - 1
        while k >= 1 and lines[k - 1].strip().startswith("#"):
            above.insert(0, comments.get(k, ""))
            k -= 1
        if above:
            found[name] = " ".join(above)
    return found


def field_comment(cls: type, name: str) -> str:
    """The schema comment of field `name` of `cls` (looked up in the class that declares it)."""
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            comment = _field_comments(klass).get(name)
            if comment:
                return comment
    return ""


@functools.cache
def yaml_file(path: Path) -> tuple[dict, dict[str, str], str]:
    """(values, {dotted key: comment}, header comment) of one packaged YAML file."""
    text = path.read_text()
    values = yaml.safe_load(text) or {}
    comments: dict[str, str] = {}
    header: list[str] = []
    pending: list[str] = []
    stack: list[tuple[int, str]] = []
    seen_key = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            (pending if seen_key else header).append(stripped.lstrip("#").strip())
            continue
        if not stripped:
            if not seen_key and header:
                seen_key = True  # a blank line ends the file's header
            pending = []
            continue
        match = re.match(r"^(\s*)([A-Za-z_]\w*):(.*)$", line)
        if not match:
            continue
        seen_key = True
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([*(k for _, k in stack), key])
        stack.append((indent, key))
        comment = _trailing_comment(rest)
        text_ = comment or " ".join(pending)
        if text_:
            comments[dotted] = text_
        pending = []
    return values, comments, " ".join(header)


def _trailing_comment(rest: str) -> str:
    quote = None
    for i, ch in enumerate(rest):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or rest[i - 1].isspace()):
            return rest[i + 1:].strip()
    return ""


# ---------------------------------------------------------------------------------------- rows


def _allowed(cls: type, f: dataclasses.Field) -> str:
    hint = typing.get_type_hints(cls)[f.name]
    text = describe_type(hint)
    checks = [c.allowed for c in f.metadata.get("checks", ())]
    return text + (f", {', '.join(checks)}" if checks else "")


def _default(cls: type, f: dataclasses.Field, yaml_values: dict | None) -> str:
    if yaml_values is not None and f.name in yaml_values:
        value = yaml_values[f.name]
    elif is_required(f):
        return "required"
    elif f.default is not dataclasses.MISSING:
        value = f.default
    else:
        return "(section)"
    return "`" + yaml_text(value).replace("|", "\\|") + "`"


def yaml_text(value: Any) -> str:
    """`value` as one writes it in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value.replace(RUN_DIR, "<run dir>") if value else '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rows(cls: type, prefix: str, yaml_values: dict | None, yaml_comments: dict[str, str], yaml_prefix: str = ""):
    """(dotted key, type, default, meaning) for every key of `cls`, nested sections flattened."""
    hints = typing.get_type_hints(cls)
    for f in config_fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        nested = hints[f.name]
        sub_yaml = (yaml_values or {}).get(f.name) if yaml_values is not None else None
        if isinstance(nested, type) and issubclass(nested, ValidatedConfig):
            yield from rows(nested, key, sub_yaml if isinstance(sub_yaml, dict) else {}, yaml_comments,
                            f"{yaml_prefix}{f.name}.")
            continue
        meaning = field_comment(cls, f.name) or yaml_comments.get(yaml_prefix + f.name, "")
        if f.name == "name" and prefix in schema.GROUPS:
            meaning = meaning or f"the option, chosen with `{prefix}=<name>`"
        yield key, _allowed(cls, f), _default(cls, f, yaml_values), meaning


@functools.cache
def deepspeed_sources() -> dict[str, list[str]]:
    """{fspeed key: the DeepSpeed keys the translator turns into it}."""
    import deepspeed_reference  # noqa: PLC0415 - docs/hooks, beside this module

    sources: dict[str, list[str]] = {}
    for ds_key, targets in deepspeed_reference.taken().items():
        for target in targets:
            if "=" not in target:
                sources.setdefault(target, []).append(ds_key)
    return sources


def table(row_iter) -> list[str]:
    out = ["| key | type and allowed values | default | meaning | from DeepSpeed |", "|---|---|---|---|---|"]
    for key, allowed, default, meaning in row_iter:
        ds = ", ".join(f"`{k}`" for k in deepspeed_sources().get(key, []))
        out.append(f"| `{key}` | {_cell(allowed)} | {default} | {_cell(meaning)} | {ds} |")
    return out


def _doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return " ".join(doc.split()) if cls.__doc__ else ""


def render() -> str:
    """The whole configuration reference as Markdown."""
    train_values, train_comments, _ = yaml_file(CONF / "train.yaml")
    groups = [g for g in schema.GROUPS]
    out = [
        "# Configuration reference",
        "",
        "Every key of `fspeed-train`'s configuration (also what `fs.initialize(model, config, overrides=[...])` "
        "composes), generated from the schema in `fspeed/config/schema.py` and the packaged Hydra tree "
        "`conf/`. Set a key on the command line as `section.key=value` (`zero.stage=3 optimizer.lr=3e-4`), "
        "choose a group option as `group=option` (`optimizer=lamb`), and print the composed job with "
        "`fspeed-train --cfg job`. A DeepSpeed `ds_config.json` given as `deepspeed_config=path` is translated "
        "into these keys ([DeepSpeed keys](deepspeed-keys.md)).",
        "",
        "Defaults are the packaged configuration's (`conf/`), which tunes a few of the schema's "
        "DeepSpeed defaults for the small default job. The last column names the `ds_config.json` keys that "
        "translate into each key. An unknown key, a wrong type or a value outside the "
        "allowed range stops `fspeed-train` before training, naming the key, the value and what is allowed.",
        "",
        "## Groups",
        "",
        "A group's option is chosen with `group=option`; its keys are then set as `group.key=value`.",
        "",
    ]
    defaults = {}
    for entry in train_values.get("defaults", []):
        if isinstance(entry, dict):
            defaults.update(entry)
    out += ["| group | default option | options |", "|---|---|---|"]
    for group in groups:
        options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        out.append(f"| `{group}` | `{defaults.get(group, '')}` | "
                   + ", ".join(f"[`{o}`](#{group}-{o.replace('_', '-')})" for o in options) + " |")
    out.append("")
    for group in groups:
        out += [f"### `{group}`", ""]
        for path in sorted((CONF / group).glob("*.yaml")):
            option = path.stem
            values, comments, header = yaml_file(path)
            out += [f"#### `{group}={option}` {{#{group}-{option.replace('_', '-')}}}", ""]
            cls = schema.option_schema(group, values.get("name", option)) if "_target_" not in values else None
            if header:
                out += [_cell(header), ""]
            if cls is None:
                out += [f"A `_target_` node: `{group}._target_=my_pkg.build_{group}` names your callable; every "
                        f"other `{group}.<key>` is a keyword argument of it, checked against its signature before "
                        "anything runs.", ""]
                continue
            if _doc(cls) and _doc(cls) != header:
                out += [_cell(_doc(cls)), ""]
            out += table(rows(cls, group, values, comments)) + [""]
    out += ["## Sections", "",
            "Sections have one fixed set of keys, set as `section.key=value`.", ""]
    for name, cls in schema.SECTIONS.items():
        if name in groups:
            continue
        out += [f"### `{name}`", ""]
        if _doc(cls):
            out += [_cell(_doc(cls)), ""]
        section_values = train_values.get(name)
        out += table(rows(cls, name, section_values if isinstance(section_values, dict) else {},
                          {k[len(name) + 1:]: v for k, v in train_comments.items() if k.startswith(name + ".")}))
        out.append("")
    out += ["## Top-level keys", ""]
    out += table(_top_level_rows(train_values, train_comments)) + [""]
    return "\n".join(out)


def top_level_keys() -> list[str]:
    """RunConfig's own keys: neither a section, a group nor a value the launch supplies."""
    return [f.name for f in config_fields(schema.RunConfig)
            if f.name not in schema.SECTIONS and f.name not in schema.KINDS and f.name not in schema.RUNTIME_FIELDS]


def _top_level_rows(train_values: dict, train_comments: dict[str, str]):
    fields = {f.name: f for f in config_fields(schema.RunConfig)}
    for key in top_level_keys():
        f = fields[key]
        meaning = field_comment(schema.RunConfig, key) or train_comments.get(key, "")
        yield key, _allowed(schema.RunConfig, f), _default(schema.RunConfig, f, train_values), meaning


def schema_keys() -> list[str]:
    """Every key the schema defines, as `section.key` (group options' keys once per group)."""
    keys: set[str] = set()

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in config_fields(cls):
            nested = hints[f.name]
            if isinstance(nested, type) and issubclass(nested, ValidatedConfig):
                walk(nested, f"{prefix}.{f.name}")
            else:
                keys.add(f"{prefix}.{f.name}")

    for group, options in schema.KINDS.items():
        for cls in options.values():
            walk(cls, group)
    for name, cls in schema.SECTIONS.items():
        walk(cls, name)
    keys |= set(top_level_keys())
    return sorted(keys)
