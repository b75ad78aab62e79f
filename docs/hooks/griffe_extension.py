"""A griffe extension for the API pages (mkdocstrings loads it from mkdocs.yml).

- A module docstring keeps its indentation: fspeed's module docstrings show code as lines indented
  under the summary, which the usual cleaning (dedenting every line after the first) would fold
  into the paragraph above.
- A class's attributes without a docstring are left out: they are implementation state, and the
  class docstring says what matters.
"""

from __future__ import annotations

import ast

from griffe import Extension


class FspeedDocs(Extension):
    def on_module_instance(self, *, node, mod, agent, **kwargs) -> None:
        if mod.docstring is None or not isinstance(node, ast.Module):
            return
        raw = ast.get_docstring(node, clean=False)
        if raw:
            mod.docstring.value = "\n".join(line.rstrip() for line in raw.strip("\n").splitlines())

    def on_class_members(self, *, node, cls, agent, **kwargs) -> None:
        for name, member in list(cls.members.items()):
            if not member.is_alias and member.is_attribute and not member.docstring:
                del cls.members[name]
