"""A DeepSpeed checkpoint (ZeRO 0-3, Adam/AdamW) into a TrainState of any layout, without DeepSpeed.

    state = fs.checkpoint.import_deepspeed("ds_ckpt/global_step1000", template)   # any plan and mesh
    fspeed-import-deepspeed ds_ckpt/global_step1000 ck                            # an fspeed checkpoint

What is read, per DeepSpeed's layout (`deepspeed/runtime/engine.py`, `zero/stage_1_and_2.py`,
`zero/stage3.py`, `utils/zero_to_fp32.py`):

    stage 0      mp_rank_00_model_states.pt: `module` (the weights), `optimizer` (torch's Adam
                 state_dict: per parameter index `step`, `exp_avg`, `exp_avg_sq`)
    stages 1-2   zero_pp_rank_<r>_mp_rank_00_optim_states.pt: per group rank r's slice of the group's
                 flat fp32 buffer (`single_partition_of_fp32_groups`) and of its moments
                 (`base_optimizer_state`); the parameters lie in `param_shapes` order, padding at the end
    stage 3      per rank the flat fp32 partitions (`fp32_flat_groups`) and moments: each parameter
                 split into world-size parts of ceil(numel / world) elements, padded at its end

plus the counters (`global_steps`, `global_samples`, `skipped_steps`, Adam's `step`, the lr).
A pipeline's checkpoint (`PipelineModule`: per-layer files, per-stage optimizer files) is read by
`deepspeed_pipeline`.
The files are pickles holding a few DeepSpeed objects (its loss scaler, `ZeroStageEnum`,
`fragment_address`): they are read with a restricted unpickler that admits torch's
weights-only globals and turns DeepSpeed's classes into inert records, and refuses anything else,
naming it. Not streamed: every rank reads all of DeepSpeed's files once and holds the whole
model's fp32 weights and both moments in host memory while it fills its own part (DeepSpeed's
per-rank flat buffers cut parameters anywhere); converting once with `fspeed-import-deepspeed`
and loading the result streams as any fspeed checkpoint does.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

import torch

from .. import optim
from ..train_init import init_train_state
from ..train_state import TrainState
from .deepspeed_files import (
    DeepSpeedRecord, DeepSpeedState, adam_hparams, adam_moments, adam_step, client_state_of, counters_of,
    read_deepspeed_file, zero12_tensors, zero_optimizer_states,
)
from .deepspeed_pipeline import is_pipeline_checkpoint, read_deepspeed_pipeline
from .errors import CheckpointError
from .meta import META_FILE
from .slices import Box
from .state_io import _replace_scalars, save_checkpoint, state_entries
from .universal import SHARED, ChunkReader, fill_slot, global_shape, state_slots

def resolve_deepspeed_dir(path: str | os.PathLike) -> Path:
    """The tag directory: `path` itself, or the one its `latest` file names."""
    path = Path(path)
    if (path / "latest").is_file() and not list(path.glob("*model_states.pt")):
        path = path / (path / "latest").read_text().strip()
    if not list(path.glob("*model_states.pt")):
        raise CheckpointError(f"{path} holds no DeepSpeed checkpoint (no *model_states.pt, no 'latest' file)")
    return path


def find_deepspeed_checkpoint(load_dir: str | os.PathLike, tag: Optional[str] = None) -> Optional[Path]:
    """The DeepSpeed checkpoint's tag directory that `load_dir` (and `tag`, else its `latest`) names,
    or None where it holds none (an fspeed checkpoint, say): what `Engine.load_checkpoint` asks."""
    path = Path(load_dir) / tag if tag else Path(load_dir)
    try:
        path = resolve_deepspeed_dir(path)
    except (CheckpointError, OSError):
        return None
    return None if (path / META_FILE).exists() else path


def _rank_of(name: str) -> int:
    match = re.search(r"zero_pp_rank_(\d+)_", name)
    return int(match.group(1)) if match else 0


def read_deepspeed(path: str | os.PathLike, model: Optional[Any] = None) -> DeepSpeedState:
    """Read a DeepSpeed checkpoint directory (module docstring) into full per-parameter tensors.
    A pipeline's (`PipelineModule`, per-layer files) is read by `deepspeed_pipeline`, in the names of
    `fs.models.sequential` over the same layers; `model` (that model) is needed at ZeRO 0."""
    path = resolve_deepspeed_dir(path)
    ds = read_deepspeed_pipeline(path, model) if is_pipeline_checkpoint(path) else _read_data_parallel(path)
    ds.where = path
    return ds


def _read_data_parallel(path: Path) -> DeepSpeedState:
    model_files = sorted(path.glob("*model_states.pt"), key=lambda p: _rank_of(p.name))
    if any("mp_rank_" in p.name and not p.name.endswith("mp_rank_00_model_states.pt") for p in model_files):
        raise CheckpointError(f"{path} was saved with tensor (model) parallelism (mp_rank > 0); importing it is not "
                              "supported: only data-parallel ZeRO 0-3 checkpoints")
    model = read_deepspeed_file(model_files[0])
    if not isinstance(model, dict) or "module" not in model:
        raise CheckpointError(f"{model_files[0]} is not a DeepSpeed model-states file (no 'module')")
    config = model.get("ds_config") or {}
    counters = counters_of(model)
    buffer_names = set(model.get("buffer_names") or [])
    module = model["module"]
    buffers = {n: t for n, t in module.items() if n in buffer_names and t.numel()}
    optim_files = sorted(path.glob("*optim_states.pt"), key=lambda p: _rank_of(p.name))
    if not optim_files:
        return _stage0(path, model, module, buffer_names, buffers, counters, config)
    states, stage = zero_optimizer_states(optim_files)
    shapes: dict[str, tuple] = {}
    for group in model.get("param_shapes") or []:
        shapes.update({n: tuple(s) for n, s in group.items()})
    if not shapes:
        raise CheckpointError(f"{model_files[0]} lacks 'param_shapes', which a ZeRO checkpoint records")
    if stage == 3:
        weights, avg, avg_sq, base = _stage3(states, shapes)
    elif stage in (1, 2):
        weights, avg, avg_sq, base = zero12_tensors(states, model.get("param_shapes"), optim_files[0])
    else:
        raise CheckpointError(f"{optim_files[0]}: unknown ZeRO stage {stage!r}")
    counters["adam_step"] = adam_step(base, optim_files[0])
    return DeepSpeedState(stage, weights, avg, avg_sq, buffers, counters, adam_hparams(base, optim_files[0]), config,
                          client_state_of(model))


def _stage0(path: Path, model: dict, module: dict, buffer_names: set, buffers: dict, counters: dict,
            config: dict) -> DeepSpeedState:
    optimizer = model.get("optimizer")
    names = [n for n in module if n not in buffer_names]
    if not isinstance(optimizer, dict) or "state" not in optimizer:
        raise CheckpointError(f"{path}: a stage-0 checkpoint without a torch optimizer state_dict (fp16/bf16 "
                              "stage-0 optimizers are not imported); allowed: fp32 Adam/AdamW or ZeRO 1-3")
    order = [i for group in optimizer["param_groups"] for i in group["params"]]
    if len(order) != len(names):
        raise CheckpointError(f"{path}: the optimizer has {len(order)} parameters, the module {len(names)}")
    weights, avg, avg_sq = {}, {}, {}
    for name, index in zip(names, order):
        weights[name] = module[name].float()
        avg[name], avg_sq[name] = adam_moments(optimizer, index, str(path))
    counters["adam_step"] = adam_step(optimizer, path)
    return DeepSpeedState(0, weights, avg, avg_sq, buffers, counters, adam_hparams(optimizer, path), config,
                          client_state_of(model))


def _stage3(states: list[dict], shapes: dict[str, tuple]):
    world = len(states)
    flats = [torch.cat([t.float() for t in s["fp32_flat_groups"]]) for s in states]
    inner = [s["optimizer_state_dict"] for s in states]
    avgs, sqs = [], []
    for s in inner:
        pairs = [adam_moments(s, i, "optimizer_state_dict") for i in sorted(s["state"])]
        avgs.append(torch.cat([p[0] for p in pairs]))
        sqs.append(torch.cat([p[1] for p in pairs]))
    weights, avg, avg_sq = {}, {}, {}
    offset = 0
    for name, shape in shapes.items():
        n = int(torch.Size(shape).numel())
        part = -(-n // world)
        for out, source in ((weights, flats), (avg, avgs), (avg_sq, sqs)):
            out[name] = torch.cat([r[offset:offset + part] for r in source])[:n].view(shape).clone()
        offset += part
    return weights, avg, avg_sq, inner[0]


class _MemoryChunks(ChunkReader):
    """Chunks served from in-memory full tensors (name -> tensor)."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: Path):
        super().__init__(where)
        self.tensors = tensors

    def read(self, chunk: list, box: Box) -> torch.Tensor:
        return self.tensors[chunk[1]][box.within(Box(tuple(chunk[2]), tuple(chunk[3])))]


