"""Parallel plans: ZeRO and tensor slicing as composable, printable data.

    plan = fs.zero(stage=3) | fs.tensor_slicing(fs.models.gpt_rules)
    print(fs.explain(plan, params, mesh))

A plan resolves, for given params and mesh, into a `Layout`: per parameter its compute spec (the
tensor-slicing spec over `model`) and its storage on this rank. ZeRO is the difference between
storage and compute, over `data`:

    stage 0   everything replicated over data; gradients all-reduced
    stage 1   fp32 masters and optimizer state: 1/N contiguous slice of the flat buffer per rank
    stage 2   + gradients reduce-scattered into that slice
    stage 3   + parameters: each unit (a layer: `blocks.3`, or a top-level entry) is flattened,
              padded to a multiple of N and split into N contiguous shards; a unit is gathered just
              in time for its use and freed after. Units of at most `param_persistence_threshold`
              elements stay resident (replicated), as DeepSpeed keeps small params whole.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from .comm import ceil_div
from .flat import FlatLayout
from .pytree import PyTree, register_node, tree_flatten_with_paths, tree_unflatten
from .sharding import AxisEntry, PartitionSpec, Rules, _rule_items, local_shape, logical_to_spec


OFFLOAD_DEVICES = ("none", "cpu")


def _check_offload_device(block: str, device: object, pin_memory: object) -> None:
    if device == "nvme":
        raise ValueError(f"zero.{block}.device='nvme' is not supported by fspeed (NVMe offload needs DeepSpeed's "
                         "async I/O swapper); allowed: 'none', 'cpu'")
    if device not in OFFLOAD_DEVICES:
        raise ValueError(f"zero.{block}.device={device!r} is not allowed; allowed: 'none', 'cpu'")
    if not isinstance(pin_memory, bool):
        raise ValueError(f"zero.{block}.pin_memory={pin_memory!r} must be true or false")


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """DeepSpeed's `offload_optimizer` block: with device "cpu", this rank's fp32 masters and
    optimizer state live in CPU memory and the optimizer runs there (ZeRO-Offload).
    `pin_memory`: page-locked buffers (only where CUDA exists). `ratio` < 1 (partial offload) is
    not supported."""

    device: str = "none"
    pin_memory: bool = True
    ratio: float = 1.0

    def __post_init__(self):
        _check_offload_device("offload_optimizer", self.device, self.pin_memory)
        if self.ratio != 1.0:
            raise ValueError(f"zero.offload_optimizer.ratio={self.ratio!r}: partial offload is not supported by "
                             "fspeed; allowed: 1.0 (the whole partition is updated on CPU)")

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True)
class OffloadParamConfig:
    """DeepSpeed's `offload_param` block (stage 3): with device "cpu", the parameter shards of
    sharded units live in CPU memory and go to the device just before each gather."""

    device: str = "none"
    pin_memory: bool = True

    def __post_init__(self):
        _check_offload_device("offload_param", self.device, self.pin_memory)

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"


def _offload_block(cls: type, block: str, value: Any):
    """An offload config from the forms users write: the class, None, a device name or a mapping."""
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if isinstance(value, str):
        return cls(device=value)
    if isinstance(value, Mapping):
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"zero.{block}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        return cls(**value)
    raise TypeError(f"zero.{block}={value!r} must be a {cls.__name__}, a mapping, a device name or None")


@dataclass(frozen=True)
class ZeroConfig:
    """DeepSpeed's `zero_optimization` keys that fspeed implements (same names, same meanings)."""

    stage: int = 0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    param_persistence_threshold: int = 100_000
    prefetch: bool = True  # stage 3: gather the next unit while the current one computes
    recompute_blocks: bool = False  # stage 3: keep only each block's input, recompute it in backward
    overlap_comm: Optional[bool] = None  # None: DeepSpeed's default, True for stage 3 and False otherwise
    model_persistence_threshold: int = sys.maxsize  # stage 3: cap on the total of persistent (unsharded) elements
    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()
    offload_param: OffloadParamConfig = OffloadParamConfig()

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero stage={self.stage!r} must be 0, 1, 2 or 3")
        object.__setattr__(self, "offload_optimizer",
                           _offload_block(OffloadOptimizerConfig, "offload_optimizer", self.offload_optimizer))
        object.__setattr__(self, "offload_param", _offload_block(OffloadParamConfig, "offload_param", self.offload_param))
        if self.offload_optimizer.enabled and self.stage == 0:
            raise ValueError("zero.offload_optimizer.device='cpu' needs zero stage 1, 2 or 3 (it offloads this "
                             "rank's ZeRO partition); got stage 0")
        if self.offload_param.enabled and self.stage != 3:
            raise ValueError(f"zero.offload_param.device='cpu' is only valid with zero stage 3 (as in DeepSpeed); "
                             f"got stage {self.stage}")
        if self.offload_param.enabled and not self.offload_optimizer.enabled:
            raise ValueError("zero.offload_param.device='cpu' needs zero.offload_optimizer.device='cpu' too in "
                             "fspeed (the optimizer updates the CPU parameter shards in place)")
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"zero.{key}={getattr(self, key)!r} must be a positive integer (elements)")
        if self.param_persistence_threshold < 0:
            raise ValueError(f"zero.param_persistence_threshold={self.param_persistence_threshold} must be >= 0")


