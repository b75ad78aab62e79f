"""Which environment variables reach the ranks on every node.

Local nodes inherit this process's whole environment. A remote node gets, over ssh, an explicit
list (DeepSpeed's rule): the variables whose names start with one of `EXPORTED_PREFIXES`, the
current directory prepended to `PYTHONPATH`, and the user's own `KEY=VALUE` file `.fspeed_env`
(DeepSpeed's `.deepspeed_env`), read from the home directory and then the current directory (a
later file wins; `FSPEED_ENV_FILE` renames it). `--env KEY=VALUE` flags win over the files. The
files and flags apply to local nodes too. Per-node variables (`CUDA_VISIBLE_DEVICES`) and
torchrun's own (`TORCHELASTIC_*`) are never copied.

In `.fspeed_env`, blank lines and `#` comments are ignored and a value may be quoted; a line
that is not `KEY=VALUE` is an error naming the file and line (DeepSpeed splits on `=` and fails
with a bare ValueError).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Optional

from .hostfile import LaunchConfigError
from .tether import AGENT_PID_ENV, AGENT_TETHER_ENV

__all__ = [
    "DEBUG_ENV", "EXPORTED_PREFIXES", "FAILURES_ENV", "NEVER_EXPORTED", "REPORT_ENV", "ENV_FILE_NAME", "parse_env_file",
    "parse_env_assignments", "user_env", "exported_env",
]

EXPORTED_PREFIXES = (
    "NCCL", "GLOO", "UCX", "MV2", "MLFLOW", "PYTHON", "TORCH", "FSPEED", "OMP_", "MKL_", "HF_", "WANDB",
)
REPORT_ENV = "FSPEED_AGENT_REPORT"      # where a local agent writes its failure report (agent.py)
DEBUG_ENV = "FSPEED_DEBUG"              # "1": agents show torchrun's tracebacks and logs on failure (--debug)
FAILURES_ENV = "FSPEED_ATTEMPT_FAILURES"  # the agent's record of failed attempts, read by restarted workers
NEVER_EXPORTED = ("CUDA_VISIBLE_DEVICES", "TORCHELASTIC_", "PYTHONHOME", REPORT_ENV, FAILURES_ENV, AGENT_PID_ENV,
                  AGENT_TETHER_ENV)
ENV_FILE_NAME = ".fspeed_env"

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _parse_assignment(text: str, where: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    key = key.strip()
    if key.startswith("export "):
        key = key[len("export "):].strip()
    if not eq or not _KEY.match(key):
        raise LaunchConfigError(
            f"{where}: {text!r} is not KEY=VALUE (KEY: letters, digits and '_', not starting with a digit)"
        )
    value = value.strip()
    if value[:1] in ("'", '"'):
        try:
            tokens = shlex.split(value)
        except ValueError:
            tokens = []
        if len(tokens) != 1:
            raise LaunchConfigError(f"{where}: the quoted value of {key} is not one balanced quoted string: {value}")
        value = tokens[0]
    return key, value


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """`KEY=VALUE` lines of an env file -> dict; blank lines and `#` comments are skipped."""
    env: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, value = _parse_assignment(line, f"env file {source!r}, line {number}")
        env[key] = value
    return env


def parse_env_assignments(items: Iterable[str]) -> dict[str, str]:
    """`--env KEY=VALUE` flags -> dict (the value is taken verbatim)."""
    env: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not _KEY.match(key):
            raise LaunchConfigError(
                f"--env {item!r} is not KEY=VALUE (KEY: letters, digits and '_', not starting with a digit)"
            )
        env[key] = value
    return env


def user_env(cwd: Path, home: Optional[Path], environ: Mapping[str, str],
             assignments: Iterable[str] = ()) -> dict[str, str]:
    """The `.fspeed_env` files (home, then cwd) overlaid with the `--env` flags."""
    name = environ.get("FSPEED_ENV_FILE", ENV_FILE_NAME)
    env: dict[str, str] = {}
    directories = [home, cwd] if home is not None and Path(home).resolve() != Path(cwd).resolve() else [cwd]
    for directory in directories:
        path = Path(directory) / name
        if path.is_file():
            env.update(parse_env_file(path.read_text(), str(path)))
    env.update(parse_env_assignments(assignments))
    return env


def exported_env(environ: Mapping[str, str], cwd: Path) -> dict[str, str]:
    """The variables carried to remote nodes: prefix matches, with `cwd` prepended to `PYTHONPATH`."""
    env = {
        key: value for key, value in environ.items()
        if key.startswith(EXPORTED_PREFIXES) and not key.startswith(NEVER_EXPORTED)
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(cwd), environ.get("PYTHONPATH", "")) if p)
    return env
