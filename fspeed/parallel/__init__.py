"""The parallel wing: meshes, partition specs, plans (ZeRO, tensor slicing, pipeline) and their runtime.

    mesh = fs.Mesh(data=-1, model=2)
    plan = fs.zero(stage=3) | fs.tensor_slicing(fs.models.gpt_rules)     # transforms compose with |
    print(fs.explain(plan, params, mesh, model.logical_axes))

Modules, bottom up: `specs` (partition specs, logical-axis rules), `comm` (collectives, logged;
every private torch API fspeed uses is in `fspeed.torch_internals`), `mesh`, `plan` (placements, transforms and
their composition), `config` (ZeRO's keys), `zero` and `tensor_slicing` (the two transforms),
`layout` (a plan resolved for a tree), `memory` and `explain` (one accounting), `grads`
(gradient delivery and bucketed reduction during backward), `ops` (how units enter a model),
`offload` (host buffers and copies), `runtime` (storage and the boundary train_step calls),
`schedules` (pipeline schedules as per-stage action lists, checked and simulated; pure Python),
`pipeline` (the pipeline transform: layers to stages) and `pipeline_runtime` (a stage's step).
"""

from .comm import CommError, CommLog
from .config import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from .explain import explain
from .layout import Layout, resolve
from .memory import MemoryEstimate, estimate_memory
from .mesh import Mesh, init_distributed, shutdown_distributed
from .ops import UnitParams
from .plan import Placement, Plan, Transform
from .runtime import gather_params
from .schedules import SCHEDULES, Action, Schedule, build_schedule, zero_bubble_for_costs
from .specs import P, PartitionSpec
from .tensor_slicing_transform import tensor_slicing
from .layer_costs import balanced_partition, layer_costs, profiled_partition
from .pipeline_transform import StagePlan, pipeline, show_schedule
from .zero_transform import zero

__all__ = [
    "SCHEDULES", "Action", "CommError", "CommLog", "Layout", "MemoryEstimate", "Mesh", "OffloadOptimizerConfig",
    "OffloadParamConfig", "P", "PartitionSpec", "Placement", "Plan", "Schedule", "Transform", "UnitParams",
    "ZeroConfig", "build_schedule", "estimate_memory", "explain", "gather_params", "init_distributed", "resolve",
    "show_schedule", "shutdown_distributed", "tensor_slicing", "zero", "StagePlan", "pipeline",
    "balanced_partition", "layer_costs", "profiled_partition", "zero_bubble_for_costs",
]
