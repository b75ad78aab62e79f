"""Each candidate's peak bytes per rank, predicted before anything runs, and the pruning it allows.

    predictions = [predict_memory(c, profile, base_run, baseline) for c in candidates]
    fits, over = prune(predictions, memory_per_rank=parse_bytes("70GiB"))   # over: Skipped with the reason

The prediction is fspeed's own estimator (`fspeed.parallel.memory.estimate_memory`: every buffer
the plan holds between steps and the transients within a step) for the candidate's plan and mesh,
with the activations the profiling pass measured (`profiling.Profile`: bytes one micro-batch keeps
under the candidate's remat, linear in the micro-batch). A pipeline stage holds each of its layers'
activations once per micro-batch in flight (`Schedule.in_flight`) and its checkpointed groups the
share the whole-model remat keeps. The process itself (interpreter, libraries, the data every rank
holds) is the `baseline`, measured once (`process_baselines`, with what a remat layout's process
holds more). On a CPU everything is one memory, so the peak per rank is device + host + baseline;
on a GPU the device part is checked.

Approximations, each erring high (a candidate is pruned only when it surely does not fit): tensor
slicing's activations are counted whole (the residual stream is replicated, the rest 1/t), and the
heaviest pipeline stage's model states are added to the most loaded stage's activations.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from ..config.schema import RunConfig
from ..parallel.memory import MemoryEstimate, estimate_memory
from ..parallel.pipeline_transform import balanced_bounds, partition_layers
from ..parallel.plan import Plan
from ..parallel.schedules import build_schedule
from ..parallel.tensor_slicing_transform import tensor_slicing
from ..parallel.zero_transform import zero
from ..remat_budget import CANDIDATES as BUDGET_ORDER
from .profiling import Profile
from .space import Candidate, Skipped


@dataclass(frozen=True)
class MemoryPrediction:
    """A candidate's predicted bytes per rank: on the compute device (model states, transients and
    activations: `estimate.device_peak`), in host memory (offloaded states: `estimate.cpu_total`),
    and the process baseline; `peak_bytes` is what must fit (`memory_per_rank`)."""

    candidate: Candidate
    estimate: MemoryEstimate
    activations: int
    baseline: int
    on_cpu: bool = True
    remat_note: str = ""  # the budget policy: which remat it picks, or why none fits

    @property
    def device_bytes(self) -> int:
        return self.estimate.device_peak

    @property
    def host_bytes(self) -> int:
        return self.estimate.cpu_total

    @property
    def peak_bytes(self) -> int:
        """Bytes per rank that must fit: all of it on a CPU, the device's part on a GPU (the baseline
        there: the allocator's reserve over what it hands out)."""
        if self.on_cpu:
            return self.device_bytes + self.host_bytes + self.baseline
        return self.device_bytes + self.baseline


def candidate_plan(candidate: Candidate, run: RunConfig, profile: Profile) -> Plan:
    """The plan fspeed-train builds for `candidate` (`run` is the candidate's own config), with a
    `profile` partition resolved from the measured layer times."""
    plan = zero(run.zero.to_library())
    if candidate.tensor > 1:
        plan = plan | tensor_slicing(profile.rules)
    if candidate.pipe > 1:
        interval = run.pipeline.activation_checkpoint_interval
        remat = run.activation_checkpointing.to_library() if interval else None
        pipe_plan = run.pipeline.to_library(candidate.grad_accum, remat)
        if run.pipeline.partition.lower() == "profile":
            bounds = pipeline_bounds(candidate, "profile", profile)
            counts = tuple(b - a for a, b in zip(bounds, bounds[1:]))
            explicit = dataclasses.replace(run.pipeline, partition=",".join(map(str, counts)))
            pipe_plan = explicit.to_library(candidate.grad_accum, remat)
        plan = plan | pipe_plan
    return plan


def budget_choice(profile: Profile, budget_mib: float, micro_batch: int) -> tuple[tuple[str, int], str]:
    """The remat `activation_checkpointing.budget_mib` picks at this micro-batch (the first of
    `remat_budget`'s order that keeps at most the budget), and a note; full remat of every block
    with a note saying it does not fit when none does."""
    budget = budget_mib * 2**20
    for policy, every in BUDGET_ORDER:
        key = (policy or "none", every)
        if key in profile.remat and profile.activation_bytes(*key, micro_batch) <= budget:
            return key, f"budget picks {key[0]}:{key[1]}"
    kept = profile.activation_bytes("full", 1, micro_batch) if ("full", 1) in profile.remat else float("nan")
    return ("full", 1), (f"activation_checkpointing.budget_mib={budget_mib:g}: even full remat keeps "
                         f"{kept / 2**20:.1f} MiB per micro-batch")


