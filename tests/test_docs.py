"""The documentation works: every code block runs as its page says (tests/docs_blocks.py), the
site builds with `mkdocs build --strict`, the generated references cover the schema and the
translator, and the built site renders in headless Chromium without console errors."""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests import docs_blocks
from tests.docs_blocks import ROOT, Block

sys.path.insert(0, str(ROOT / "docs" / "hooks"))

BLOCKS = docs_blocks.all_blocks()
PYTHON_PAGES = sorted({b.path for b in BLOCKS if b.language == "python" and b.runs and not b.ranks})
RANKS_BLOCKS = [b for b in BLOCKS if b.language == "python" and b.runs and b.ranks]
BASH_BLOCKS = [b for b in BLOCKS if b.language == "bash" and b.runs]
DATA_BLOCKS = [b for b in BLOCKS if b.language in ("yaml", "json") and b.runs]
PAGE_TIMEOUT_S = 120  # the single-process pages together: this many seconds per page
LINE_TIMEOUT_S = 120


def _ids(blocks: list[Block]) -> list[str]:
    return [f"{b.path}:{b.line}" for b in blocks]


# ------------------------------------------------------------------------------------- code blocks


def _once(tmp_path_factory, name: str, make) -> Path:
    """`make(directory)` run once per test session, also when pytest-xdist spreads the tests over
    workers (they share the session's base directory; a lock makes the others wait and reuse it)."""
    from filelock import FileLock  # noqa: PLC0415 - torch's own dependency

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    directory, done = base / name, base / f"{name}.done"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists():
            directory.mkdir(exist_ok=True)
            make(directory)
            done.write_text("ok")
    return directory


