"""Per-rank model-state memory of a plan, before anything is built; one accounting for
`estimate_memory`, `explain` and the benchmarks.

    est = fs.estimate_memory(params, fs.zero(2, offload_optimizer="cpu"), {"data": 8}, "bf16")
    print(est)        # device and CPU bytes per rank, the peak within a step, the ZeRO paper's formula

Two accounts, side by side:

* fspeed's own buffers, exactly what `init_train_state` and `make_train_step` hold between steps
  (padding included): compute params (stage 3: the shards, the persistent parameters' partition
  and their whole copies), gradient buffers (stage 0-1: the full accumulation buffer; stage 2: the
  fp32 partition accumulator and its one or two reduce buckets; stage 3: the accumulator of the
  shards and the persistent partition, and the persistent parameters' reduce buckets), fp32
  masters, optimizer moments, and with ZeRO-Offload the host gradient
  copy and the 16-bit upload staging buffer. Within a step come transients (`peak`): the
  gradients of one unit as backward delivers them, stage 3's gathered units (the current one
  and the prefetched next) and the padded gradient it reduce-scatters.
* the ZeRO paper's formulas for mixed-precision Adam (reference 2.2): 2 bytes of params,
  2 of grads and K = 12 of optimizer state per parameter, with `N` data ranks. Offloading the
  optimizer moves the K bytes of the partition and its fp32 gradient copy (4 bytes) to CPU
  (16 Psi / N, reference 3.5); offloading parameters (stage 3) moves their 2 + 2 bytes too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Union

import torch

from ..precision import Precision
from ..pytree import PyTree, tensor_leaves
from .layout import Layout, resolve
from .plan import Plan

PAPER_PARAM_BYTES, PAPER_GRAD_BYTES, PAPER_K = 2, 2, 12
ADAM_STATE_BYTES = 8  # two fp32 moments


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by buffer, on the device and in CPU memory, the transients on the device
    within a step (`peak`), and the paper's totals."""

    plan: str
    precision: str
    parameters: int  # per model-parallel rank (Psi)
    data_size: int
    device: dict[str, int]
    cpu: dict[str, int]
    peak: dict[str, int]
    paper_device: int
    paper_cpu: int
    persistent: int = 0  # ZeRO-3: elements of the persistent parameters, whose compute copy each rank holds whole
    persistent_bytes: int = 0  # of `device` (or `cpu` with offload_param): those whole copies and their reduce buckets

    @property
    def device_total(self) -> int:
        """Held between steps."""
        return sum(self.device.values())

    @property
    def device_peak(self) -> int:
        """Held between steps plus the largest transients within a step."""
        return self.device_total + sum(self.peak.values())

    @property
    def cpu_total(self) -> int:
        return sum(self.cpu.values())

    @property
    def peak_grad_bytes(self) -> int:
        """Gradient bytes at the peak of a step: the held gradient buffers and the unit gradients
        in flight."""
        return self.device["grads"] + self.peak.get("unit grads", 0) + self.peak.get("reduce-scatter input", 0)

    def __str__(self) -> str:
        def line(where: str, parts: dict[str, int], total: int, paper: int) -> str:
            shown = ", ".join(f"{k} {_gib(v)}" for k, v in parts.items() if v) or "nothing"
            return f"  {where:<6} {_gib(total):>10} per rank ({shown}); ZeRO paper formula {_gib(paper)}"

        transient = ", ".join(f"{k} {_gib(v)}" for k, v in self.peak.items() if v) or "nothing"
        persistent = [f"  {'':<6} {_gib(self.persistent_bytes):>10} of it: the compute copy of {self.persistent:,} "
                      "persistent elements (zero.param_persistence_threshold), whole on every rank, and their reduce "
                      "buckets; their gradients, masters and optimizer state are partitioned"] if self.persistent else []
        return "\n".join([
            f"model-state memory, {self.plan}, {self.precision}, {self.parameters:,} parameters, "
            f"{self.data_size} data rank(s):",
            line("device", self.device, self.device_total, self.paper_device),
            *persistent,
            f"  {'peak':<6} {_gib(self.device_peak):>10} within a step (+ {transient})",
            line("CPU", self.cpu, self.cpu_total, self.paper_cpu),
        ])


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**26 else f"{n / 2**20:.2f} MiB"


