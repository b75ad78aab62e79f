"""The benchmark page, generated from `benchmarks/results/*.json`.

Each benchmark writes one file (`benchmarks/figures.py`): {"benchmark", "date", "commit", "machine",
"command", "figures": {name: value}, and optionally "notes": {name: text}}. Every file found is
rendered as one section; the page says so when there is none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FIELDS = ("benchmark", "date", "commit", "machine", "command", "figures")


class ResultError(ValueError):
    """A results file that does not have the documented format."""


def load(path: Path) -> dict[str, Any]:
    """One results file, checked: every field present, figures a mapping of names to numbers."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ResultError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ResultError(f"{path}: expected a JSON object")
    missing = [f for f in FIELDS if f not in data]
    if missing:
        raise ResultError(f"{path}: missing {', '.join(missing)} (fields: {', '.join(FIELDS)})")
    if not isinstance(data["figures"], dict):
        raise ResultError(f"{path}: figures must be an object of name -> number")
    if not isinstance(data.get("notes", {}), dict):
        raise ResultError(f"{path}: notes must be an object of figure name -> text")
    return data


def results(directory: Path = RESULTS) -> list[dict[str, Any]]:
    """Every results file in `directory`, sorted by benchmark name."""
    return sorted((load(p) for p in sorted(directory.glob("*.json"))), key=lambda d: str(d["benchmark"]))


def figure_text(value: Any) -> str:
    """A figure as shown: up to 4 significant digits; null (nan or inf) as n/a; text as written."""
    if value is None:
        return "n/a"
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(directory: Path = RESULTS) -> str:
    """The benchmark page as Markdown."""
    out = ["# Benchmarks", "",
           "Measured comparisons against the real alternatives, side by side in one run (ratios rather than "
           "absolute times where the machine matters). Each benchmark in `benchmarks/` writes "
           "`benchmarks/results/<benchmark>.json`; this page is generated from those files, with the date, "
           "commit, machine and command of each measurement.", ""]
    found = results(directory) if directory.is_dir() else []
    if not found:
        out += ["No benchmark results are recorded yet: running a benchmark (`python benchmarks/<name>.py`) writes "
                "`benchmarks/results/<name>.json`, and the page shows it at the next build.", ""]
        return "\n".join(out)
    out += ["| benchmark | date | commit | machine |", "|---|---|---|---|"]
    for data in found:
        name = _cell(data["benchmark"])
        out.append(f"| [{name}](#{anchor(name)}) | {_cell(data['date'])} | `{str(data['commit'])[:10]}` | "
                   f"{_cell(data['machine'])} |")
    for data in found:
        name = _cell(data["benchmark"])
        out += ["", f"## {name} {{#{anchor(name)}}}", "",
                f"{_cell(data['date'])}, commit `{str(data['commit'])[:10]}`, {_cell(data['machine'])}.", "",
                "```text", str(data["command"]), "```", "",
                "| figure | value | note |", "|---|---|---|"]
        notes = data.get("notes", {})
        out += [f"| `{_cell(k)}` | {_cell(figure_text(v))} | {_cell(notes.get(k, ''))} |"
                for k, v in data["figures"].items()]
    out.append("")
    return "\n".join(out)


def anchor(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
