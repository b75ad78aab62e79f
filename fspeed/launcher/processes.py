"""The processes below a launcher, from /proc: a node agent's workers, to stop them all.

    descendants(agent.pid)      # every live process below it (its workers and theirs)
    alive(pids)                 # those still running

Linux only; elsewhere (no /proc) the table is empty and `children` says None: unknown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence


def proc_table(cmdlines: bool = True) -> dict[int, tuple[int, str, bool]]:
    """pid -> (parent pid, command line ("" without `cmdlines`), is a zombie), from /proc. Reading a
    command line takes the process's memory lock, so the scans that need only the tree skip it."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") \
                if cmdlines else ""
        except (OSError, IndexError):
            continue
        table[int(stat.parent.name)] = (int(fields[1]), cmdline, fields[0] == "Z")
    return table


def children(pid: int) -> Optional[set[int]]:
    """The live child processes of `pid` (None where /proc is unavailable: not Linux)."""
    if not Path("/proc/self/stat").exists():
        return None
    return {child for child, (parent, _, zombie) in proc_table(False).items() if parent == pid and not zombie}


def descendants(root: int) -> list[int]:
    """Every live (non-zombie) process below `root`."""
    table = proc_table(False)
    below: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        below.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in below.get(todo.pop(), []):
            if not table[child][2]:
                found.append(child)
            todo.append(child)
    return found


def alive(pids: Sequence[int]) -> list[int]:
    """The pids of `pids` still running (zombies are not running)."""
    table = proc_table(False)
    return [pid for pid in pids if pid in table and not table[pid][2]]


__all__ = ["alive", "children", "descendants", "proc_table"]
