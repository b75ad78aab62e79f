"""The hostfile grammar: which machines a job may use, and how many slots (devices) each has.

DeepSpeed's MPI-style hostfile, one host per line:

    # comment
    worker-0 slots=4
    worker-1 slots=4      # trailing comment

Blank lines and `#` comments are ignored; a host listed twice, a malformed line or a file with
no hosts is an error. DeepSpeed matches `^(\\S+)\\s+slots=(\\d+)` and ignores whatever follows, so
`worker-0 slots=4gpus` silently means 4; here only a `# comment` may follow the slot count, and
the error names the file, the line number and the line. Host names may not contain `@`, `:` or
`,` because those separate hosts and slots in `--include`/`--exclude`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Union

__all__ = ["LaunchConfigError", "HostfileError", "parse_hostfile", "read_hostfile", "HOSTFILE_GRAMMAR"]

HOSTFILE_GRAMMAR = "'<hostname> slots=<n>' (n >= 1, optionally followed by '# comment'), '# comment' or a blank line"

_HOST_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)\s*(?:#.*)?$")
_FORBIDDEN_IN_HOST = "@:,"


class LaunchConfigError(ValueError):
    """A launcher input (hostfile, filter, flag, env file) is invalid; the message says how."""


class HostfileError(LaunchConfigError):
    """The hostfile is malformed; the message names the file, the line number and the line."""


def parse_hostfile(text: str, source: str = "<hostfile>") -> dict[str, int]:
    """Host name -> slot count, in file order (file order is rank order: node-major, like DeepSpeed)."""
    pool: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"hostfile {source!r}, line {number}: {line!r}"
        match = _HOST_LINE.match(line)
        if match is None:
            raise HostfileError(f"{where} is not a host entry; each line must be {HOSTFILE_GRAMMAR}")
        host, slots = match["host"], int(match["slots"])
        bad = sorted(set(host) & set(_FORBIDDEN_IN_HOST))
        if bad:
            raise HostfileError(
                f"{where}: host name {host!r} contains {''.join(bad)!r}; '@', ':' and ',' separate hosts "
                "and slots in --include/--exclude, so host names may not contain them"
            )
        if slots < 1:
            raise HostfileError(f"{where}: slots={slots}; a host needs at least 1 slot (remove the line instead)")
        if host in pool:
            raise HostfileError(
                f"{where}: host {host!r} is listed twice (first on line {first_line[host]}); "
                "list each host once with its total slot count"
            )
        pool[host] = slots
        first_line[host] = number
    if not pool:
        raise HostfileError(f"hostfile {source!r} lists no hosts; each line must be {HOSTFILE_GRAMMAR}")
    return pool


def read_hostfile(path: Union[str, Path]) -> dict[str, int]:
    """`parse_hostfile` of a file; a missing or unreadable file is a `HostfileError` naming the path."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise HostfileError(f"hostfile {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise HostfileError(f"hostfile {str(path)!r} cannot be read: {error}") from None
    return parse_hostfile(text, source=str(path))
