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
import subprocess
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


# ------------------------------------------------------------------------- the ranks of a block


class RankLauncher:
    """Runs a script on N ranks, forked from a process that imported torch and fspeed once.

    Each `python ranks=N` block would otherwise pay N interpreter starts and imports (seconds each
    on a small machine). The launcher process (`python tests/docs_blocks.py --ranks-server`) has no
    threads and has run no torch operation when it forks, so the children start clean; each runs
    the script as `__main__` with torchrun's environment variables, its output in its own file.
    """

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, __file__, "--ranks-server"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, cwd=ROOT, env=environment())

    def run(self, script: Path, ranks: int, cwd: Path, env: dict[str, str], timeout_s: float) -> list[dict]:
        """[{"rank", "code" (None: killed at the timeout), "output"}] for each rank."""
        request = {"script": str(script), "ranks": ranks, "cwd": str(cwd), "env": env, "timeout_s": timeout_s}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the ranks launcher died (exit {self._proc.wait()})")
        codes = json.loads(line)
        return [{"rank": r, "code": codes[r], "output": (cwd / f"rank{r}.out").read_text(errors="replace")}
                for r in range(ranks)]

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=30)


def _serve_ranks() -> None:
    import runpy  # noqa: PLC0415
    import signal  # noqa: PLC0415

    import fspeed  # noqa: F401, PLC0415 - what the children need, imported once
    import torch  # noqa: F401, PLC0415

    for line in sys.stdin:
        job = json.loads(line)
        children = {}
        for rank in range(job["ranks"]):
            pid = os.fork()
            if pid == 0:  # the rank
                code = 1
                try:
                    out = os.open(os.path.join(job["cwd"], f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(out, 1)
                    os.dup2(out, 2)
                    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                    os.environ.clear()
                    os.environ.update(job["env"], RANK=str(rank), LOCAL_RANK=str(rank))
                    os.chdir(job["cwd"])
                    sys.argv = [job["script"]]
                    runpy.run_path(job["script"], run_name="__main__")
                    code = 0
                except SystemExit as stop:
                    code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                except BaseException:  # noqa: BLE001 - the rank's failure, in its output
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            children[pid] = rank
        codes: list = [None] * job["ranks"]
        deadline = time.monotonic() + job["timeout_s"]
        while children and time.monotonic() < deadline:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.05)
                continue
            codes[children.pop(pid)] = code = os.waitstatus_to_exitcode(status)
            if code != 0:  # the others would wait for it in a collective: a short grace, then stop them
                deadline = min(deadline, time.monotonic() + 10)
        for pid in children:  # past the timeout
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        print(json.dumps(codes), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--ranks-server"]:
        _serve_ranks()
    else:
        out = sys.argv[1]
        json.dump(run_pages(sys.argv[2:]), open(out, "w"), indent=1)  # noqa: SIM115
