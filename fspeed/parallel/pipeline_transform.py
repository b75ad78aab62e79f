"""Pipeline parallelism over the `pipe` axis: the transform, and which layers each stage holds.

    plan = fs.zero(1) | fs.tensor_slicing(fs.models.gpt_rules) | fs.pipeline(micro_batches=8, schedule="1f1b")

A model's layer sequence (`Model.layers`, `fspeed.models.layers`) is cut into `stages x
virtual_stages` consecutive pieces by a partition method (DeepSpeed's `partition_method`):

    "uniform"        equal layer counts, the first pieces one more when it does not divide
    "parameters"     balanced by the parameters each layer uses (DeepSpeed's default)
    "type:<regex>"   balanced by the layers whose kind (class name) matches, case-insensitive
    "profile"        balanced by each layer's measured time on an example micro-batch (DeepSpeed
                     names this method and leaves it unimplemented; `fspeed.parallel.layer_costs`:
                     fspeed-train and `fs.initialize` measure on the first micro-batch)
    (4, 6, 6, 4)     explicit layer counts per piece

Piece k runs on stage `k % stages` as its chunk `k // stages` (Megatron's interleaving). A stage
holds the parameters its layers use, under their global paths; the layout (`fspeed.parallel.layout`)
keeps only those, so ZeRO and tensor slicing then partition the stage's parameters over its own
`data` and `model` ranks. A parameter used on several stages (a tied embedding and output head) is
held by each of them; their gradients are summed over those stages, so the copies stay equal.
The runtime (`fspeed.parallel.pipeline_runtime`) runs the schedule (`fspeed.parallel.schedules`).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from .plan import COMPUTE, ParamEntry, Placement, Plan

PARTITION_METHODS = ("uniform", "parameters", "type:<regex>", "profile", "explicit per-piece layer counts")
Partition = Union[str, tuple[int, ...]]


@dataclass(frozen=True)
class StagePlan:
    """The layers of every piece and the stages holding every parameter (identical on all ranks),
    and this rank's stage. `bounds[k]:bounds[k+1]` are the layer indices of piece k."""

    stages: int
    virtual_stages: int
    stage: int
    bounds: tuple[int, ...]
    layer_names: tuple[str, ...]
    holders: tuple[tuple[str, tuple[int, ...]], ...]  # parameter path -> the stages that hold it, in model order
    global_paths: tuple[str, ...]  # every parameter of the model, in its flat order
    global_shapes: tuple[tuple[int, ...], ...]
    global_treedef: Any

    def piece(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    def stage_of_layer(self, i: int) -> int:
        """The stage that runs layer i."""
        return (bisect.bisect_right(self.bounds, i) - 1) % self.stages

    def layers_of(self, stage: int, chunk: int) -> range:
        """The layer indices of `chunk` on `stage`."""
        k = self.piece(stage, chunk)
        return range(self.bounds[k], self.bounds[k + 1])

    def stages_holding(self, path: str) -> tuple[int, ...]:
        return dict(self.holders)[path]

    def holds(self, path: str, stage: Optional[int] = None) -> bool:
        return (self.stage if stage is None else stage) in dict(self.holders)[path]

    @property
    def tied(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The parameters held by more than one stage, with those stages."""
        return tuple((p, s) for p, s in self.holders if len(s) > 1)

    def describe(self) -> str:
        """One line per stage: its chunks' layer names."""
        lines = []
        for s in range(self.stages):
            chunks = []
            for c in range(self.virtual_stages):
                names = [self.layer_names[i] for i in self.layers_of(s, c)]
                chunks.append(f"{names[0]}..{names[-1]} ({len(names)})" if len(names) > 2 else
                              (", ".join(names) or "(no layers)"))
            lines.append(f"stage {s}: " + " | ".join(chunks))
        return "\n".join(lines)


@dataclass(frozen=True)
class Pipeline:
    """The pipeline transform (build it with `pipeline(...)`)."""

    micro_batches: int
    schedule: str = "1f1b"
    partition: Partition = "parameters"
    virtual_stages: int = 1
    activation_checkpoint_interval: int = 0
    remat: Any = None  # a `fspeed.Remat` for the checkpointed groups (None: full recompute)
    input_grad_first: bool = True  # the cooldown's B's send the input's gradient before the weights' (schedules)
    name: str = "pipeline"
    phase: int = COMPUTE

    def mesh_axes(self) -> tuple[str, ...]:
        return ("pipe",)

    def place(self, entries: Sequence[ParamEntry], placements: Sequence[Placement],
              mesh_sizes: Mapping[str, int]) -> tuple[Placement, ...]:
        return tuple(placements)  # which parameters a stage holds is `stage_plan`'s; their specs are unchanged

    def wrap_ops(self, ops: Any, mesh: Any, tensor_axes: Sequence[str]) -> Any:
        return ops

    def stage_plan(self, layers: Any, paths: Sequence[str], shapes: Sequence[tuple[int, ...]], treedef: Any,
                   mesh_sizes: Mapping[str, int], mesh_coords: Mapping[str, int]) -> StagePlan:
        """Cut `layers` (a `LayerSequence`) into this mesh's pieces and say who holds what."""
        from .schedules import build_schedule  # noqa: PLC0415

        stages = int(mesh_sizes.get("pipe", 1))
        pieces = stages * self.virtual_stages
        build_schedule(self.schedule, stages, self.micro_batches, self.virtual_stages,
                       self.input_grad_first)  # its errors, before training
        seq = layers.layers
        uses = [_params_used(layer, paths) for layer in seq]
        used = {p for u in uses for p in u}
        unused = [p for p in paths if p not in used]
        if unused:
            raise ValueError(f"parameters {unused[:5]} are used by no layer of the model's layer sequence; every "
                             "parameter must belong to a layer (Layer.uses) to be placed on a stage")
        if len(seq) < pieces:
            raise ValueError(f"the model has {len(seq)} layers, fewer than the {pieces} pipeline pieces ({stages} "
                             f"stages x {self.virtual_stages} virtual stages); use fewer stages")
        numel = dict(zip(paths, (_prod(s) for s in shapes)))
        bounds = partition_layers(self.partition, seq, [sum(numel[p] for p in u) for u in uses], pieces)
        holders: dict[str, list[int]] = {p: [] for p in paths}
        for k in range(pieces):
            for i in range(bounds[k], bounds[k + 1]):
                for p in uses[i]:
                    if k % stages not in holders[p]:
                        holders[p].append(k % stages)
        return StagePlan(stages, self.virtual_stages, int(mesh_coords.get("pipe", 0)), tuple(bounds),
                         tuple(layer.name for layer in seq), tuple((p, tuple(sorted(h))) for p, h in holders.items()),
                         tuple(paths), tuple(tuple(s) for s in shapes), treedef)

    def __repr__(self) -> str:
        extra = f", virtual_stages={self.virtual_stages}" if self.virtual_stages != 1 else ""
        if self.activation_checkpoint_interval:
            extra += f", activation_checkpoint_interval={self.activation_checkpoint_interval}"
        if not self.input_grad_first:
            extra += ", input_grad_first=False"
        return f"pipeline(micro_batches={self.micro_batches}, schedule={self.schedule!r}, " \
               f"partition={self.partition!r}{extra})"


def pipeline(micro_batches: int, schedule: str = "1f1b", partition: Partition = "parameters",
             virtual_stages: int = 1, activation_checkpoint_interval: int = 0, remat: Any = None,
             input_grad_first: bool = True) -> Plan:
    """Pipeline parallelism over `pipe` (module docstring): `micro_batches` per step (the gradient
    accumulation), a schedule of `fspeed.parallel.schedules.SCHEDULES`, a partition method, model
    chunks per stage (`virtual_stages`, interleaved_1f1b). `activation_checkpoint_interval=k`
    (DeepSpeed's) checkpoints each run of k consecutive layers of a stage that has parameters: only
    its input is kept and it is recomputed in backward, with `remat`'s policy (a `fspeed.Remat`;
    default full recompute; its `every` is not used here). `input_grad_first` (gpipe, 1f1b,
    interleaved_1f1b): the backwards of the cooldown, which the previous stage waits for, send
    the input's gradient before computing the weights' (`fspeed.parallel.schedules`); False runs
    each backward whole, as DeepSpeed and torch.distributed.pipelining do. The gradients are the
    same up to rounding (a deferred weight gradient is added into its sum by one GEMM)."""
    from .schedules import SCHEDULES  # noqa: PLC0415 (kept light: schedules are pure data)

    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"pipeline(micro_batches={micro_batches!r}) must be a positive integer")
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline(schedule={schedule!r}); allowed: {', '.join(SCHEDULES)}")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"pipeline(virtual_stages={virtual_stages!r}) must be a positive integer")
    if virtual_stages > 1 and schedule != "interleaved_1f1b":
        raise ValueError(f"pipeline(virtual_stages={virtual_stages}) needs schedule='interleaved_1f1b', "
                         f"got {schedule!r}")
    if schedule == "interleaved_1f1b" and virtual_stages < 2:
        raise ValueError("schedule='interleaved_1f1b' needs virtual_stages >= 2 (model chunks per stage)")
    if not isinstance(input_grad_first, bool):
        raise ValueError(f"pipeline(input_grad_first={input_grad_first!r}) must be True or False")
    if schedule == "zero_bubble" and not input_grad_first:
        raise ValueError("pipeline(schedule='zero_bubble', input_grad_first=False): zero bubble's B computes the "
                         "input's gradient alone and always sends it first; input_grad_first=False applies to "
                         "gpipe, 1f1b and interleaved_1f1b")
    if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
        raise ValueError(f"pipeline(activation_checkpoint_interval={activation_checkpoint_interval!r}) must be an "
                         "integer >= 0 (0: no checkpointing)")
    if remat is not None and not activation_checkpoint_interval:
        raise ValueError("pipeline(remat=...) sets how checkpointed layer groups run; give "
                         "activation_checkpoint_interval > 0 too")
    if not isinstance(partition, str):
        partition = tuple(partition)
        if not partition or not all(isinstance(c, int) and c >= 1 for c in partition):
            raise ValueError(f"pipeline(partition={partition!r}): explicit layer counts must be positive integers")
    else:
        _check_method(partition)
    return Plan((Pipeline(micro_batches, schedule, partition, virtual_stages, activation_checkpoint_interval, remat,
                          input_grad_first),))


def show_schedule(plan: Union[Plan, "Schedule"], mesh: Any = None) -> str:
    """The schedule a plan's pipeline runs on a mesh, per stage (`F0 F1 B0 F2 B1 ...`), and its
    bubble: `show_schedule(plan, mesh)`, where `mesh` is a `Mesh` or its sizes (`{"pipe": 4}`,
    no process group needed); or `show_schedule(schedule)` for a built `Schedule`. For zero_bubble
    it is the ZB-H1 of the first step; later steps run `zero_bubble_for_costs` of the measured times."""
    from .schedules import Schedule, build_schedule  # noqa: PLC0415
    from .schedules import show_schedule as show  # noqa: PLC0415

    if isinstance(plan, Schedule):
        return show(plan)
    pipe = plan.find("pipeline") if isinstance(plan, Plan) else None
    if pipe is None:
        raise ValueError(f"show_schedule: {plan!r} has no pipeline; add fs.pipeline(micro_batches=...) to the plan")
    sizes = getattr(mesh, "sizes", mesh)
    if not isinstance(sizes, Mapping) or "pipe" not in sizes:
        raise ValueError(f"show_schedule(plan, mesh): mesh must be a Mesh or sizes with a 'pipe' entry, got {mesh!r}")
    return show(build_schedule(pipe.schedule, int(sizes["pipe"]), pipe.micro_batches, pipe.virtual_stages,
                               pipe.input_grad_first))


def partition_layers(method: Partition, layers: Sequence[Any], param_counts: Sequence[int], pieces: int) -> list[int]:
    """The `pieces + 1` boundaries cutting `layers` into consecutive pieces by `method` (module docstring)."""
    n = len(layers)
    if not isinstance(method, str):
        if len(method) != pieces or sum(method) != n:
            raise ValueError(f"pipeline partition {list(method)}: needs {pieces} layer counts (one per stage and "
                             f"virtual stage) summing to the model's {n} layers, got {len(method)} summing to "
                             f"{sum(method)}")
        bounds = [0]
        for c in method:
            bounds.append(bounds[-1] + c)
        return bounds
    name = _check_method(method)
    if name == "uniform":
        return uniform_bounds(n, pieces)
    if name == "parameters":
        return balanced_bounds(list(param_counts), pieces)
    if name == "profile":
        raise ValueError("pipeline partition 'profile' times each layer on an example micro-batch before the stages "
                         "exist: resolve it with fs.parallel.profiled_partition(plan, model, example, stages) "
                         "(fspeed-train and fs.initialize do), or pass fs.parallel.balanced_partition(model, "
                         "example, pieces)'s layer counts")
    pattern = re.compile(method[len("type:"):], re.IGNORECASE)
    weights = [1 if pattern.search(layer.kind) else 0 for layer in layers]
    if not any(weights):
        kinds = sorted({layer.kind for layer in layers})
        raise ValueError(f"pipeline partition {method!r} matches no layer kind; the kinds are {kinds}")
    return balanced_bounds(weights, pieces)


def uniform_bounds(n: int, pieces: int) -> list[int]:
    """DeepSpeed's `partition_uniform`: n // pieces layers each, the first `n % pieces` one more."""
    chunk, extra = divmod(n, pieces)
    bounds = [0]
    for k in range(pieces):
        bounds.append(bounds[-1] + chunk + (1 if k < extra else 0))
    return bounds


def balanced_bounds(weights: Sequence[int], pieces: int) -> list[int]:
    """Consecutive pieces, each of at least one layer, minimising the heaviest piece's weight (ties: the
    lightest piece heaviest, then later cuts), by dynamic programming over prefix sums."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = (float("inf"), float("inf"))
    # best[k][i]: (max piece, -min piece) of cutting the first i layers into k pieces, and the last cut
    best = [[inf] * (n + 1) for _ in range(pieces + 1)]
    cut = [[0] * (n + 1) for _ in range(pieces + 1)]
    best[0][0] = (0, float("-inf"))
    for k in range(1, pieces + 1):
        for i in range(k, n - (pieces - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev == inf:
                    continue
                w = prefix[i] - prefix[j]
                cand = (max(prev[0], w), max(prev[1], -w) if k > 1 else -w)
                if cand <= best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    bounds = [n]
    for k in range(pieces, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def _check_method(method: str) -> str:
    name = method.lower()
    if name in ("uniform", "parameters", "profile"):
        return name
    if name.startswith("type:"):
        try:
            re.compile(method[len("type:"):])
        except re.error as err:
            raise ValueError(f"pipeline partition {method!r}: bad regex ({err})") from None
        return "type"
    raise ValueError(f"pipeline partition {method!r}; allowed: {', '.join(PARTITION_METHODS)}")


def _params_used(layer: Any, paths: Sequence[str]) -> list[str]:
    used = [p for p in paths if any(p == u or p.startswith(u + ".") for u in layer.uses)]
    missing = [u for u in layer.uses if not any(p == u or p.startswith(u + ".") for p in paths)]
    if missing:
        raise ValueError(f"layer {layer.name!r} uses {missing}, which name no parameter of the model")
    return used


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


__all__ = ["PARTITION_METHODS", "Pipeline", "StagePlan", "balanced_bounds", "partition_layers", "pipeline",
           "show_schedule",
           "uniform_bounds"]