def _precision(precision: Union[Precision, str]) -> Precision:
    if isinstance(precision, Precision):
        return precision
    from .. import precision as policies  # noqa: PLC0415 (the module shares the argument's name)

    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision={precision!r}: allowed: 'fp32', 'bf16', 'fp16' or a fspeed Precision")
    return getattr(policies, precision)()


def _layout(params_or_numel: Union[PyTree, int], plan: Plan, mesh_sizes: Mapping[str, int],
            logical_axes=None, layers=None) -> Layout:
    """The layout of rank 0's coordinates; under a pipeline, of the stage holding the most parameters."""
    if isinstance(params_or_numel, bool) or (isinstance(params_or_numel, int) and params_or_numel < 1):
        raise ValueError(f"params_or_numel={params_or_numel!r}: pass a parameter tree or a positive element count")
    params = {"params": torch.empty(params_or_numel, device="meta")} if isinstance(params_or_numel, int) \
        else params_or_numel
    sizes = {axis: int(size) for axis, size in mesh_sizes.items()}
    stages = [resolve(plan, params, sizes, {**{axis: 0 for axis in sizes}, "pipe": s}, logical_axes, layers=layers)
              for s in range(sizes.get("pipe", 1) if plan.find("pipeline") is not None else 1)]
    return max(stages, key=lambda layout: layout.local.numel)


def estimate_memory(params_or_numel: Union[PyTree, int], plan: Plan, mesh_sizes: Mapping[str, int],
                    precision: Union[Precision, str] = "bf16", *, optimizer_state_bytes: int = ADAM_STATE_BYTES,
                    logical_axes=None, activations: int = 0, layers=None) -> MemoryEstimate:
    """Per-rank device and CPU bytes of the model states `plan` gives (see the module docstring).

    `params_or_numel`: the parameter tree (global shapes; meta tensors are fine) or a parameter
    count (one flat tensor: stage 3 then has a single unit). `mesh_sizes`: {"data": N, "model": M}.
    `optimizer_state_bytes`: per parameter, 8 for Adam's two fp32 moments, 4 for SGD momentum.
    `activations`: bytes a micro-batch's forward keeps for backward (`fs.measure_activations`, under
    the run's activation checkpointing), counted among the transients of a step. `layers` (the
    model's `LayerSequence`): what a pipeline plan cuts into stages; the estimate is then the
    heaviest stage's.
    """
    estimate = layout_memory(_layout(params_or_numel, plan, mesh_sizes, logical_axes, layers), _precision(precision),
                             optimizer_state_bytes)
    if activations:
        estimate = dataclasses.replace(estimate, peak={**estimate.peak, "activations": activations})
    return estimate


