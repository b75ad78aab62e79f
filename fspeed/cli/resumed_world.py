"""Resuming on another number of data ranks with the same global batch.

Every fspeed-train checkpoint records its batch (`BATCH_KEY` in the client_state: the global
batch, micro-batch, accumulation and the data-parallel size it ran on). A run resumed on a
different data-parallel size (e.g. `parallel.data=-1` on whatever the world now gives) keeps the
checkpoint's global batch: the micro-batch per rank stays what the config says where the global
batch divides by micro-batch x data ranks, and the gradient accumulation is recomputed (2 ranks x
micro 4 x accumulation 1 -> 1 rank x micro 4 x accumulation 2); otherwise the largest micro-batch
below it that divides the per-rank share is taken. One log line says what was kept and what
changed. A global batch that does not divide by the new number of data ranks stops the run
naming the sizes that fit. An explicit `train.train_batch_size` other than the checkpoint's is the
user's new global batch and is kept as given. With `elasticity.enabled` the batch is the elastic
one (the same on every valid world size). The state reshards on load, the data loader's position
is in global batches (`fspeed.data.epochs`), so no sample is repeated or skipped, and the step and
learning-rate schedule continue.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Optional

from .. import checkpoint
from ..config import ConfigError, Problem
from ..config.schema import RunConfig

BATCH_KEY = "batch"  # client_state key of the run's batch

log = logging.getLogger("fspeed")


def batch_record(run: RunConfig) -> dict[str, int]:
    """The run's batch as a checkpoint records it."""
    b = run.batch
    return {"train_batch_size": b.train_batch_size, "micro_batch_size": b.micro_batch_size,
            "grad_accum": b.grad_accum, "data_parallel": b.dp_world_size}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def keep_global_batch(run: RunConfig, saved: Optional[dict[str, Any]]) -> tuple[RunConfig, Optional[str]]:
    """(`run` with the saved global batch on its own data-parallel size, the line saying so); the run
    unchanged (and None) when the data-parallel size is the saved one, there is no record, the batch
    is elastic or train.train_batch_size asks for another global batch. ConfigError when the saved
    global batch does not divide by the new number of data ranks."""
    if not saved or run.elasticity.enabled:
        return run, None
    global_batch, before, dp = int(saved["train_batch_size"]), int(saved["data_parallel"]), run.dp_world_size
    if dp == before:
        return run, None
    t = run.train
    if t.train_batch_size is not None and t.train_batch_size != global_batch:
        return run, (f"resuming on {dp} data ranks (saved on {before}): train.train_batch_size={t.train_batch_size} "
                     f"replaces the checkpoint's global batch {global_batch}")
    if global_batch % dp:
        fits = _divisors(global_batch)[:16]
        raise ConfigError([Problem("parallel.data", f"the checkpoint's global batch {global_batch} (saved on {before} "
                                   f"data ranks) does not divide over {dp} data ranks, so the run cannot continue "
                                   "with the same batch", dp, ", ".join(map(str, fits)),
                                   hint="resume on a number of data ranks dividing the global batch, or set "
                                   "train.train_batch_size to change the batch")])
    share, wanted = global_batch // dp, t.micro_batch_size or run.batch.micro_batch_size
    micro = max(m for m in _divisors(share) if m <= wanted) if share % wanted else wanted
    train = dataclasses.replace(t, train_batch_size=global_batch, micro_batch_size=micro,
                                grad_accum=share // micro)
    kept = dataclasses.replace(run, train=train)
    b = kept.batch
    why = f"micro_batch_size {micro}" + (f" (train.micro_batch_size={wanted} does not divide the per-rank share "
                                         f"{share})" if micro != wanted else "")
    return kept, (f"resuming on {dp} data ranks (saved on {before} x micro {saved.get('micro_batch_size')} x "
                  f"accumulation {saved.get('grad_accum')}): global batch {b.train_batch_size} kept, {why} x "
                  f"grad_accum {b.grad_accum} x {dp} data ranks")


def batch_for_resume(run: RunConfig, ckpt_dir: Path, tag: Optional[str]) -> RunConfig:
    """`run` with the global batch of checkpoint `tag` kept when the run resumes on another data-parallel
    size (`keep_global_batch`); rank 0 logs the line saying so. `run` itself without a checkpoint."""
    if tag is None:
        return run
    saved = checkpoint.read_meta(ckpt_dir, tag)["client_state"].get(BATCH_KEY)
    kept, line = keep_global_batch(run, saved if isinstance(saved, dict) else None)
    if line and int(os.environ.get("RANK", "0")) == 0:
        log.info("%s", line)
    return kept


__all__ = ["BATCH_KEY", "batch_for_resume", "batch_record", "keep_global_batch"]
