"""The library's code stays readable in pieces: no function in fspeed/ is longer than a reader can hold
(MAX_FUNCTION_LINES, nested functions counted on their own too), and its modules import one another
without cycles, so each can be read (and imported) after the ones below it.

The import graph is read from the source with `ast`, nothing imported: every `import` and `from`
statement of a module, at module level or inside a function (an import deferred into a function
to dodge a cycle is still the cycle), relative ones resolved. `from package import name` depends on
`package.name` where that is a module, else on the package itself. The kernels folder is the
package `fspeed.kernels`. A package's own `__init__` running before its submodules is not counted.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"fspeed": ROOT / "fspeed", "fspeed.kernels": ROOT / "kernels"}
MAX_FUNCTION_LINES = 120


@functools.lru_cache(maxsize=None)
def module_files() -> dict[str, Path]:
    """Every module of the library by its dotted name (a package by its `__init__.py`)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


@functools.lru_cache(maxsize=None)
def statements_of(path: Path) -> tuple[ast.stmt, ...]:
    """Every statement of a source file, nested ones included (imports and definitions are statements:
    expressions need not be walked)."""
    found: list[ast.stmt] = []
    pending = list(ast.parse(path.read_text(), str(path)).body)
    while pending:
        node = pending.pop()
        found.append(node)
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, ()):
                pending.extend(child.body if isinstance(child, (ast.ExceptHandler, ast.match_case)) else [child])
    return tuple(found)


def imported_modules(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
                     modules: dict[str, Path]) -> set[str]:
    """The library's modules that one import statement of `module` depends on."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = set()
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:  # `import a.b.c` depends on the longest module prefix
            parts.pop()
        if parts and ".".join(parts) != module:
            found.add(".".join(parts))
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of its first such import}."""
    modules = module_files()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        for node in statements_of(path):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported_modules(module, path.name == "__init__.py", node, modules):
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> Optional[list[str]]:
    """One import cycle as its path of modules (the first again at the end), or None."""
    state: dict[str, str] = {}  # "open" on the current path, "done" once every path from it was followed
    path: list[str] = []

    def visit(module: str) -> Optional[list[str]]:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, {})):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def long_functions(limit: int) -> Iterator[str]:
    """`path:line name (n lines)` for each function in fspeed/ longer than `limit` lines."""
    for path in sorted(PACKAGES["fspeed"].rglob("*.py")):
        for node in statements_of(path):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)"


def test_no_function_in_the_library_is_longer_than_a_reader_can_hold():
    assert list(long_functions(MAX_FUNCTION_LINES)) == [], \
        f"functions over {MAX_FUNCTION_LINES} lines: split them into named parts"


def test_the_library_imports_without_cycles():
    graph = import_graph()
    assert "fspeed.train_step" in graph and graph["fspeed.train_step"], "the import graph read nothing"
    cycle = find_cycle(graph)
    if cycle:
        files = module_files()
        steps = [f"{a} ({files[a].relative_to(ROOT)}:{graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle: " + " -> ".join(steps + [cycle[-1]]) +
                             "; move what both need to a module below them (DESIGN.md's layers)")


def test_the_cycle_finder_finds_a_cycle_and_resolves_relative_imports():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 2}}) is None
    modules = {"fspeed.parallel": Path(), "fspeed.parallel.mesh": Path(), "fspeed.parallel.comm": Path(),
               "fspeed.pytree": Path()}
    relative = ast.parse("from .comm import AxisComm\nfrom ..pytree import tree_map\nfrom . import comm").body
    found = set().union(*(imported_modules("fspeed.parallel.mesh", False, node, modules) for node in relative))
    assert found == {"fspeed.parallel.comm", "fspeed.pytree"}
    in_package = ast.parse("from .mesh import Mesh").body[0]
    assert imported_modules("fspeed.parallel", True, in_package, modules) == {"fspeed.parallel.mesh"}
