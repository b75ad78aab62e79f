"""MkDocs hook: the generated reference pages (configuration, DeepSpeed keys, benchmarks, API).

They are built from the code and `benchmarks/results/` at every build, never written by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))

import api_pages  # noqa: E402
import benchmark_tables  # noqa: E402
import config_reference  # noqa: E402
import deepspeed_reference  # noqa: E402


def generated_pages() -> dict[str, str]:
    """{path under docs/: Markdown} of every generated page."""
    return {
        "reference/config.md": config_reference.render(),
        "reference/deepspeed-keys.md": deepspeed_reference.render(),
        "reference/benchmarks.md": benchmark_tables.render(),
        **api_pages.pages(),
    }


FENCE = re.compile(r"^(?P<head>[ \t]*(?:`{3,}|~{3,})[A-Za-z0-9_+-]+)[ \t]+(?P<attrs>[^`\n]*)$", re.MULTILINE)


def _fence(match: re.Match) -> str:
    """A fence's test attributes (`ranks=N`, `no-run`; tests/docs_blocks.py) as the rendered title."""
    words = match.group("attrs").split()
    if not all(w == "no-run" or re.fullmatch(r"ranks=\d+", w) for w in words):
        return match.group(0)
    ranks = [w.split("=")[1] for w in words if w.startswith("ranks=")]
    return match.group("head") + (f' title="on {ranks[0]} ranks"' if ranks else "")


def on_page_markdown(markdown, page, config, files):
    return FENCE.sub(_fence, markdown)


def on_files(files, config):
    for path, text in generated_pages().items():
        if files.get_file_from_path(path) is not None:
            raise RuntimeError(f"docs/{path} is generated at build time; remove the file")
        files.append(File.generated(config, path, content=text))
    return files
