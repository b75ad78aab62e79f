"""A DeepSpeed pipeline checkpoint (`PipelineModule`, ZeRO 0-2, Adam/AdamW) read into full tensors by
name, for `import_deepspeed`; no DeepSpeed needed.

What DeepSpeed writes (`runtime/pipe/module.py` `save_state_dict`, `runtime/engine.py`):

    layer_<idx>-model_states.pt      each layer's module `state_dict`, idx over the whole layer list; a
                                     `TiedLayerSpec`'s module under each index that calls it without a
                                     `forward_fn`; nothing for callables or `forward_fn` places
    mp_rank_<stage>_model_states.pt  per stage: the counters and, at ZeRO 0, the stage's torch optimizer
                                     `state_dict`, its parameters by position: the stage's tied modules
                                     (in order of first use), then its layers' parameters in order
    zero_pp_rank_<d>_mp_rank_<stage>_optim_states.pt   ZeRO 1-2: data rank d's slice of the stage's
                                     flat fp32 buffer and moments, named by the stage's `param_shapes`

Names become those of `fs.models.sequential` over the same layer list (`TiedLayer` for each
`TiedLayerSpec`): `<idx>.` stays, `tied_modules.<key>.` becomes `tied.<key>.`. A ZeRO-0 checkpoint
names no parameter, so reading one needs that model: its layers say which stage entries are whose.
Tensor-sliced pipelines (several files per layer) are refused.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Optional

import torch

from ..pytree import tree_flatten_with_paths
from .deepspeed_files import (
    DeepSpeedState, adam_hparams, adam_moments, adam_step, client_state_of, counters_of, read_deepspeed_file,
    zero12_tensors, zero_optimizer_states,
)
from .errors import CheckpointError

_LAYER_FILE = re.compile(r"layer_(\d+)-(.*)model_states\.pt$")
_STAGE_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def is_pipeline_checkpoint(path: Path) -> bool:
    """Whether the tag directory `path` holds DeepSpeed's per-layer files (a `PipelineModule`'s)."""
    return any(_LAYER_FILE.match(p.name) for p in path.glob("layer_*model_states.pt"))


def fspeed_name(ds_name: str) -> str:
    """A `PipelineModule` parameter or buffer name as `fs.models.sequential` names it."""
    return "tied." + ds_name[len("tied_modules."):] if ds_name.startswith("tied_modules.") else ds_name


def read_deepspeed_pipeline(path: Path, model: Optional[Any] = None):
    """The checkpoint in the tag directory `path` (module docstring) as a `DeepSpeedState`, in
    fspeed's names. `model`: the `fs.models.sequential` model of the same layers (needed at ZeRO 0)."""
    numbered = [(int(m.group(1)), p) for p in path.iterdir() if (m := _STAGE_FILE.match(p.name))]
    stage_files = [p for _, p in sorted(numbered)]
    if not stage_files:
        raise CheckpointError(f"{path}: a pipeline checkpoint (layer_*-model_states.pt) without its per-stage "
                              "mp_rank_<stage>_model_states.pt files")
    stages = [read_deepspeed_file(p) for p in stage_files]
    dims = stages[0].get("checkpoint_parallel_dimensions") or {}
    if int(dims.get("tp_degree", 1)) > 1:
        raise CheckpointError(f"{path} was saved with tensor (model) parallelism inside the pipeline "
                              f"(tp_degree {dims['tp_degree']}); only data x pipeline checkpoints are imported")
    if [n for n, _ in sorted(numbered)] != list(range(int(dims.get("pp_degree", len(stages))))):
        raise CheckpointError(f"{path}: stage files {[p.name for p in stage_files]} do not cover its "
                              f"{dims.get('pp_degree')} pipeline stages")
    layers: dict[int, dict] = {}
    for p in sorted(path.glob("layer_*model_states.pt")):
        if (m := _LAYER_FILE.match(p.name)) is None:
            continue
        if int(m.group(1)) in layers:
            raise CheckpointError(f"{path}: several files for layer {int(m.group(1))} (a tensor-sliced pipeline); "
                                  "only data x pipeline checkpoints are imported")
        layers[int(m.group(1))] = read_deepspeed_file(p)
    optim = [(int(m.group(2)), int(m.group(1)), p) for p in path.iterdir() if (m := _OPTIM_FILE.match(p.name))]
    known = _buffer_names(model)  # (the model's buffers, built once)
    if optim:
        zero, weights, avg, avg_sq, base, where = _zero12(path, stages, sorted(optim))  # where: a file, for messages
    else:
        if model is None or getattr(model, "layers", None) is None:
            raise CheckpointError(
                f"{path} is a ZeRO-0 pipeline checkpoint, whose optimizer files name no parameter: pass "
                "model=fs.models.sequential(<the PipelineModule's layers>, ...) so each stage's entries can be "
                "matched to its layers (fspeed-import-deepspeed cannot; use fs.checkpoint.import_deepspeed)")
        zero, (weights, avg, avg_sq, base), where = 0, _zero0(path, stages, layers, model, known), stage_files[0]
    buffers = _buffers(layers, weights, known)
    first = stages[0]
    counters = {**counters_of(first), "adam_step": adam_step(base, where)}

    def named(table: dict) -> dict:
        return {fspeed_name(k): v for k, v in table.items()}
    return DeepSpeedState(zero, named(weights), named(avg), named(avg_sq), buffers, counters,
                          adam_hparams(base, where), first.get("ds_config") or {}, client_state_of(first))


