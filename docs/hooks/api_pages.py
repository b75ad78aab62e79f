"""The API reference pages: one page per public module, each public name on the page of its home.

A module's public names are its `__all__` (fspeed.precision's: the functions and classes it defines).
A name exported by the top-level package and by a documented subpackage lives on the subpackage's
page; the top-level page lists it with a link there.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import types

MODULES = {  # page (under reference/api/) -> module
    "fspeed": "fspeed",
    "optim": "fspeed.optim",
    "models": "fspeed.models",
    "parallel": "fspeed.parallel",
    "checkpoint": "fspeed.checkpoint",
    "data": "fspeed.data",
    "sparse": "fspeed.sparse",
    "testing": "fspeed.testing",
    "profile": "fspeed.profile",
    "monitor": "fspeed.monitor",
    "precision": "fspeed.precision",
    "autotune": "fspeed.autotune",
}


def public_names(module_name: str) -> list[str]:
    """The public names of a module, submodules left out."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_")
                 and (inspect.isfunction(v) or inspect.isclass(v)) and v.__module__ == module_name]
    return [n for n in names if not isinstance(getattr(module, n), types.ModuleType)]


def homes() -> dict[str, dict[str, str]]:
    """{page: {name: the module whose page documents it}} for every documented module."""
    out: dict[str, dict[str, str]] = {}
    sub = {page: set(public_names(mod)) for page, mod in MODULES.items() if page != "fspeed"}
    top = importlib.import_module("fspeed")
    for page, mod in MODULES.items():
        if page != "fspeed":
            out[page] = {name: mod for name in public_names(mod)}
            continue
        out[page] = {}
        for name in public_names(mod):
            obj = getattr(top, name)
            owner = next((p for p, names in sub.items()
                          if name in names and getattr(importlib.import_module(MODULES[p]), name) is obj), None)
            out[page][name] = MODULES[owner] if owner else mod
    return out


def shadowed(module_name: str, name: str) -> bool:
    """Whether a submodule of `module_name` has the name `name` (the documentation tool then resolves
    `module.name` to the submodule, so the object is documented by its full path)."""
    module = importlib.import_module(module_name)
    return importlib.util.find_spec(f"{module_name}.{name}") is not None if hasattr(module, "__path__") else False


def identifier(module_name: str, name: str) -> str:
    """The anchor of `name` on its module's page."""
    if shadowed(module_name, name):
        obj = getattr(importlib.import_module(module_name), name)
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"{module_name}.{name}"


def render(page: str, home: dict[str, str]) -> str:
    """The Markdown of one API page."""
    mod = MODULES[page]
    own = [name for name, where in home.items() if where == mod]
    lines = [f"# `{mod}`", ""]
    lines += [f"::: {mod}", "    options:", "      show_root_heading: false", "      show_root_toc_entry: false",
              "      members:"]
    lines += [f"        - {name}" for name in own if not shadowed(mod, name)]
    lines.append("")
    for name in own:
        if shadowed(mod, name):
            lines += [f"::: {identifier(mod, name)}", ""]
    elsewhere = {name: where for name, where in home.items() if where != mod}
    if elsewhere:
        lines += ["## Exported here, documented with their module", "",
                  "| name | documented in |", "|---|---|"]
        for name, where in elsewhere.items():
            lines.append(f"| [`{mod}.{name}`][{identifier(where, name)}] | [`{where}`]({MODULES_PAGE[where]}) |")
        lines.append("")
    return "\n".join(lines)


MODULES_PAGE = {mod: f"{page}.md" for page, mod in MODULES.items()}


def pages() -> dict[str, str]:
    """{path under docs/: Markdown} for every API page."""
    h = homes()
    return {f"reference/api/{page}.md": render(page, h[page]) for page in MODULES}
