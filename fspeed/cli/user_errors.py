"""How fspeed-train reports what a user can fix: one clean message on stderr and exit code 2.

User errors are a bad configuration or corpus (`ConfigError`, naming the key), a checkpoint
that cannot be written or loaded (`CheckpointError`, naming the file) and a diverged run
(`NonFiniteError`, `LossScaleAtMinimumError`, naming the step). `--debug` or HYDRA_FULL_ERROR=1
shows the traceback instead. In a run of several ranks, an error every rank raised alike (all
of these but a checkpoint error one rank met alone) is printed by rank 0 only; under torchrun each
failing rank also writes its message to TORCHELASTIC_ERROR_FILE, from which the `fspeed` launcher's
failure summary quotes it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import NoReturn, Optional

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


def divergence_advice(gradient_clipping: Optional[float]) -> str:
    """What to change after a divergence, given train.gradient_clipping (None: not known)."""
    if gradient_clipping is None:
        clip = "enable or lower train.gradient_clipping"
    elif gradient_clipping > 0:
        clip = f"lower train.gradient_clipping (now {gradient_clipping:g})"
    else:
        clip = "enable train.gradient_clipping (e.g. 1.0; it is 0, off)"
    return f"Lower optimizer.lr, {clip}, or set train.on_nonfinite=skip to skip such steps"


def message(error: BaseException, gradient_clipping: Optional[float] = None) -> str:
    """The one message shown for a user error (with the checkpoint saved on the way out, if any).
    `gradient_clipping`: the run's train.gradient_clipping, for a divergence's advice."""
    if isinstance(error, CheckpointError):
        text = f"checkpoint error: {error}"
    elif isinstance(error, NonFiniteError):
        text = f"{error}. {divergence_advice(gradient_clipping)}"
    else:
        text = str(error)
    saved = getattr(error, "final_checkpoint", None)
    return text + (f"\nfspeed-train: the last good step is saved: {saved}" if saved else "")


def exit_with_user_error(error: BaseException, rank: int = 0, gradient_clipping: Optional[float] = None) -> NoReturn:
    """Print `error` (see the module docstring for who prints and where it is recorded) and exit with code 2."""
    text = message(error, gradient_clipping)
    if rank == 0 or not raised_on_every_rank(error):
        who = f" (rank {rank})" if rank else ""
        print(f"fspeed-train{who}: {text}", file=sys.stderr, flush=True)
    record_for_the_launcher(text.replace("\nfspeed-train: ", "\n"))
    sys.exit(EXIT_USER_ERROR)


def record_for_the_launcher(text: str) -> None:
    """Write `text` where torchrun reads a failed worker's message (TORCHELASTIC_ERROR_FILE, when set)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as file:
            json.dump({"message": {"message": text, "extraInfo": {"timestamp": str(int(time.time()))}}}, file)
    except OSError:  # the summary then lacks the message; the rank's own output still has it
        pass
