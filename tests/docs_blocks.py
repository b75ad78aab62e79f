"""The code blocks of the documentation (docs/**/*.md and README.md), and how each kind runs.

Convention (docs/development.md):

- ```python : all plain python blocks of a page run in order in one namespace, one page after another
  in one process that imports fspeed once (`python tests/docs_blocks.py PAGES...`), each page in a
  fresh namespace and a fresh temporary directory.
- ```python ranks=N : its own script on N gloo ranks (torchrun's environment variables; the script
  calls fs.init_distributed() itself).
- ```bash : each line is one shell command; a block's lines run in order in a fresh temporary
  directory, with the venv on PATH and the repository root on PYTHONPATH.
- ```bash no-run (any language with no-run), text, console: shown, not run; yaml and json: parsed.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
RUN_LANGUAGES = ("python", "bash", "yaml", "json")


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    language: str
    attrs: dict[str, str] = field(default_factory=dict)
    code: str = ""

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line} ({self.info})"

    @property
    def info(self) -> str:
        return " ".join([self.language, *(f"{k}={v}" if v else k for k, v in self.attrs.items())])

    @property
    def runs(self) -> bool:
        return self.language in RUN_LANGUAGES and "no-run" not in self.attrs

    @property
    def ranks(self) -> int:
        return int(self.attrs.get("ranks", 0) or 0)


def pages() -> list[Path]:
    """Every documentation page whose blocks run: README.md and docs/**/*.md (not the hooks' sources)."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.relative_to(ROOT / "docs").parts)
    return [ROOT / "README.md", *docs]


def parse(path: Path) -> list[Block]:
    """The fenced code blocks of one Markdown file (fences may be indented, e.g. inside admonitions)."""
    rel = str(path.relative_to(ROOT))
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = match.group("indent"), match.group("fence"), match.group("info").strip()
        words = info.split()
        language = words[0].lower() if words else ""
        attrs = dict((w.split("=", 1) + [""])[:2] for w in words[1:])
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            close = lines[j].strip()
            if close.startswith(fence[0] * len(fence)) and not close.strip(fence[0]):
                break
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        else:
            raise ValueError(f"{rel}:{i + 1}: a code block that never closes")
        blocks.append(Block(rel, i + 1, language, attrs, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in parse(p)]


def shell_lines(code: str) -> list[str]:
    """A bash block's commands: one per line, backslash continuations joined, comments skipped."""
    out: list[str] = []
    pending = ""
    for raw in code.splitlines():
        line = raw.rstrip()
        if pending:
            line = pending + " " + line.lstrip()
            pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    if pending:
        out.append(pending)
    return out


def environment(repo_on_path: bool = False) -> dict[str, str]:
    """The environment blocks run in: the venv's bin first on PATH; the repository root on PYTHONPATH
    for bash blocks only (python blocks import fspeed as a user does: the root's `kernels/` folder
    would hide an installed `kernels` package)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if repo_on_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MPLBACKEND", "Agg")
    env["HYDRA_FULL_ERROR"] = env.get("HYDRA_FULL_ERROR", "0")
    return env


# ----------------------------------------------------------------- the single-process page runner


def run_pages(paths: list[str]) -> dict[str, dict]:
    """Run every plain python block of each page (relative paths), a fresh namespace and directory
    per page; {page: {"ok", "seconds", "where", "error"}}."""
    import fspeed  # noqa: F401, PLC0415 - imported once for every page

    results: dict[str, dict] = {}
    start_dir = os.getcwd()
    for rel in paths:
        blocks = [b for b in parse(ROOT / rel) if b.language == "python" and b.runs and not b.ranks]
        started = time.perf_counter()
        result = {"ok": True, "blocks": len(blocks), "where": "", "error": ""}
        namespace: dict = {"__name__": "__main__"}
        with tempfile.TemporaryDirectory(prefix="docs-page-") as tmp:
            os.chdir(tmp)
            try:
                for block in blocks:
                    try:
                        # padded so that a traceback names the page's own line numbers
                        code = compile("\n" * block.line + block.code, block.path, "exec")
                        exec(code, namespace)  # noqa: S102 - the documentation's own examples
                    except BaseException:  # noqa: BLE001 - reported with the block's location
                        result.update(ok=False, where=block.where, error=traceback.format_exc(limit=-8))
                        break
            finally:
                os.chdir(start_dir)
        result["seconds"] = round(time.perf_counter() - started, 2)
        results[rel] = result
    return results


if __name__ == "__main__":
    out = sys.argv[1]
    json.dump(run_pages(sys.argv[2:]), open(out, "w"), indent=1)  # noqa: SIM115