def _zero12(path: Path, stages: list[dict], optim: list[tuple[int, int, Path]]):
    """Weights and moments from each stage's ZeRO-1/2 partitions (a tied parameter from its first stage)."""
    weights: dict = {}
    avg: dict = {}
    avg_sq: dict = {}
    base, zero = None, None
    for s, stage in enumerate(stages):
        files = [p for st, _, p in optim if st == s]
        if not files or not stage.get("param_shapes"):
            raise CheckpointError(f"{path}: pipeline stage {s} has no ZeRO optimizer files or no 'param_shapes'")
        states, zero = zero_optimizer_states(files)
        if zero not in (1, 2):
            raise CheckpointError(f"{files[0]}: ZeRO stage {zero} in a pipeline checkpoint; allowed: 0-2")
        w, a, q, stage_base = zero12_tensors(states, stage["param_shapes"], files[0])
        for name in w:
            if name not in weights:
                weights[name], avg[name], avg_sq[name] = w[name], a[name], q[name]
        base = base or stage_base
    return zero, weights, avg, avg_sq, base, optim[0][2]


def _zero0(path: Path, stages: list[dict], layers: dict[int, dict], model: Any, known: Optional[set[str]]):
    """Weights from the layer files; each stage's positional Adam state matched to its layers: the
    stage bounds are those under which the stage's parameter order (module docstring) has the shapes
    of its optimizer entries."""
    seq = model.layers.layers
    buffer_names = known or set()
    prefixes = []
    for i, layer in enumerate(seq):
        if len(layer.uses) > 1:
            raise CheckpointError(f"layer {layer.name!r} uses {list(layer.uses)}: a ZeRO-0 pipeline checkpoint maps onto "
                                  "a fs.models.sequential layer list (one module per layer)")
        prefixes.append(layer.uses[0] if layer.uses else None)
    if len(seq) < max(layers, default=-1) + 1:
        raise CheckpointError(f"{path} has files for {max(layers) + 1} layers, the model {len(seq)}")
    keys: dict[str, list[str]] = {}  # fspeed prefix -> its parameter names in the module's order
    weights: dict[str, torch.Tensor] = {}
    for i, prefix in enumerate(prefixes):
        if prefix is None or i not in layers or prefix in keys:
            continue
        ds_prefix = "tied_modules." + prefix[5:] if prefix.startswith("tied.") else prefix
        keys[prefix] = [k for k in layers[i] if f"{prefix}.{k}" not in buffer_names]
        weights.update({f"{ds_prefix}.{k}": layers[i][k].float() for k in keys[prefix]})
    unsaved = sorted({p for p in prefixes if p is not None and p not in keys})
    if any(p.startswith("tied.") for p in unsaved):
        raise CheckpointError(f"{path}: no layer file holds {[p for p in unsaved if p.startswith('tied.')]} (DeepSpeed "
                              "saves a tied module only where a layer calls it without forward_fn)")
    if unsaved:
        raise CheckpointError(f"{path} has no file for the model's layers {unsaved}, which have parameters; is the "
                              "model the PipelineModule's layer list?")

    def stage_names(a: int, b: int) -> list[str]:
        tied = list(dict.fromkeys(p for p in prefixes[a:b] if p is not None and p.startswith("tied.")))
        return ([f"tied_modules.{p[5:]}.{k}" for p in tied for k in keys[p]]
                + [f"{p}.{k}" for p in prefixes[a:b] if p is not None and not p.startswith("tied.") for k in keys[p]])

    optimizers = []
    for s, stage in enumerate(stages):
        opt = stage.get("optimizer")
        if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt:
            raise CheckpointError(f"{path}: stage {s}'s ZeRO-0 checkpoint holds no torch optimizer state_dict (fp16/bf16 "
                                  "stage-0 optimizers are not imported); allowed: fp32 Adam/AdamW or ZeRO 1-2")
        order = [i for group in opt["param_groups"] for i in group["params"]]
        optimizers.append((opt, order, [tuple(adam_moments(opt, i, str(path))[0].shape) for i in order]))

    @functools.lru_cache(maxsize=None)
    def bounds_from(s: int, a: int) -> Optional[tuple[int, ...]]:
        if s == len(stages):
            return () if a == len(seq) else None
        for b in range(a + 1, len(seq) + 1):
            if [tuple(weights[n].shape) for n in stage_names(a, b)] == optimizers[s][2]:
                rest = bounds_from(s + 1, b)
                if rest is not None:
                    return (b,) + rest
        return None

    ends = bounds_from(0, 0)
    if ends is None:
        raise CheckpointError(f"{path}: no split of the model's {len(seq)} layers into {len(stages)} stages gives each "
                              "stage's optimizer entries (their shapes, in order); is it the PipelineModule's layer list?")
    avg: dict = {}
    avg_sq: dict = {}
    for s, (a, b) in enumerate(zip((0,) + ends[:-1], ends)):
        opt, order, _ = optimizers[s]
        for name, index in zip(stage_names(a, b), order):
            if name not in avg:
                avg[name], avg_sq[name] = adam_moments(opt, index, str(path))
    return weights, avg, avg_sq, optimizers[0][0]


def _buffer_names(model: Optional[Any]) -> Optional[set[str]]:
    """The model's buffer names, or None where no model (or one without buffers) says."""
    if model is None or model.init_buffers is None:
        return None
    return set(tree_flatten_with_paths(model.init_buffers())[0])


def _buffers(layers: dict[int, dict], weights: dict, known: Optional[set[str]]) -> dict[str, torch.Tensor]:
    """The module state (BatchNorm statistics) in the layer files, by fspeed name: the model's buffers
    (`known`) where it names them, else each file's entries that are no parameter (a tied module's
    file: none)."""
    out = {}
    for i, state in sorted(layers.items()):
        regular = any(f"{i}.{k}" in weights for k in state)
        tied = not regular and state and all(any(w.startswith("tied_modules.") and w.endswith("." + k) for w in weights)
                                             for k in state)
        for k, t in state.items():
            name = f"{i}.{k}"
            if (name in known if known is not None else not tied and name not in weights) and t.numel():
                out[name] = t
    return out


__all__ = ["fspeed_name", "is_pipeline_checkpoint", "read_deepspeed_pipeline"]
