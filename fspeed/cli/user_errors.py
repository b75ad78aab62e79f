"""How fspeed-train reports what a user can fix: one clean message on stderr and exit code 2.

User errors are a bad configuration or corpus (`ConfigError`, naming the key), a checkpoint
that cannot be written or loaded (`CheckpointError`, naming the file) and a diverged run
(`NonFiniteError`, `LossScaleAtMinimumError`, naming the step). `--debug` or HYDRA_FULL_ERROR=1
shows the traceback instead. In a run of several ranks, an error every rank raised alike (all
of these but a checkpoint error one rank met alone) is printed by rank 0 only.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from ..checkpoint import CheckpointError
from ..config import ConfigError
from ..loss_scale import LossScaleAtMinimumError
from ..train_step import NonFiniteError

EXIT_USER_ERROR = 2
USER_ERRORS = (ConfigError, CheckpointError, NonFiniteError, LossScaleAtMinimumError)
DEBUG_ENV = "HYDRA_FULL_ERROR"


def debug_requested() -> bool:
    """Whether tracebacks were asked for (`--debug` sets HYDRA_FULL_ERROR=1, as Hydra reads it)."""
    return os.environ.get(DEBUG_ENV) == "1"


def raised_on_every_rank(error: BaseException) -> bool:
    """Whether every rank of the job raised this same error (then rank 0 alone prints it)."""
    return not isinstance(error, CheckpointError) or error.on_every_rank


def message(error: BaseException) -> str:
    """The one message shown for a user error (with the checkpoint saved on the way out, if any)."""
    if isinstance(error, CheckpointError):
        text = f"checkpoint error: {error}"
    elif isinstance(error, NonFiniteError):
        text = (f"{error}. Lower optimizer.lr, enable train.gradient_clipping, or set train.on_nonfinite=skip to skip "
                "such steps")
    else:
        text = str(error)
    saved = getattr(error, "final_checkpoint", None)
    return text + (f"\nfspeed-train: the last good step is saved: {saved}" if saved else "")


def exit_with_user_error(error: BaseException, rank: int = 0) -> NoReturn:
    """Print `error` (see the module docstring for who prints) and exit with code 2."""
    if rank == 0 or not raised_on_every_rank(error):
        who = f" (rank {rank})" if rank else ""
        print(f"fspeed-train{who}: {message(error)}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)