def _remat_key(candidate: Candidate, profile: Profile) -> tuple[tuple[str, int], str]:
    if candidate.remat == "budget":
        return budget_choice(profile, candidate.remat_budget_mib, candidate.micro_batch)
    return (candidate.remat, candidate.remat_every), ""


def pipeline_bounds(candidate: Candidate, partition: str, profile: Profile) -> list[int]:
    """The `pipe x virtual_stages + 1` layer boundaries `partition` (pipeline.partition) gives the
    candidate's pieces; `profile` balances the measured layer times, as fspeed-train's partition does."""
    costs = profile.layer_costs
    if not costs:
        raise ValueError("pipeline candidates need the layers' costs: profile with with_layers=True")
    pieces = candidate.pipe * candidate.virtual_stages
    method = tuple(int(c) for c in partition.split(",")) if partition[:1].isdigit() else partition
    if method == "profile":
        return balanced_bounds([round(1e6 * (c.forward_s + c.backward_s)) for c in costs], pieces)
    layers = profile.layers.layers if profile.layers is not None else costs  # `type:` needs the real layers
    return partition_layers(method, layers, [c.params for c in costs], pieces)


def pipeline_activations(candidate: Candidate, partition: str, profile: Profile, remat: tuple[str, int]) -> int:
    """Bytes of activations on the most loaded pipeline stage: per stage, its layers' kept bytes at this
    micro-batch times its micro-batches in flight (per chunk, with interleaving), scaled by the share
    the remat keeps of the whole model's."""
    bounds = pipeline_bounds(candidate, partition, profile)
    scale = candidate.micro_batch / profile.layer_micro_batch
    piece_kept = [sum(c.kept_bytes for c in profile.layer_costs[a:b]) * scale for a, b in zip(bounds, bounds[1:])]
    schedule = build_schedule(candidate.schedule, candidate.pipe, candidate.grad_accum, candidate.virtual_stages)
    share = 1.0
    if remat[0] != "none":
        whole = profile.activation_bytes("none", 1, candidate.micro_batch)
        share = profile.activation_bytes(*remat, candidate.micro_batch) / whole if whole else 1.0
    worst = 0.0
    for stage in range(candidate.pipe):
        mine = piece_kept[stage::candidate.pipe]
        worst = max(worst, schedule.in_flight(stage) * sum(mine) / len(mine))
    return int(worst * share)


def predict_memory(candidate: Candidate, profile: Profile, base: RunConfig, baseline: int = 0,
                   on_cpu: bool = True) -> MemoryPrediction:
    """`candidate`'s predicted bytes per rank (module docstring)."""
    run = candidate.apply_to(base)
    remat, note = _remat_key(candidate, profile)
    if candidate.pipe > 1:
        activations = pipeline_activations(candidate, run.pipeline.partition, profile, remat)
    else:
        activations = int(profile.activation_bytes(*remat, candidate.micro_batch))
    params = profile.pipeline_params if candidate.pipe > 1 and profile.pipeline_params is not None else profile.params
    estimate = estimate_memory(params, candidate_plan(candidate, run, profile),
                               {"data": candidate.data, "model": candidate.tensor, "pipe": candidate.pipe},
                               profile.precision, optimizer_state_bytes=profile.optimizer_state_bytes,
                               logical_axes=profile.logical_axes if candidate.pipe == 1 else profile.pipeline_axes,
                               activations=activations, layers=profile.layers if candidate.pipe > 1 else None)
    return MemoryPrediction(candidate, estimate, activations, baseline, on_cpu, note)


def calibrated_baseline(prediction: MemoryPrediction, measured_peak: int) -> int:
    """The process baseline that makes `prediction` match a trial's measured peak (on a CPU): what a
    rank holds besides the model's states and activations (interpreter, libraries, data, the process
    group's buffers, the allocator's slack), measured once and carried to the other candidates."""
    return max(measured_peak - prediction.device_bytes - prediction.host_bytes, 0)