@dataclass(frozen=True)
class Plan:
    """What to parallelize: ZeRO over `data` and/or tensor slicing over `model`. Compose with `|`."""

    zero: Optional[ZeroConfig] = None
    tensor_rules: Optional[tuple[tuple[str, AxisEntry], ...]] = None

    def __or__(self, other: "Plan") -> "Plan":
        if not isinstance(other, Plan):
            return NotImplemented
        if self.zero is not None and other.zero is not None:
            raise ValueError(f"a plan has at most one zero(...) transform; got {self.zero} and {other.zero}")
        if self.tensor_rules is not None and other.tensor_rules is not None:
            raise ValueError("a plan has at most one tensor_slicing(...) transform")
        return Plan(self.zero or other.zero, self.tensor_rules or other.tensor_rules)

    @property
    def stage(self) -> int:
        return self.zero.stage if self.zero else 0

    def __repr__(self) -> str:
        parts = []
        if self.zero:
            offload = "".join(f", {name}={getattr(self.zero, name).device!r}"
                              for name in ("offload_optimizer", "offload_param") if getattr(self.zero, name).enabled)
            parts.append(f"zero(stage={self.zero.stage}{offload})")
        if self.tensor_rules:
            parts.append("tensor_slicing({" + ", ".join(f"{k!r}: {v!r}" for k, v in self.tensor_rules) + "})")
        return " | ".join(parts) or "Plan()"


def zero(stage: int, **options: Any) -> Plan:
    """ZeRO stage 0-3 over the `data` axis; `options` are `ZeroConfig` fields (DeepSpeed's keys)."""
    return Plan(zero=ZeroConfig(stage=stage, **options))


def tensor_slicing(rules: Rules) -> Plan:
    """Megatron-style tensor slicing over `model`, by logical-axis rules (`{"mlp": "model", ...}`)."""
    items = tuple(_rule_items(rules))
    for name, target in items:
        if target not in (None, "model") and not (isinstance(target, tuple) and set(target) <= {"model"}):
            raise ValueError(f"tensor_slicing rule {name!r} -> {target!r}: tensor slicing shards over 'model' only")
    return Plan(tensor_rules=items)


# ------------------------------------------------------------------------------- the layout


@dataclass(frozen=True)
class ParamInfo:
    path: str
    shape: tuple[int, ...]
    axes: tuple[Optional[str], ...]
    spec: PartitionSpec  # compute spec (tensor slicing)
    local_shape: tuple[int, ...]
    unit: str

    @property
    def tp_sharded(self) -> bool:
        return "model" in self.spec.axes()


@dataclass(frozen=True)
class UnitInfo:
    """A group of parameters gathered together under ZeRO-3 (a layer, or a top-level entry)."""

    name: str
    layout: FlatLayout  # the unit's TP-local parameters (paths relative to the unit)
    sharded: bool  # False: resident (replicated over data)
    shard_numel: int  # ceil(numel / data size); numel when resident

    @property
    def numel(self) -> int:
        return self.layout.numel


@dataclass(frozen=True)
class Layout:
    """A plan resolved for given params and mesh sizes/coordinates (static, hashable metadata)."""

    stage: int
    zero: ZeroConfig
    mesh_sizes: tuple[tuple[str, int], ...]
    mesh_coords: tuple[tuple[str, int], ...]
    params: tuple[ParamInfo, ...]
    local: FlatLayout  # the TP-local parameter tree (what stages 0-2 keep whole)
    units: tuple[UnitInfo, ...]
    tensor_axes: tuple[str, ...] = ()  # logical axes sliced over `model`

    @property
    def data_size(self) -> int:
        return dict(self.mesh_sizes).get("data", 1)

    @property
    def model_size(self) -> int:
        return dict(self.mesh_sizes).get("model", 1)

    @property
    def partition_numel(self) -> int:
        """Stages 1-2: elements of this rank's slice of the (padded) flat buffer."""
        return ceil_div(self.local.numel, self.data_size)

    @property
    def info(self) -> dict[str, ParamInfo]:
        return {p.path: p for p in self.params}

    @property
    def sharded_units(self) -> tuple[UnitInfo, ...]:
        return tuple(u for u in self.units if u.sharded)