def layout_memory(layout: Layout, policy: Precision, optimizer_state_bytes: int = ADAM_STATE_BYTES) -> MemoryEstimate:
    """`estimate_memory` of a resolved layout."""
    pb = torch.empty(0, dtype=policy.param_dtype).element_size()
    gb = torch.empty(0, dtype=policy.grad_accum_dtype).element_size()
    cfg = layout.zero
    offload, offload_params = cfg.offload_optimizer.enabled, cfg.offload_param.enabled
    psi, n, stage = layout.local.numel, layout.data_size, layout.stage

    def buckets(total: int) -> int:
        """Elements of the packed reduce buckets for `total` elements of gradient (grads.py)."""
        size = min(cfg.reduce_bucket_size, total)
        return size * (2 if cfg.overlaps and size < total else 1)

    device = {"params": 0, "grads": 0, "master": 0, "optimizer": 0}
    cpu = {"params": 0, "grads": 0, "master": 0, "optimizer": 0, "staging": 0}
    largest_unit = max((sum(layout.params[i].local_numel for i in u.params) for u in layout.units), default=0)
    peak = {"unit grads": largest_unit * pb}
    if stage == 3:
        # masters, optimizer state and gradients: the units' shards and the persistent partition;
        # the compute params: those and every persistent parameter whole (layout.py)
        local = layout.storage.numel
        gathered = sorted((u.numel for u in layout.sharded_units), reverse=True)
        peak["gathered"] = sum(gathered[:2 if cfg.prefetch else 1]) * pb  # the current unit and the prefetched one
        peak["reduce-scatter input"] = (gathered[0] if gathered else 0) * pb * (3 if cfg.overlaps else 1)
        updated = local
        params_at, grads_at = (cpu, cpu) if offload_params else (device, device)
        params_at["params"] = layout.param_storage.numel * pb
        grads_at["grads"] = local * gb
        persistent_buckets = buckets(layout.persistent_numel) * gb if layout.persistent else 0
        device["grads"] += persistent_buckets
        persistent = (layout.persistent_numel, layout.data_size * layout.persistent_part * pb + persistent_buckets)
        # in fp32 the masters are the compute buffer's leading part, unless the optimizer is offloaded
        separate_master = policy.has_master or (offload and not offload_params)
    else:
        part = layout.partition_numel
        padded = n * part if stage else psi
        updated = part if stage else psi
        device["params"] = padded * pb
        grads = {0: psi, 1: padded, 2: part + buckets(psi)}[stage]
        device["grads"] = grads * gb
        separate_master = policy.has_master or (stage in (1, 2) and offload)
        persistent = (0, 0)
    state_at = cpu if offload else device
    state_at["master"] = updated * 4 if separate_master else 0
    state_at["optimizer"] = updated * optimizer_state_bytes
    if offload and not offload_params:
        cpu["grads"] = updated * gb  # the reduced gradient, downloaded in the accumulation dtype
        cpu["staging"] = updated * pb if policy.has_master else 0  # the 16-bit cast, uploaded
    paper_device, paper_cpu = _paper_formula(stage, psi, n, offload, offload_params)
    return MemoryEstimate(repr(layout.plan), policy.name, psi, n, device, cpu, peak, paper_device, paper_cpu,
                          *persistent)


def state_bytes_per_parameter(optimizer, path: str = "probe") -> int:
    """Bytes of optimizer state per parameter `optimizer` keeps (8 for Adam, 4 for SGD with
    momentum, 0 without), measured on a probe tensor named `path` by the optimizer's own `init`
    (pass a real parameter path for parameter groups that must cover every parameter)."""
    probe = 64
    state = optimizer.init({path: torch.zeros(probe)})
    leaves = [t for t in tensor_leaves(state) if isinstance(t, torch.Tensor) and t.numel() == probe]
    return sum(t.element_size() for t in leaves)


def _paper_formula(stage: int, psi: int, n: int, offload: bool, offload_params: bool) -> tuple[int, int]:
    """(device, CPU) bytes per rank from the ZeRO paper's model (2 + 2 + K bytes per parameter)."""
    p, g, k = PAPER_PARAM_BYTES, PAPER_GRAD_BYTES, PAPER_K
    device = {
        0: (p + g + k) * psi,
        1: (p + g) * psi + k * psi / n,
        2: p * psi + (g + k) * psi / n,
        3: (p + g + k) * psi / n,
    }[stage]
    cpu = 0.0
    if offload:  # the K bytes of the partition move to CPU, with an fp32 copy of its gradient
        device -= k * psi / n
        cpu += (k + 4) * psi / n
    if offload_params:  # stage 3: the 16-bit parameter and gradient shards move too
        device -= (p + g) * psi / n
        cpu += (p + g) * psi / n
    return int(math.ceil(device)), int(math.ceil(cpu))


__all__ = ["MemoryEstimate", "estimate_memory", "layout_memory", "state_bytes_per_parameter"]
