"""Autotuning: the fastest layout of a run for a model and a world, found in a few short trials.

    import fspeed as fs
    report = fs.autotune(world=2, global_batch=64, overrides=["model.n_layer=4"])   # fspeed.autotune.tuner.autotune
    print(report.table())                # fspeed-autotune does the same from the command line

The parts, bottom up: `space` (the candidate layouts, and those fspeed or the model would refuse,
with the reason), `profiling` (the one short profiling pass), `memory_model` (each candidate's
predicted peak bytes per rank, and pruning), `collectives` and `cost_model` (each candidate's
predicted step time), `trials` (real short runs of fspeed-train, recorded in a results file that an
interrupted tuning resumes from), `tuner` (the search and its strategies), `outputs` (the best
layout as overrides, a config file and a ds_config), `plots` and `command` (`fspeed-autotune`), and
`deepspeed_block` (DeepSpeed's `autotuning` block as the tuner's settings).

The package itself is callable (`fs.autotune(...)` is `tuner.autotune`), and its names load on
first use: importing fspeed does not import the configuration machinery the tuner composes with.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_HOMES = {
    "Candidate": "space", "Enumerated": "space", "ModelFacts": "space", "SearchSpace": "space", "Skipped": "space",
    "enumerate_candidates": "space", "parse_remat": "space",
    "Profile": "profiling", "build_job": "profiling", "profile_job": "profiling",
    "MemoryPrediction": "memory_model", "parse_bytes": "memory_model", "predict_memory": "memory_model",
    "prune": "memory_model",
    "CommCosts": "cost_model", "LinkCost": "cost_model", "StepCost": "cost_model", "predict_step": "cost_model",
    "ResultsFile": "trials", "TrialResult": "trials", "TrialSettings": "trials", "run_trial": "trials",
    "TuneReport": "tuner", "TuneSettings": "tuner", "autotune": "tuner", "tune": "tuner",
    "ds_config": "outputs", "merged_ds_config": "outputs", "write_best": "outputs",
    "translate_block": "deepspeed_block",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'fspeed.autotune' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


class _CallablePackage(types.ModuleType):
    """This package, called: `fs.autotune(...)` runs `fspeed.autotune.tuner.autotune`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from .tuner import autotune

        return autotune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