def default_unit(path: str) -> str:
    """The ZeRO-3 unit of a parameter: `blocks.3` for `blocks.3.attn.wqkv`, else the top-level entry."""
    parts = path.split(".")
    if len(parts) > 2 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0]


def resolve(plan: Plan, params: PyTree, mesh_sizes: Mapping[str, int], mesh_coords: Mapping[str, int],
            logical_axes: Optional[Mapping[str, Sequence[Optional[str]]]] = None) -> Layout:
    """Resolve `plan` for `params` (global shapes) on a mesh with the given sizes and coordinates."""
    zero_cfg = plan.zero or ZeroConfig()
    paths, leaves, _ = tree_flatten_with_paths(params)
    sizes = {a: int(s) for a, s in mesh_sizes.items()}
    if sizes.get("model", 1) > 1 and not plan.tensor_rules:
        raise ValueError(f"the mesh has model={sizes['model']} but the plan has no tensor_slicing(...) transform")
    if plan.tensor_rules and logical_axes is None:
        raise ValueError("tensor_slicing needs the model's logical axes (Model.logical_axes)")
    infos = []
    for path, leaf in zip(paths, leaves):
        shape = tuple(leaf.shape)
        axes = tuple(logical_axes.get(path, (None,) * len(shape))) if logical_axes else (None,) * len(shape)
        if len(axes) != len(shape):
            raise ValueError(f"logical axes of {path!r} {axes} do not match its shape {list(shape)}")
        spec = logical_to_spec(axes, plan.tensor_rules or (), sizes) if plan.tensor_rules else PartitionSpec(*([None] * len(shape)))
        infos.append(ParamInfo(path, shape, axes, spec, local_shape(shape, spec, sizes, path), default_unit(path)))
    local_tree = _local_tree(params, infos)
    local = FlatLayout.of_tree(local_tree)
    units = _units(infos, local_tree, zero_cfg, sizes.get("data", 1)) if zero_cfg.stage == 3 else ()
    tensor_axes = tuple(name for name, target in (plan.tensor_rules or ())
                        if sizes.get("model", 1) > 1 and target is not None
                        and "model" in ((target,) if isinstance(target, str) else target))
    return Layout(zero_cfg.stage, zero_cfg, tuple(sorted(sizes.items())), tuple(sorted(mesh_coords.items())),
                  tuple(infos), local, units, tensor_axes)


def _local_tree(params: PyTree, infos: Sequence[ParamInfo]) -> PyTree:
    """A tree shaped like params whose leaves are empty tensors of the TP-local shapes (for layouts)."""
    _, _, treedef = tree_flatten_with_paths(params)
    return tree_unflatten(treedef, [torch.empty(i.local_shape, device="meta") for i in infos])


def subtree(tree: PyTree, path: str) -> PyTree:
    """The subtree of nested dicts/lists at a dotted path (`blocks.3` -> tree["blocks"][3])."""
    for part in path.split(".") if path else ():
        tree = tree[int(part)] if isinstance(tree, (list, tuple)) else tree[part]
    return tree


def _units(infos: Sequence[ParamInfo], local_tree: PyTree, cfg: ZeroConfig, data_size: int) -> tuple[UnitInfo, ...]:
    names = list(dict.fromkeys(info.unit for info in infos))
    units = []
    for name in names:
        layout = FlatLayout.of_tree(subtree(local_tree, name))
        sharded = data_size > 1 and layout.numel > cfg.param_persistence_threshold
        units.append(UnitInfo(name, layout, sharded, ceil_div(layout.numel, data_size) if sharded else layout.numel))
    return tuple(units)


# ---------------------------------------------------------------------- explain and memory