def prune(predictions: Sequence[MemoryPrediction],
          memory_per_rank: int) -> tuple[list[MemoryPrediction], list[Skipped]]:
    """(the predictions that fit `memory_per_rank` bytes, the rest as `Skipped` with the reason); a
    budget remat that no policy meets is skipped too (fspeed-train refuses it at start-up)."""
    fits, over = [], []
    for p in predictions:
        if "even full remat" in p.remat_note:
            over.append(Skipped(p.candidate, p.remat_note))
        elif p.peak_bytes > memory_per_rank:
            over.append(Skipped(p.candidate, f"predicted peak {format_bytes(p.peak_bytes)} per rank is over "
                                             f"autotune.memory_per_rank={format_bytes(memory_per_rank)}"))
        else:
            fits.append(p)
    return fits, over


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: object) -> int:
    """Bytes from `70GiB`, `512MiB`, `1.5GB` or a plain number of bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = int(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"autotune.memory_per_rank: {text!r} is not a size; allowed: a number of bytes or a "
                             "number with a unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 70GiB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"autotune.memory_per_rank: {text!r} must be a positive size")
    return value


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (the memory new processes can take without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line; give autotune.memory_per_rank")


def default_memory_per_rank(world: int, on_cpu: bool = True, share: float = 0.9) -> int:
    """The default `memory_per_rank`: on a CPU `share` of the available memory split over the `world`
    ranks of this machine; on a GPU the current device's free memory."""
    if not on_cpu:
        import torch  # noqa: PLC0415

        return int(torch.cuda.mem_get_info()[0])
    return int(available_host_bytes() * share / world)


_BASELINE_SCRIPT = """
import json, sys, torch
from fspeed.cli.train import main  # what a rank imports
from fspeed.host_memory import retain_freed_host_memory
from fspeed.config.compose import compose_run_config
from fspeed.autotune.profiling import build_job
retain_freed_host_memory()  # as fspeed-train does: freed memory stays in the process
from fspeed.config.build import build_optimizer, build_precision
from fspeed.train_init import init_train_state
from fspeed.train_step import make_train_step
run = compose_run_config(overrides=json.loads(sys.argv[1]))[0]
job = build_job(run)  # the data and model, as a rank builds them
x = torch.randn(64, 256, requires_grad=True)
w = torch.nn.Linear(256, 256)
torch.nn.functional.gelu(torch.nn.functional.scaled_dot_product_attention(
    w(x)[None, None], x[None, None], x[None, None])).sum().backward()
opt = build_optimizer(run)  # a step of the run's optimizer on a small parameter: its kernels are compiled
state = init_train_state({"w": torch.zeros(4096)}, opt, precision=build_precision(run))
make_train_step(lambda p, b, rng=None: (p["w"] * b).sum(), opt)(state, torch.ones(4096))
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
print(peak())
from torch.utils.checkpoint import checkpoint  # remat's first call imports what its contexts need
checkpoint(lambda a: w(a).sin(), x, use_reentrant=False).sum().backward()
print(peak())
"""


def process_baselines(base_overrides: Sequence[str] = (), python: Optional[str] = None) -> tuple[int, int]:
    """(peak resident bytes of a fresh interpreter that imported fspeed-train, prepared the run's
    data and model as a rank does (`profiling.build_job` of `base_overrides`) and ran a small forward
    and backward, the bytes a first remat call adds to it). The first: a trial's memory that is not
    the model's states and activations; the first trial measures it better (`calibrated_baseline`):
    a rank also holds its process group's buffers. The second: what torch's checkpoint imports on its
    first call (its selective contexts; ~80 MiB with torch 2.13), paid by every remat layout."""
    out = subprocess.run([python or sys.executable, "-c", _BASELINE_SCRIPT, json.dumps(list(base_overrides))],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"measuring the process baseline failed:\n{out.stderr[-2000:]}")
    plain, with_remat = (int(v) for v in out.stdout.strip().splitlines()[-2:])
    return plain, max(with_remat - plain, 0)


__all__ = ["MemoryPrediction", "available_host_bytes", "budget_choice", "calibrated_baseline", "candidate_plan",
           "default_memory_per_rank", "format_bytes", "parse_bytes", "pipeline_activations", "pipeline_bounds",
           "predict_memory", "process_baselines", "prune"]
