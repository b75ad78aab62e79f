"""A benchmark's headline figures as a results file the docs render.

Every benchmark ends its output with `name=value` lines (e.g. `pipeline_step_time_vs_torch=0.981`,
sometimes followed by a note: `hf_step_time_vs_eager=1.005  # 0.998`). Run under `recorded`, those
lines are also collected as they are printed, and when the run completes (no exception, exit status
0) they are written to `benchmarks/results/<benchmark>.json`, replacing the previous file:

    {"benchmark": "pipeline", "date": "2026-12-07", "commit": "<sha>[-dirty]",
     "machine": "<cpu model>, <n> cores, torch <version>, <os>", "command": "python benchmarks/pipeline.py ...",
     "figures": {"pipeline_step_time_vs_torch": 0.981, ...}, "notes": {"<name>": "<the line's note>"}}

A value that is not a number stays text (`disk_full_mode=tmpfs`); nan and inf become null, with the
line's note kept. FSPEED_RESULTS_DIR writes the file elsewhere (a small trial run should not replace
the results of a full one). A benchmark's printed output is not changed; the path written goes to
stderr.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

RESULTS_DIR_ENV = "FSPEED_RESULTS_DIR"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = Path(__file__).resolve().parent / "results"
FIGURE_LINE = re.compile(r"^([a-z][a-z0-9_]*)=(\S*)\s*(.*?)\s*$")


def results_dir() -> Path:
    """Where results files go: $FSPEED_RESULTS_DIR if set, else benchmarks/results."""
    return Path(os.environ[RESULTS_DIR_ENV]) if os.environ.get(RESULTS_DIR_ENV) else DEFAULT_DIR


def parse_value(text: str) -> Any:
    """An int or float where `text` is one (nan and inf: None), else the text itself."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return text
    return value if math.isfinite(value) else None


def parse_figure(line: str) -> Optional[tuple[str, Any, str]]:
    """(name, value, note) of a `name=value[ note]` line, or None for any other line."""
    match = FIGURE_LINE.match(line)
    if match is None:
        return None
    name, value, note = match.groups()
    return name, parse_value(value), note.lstrip("#").strip()


def git_commit(root: Path = ROOT) -> str:
    """HEAD's sha, with '-dirty' when a tracked file differs from it; 'unknown' outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    try:
        sha = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """A short description of where the figures were measured: CPU model, cores, torch, GPU, OS."""
    parts = [cpu_model(), f"{os.cpu_count()} cores"]
    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts.append(torch.cuda.get_device_name())
    parts.append(f"{platform.system()} {platform.release()}")
    return ", ".join(parts)


def command_line(argv: Optional[list[str]] = None) -> str:
    """The command as typed from the repository root: `python benchmarks/<script>.py <args>`."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path("?")
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *argv[1:]])


def record(benchmark: str, figures: dict[str, Any], command: str, *, notes: Optional[dict[str, str]] = None,
           directory: Optional[Path] = None) -> Path:
    """Write `<directory>/<benchmark>.json` (default: `results_dir()`), replacing it atomically."""
    directory = Path(directory) if directory is not None else results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    content = {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "commit": git_commit(),
        "machine": machine(),
        "command": command,
        "figures": dict(figures),
    }
    if notes:
        content["notes"] = dict(notes)
    path = directory / f"{benchmark}.json"
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(content, indent=2, allow_nan=False) + "\n")
    os.replace(partial, path)
    return path


class FigureTee:
    """A text stream that passes everything through to `stream` and collects its `name=value` lines."""

    def __init__(self, stream):
        self.stream = stream
        self.figures: dict[str, Any] = {}
        self.notes: dict[str, str] = {}
        self._partial = ""

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._take(line)
        return written

    def _take(self, line: str) -> None:
        figure = parse_figure(line)
        if figure is not None:
            name, value, note = figure
            self.figures[name] = value
            if note:
                self.notes[name] = note
            else:
                self.notes.pop(name, None)

    def finish(self) -> None:
        if self._partial:
            self._take(self._partial)
            self._partial = ""

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):  # flush, fileno, isatty, encoding, buffer...: the stream's own
        return getattr(self.stream, name)


@contextmanager
def recorded(benchmark: str, *, enabled: bool = True, command: Optional[str] = None) -> Iterator[FigureTee]:
    """Collect the `name=value` lines printed inside the block; when it completes (no exception, no
    non-zero exit status) and printed at least one, write them to `<results_dir()>/<benchmark>.json`."""
    tee = FigureTee(sys.stdout)
    sys.stdout = tee
    completed = False
    try:
        yield tee
        completed = True
    except SystemExit as stop:
        completed = stop.code in (None, 0)
        raise
    finally:
        sys.stdout = tee.stream
        tee.finish()
        if completed and enabled and tee.figures:
            sys.stdout.flush()
            path = record(benchmark, tee.figures, command or command_line(), notes=tee.notes)
            print(f"{benchmark}: figures written to {path}", file=sys.stderr)