def explain(plan: Plan, params: PyTree, mesh, logical_axes: Optional[Mapping] = None,
            dtype: torch.dtype = torch.float32) -> str:
    """Per parameter: global shape, compute spec, storage, local shape and bytes per rank; then
    model-state bytes per rank against the ZeRO paper's formula (mixed-precision Adam)."""
    if logical_axes is None and hasattr(params, "logical_axes"):
        raise TypeError("pass the params tree, and the model's logical axes as logical_axes=")
    layout = resolve(plan, params, mesh.sizes, mesh.coords, logical_axes)
    elem = torch.empty(0, dtype=dtype).element_size()
    units = {u.name: u for u in layout.units}
    n = layout.data_size
    rows = [("parameter", "global shape", "compute spec", "storage", "local shape", "bytes/rank")]
    for p in layout.params:
        local_numel = math.prod(p.local_shape)
        unit = units.get(p.unit)
        if unit is not None and unit.sharded:
            storage, numel = f"unit {unit.name}: 1/{n} flat shard", ceil_div(local_numel, n)
        else:
            storage, numel = ("replicated" if n > 1 else "whole"), local_numel
        rows.append((p.path, str(list(p.shape)), repr(p.spec), storage, str(list(p.local_shape)), f"{numel * elem:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    mem = model_state_bytes(layout)
    lines.append(f"\n{plan!r} on mesh {dict(layout.mesh_sizes)}: {sum(math.prod(p.shape) for p in layout.params):,} "
                 f"parameters, {layout.local.numel:,} per model-parallel rank")
    lines.append("model states per rank, mixed-precision Adam (bytes): " +
                 ", ".join(f"{k} {v:,}" for k, v in mem.items() if k != "paper formula") +
                 f"; ZeRO paper formula {mem['paper formula']:,}")
    return "\n".join(lines)


def model_state_bytes(layout: Layout, param_bytes: int = 2, grad_bytes: int = 2,
                      optimizer_bytes: int = 12) -> dict[str, int]:
    """Per-rank model-state bytes fspeed holds for a layout, and the ZeRO paper's formula (section 2.2).

    Defaults are the paper's mixed-precision Adam: 16-bit params and grads, K=12 bytes of
    optimizer state (fp32 master, momentum, variance) per parameter. Stage 3 adds the largest
    unit gathered in full (DeepSpeed's estimator counts it too).
    """
    psi, n = layout.local.numel, layout.data_size
    part = layout.partition_numel
    if layout.stage == 3:
        local = sum(u.shard_numel for u in layout.units)
        largest = max((u.numel for u in layout.units if u.sharded), default=0)
        params, grads, opt = local * param_bytes, local * grad_bytes, local * optimizer_bytes
        gathered = largest * param_bytes
    else:
        padded = n * part if layout.stage else psi  # slices are equal: the flat buffer is padded to N*P
        params = padded * param_bytes
        # stage 1 keeps the full accumulation buffer and the reduce-scattered slice; stage 2 only the slice
        grads = {0: psi, 1: padded + part, 2: part}[layout.stage] * grad_bytes
        opt = (part if layout.stage >= 1 else psi) * optimizer_bytes
        gathered = 0
    formula = {
        0: (param_bytes + grad_bytes + optimizer_bytes) * psi,
        1: (param_bytes + grad_bytes) * psi + optimizer_bytes * psi / n,
        2: param_bytes * psi + (grad_bytes + optimizer_bytes) * psi / n,
        3: (param_bytes + grad_bytes + optimizer_bytes) * psi / n,
    }[layout.stage]
    return {"params": params, "grads": grads, "optimizer": opt, "gathered": gathered,
            "total": params + grads + opt + gathered, "paper formula": int(formula)}


# -------------------------------------------------------------------- ZeRO-3 model view


class ShardedUnit:
    """What a model sees for a ZeRO-3 sharded unit: this rank's flat shard and the unit's layout.

    Models hand it to `ops.param(...)` / `ops.scan(...)`, which gather it just in time.
    """

    __slots__ = ("shard", "unit")

    def __init__(self, shard: torch.Tensor, unit: UnitInfo):
        self.shard = shard
        self.unit = unit

    def __repr__(self) -> str:
        return f"ShardedUnit({self.unit.name!r}, {self.shard.numel():,} of {self.unit.numel:,} elements)"


register_node(ShardedUnit, lambda s: ((s.shard,), s.unit), lambda unit, children: ShardedUnit(next(iter(children)), unit),
              child_names=lambda unit: ("shard",))


def replace_units(tree: PyTree, replacements: Mapping[str, Any], prefix: str = "") -> PyTree:
    """A copy of the nested dict/list `tree` with the subtrees at the given paths replaced."""
    if prefix in replacements:
        return replacements[prefix]
    if isinstance(tree, dict):
        return {k: replace_units(v, replacements, f"{prefix}.{k}" if prefix else str(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        items = [replace_units(v, replacements, f"{prefix}.{i}" if prefix else str(i)) for i, v in enumerate(tree)]
        return type(tree)(items)
    return tree


__all__ = [
    "Layout", "OffloadOptimizerConfig", "OffloadParamConfig", "ParamInfo", "Plan", "ShardedUnit", "UnitInfo", "ZeroConfig", "default_unit", "explain",
    "model_state_bytes", "replace_units", "resolve", "subtree", "tensor_slicing", "zero",
]
