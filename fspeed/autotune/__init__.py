"""Autotuning: the fastest layout of a run for a model and a world, found in a few short trials.

    report = fspeed.autotune.autotune(world=2, global_batch=64, overrides=["model.n_layer=4"])
    print(report.table())                # fspeed-autotune does the same from the command line

The parts, bottom up: `space` (the candidate layouts, and those fspeed or the model would refuse,
with the reason), `profiling` (the one short profiling pass), `memory_model` (each candidate's
predicted peak bytes per rank, and pruning), `collectives` and `cost_model` (each candidate's
predicted step time), `trials` (real short runs of fspeed-train, recorded in a results file that an
interrupted tuning resumes from), `tuner` (the search and its strategies), `outputs` (the best
layout as overrides, a config file and a ds_config) and `command` (`fspeed-autotune`).
"""

from .cost_model import CommCosts, LinkCost, StepCost, predict_step
from .memory_model import MemoryPrediction, parse_bytes, predict_memory, prune
from .outputs import ds_config, write_best
from .profiling import Profile, build_job, profile_job
from .space import Candidate, Enumerated, ModelFacts, SearchSpace, Skipped, enumerate_candidates, parse_remat
from .trials import ResultsFile, TrialResult, TrialSettings, run_trial
from .tuner import TuneReport, TuneSettings, autotune, tune

__all__ = [
    "Candidate", "CommCosts", "Enumerated", "LinkCost", "MemoryPrediction", "ModelFacts", "Profile", "ResultsFile",
    "SearchSpace", "Skipped", "StepCost", "TrialResult", "TrialSettings", "TuneReport", "TuneSettings", "autotune",
    "build_job", "ds_config", "enumerate_candidates", "parse_bytes", "parse_remat", "predict_memory",
    "predict_step", "profile_job", "prune", "run_trial", "tune", "write_best",
]
