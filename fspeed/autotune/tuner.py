"""The search: profile once, predict every candidate's memory and step time, run the promising ones.

    report = tune(TuneSettings(world=2, base_overrides=("train.train_batch_size=32",), workdir=Path("autotune")))
    print(report.table())
    report.best.candidate.to_overrides()       # what fspeed-train takes

Strategies (`TuneSettings.strategy`):

- `model` (default): trials in the cost model's predicted order. After each trial the predictions
  are calibrated by the measured/predicted ratio of the trials so far (their median), and the
  search stops when the next candidate's calibrated prediction cannot beat the best measured step
  by more than `noise` (or after `max_trials`). The memory baseline is calibrated on the first
  finished trial and the rest re-pruned with it.
- `grid`: every candidate that fits, in enumeration order (up to `max_trials`).
- `random`: a seeded random sample of `max_trials` of them.
- `fast`: DeepSpeed's fast mode for comparison: the ZeRO stages at the base's other settings (no
  remat, no tensor or pipeline slicing, the first value of each offload axis), each with its
  largest fitting micro-batch and the next smaller ones (`fast_micro_batches` in all, 3 by
  default), stopping after 5 trials without improvement.

Layouts are compared by `metric`: `throughput` (default: samples per second, which at a fixed
global batch orders them as step time does) or `latency` (seconds per step, whatever the batch).
`patience` stops any strategy after that many trials in a row without a better one (DeepSpeed's
`tuner_early_stopping`).

Every trial goes to `workdir/results.jsonl` first (`trials.ResultsFile`); a tuning started again
with the same settings runs only the trials that file does not hold.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..config.compose import compose_run_config
from ..config.overrides import override_value
from ..remat_budget import CANDIDATES as BUDGET_ORDER
from .collectives import measure_collectives
from .cost_model import CommCosts, predict_step
from .memory_model import default_memory_per_rank, format_bytes, predict_memory, process_baselines, prune
from .profiling import Profile, build_job, profile_job, run_device
from .space import Candidate, SearchSpace, enumerate_candidates
from .trials import ResultsFile, TrialResult, TrialSettings, candidate_key, rank_threads, run_fingerprint, run_trial

STRATEGIES = ("model", "grid", "random", "fast")
METRICS = ("throughput", "latency")


@dataclass(frozen=True)
class TuneSettings:
    """What to tune and how (module docstring). `memory_per_rank` None: `default_memory_per_rank`."""

    world: int
    base_overrides: tuple[str, ...] = ()
    workdir: Path = Path("autotune")
    space: SearchSpace = SearchSpace()
    strategy: str = "model"
    memory_per_rank: Optional[int] = None
    max_trials: int = 8
    noise: float = 0.05
    seed: int = 0
    trial: TrialSettings = TrialSettings()
    metric: str = "throughput"
    patience: Optional[int] = None  # None: the strategy's own stop (5 for fast)
    fast_micro_batches: int = 3
    resume: bool = True  # False: start from scratch (workdir's earlier predictions and trials kept as *.previous)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"autotune.strategy={self.strategy!r}; allowed: {', '.join(STRATEGIES)}")
        if self.metric not in METRICS:
            raise ValueError(f"autotune.metric={self.metric!r}; allowed: {', '.join(METRICS)}")
        for name in ("max_trials", "fast_micro_batches", *(("patience",) if self.patience is not None else ())):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"autotune.{name}={value!r} must be a positive integer")
        if self.fast_micro_batches != 3 and self.strategy != "fast":
            raise ValueError(f"autotune.fast_micro_batches applies to autotune.strategy=fast, and the strategy is "
                             f"{self.strategy}")
        if not 0 <= self.noise < 1:
            raise ValueError(f"autotune.noise={self.noise!r} must be in [0, 1) (a relative measurement noise)")
        object.__setattr__(self, "base_overrides", tuple(self.base_overrides))
        object.__setattr__(self, "workdir", Path(self.workdir))


@dataclass
class Row:
    """One candidate in the table: its predictions, its trial if it ran, and its status."""

    candidate: Candidate
    status: str  # skipped | over memory | not run | ok | failed | out_of_memory | timeout
    reason: str = ""
    predicted_bytes: Optional[int] = None
    predicted_s: Optional[float] = None
    result: Optional[TrialResult] = None

    def as_dict(self) -> dict:
        r = self.result
        return {"configuration": self.candidate.label(), "status": self.status, "reason": self.reason,
                "predicted_peak_bytes": self.predicted_bytes, "predicted_step_s": self.predicted_s,
                "measured_peak_bytes": r.max_peak_bytes if r else None, "measured_step_s": r.step_s if r else None,
                "samples_per_s": r.samples_per_s if r else None, "tokens_per_s": r.tokens_per_s if r else None,
                "overrides": " ".join(self.candidate.to_overrides())}


@dataclass
class TuneReport:
    """Every candidate's row, the best measured one, and how many trials ran now (not resumed)."""

    rows: list[Row]
    best: Optional[Row]
    trials_run: int
    trials_resumed: int

    def table(self) -> str:
        lines = [f"{'configuration':<44} {'pred mem':>10} {'meas mem':>10} {'pred s':>8} {'meas s':>8} "
                 f"{'samples/s':>10} status"]
        order = sorted(self.rows, key=lambda r: (r.result is None or not r.result.ok,
                                                 r.result.step_s if r.result and r.result.ok else 0,
                                                 r.predicted_s if r.predicted_s is not None else float("inf")))
        for row in order:
            r = row.result
            mark = "  <- best" if row is self.best else ""
            lines.append(f"{row.candidate.label():<44} {_mem(row.predicted_bytes):>10} "
                         f"{_mem(r.max_peak_bytes if r else None):>10} {_sec(row.predicted_s):>8} "
                         f"{_sec(r.step_s if r else None):>8} "
                         f"{(f'{r.samples_per_s:,.1f}' if r and r.samples_per_s else '-'):>10} "
                         f"{row.status}{(': ' + row.reason) if row.reason else ''}{mark}")
        return "\n".join(lines)

    def write(self, directory: Path) -> dict[str, Path]:
        """results.csv and results.json (one row per candidate) in `directory`; their paths (the best
        layout's files: `outputs.write_best`)."""
        directory.mkdir(parents=True, exist_ok=True)
        rows = [row.as_dict() for row in self.rows]
        paths = {"csv": directory / "results.csv", "json": directory / "results.json"}
        with open(paths["csv"], "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["configuration"])
            writer.writeheader()
            writer.writerows(rows)
        paths["json"].write_text(json.dumps(rows, indent=1))
        return paths


def _mem(n: Optional[int]) -> str:
    return format_bytes(n) if n else "-"


def _sec(s: Optional[float]) -> str:
    return f"{s:.4f}" if s is not None else "-"


@dataclass
class Prepared:
    """What the search works from: every candidate's row (skipped, over memory, or not run yet with its
    predictions), the predicted bytes of the model's part per rank (`states`: without the process
    baseline), the baseline, the predicted seconds per step (`costs`) and the memory limit."""

    base_overrides: tuple[str, ...]
    states: dict[Candidate, int]
    costs: dict[Candidate, float]
    rows: dict[Candidate, Row] = field(default_factory=dict)
    memory_per_rank: int = 0
    baseline: int = 0
    on_cpu: bool = True  # the baseline: the process's host memory on a CPU, the allocator's slack on a GPU
    remat_baseline: int = 0  # what a remat layout's process holds more (`memory_model.process_baselines`)

    def peak(self, candidate: Candidate, baseline: Optional[int] = None) -> int:
        base = (self.baseline if baseline is None else baseline) + self.remat_extra(candidate)
        return self.states[candidate] + base

    def remat_extra(self, candidate: Candidate) -> int:
        return self.remat_baseline if candidate.remat != "none" else 0

    def to_json(self, fingerprint: str) -> str:
        rows = [{"candidate": dataclasses.asdict(c), "status": r.status, "reason": r.reason,
                 "states": self.states.get(c), "predicted_s": self.costs.get(c)} for c, r in self.rows.items()]
        return json.dumps({"fingerprint": fingerprint, "memory_per_rank": self.memory_per_rank,
                           "baseline": self.baseline, "on_cpu": self.on_cpu, "remat_baseline": self.remat_baseline,
                           "rows": rows})

    @classmethod
    def from_json(cls, text: str, fingerprint: str, base_overrides: tuple[str, ...]) -> Optional["Prepared"]:
        """The predictions saved by the same tuning (same base, world, protocol, space and limit), else None."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return None
        if data.get("fingerprint") != fingerprint:
            return None
        prepared = cls(base_overrides, {}, {}, {}, data["memory_per_rank"], data["baseline"], data["on_cpu"],
                       data.get("remat_baseline", 0))
        for item in data["rows"]:
            c = Candidate(**item["candidate"])
            if item["states"] is not None:
                prepared.states[c] = item["states"]
            if item["predicted_s"] is not None:
                prepared.costs[c] = item["predicted_s"]
            predicted = prepared.peak(c) if c in prepared.states else None
            prepared.rows[c] = Row(c, item["status"], item["reason"], predicted, item["predicted_s"])
        return prepared


def base_space(settings: TuneSettings) -> SearchSpace:
    """The search space with what the base fixes: its `train.micro_batch_size` fixes that axis (unless
    the space restricts it too: an error), and with a fixed global batch a `train.grad_accum` in the
    base is an error (the accumulation follows from the micro-batch)."""
    space, base = settings.space, settings.base_overrides
    micro, accum = override_value(base, "train.micro_batch_size"), override_value(base, "train.grad_accum")
    if accum not in (None, "null") and override_value(base, "train.train_batch_size") not in (None, "null"):
        raise ValueError(f"train.grad_accum={accum} in the base: with a fixed global batch the tuner derives the "
                         "accumulation from the micro-batch; drop it, or fix train.micro_batch_size")
    if micro in (None, "null"):
        return space
    if space.micro_batch is not None:
        raise ValueError(f"train.micro_batch_size={micro} in the base and autotune.space.micro_batch="
                         f"{list(space.micro_batch)} both fix the micro-batch; keep one")
    return dataclasses.replace(space, micro_batch=(int(micro),))


def base_config(settings: TuneSettings):
    """The base run composed for the search. With a fixed global batch (train.train_batch_size) its
    micro-batch and accumulation are left to the candidates, each of which sets all three."""
    return compose_run_config(overrides=_baseline_overrides(settings), dp_world_size=1)[0]


def prepare(settings: TuneSettings, links: Optional[CommCosts] = None, baseline: Optional[int] = None,
            progress: Callable[[str], None] = print) -> Prepared:
    """Enumerate, profile, predict memory and prune, measure the collectives and predict step times."""
    base = base_config(settings)
    device = run_device(base)
    on_cpu = device.type == "cpu"
    progress(f"autotune: building the model and data ({device.type})")
    job = build_job(base, None if on_cpu else device)
    found = enumerate_candidates(base_space(settings), base, settings.world, job.facts)
    rows = {s.candidate: Row(s.candidate, "skipped", s.reason) for s in found.skipped}
    limit = settings.memory_per_rank or default_memory_per_rank(settings.world, on_cpu)
    if not found.candidates:
        return Prepared(settings.base_overrides, {}, {}, rows, limit, on_cpu=on_cpu)
    profile = _profile(job, base, found.candidates, rank_threads(settings.world), progress)
    if not on_cpu:
        torch.cuda.empty_cache()  # the trials' ranks need the device this process profiled on
    remat_baseline = 0
    if baseline is None:  # on a GPU: the allocator's slack over what it hands out, calibrated by the first trial
        baseline, remat_baseline = process_baselines(_baseline_overrides(settings)) if on_cpu else (0, 0)
    memory = {c: predict_memory(c, profile, base, baseline + (remat_baseline if c.remat != "none" else 0), on_cpu)
              for c in found.candidates}
    fits, over = prune(list(memory.values()), limit)
    for s in over:
        rows[s.candidate] = Row(s.candidate, "over memory", s.reason, memory[s.candidate].peak_bytes)
    progress(f"autotune: {len(found.candidates)} candidates, {len(found.skipped)} skipped, {len(over)} predicted "
             f"over {format_bytes(limit)} per rank; measuring the collectives of {settings.world} ranks")
    links = links if links is not None else measure_collectives(settings.world, device_type=device.type)
    partition = base.pipeline.partition
    costs = {p.candidate: predict_step(p.candidate, profile, links, partition).seconds for p in fits}
    for p in fits:
        rows[p.candidate] = Row(p.candidate, "not run", "", p.peak_bytes, costs[p.candidate])
    states = {c: dataclasses.replace(m, baseline=0).peak_bytes for c, m in memory.items()}
    return Prepared(settings.base_overrides, states, costs, rows, limit, baseline, on_cpu, remat_baseline)


def _baseline_overrides(settings: TuneSettings) -> list[str]:
    overrides = list(settings.base_overrides)
    if any(o.startswith("train.train_batch_size=") for o in overrides):  # the candidates set the split
        overrides += ["train.micro_batch_size=null", "train.grad_accum=null"]
    return overrides


def _profile(job, base, candidates: Sequence[Candidate], threads: int, progress: Callable[[str], None]) -> Profile:
    micro = sorted({c.micro_batch for c in candidates})
    keys = {(c.remat, c.remat_every) for c in candidates if c.remat != "budget"} | {("none", 1)}
    if any(c.remat == "budget" for c in candidates):
        keys |= {(policy or "none", every) for policy, every in BUDGET_ORDER}
    progress(f"autotune: profiling {len(keys)} remat choice(s) at micro-batch {micro[0]} and {micro[-1]} on "
             f"{threads} thread(s), as a trial's rank")
    return profile_job(job, base, (micro[0], micro[-1]), sorted(keys),
                       with_layers=any(c.pipe > 1 or c.tensor > 1 for c in candidates), threads=threads)


def _order(settings: TuneSettings, prepared: Prepared) -> list[Candidate]:
    """The candidates in the order the strategy tries them."""
    fits = [c for c, row in prepared.rows.items() if row.status == "not run"]
    if settings.strategy == "model":
        return sorted(fits, key=lambda c: _score(settings, c, prepared.costs[c]))
    if settings.strategy == "grid":
        return fits
    if settings.strategy == "random":
        return random.Random(settings.seed).sample(fits, len(fits))
    space = base_space(settings)  # the fast mode keeps the other axes at their first value (offload: the base's)
    plain = [c for c in fits if c.remat == "none" and c.tensor == 1 and c.pipe == 1
             and (c.offload_optimizer, c.offload_param) == (space.offload_optimizer[0], space.offload_param[0])]
    ordered = []
    for stage in sorted({c.zero_stage for c in plain}):
        mine = sorted((c for c in plain if c.zero_stage == stage), key=lambda c: -c.micro_batch)
        ordered += mine[:settings.fast_micro_batches]
    return ordered


def _score(settings: TuneSettings, candidate: Candidate, step_s: float) -> float:
    """What the search minimises for `candidate` taking `step_s` per step: seconds per sample for
    throughput, seconds per step for latency."""
    return step_s / candidate.global_batch if settings.metric == "throughput" else step_s


def tune(settings: TuneSettings, links: Optional[CommCosts] = None, baseline: Optional[int] = None,
         progress: Callable[[str], None] = print) -> TuneReport:
    """Run the search (module docstring) and return its report. The predictions are saved in
    `workdir/predictions.json` before the first trial: a tuning started again with the same settings
    takes them (and the trials of results.jsonl) and goes on along the same path."""
    fingerprint = run_fingerprint(settings.base_overrides, settings.world, settings.trial)
    saved = settings.workdir / "predictions.json"
    if not settings.resume:  # a tuning from scratch; the earlier one's files are kept as *.previous
        for path in (saved, settings.workdir / "results.jsonl"):
            if path.exists():
                path.replace(path.with_name(path.name + ".previous"))
    prediction_key = f"{fingerprint} {base_space(settings)!r} {settings.memory_per_rank}"
    prepared = Prepared.from_json(saved.read_text(), prediction_key, settings.base_overrides) \
        if saved.exists() else None
    if prepared is None:
        prepared = prepare(settings, links, baseline, progress)
        settings.workdir.mkdir(parents=True, exist_ok=True)
        saved.write_text(prepared.to_json(prediction_key))
    else:
        progress(f"autotune: the predictions of {saved} (the same tuning, resumed)")
    results = ResultsFile(settings.workdir / "results.jsonl", fingerprint)
    done = results.load()
    ran = resumed = 0
    calibration: list[float] = []
    since_best = 0
    best: Optional[Row] = None
    patience = settings.patience or (5 if settings.strategy == "fast" else None)
    for candidate in _order(settings, prepared):
        row = prepared.rows[candidate]
        if row.status != "not run":  # re-pruned after the memory baseline was calibrated
            continue
        if ran + resumed >= settings.max_trials or _cannot_win(settings, prepared, candidate, calibration, best) \
                or (patience is not None and since_best >= patience):
            break
        key = candidate_key(candidate)
        if key in done:
            result, resumed = done[key], resumed + 1
        else:
            progress(f"autotune: trial {ran + resumed + 1}: {candidate.label()}")
            result = run_trial(candidate, settings.base_overrides, settings.workdir / key, settings.trial, key)
            results.append(result)
            ran += 1
        row.result, row.status, row.reason = result, result.status, result.reason
        if result.ok:
            calibration.append(result.step_s / prepared.costs[candidate])
            if len(calibration) == 1 and result.max_peak_bytes:
                _recalibrate_memory(prepared, candidate, result.max_peak_bytes)
            if best is None or _score(settings, candidate, result.step_s) < _score(settings, best.candidate,
                                                                                    best.result.step_s):
                best, since_best = row, 0
            else:
                since_best += 1
        progress(f"autotune:   {result.status}" + (f", {result.step_s:.4f} s per step" if result.ok else
                                                   f": {result.reason}"))
    return TuneReport(list(prepared.rows.values()), best, ran, resumed)


def _cannot_win(settings: TuneSettings, prepared: Prepared, candidate: Candidate, calibration: list[float],
                best: Optional[Row]) -> bool:
    """The model strategy's stop: the next candidate's calibrated prediction is no better than the best
    measured step by more than the noise."""
    if settings.strategy != "model" or best is None or len(calibration) < 2:
        return False
    expected = prepared.costs[candidate] * statistics.median(calibration)
    return _score(settings, candidate, expected) * (1 + settings.noise) >= _score(settings, best.candidate,
                                                                                   best.result.step_s)


def _recalibrate_memory(prepared: Prepared, measured: Candidate, peak: int) -> None:
    """Carry the baseline the first trial measured to every prediction, and prune again with it."""
    prepared.baseline = max(peak - prepared.states[measured] - prepared.remat_extra(measured), 0)
    for c in prepared.states:
        row = prepared.rows.get(c)
        if row is not None and row.status == "not run":
            row.predicted_bytes = prepared.peak(c)
            if row.predicted_bytes > prepared.memory_per_rank:
                row.status, row.reason = "over memory", (
                    f"predicted peak {format_bytes(row.predicted_bytes)} per rank (baseline measured by the first "
                    f"trial) is over autotune.memory_per_rank={format_bytes(prepared.memory_per_rank)}")


def _target_path(obj: object, what: str) -> str:
    """`obj`'s dotted path for a `_target_` (a trial is a new process: it imports what it builds)."""
    if isinstance(obj, str):
        return obj
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not callable(obj) or module in (None, "__main__") or name is None or "<" in name:
        raise ValueError(f"autotune({what}=...): give the function that builds it, importable by a dotted path "
                         f"(my_pkg.build_{what}) or that path as a string; each trial is a new fspeed-train process, "
                         f"which builds the {what} itself (got {type(obj).__name__})")
    return f"{module}.{name}"


def autotune(model: object = None, data: object = None, *, world: int, global_batch: Optional[int] = None,
             memory_per_rank: Optional[int] = None, overrides: Sequence[str] = (), strategy: str = "model",
             space: SearchSpace = SearchSpace(), workdir: Path = Path("autotune"), max_trials: int = 8,
             trial: TrialSettings = TrialSettings(), progress: Callable[[str], None] = print) -> TuneReport:
    """The fastest layout of fspeed-train's run for `world` ranks (module docstring), from Python.

    `model` and `data`: the functions that build them (fspeed-train's `model._target_` and
    `data._target_`; None: the built-in corpus GPT), `global_batch` the fixed train_batch_size,
    `overrides` any other fspeed-train keys. The best layout's files (`outputs.write_best`) and the
    table's rows (results.csv, results.json) are written to `workdir`."""
    from .outputs import write_best  # noqa: PLC0415

    base = list(overrides)
    if model is not None:
        base.append(f"model._target_={_target_path(model, 'model')}")
    if data is not None:
        base.append(f"data._target_={_target_path(data, 'data')}")
    if global_batch is not None:
        base.append(f"train.train_batch_size={global_batch}")
    settings = TuneSettings(world=world, base_overrides=tuple(base), workdir=Path(workdir), space=space,
                            strategy=strategy, memory_per_rank=memory_per_rank, max_trials=max_trials, trial=trial)
    report = tune(settings, progress=progress)
    report.write(settings.workdir)
    if report.best is not None:
        write_best(settings.workdir, settings.base_overrides, report.best.candidate)
    return report


__all__ = ["METRICS", "Prepared", "Row", "STRATEGIES", "TuneReport", "TuneSettings", "autotune", "base_config",
           "base_space", "prepare", "tune"]