def import_deepspeed(source: str | os.PathLike, template: TrainState, model: Optional[Any] = None) -> TrainState:
    """`template` (any layout; Adam/AdamW state) filled from the DeepSpeed checkpoint at `source`:
    weights (and fp32 masters), Adam moments, module buffers, counters and lr. Parameter names are
    DeepSpeed's module names: `functionalize` the same module; for a `PipelineModule`'s checkpoint,
    `fs.models.sequential` over the same layer list (`TiedLayer` for `TiedLayerSpec`), which `model`
    must be at ZeRO 0 (`deepspeed_pipeline`). Raises CheckpointError naming what does not fit."""
    return fill_from_deepspeed(read_deepspeed(source, model), template)


def fill_from_deepspeed(ds: DeepSpeedState, template: TrainState) -> TrainState:
    """`template` filled from the checkpoint `read_deepspeed` gave (`import_deepspeed` after its read)."""
    where = ds.where
    sources: dict[str, dict[str, torch.Tensor]] = {}
    slots, _ = state_slots(template)
    problems = []
    for slot in slots:
        head, _, name = slot.key.partition("/")
        table = (ds.weights if head in ("params", "master") else ds.exp_avg if head.endswith(".mu")
                 else ds.exp_avg_sq if head.endswith(".nu") else None)
        if slot.key.startswith("buffers."):
            name, table = slot.key[len("buffers."):], ds.buffers
        if table is None:
            problems.append(f"{slot.key} has no DeepSpeed counterpart (Adam/AdamW moments and weights are imported)")
        elif name not in table:
            problems.append(f"{name} is not in the DeepSpeed checkpoint")
        elif tuple(table[name].shape) != global_shape(slot, template):
            problems.append(f"{name} is {list(table[name].shape)} there, {list(global_shape(slot, template))} here")
        else:
            sources[slot.key] = table
    layout = template.layout  # by the layout: a rank may hold none; a pipeline stage names all
    model_paths = layout.pipeline.global_paths if layout.pipeline is not None else layout.info
    missing_here = sorted(set(ds.weights) - set(model_paths))
    if missing_here:
        problems.append(f"parameters the model lacks: {missing_here[:8]}")
    if problems:
        raise CheckpointError(f"{where} does not fit this state: " + "; ".join(sorted(set(problems))[:12]))
    for slot in slots:
        name = slot.key.partition("/")[2] if not slot.key.startswith("buffers.") else slot.key[len("buffers."):]
        table = sources[slot.key]
        chunk = [where.name, name, [0] * table[name].dim(), list(table[name].shape), SHARED]
        fill_slot(slot, name, [chunk], _MemoryChunks(table, where))
    _, scalars = state_entries(template)
    saved = dict(scalars)
    saved.update(step=ds.counters["step"], samples=ds.counters["samples"], skipped_steps=ds.counters["skipped_steps"])
    for key in scalars:
        if key.startswith("opt_state") and key.endswith(".count"):
            saved[key] = ds.counters["adam_step"]
        elif key.startswith("opt_state") and key.endswith(".lr") and isinstance(scalars[key], float):
            saved[key] = ds.hparams["lr"]
    state = _replace_scalars(template, saved)
    template.donate()
    return state