@pytest.fixture(scope="module")
def page_results(tmp_path_factory):
    """Every single-process page run in one subprocess (fspeed imported once)."""

    def run(directory: Path) -> None:
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "docs_blocks.py"), str(directory / "pages.json"),
                               *PYTHON_PAGES], capture_output=True, text=True, env=docs_blocks.environment(), cwd=ROOT,
                              timeout=PAGE_TIMEOUT_S * max(1, len(PYTHON_PAGES)))
        (directory / "output.txt").write_text(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")

    directory = _once(tmp_path_factory, "docs-pages", run)
    output = (directory / "output.txt").read_text()
    if not (directory / "pages.json").exists():
        pytest.fail(f"the page runner died:\n{output}")
    return json.loads((directory / "pages.json").read_text()), output


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks_of_page(page, page_results):
    results, output = page_results
    result = results[page]
    assert result["ok"], f"{result['where']} failed:\n{result['error']}\n--- output of the page runner:\n{output[-2000:]}"


@pytest.fixture(scope="module")
def rank_launcher():
    launcher = docs_blocks.RankLauncher()
    yield launcher
    launcher.close()


@pytest.mark.parametrize("block", RANKS_BLOCKS, ids=_ids(RANKS_BLOCKS))
def test_python_block_on_ranks(block, tmp_path, rank_launcher):
    """A `python ranks=N` block: its own script on N processes with torchrun's environment variables."""
    from fspeed.testing import free_port  # noqa: PLC0415

    assert 1 <= block.ranks <= 8, f"{block.where}: ranks must be 1..8"
    script = tmp_path / "block.py"
    script.write_text("\n" * block.line + block.code)  # tracebacks name the page's own line numbers
    env = {**docs_blocks.environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(block.ranks), "LOCAL_WORLD_SIZE": str(block.ranks), "GROUP_RANK": "0"}
    ranks = rank_launcher.run(script, block.ranks, tmp_path, env, LINE_TIMEOUT_S)
    failures = [f"rank {r['rank']} " + ("timed out" if r["code"] is None else f"exited {r['code']}")
                + f":\n{r['output'][-3000:]}" for r in ranks if r["code"] != 0]
    assert not failures, f"{block.where} failed on {len(failures)} rank(s):\n" + "\n".join(failures)


@pytest.mark.parametrize("block", BASH_BLOCKS, ids=_ids(BASH_BLOCKS))
def test_bash_block(block, tmp_path):
    """Each line of a bash block, in order, in a fresh directory for the block."""
    env = docs_blocks.environment(repo_on_path=True)
    for command in docs_blocks.shell_lines(block.code):
        try:
            proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=LINE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.where}: `{command}` did not finish in {LINE_TIMEOUT_S} s")
        assert proc.returncode == 0, (f"{block.where}: `{command}` exited {proc.returncode}:\n"
                                      f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


@pytest.mark.parametrize("block", DATA_BLOCKS, ids=_ids(DATA_BLOCKS))
def test_yaml_and_json_blocks_parse(block):
    try:
        if block.language == "json":
            json.loads(block.code)
        else:
            yaml.safe_load(block.code)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        pytest.fail(f"{block.where}: not valid {block.language}: {err}")


def test_block_parser_reads_fences_attributes_and_shell_lines(tmp_path, monkeypatch):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("text\n```python ranks=2\nx = 1\n```\n\n!!! note\n    ```bash no-run\n    pip install x\n"
                    "    ```\n````markdown\n```python\nnot a block\n```\n````\n")
    monkeypatch.setattr(docs_blocks, "ROOT", tmp_path)
    blocks = docs_blocks.parse(page)
    assert [(b.line, b.language, b.attrs, b.runs) for b in blocks] == [
        (2, "python", {"ranks": "2"}, True), (7, "bash", {"no-run": ""}, False), (10, "markdown", {}, False)]
    assert blocks[0].ranks == 2 and blocks[1].code == "pip install x\n"
    assert docs_blocks.shell_lines("# c\na \\\n  b\n\nc\n") == ["a b", "c"]


def test_page_runner_names_the_failing_block(tmp_path, monkeypatch):
    page = tmp_path / "docs" / "p.md"
    page.parent.mkdir()
    page.write_text("```python\nx = 2\n```\n\n```python\nassert x == 3, 'x is not 3'\n```\n")
    monkeypatch.setattr(docs_blocks, "ROOT", tmp_path)
    result = docs_blocks.run_pages(["docs/p.md"])["docs/p.md"]
    assert not result["ok"] and result["where"] == "docs/p.md:5 (python)"
    assert 'File "docs/p.md", line 6' in result["error"] and "x is not 3" in result["error"]


# --------------------------------------------------------------------------------- generated pages


def test_config_reference_lists_every_schema_key():
    import config_reference  # noqa: PLC0415 - docs/hooks

    page = config_reference.render()
    keys = config_reference.schema_keys()
    assert len(keys) > 100
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing, f"keys of the schema missing from the configuration reference: {missing}"


def test_deepspeed_table_accounts_for_every_deepspeed_key():
    import deepspeed_reference  # noqa: PLC0415
    from fspeed.config import deepspeed_keys as K  # noqa: PLC0415

    page = deepspeed_reference.render()
    for key in K.ALL_TOP_LEVEL:
        assert f"| `{key}" in page, key
    for key in K.ZERO_KEYS:
        assert f"| `zero_optimization.{key}" in page, key
    assert "| `zero_optimization.stage` | taken: `zero.stage` |" in page
    assert "| `train_micro_batch_size_per_gpu` | taken: `train.micro_batch_size` |" in page


def test_benchmark_page_renders_results_and_says_when_there_are_none(tmp_path):
    import benchmark_tables  # noqa: PLC0415

    assert "No benchmark results are recorded yet" in benchmark_tables.render(tmp_path)
    (tmp_path / "zero_comm.json").write_text(json.dumps({
        "benchmark": "zero_comm", "date": "2025-01-02", "commit": "0123456789abcdef", "machine": "2 CPU cores",
        "command": "python benchmarks/zero_comm.py", "figures": {"zero3_comm_over_theory": 0.96712, "mode": "tmpfs",
                                                              "ratio": None}, "notes": {"ratio": "no baseline"}}))
    page = benchmark_tables.render(tmp_path)
    assert "## zero_comm" in page and "| `zero3_comm_over_theory` | 0.9671 |  |" in page and "`0123456789`" in page
    assert "| `mode` | tmpfs |  |" in page and "| `ratio` | n/a | no baseline |" in page
    (tmp_path / "bad.json").write_text(json.dumps({"benchmark": "bad"}))
    with pytest.raises(benchmark_tables.ResultError, match="bad.json: missing date"):
        benchmark_tables.render(tmp_path)


def test_every_results_file_has_the_documented_format():
    import benchmark_tables  # noqa: PLC0415

    for data in benchmark_tables.results():
        assert all(isinstance(v, (int, float, str, bool, type(None))) for v in data["figures"].values()), data


def test_api_pages_document_each_public_name_once():
    import api_pages  # noqa: PLC0415

    homes = api_pages.homes()
    documented: dict[str, str] = {}
    for page, names in homes.items():
        module = api_pages.MODULES[page]
        for name, where in names.items():
            if where == module:
                key = api_pages.identifier(module, name)
                assert key not in documented, f"{key} documented on {documented[key]} and {page}"
                documented[key] = page
    assert "fspeed.parallel.Mesh" in documented and "fspeed.make_train_step" in documented
    assert homes["fspeed"]["Mesh"] == "fspeed.parallel"


# ------------------------------------------------------------------------------------ the site


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built once with `mkdocs build --strict`."""

    def build(directory: Path) -> None:
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(directory / "site")],
                              cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
        (directory / "exit").write_text(str(proc.returncode))
        (directory / "output.txt").write_text(f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")

    directory = _once(tmp_path_factory, "docs-site", build)
    assert (directory / "exit").read_text() == "0", \
        f"mkdocs build --strict failed:\n{(directory / 'output.txt').read_text()}"
    return directory / "site"


def test_site_builds_strictly(site):
    assert (site / "index.html").exists()
    assert (site / "reference" / "config" / "index.html").exists()
    assert (site / "reference" / "api" / "parallel" / "index.html").exists()
    text = (site / "index.html").read_text()
    assert "fonts.googleapis.com" not in text and "cdn.jsdelivr" not in text, "the site must work offline"


@pytest.fixture(scope="module")
def served(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_site_renders_in_chromium(served):
    from tests.browser import Browser, find_chromium, png_colours  # noqa: PLC0415

    binary = find_chromium()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("no chromium binary: .ci/run installs Debian's chromium package")
        pytest.skip("no chromium binary on PATH (apt-get install chromium)")
    with Browser(binary) as browser:
        for path in ("/", "/guides/your-model/", "/reference/api/fspeed/"):
            visit = browser.visit(served + path)
            assert not visit.problems, f"{path}: {visit.problems}"
            assert visit.title.endswith("fspeed"), (path, visit.title)
            colours = png_colours(visit.png)
            assert colours > 16, f"{path}: the screenshot looks blank ({colours} colours)"


def test_rendered_fences_drop_the_test_attributes():
    import generate  # noqa: PLC0415 - docs/hooks

    page = "```python ranks=2\nx\n```\n  ```bash no-run\ny\n  ```\n```python title=\"t\"\nz\n```\n"
    assert generate.on_page_markdown(page, None, None, None) == (
        '```python title="on 2 ranks"\nx\n```\n  ```bash\ny\n  ```\n```python title="t"\nz\n```\n')


def test_readme_benchmark_headline_is_the_results_files():
    import benchmark_tables  # noqa: PLC0415

    readme = (ROOT / "README.md").read_text()
    assert benchmark_tables.readme_block() in readme, (
        "README.md's benchmark headline differs from benchmarks/results/*.json: run "
        "`python docs/hooks/benchmark_tables.py --readme`")


def test_readme_benchmark_headline_renders_the_chosen_figures(tmp_path):
    import benchmark_tables  # noqa: PLC0415

    (tmp_path / "zero_comm.json").write_text(json.dumps({
        "benchmark": "zero_comm", "date": "2025-01-02", "commit": "0123456789abcdef", "machine": "m",
        "command": "c", "figures": {"zero3_comm_over_theory": 0.967, "other": 1}}))
    table = benchmark_tables.readme_table(tmp_path)
    assert "| `zero3_comm_over_theory` | 0.967 | 2025-01-02, `0123456789` |" in table and "other" not in table
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{benchmark_tables.readme_block(tmp_path / 'none')}\nb\n")
    assert benchmark_tables.update_readme(readme, tmp_path) and "0.967" in readme.read_text()
    assert not benchmark_tables.update_readme(readme, tmp_path)


def test_readme_links_point_at_files():
    import re  # noqa: PLC0415

    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    missing = [t for t in targets if not t.startswith(("http://", "https://")) and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_rank_launcher_reports_each_rank(tmp_path, rank_launcher):
    script = tmp_path / "s.py"
    script.write_text("import os, sys, time\nrank = int(os.environ['RANK'])\nprint('rank', rank, os.environ['WORLD_SIZE'])\n"
                      "if rank == 1:\n    raise ValueError('rank one fails')\nif rank == 2:\n    sys.exit(3)\n"
                      "if rank == 3:\n    time.sleep(60)\n")
    ranks = rank_launcher.run(script, 4, tmp_path, {"WORLD_SIZE": "4"}, timeout_s=5)
    assert [r["code"] for r in ranks] == [0, 1, 3, None]
    assert "rank 0 4" in ranks[0]["output"] and "ValueError: rank one fails" in ranks[1]["output"]
