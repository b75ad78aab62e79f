"""Autotuning: the fastest layout of a run for a model and a world, found in a few short trials.

The parts, bottom up: `space` (the candidate layouts, and those fspeed or the model would refuse,
with the reason), `memory_model` (each candidate's predicted peak bytes per rank, from the
memory estimator and activations measured in one profiling pass), `cost_model` (each
candidate's predicted step time from measured layer times, collectives and the pipeline
schedule simulator) and `trials` (real short runs of fspeed-train, recorded in a results file
that an interrupted tuning resumes from).
"""

from .space import Candidate, Enumerated, ModelFacts, SearchSpace, Skipped, enumerate_candidates, parse_remat

__all__ = ["Candidate", "Enumerated", "ModelFacts", "SearchSpace", "Skipped", "enumerate_candidates", "parse_remat"]