def template_optimizer(ds: DeepSpeedState) -> Any:
    """The fspeed optimizer a DeepSpeed run's Adam/AdamW is (behind clipping when its config clips),
    built as `fspeed-train` builds it, so that the imported checkpoint resumes there."""
    h = ds.hparams
    make = optim.adamw if h["decoupled"] else optim.adam
    opt = make(h["lr"], b1=h["betas"][0], b2=h["betas"][1], eps=h["eps"], weight_decay=h["weight_decay"])
    clip = float(ds.config.get("gradient_clipping", 0.0) or 0.0)
    return optim.chain(optim.clip_by_global_norm(clip), opt) if clip > 0 else opt


def convert_deepspeed(source: str | os.PathLike, out: str | os.PathLike, tag: Optional[str] = None) -> Path:
    """Write the DeepSpeed checkpoint at `source` as a one-process fspeed checkpoint under `out`
    (any layout loads it). Its parameter tree is flat by name; loading matches by path."""
    ds = read_deepspeed(source)
    params = {name: torch.zeros(t.shape) for name, t in ds.weights.items()}
    template = init_train_state(params, template_optimizer(ds), buffers=dict(ds.buffers))
    state = fill_from_deepspeed(ds, template)
    return save_checkpoint(out, state, tag=tag)


__all__ = ["DeepSpeedRecord", "DeepSpeedState", "client_state_of", "convert_deepspeed", "counters_of",
           "fill_from_deepspeed", "find_deepspeed_checkpoint", "import_deepspeed", "read_deepspeed",
           "read_deepspeed_file", "template_optimizer", "zero_optimizer_states"]
