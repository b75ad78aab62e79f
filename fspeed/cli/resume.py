"""Which checkpoint `checkpoint.resume` continues from, said plainly when there is none.

`checkpoint.resume=true` loads `latest` from checkpoint.dir when there is one and otherwise starts
from step 0 with one warning naming the directory; `checkpoint.resume=required` makes a missing
checkpoint an error (a ConfigError: exit code 2 before any work). The default checkpoint.dir is
the run's own new directory, where there is never anything to resume: both say so. A worker that
torchrun restarted after a failure (`restarts`) resumes as with `checkpoint.resume=true`, whatever
the setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .. import checkpoint
from ..checkpoint import CheckpointError
from ..config import ConfigError, Problem
from ..config.schema import RunConfig


def resumable_tag(run: RunConfig, out_dir: Path, restarted: bool = False) -> Optional[str]:
    """The checkpoint tag `checkpoint.resume` loads (or, `restarted`, a restarted worker resumes);
    None: a fresh start. With resume=required, no checkpoint is a ConfigError."""
    if not run.checkpoint.resume and not restarted:
        return None
    tag = checkpoint.latest_tag(run.checkpoint.dir)
    if tag is None and run.checkpoint.resume == "required":
        missing, hint = _nothing_to_resume(run, out_dir)
        fresh = "or checkpoint.resume=true to start from step 0 when there is none"
        raise ConfigError([Problem("checkpoint.resume", missing, "required", hint=f"{hint}, {fresh}" if hint
                                   else f"set checkpoint.dir to the checkpoints of the run to resume, {fresh}")])
    return tag


def _nothing_to_resume(run: RunConfig, out_dir: Path) -> tuple[str, Optional[str]]:
    """(what is missing, naming the directory; a hint when checkpoint.dir is the run's own new directory)."""
    ckpt_dir = Path(run.checkpoint.dir)
    missing = f"there is no checkpoint in {ckpt_dir} (no '{checkpoint.LATEST_FILE}' file)"
    if ckpt_dir.resolve() != (out_dir / "checkpoints").resolve():
        return missing, None
    return missing, ("checkpoint.dir is this run's own new directory (the default): set checkpoint.dir to the "
                     "checkpoints of the run to resume")


def saved_tokenizer(ckpt_dir: Path, tag: Optional[str]) -> Optional[dict]:
    """The tokenizer description saved in checkpoint `tag` (None without one), for a resumed run."""
    if tag is None:
        return None
    client_state = checkpoint.read_meta(ckpt_dir, tag)["client_state"]
    if not isinstance(client_state.get("tokenizer"), dict):
        raise CheckpointError(f"{ckpt_dir / tag} has no tokenizer in its client_state: it was not saved by "
                              "fspeed-train, which cannot resume it")
    return client_state["tokenizer"]


def nothing_to_resume_line(run: RunConfig, out_dir: Path) -> str:
    """The warning of a `checkpoint.resume=true` run that found no checkpoint."""
    missing, hint = _nothing_to_resume(run, out_dir)
    return f"checkpoint.resume=true, but {missing}: training starts from step 0" + (f"; {hint}" if hint else "")
