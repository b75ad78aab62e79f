"""DeepSpeed's `elasticity` block in the ds_config translator -> fspeed's `elasticity` section.

An enabled block becomes `elasticity.*` overrides: the global batch is then DeepSpeed's elastic
batch and the micro-batch and accumulation are computed for the data-parallel world the run
starts on (`fspeed.config.elastic_section`). As in DeepSpeed, `max_train_batch_size` and
`micro_batch_sizes` are required, and the batch keys (`train_batch_size`,
`train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`) beside an enabled block are an
error unless `ignore_non_elastic_batch_info` is true, when they are ignored. `min_time` is read by
a resource scheduler deciding when to rescale a job, not by training: accepted with no effect
once checked (>= 0). A disabled block has no effect, as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .deepspeed_keys import ENABLED_BLOCK_REASON, TRIAD
from .errors import Problem

ELASTICITY_KEYS: dict[str, Any] = {  # DeepSpeed's defaults (deepspeed/elasticity/constants.py)
    "enabled": False, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1, "max_gpus": 10000,
    "min_time": 0, "prefer_larger_batch": True, "ignore_non_elastic_batch_info": False, "version": 0.2,
    "model_parallel_size": 1, "num_gpus_per_node": 1,
}
REQUIRED_WHEN_ENABLED = ("max_train_batch_size", "micro_batch_sizes")
MIN_TIME_REASON = "read by a resource scheduler deciding when to rescale a job, not by training"
IGNORED_BATCH_REASON = "elasticity chooses the batch; ignored as elasticity.ignore_non_elastic_batch_info is true"


def elasticity_enabled(ds: Mapping[str, Any]) -> bool:
    """Whether `ds` has an enabled `elasticity` block (then it, not the batch keys, sets the batch)."""
    block = ds.get("elasticity")
    return isinstance(block, Mapping) and block.get("enabled", False) is True


def translate_elasticity(ds: Mapping[str, Any], w: Any) -> None:
    """`elasticity` -> elasticity.* (`w` is the translator's ledger); the batch keys beside it checked."""
    block = w.known_block("elasticity", ds["elasticity"], ELASTICITY_KEYS)
    if block is None:
        return
    enabled = block.get("enabled", False)
    if not isinstance(enabled, bool):
        w.unsupported("elasticity.enabled", enabled, "true, false", "expected a boolean")
        return
    if not enabled:
        w.accept("elasticity", dict(block), ENABLED_BLOCK_REASON)
        return
    missing = [k for k in REQUIRED_WHEN_ENABLED if k not in block]
    if missing:
        w.problems.append(Problem(f"elasticity.{missing[0]}", "is required when elasticity is enabled (DeepSpeed "
                                  "raises without it)", hint="e.g. max_train_batch_size 2000, micro_batch_sizes "
                                  "[2, 4, 6]"))
        return
    _batch_keys_beside(ds, block, w)
    for key, value in block.items():
        if key == "min_time":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                w.unsupported("elasticity.min_time", value, ">= 0", "must be a number >= 0 (DeepSpeed checks it)")
            else:
                w.accept("elasticity.min_time", value, MIN_TIME_REASON)
        else:
            w.emit(f"elasticity.{key}", f"elasticity.{key}", value)


def _batch_keys_beside(ds: Mapping[str, Any], block: Mapping[str, Any], w: Any) -> None:
    """DeepSpeed's rule for train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps
    beside an enabled block: an error, or ignored with ignore_non_elastic_batch_info."""
    given = [k for k in TRIAD if k in ds]
    if not given:
        return
    if block.get("ignore_non_elastic_batch_info", False) is True:
        for key in given:
            w.accept(key, ds[key], IGNORED_BATCH_REASON)
        return
    w.problems.append(Problem(given[0], f"elasticity is enabled and chooses the batch, so {', '.join(given)} would "
                              "not be used (DeepSpeed refuses them too)", ds[given[0]],
                              hint="remove them, or set elasticity.ignore_non_elastic_batch_info: true to ignore "
                              "them"))


__all__ = ["ELASTICITY_KEYS", "elasticity_enabled", "translate_elasticity"]
