"""Before the first step: can this run write checkpoints where it was told to, and is there room?

Training for hours and failing at the first save loses the run. `preflight` finds out at once:
every rank creates, writes, fsyncs, renames and deletes a small file in the checkpoint directory,
and the filesystem must have room for one checkpoint of the state (its exact byte count, all
ranks' files together when they share the directory).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Optional

from .directory import ensure_directory, lock, unique_name, unlock
from .errors import CheckpointError, os_error_text
from .state_io import is_sharded, state_entries
from .tensor_file import tensor_bytes

METADATA_BYTES = 64 << 10      # meta.json (scalars, client_state), generously
HEADER_BYTES_PER_TENSOR = 256  # a safetensors header entry (key, dtype, shape, offsets)


def probe_directory(directory: str | os.PathLike) -> Path:
    """Create `directory` if needed, then create, write, rename and delete a file in it.

    Raises CheckpointError naming the directory and the step that failed (e.g. a read-only mount,
    a path under /proc, a regular file where the directory should be).
    """
    directory = Path(directory)
    ensure_directory(directory)
    probe = unique_name(directory, f".preflight-{socket.gethostname()}-{os.getpid()}-")
    renamed = probe.with_name(probe.name + "-renamed")
    step, lock_fd = "create", None
    try:
        with open(probe, "x") as f:
            lock_fd = lock(probe)  # so that tidy of another process leaves it alone
            step = "write"
            f.write("fspeed checkpoint preflight\n")
            f.flush()
            os.fsync(f.fileno())
            step = "rename"
            os.rename(probe, renamed)
            step = "delete"
            os.unlink(renamed)
    except OSError as e:
        for leftover in (probe, renamed):
            try:
                os.unlink(leftover)
            except OSError:
                pass
        raise CheckpointError(f"checkpoint directory {str(directory)!r} is not writable: cannot {step} a file "
                              f"in it: {os_error_text(e, probe)}") from None
    finally:
        unlock(lock_fd)
    return directory


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000
    return f"{n} B"


def checkpoint_bytes(state) -> int:
    """The bytes one checkpoint of this rank's part of `state` takes on disk (headers and meta.json included)."""
    tensors, _ = state_entries(state)
    return tensor_bytes(tensors) + HEADER_BYTES_PER_TENSOR * len(tensors) + METADATA_BYTES


def preflight(directory: str | os.PathLike, state, *, mesh=None) -> None:
    """Check that checkpoints of `state` can be written to `directory` and that it has room for one.

    With a sharded state (a plan over several ranks) this is a collective: every rank checks its
    own access, the room needed is the sum of all ranks' files, and every rank raises the same
    CheckpointError naming the failing ranks.
    """
    directory = Path(directory)
    sharded = is_sharded(state, mesh, "preflight")
    needed = checkpoint_bytes(state)
    problem: Optional[str] = None
    try:
        probe_directory(directory)
    except CheckpointError as e:
        problem = str(e)
    if sharded:
        reports = mesh.all_gather_objects((problem, needed), "checkpoint preflight")
        needed = sum(n for _, n in reports)
    if problem is None:
        free = shutil.disk_usage(directory).free
        if free < needed:
            problem = (f"checkpoint directory {str(directory)!r} has {_human(free)} free; one checkpoint of this "
                       f"state needs {_human(needed)}" + (" (all ranks' files together)" if sharded else ""))
    if not sharded:
        if problem:
            raise CheckpointError(problem)
        return
    problems = [(r, p) for r, p in enumerate(mesh.all_gather_objects(problem, "checkpoint preflight"))
                if p is not None]
    if problems:
        if len({p for _, p in problems}) == 1 and len(problems) == mesh.world_size:
            message = problems[0][1] + " (on every rank)"
        else:
            message = "; ".join(f"rank {r}: {p}" for r, p in problems)
        raise CheckpointError(message, on_every_rank=True)
