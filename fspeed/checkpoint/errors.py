"""The one error type of checkpoints, and OS errors turned into lines that name their path."""

from __future__ import annotations

import errno
import os


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupted or does not match the state it is loaded into,
    or a checkpoint directory cannot be written. The message names the file or directory.

    `on_every_rank` is True when every rank of a job raised this same message (a collective save,
    load or preflight agreed on it), so a launcher may print it once.
    """

    def __init__(self, message: str, *, on_every_rank: bool = False):
        super().__init__(message)
        self.on_every_rank = on_every_rank


def os_error_text(error: OSError, path: str | os.PathLike) -> str:
    """`error` as one line that always names a path: `'/ck/x': No space left on device (ENOSPC)`.

    `path` is used when the error carries no file name (a failed write() names none).
    """
    where = error.filename if error.filename is not None else path
    return f"{str(where)!r}: {os_reason(error)}"


def os_reason(error: OSError) -> str:
    """What went wrong, without the path: `No space left on device (ENOSPC)`."""
    code = errno.errorcode.get(error.errno or 0)
    reason = error.strerror or str(error) or type(error).__name__
    return reason + (f" ({code})" if code else "")
