"""MkDocs hook: the generated reference pages (configuration, DeepSpeed keys, benchmarks, API).

They are built from the code and `benchmarks/results/` at every build, never written by hand.
"""

from __future__ import annotations

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


def on_files(files, config):
    for path, text in generated_pages().items():
        if files.get_file_from_path(path) is not None:
            raise RuntimeError(f"docs/{path} is generated at build time; remove the file")
        files.append(File.generated(config, path, content=text))
    return files
