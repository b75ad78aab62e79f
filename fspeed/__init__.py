"""fspeed: DeepSpeed's training features as a functional library on torch.func.

    import fspeed as fs
    model = fs.models.gpt(fs.models.GPTConfig(vocab_size=256))
    params = model.init(torch.Generator().manual_seed(0))
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0),
                         fs.optim.adamw(fs.optim.warmup_cosine(3e-4, total_num_steps=1000), weight_decay=0.1))
    state = fs.init_train_state(params, opt, precision=fs.precision.bf16())
    step = fs.make_train_step(model.loss, opt, grad_accum=4)
    state, metrics = step(state, batch)
"""

from . import checkpoint, data, models, optim, precision, sparse
from . import monitor, profile
from . import parallel
from . import autotune  # callable: fs.autotune(...) finds the fastest layout (fspeed.autotune.tuner.autotune)
from .flat import Flat, FlatLayout, LooseGrads
from .host_memory import retain_freed_host_memory
from .remat_budget import BudgetChoice, measure_activations, remat_within_budget
from .rematerialization import Remat, RematPolicy, RematProfile, remat_name, remat, remat_policies
from .parallel import pipeline
from .parallel import (
    CommError, CommLog, MemoryEstimate, Mesh, OffloadOptimizerConfig, OffloadParamConfig, P, PartitionSpec, Plan,
    UnitParams, ZeroConfig, estimate_memory, explain, gather_params, init_distributed, shutdown_distributed,
    tensor_slicing, zero,
)
from .loss_scale import LossScaleAtMinimumError, LossScaleState
from .models import Model, causal_lm_loss, functionalize, to_module, tp_plan_from
from .pytree import tree_flatten_with_paths, tree_map, tree_paths
from .engine import Engine, add_config_arguments, initialize
from .train_init import init_train_state
from .train_state import DonatedStateError, TrainState
from .eval_step import make_eval_step
from .train_step import NonFiniteError, TrainStep, make_train_step
from .timers import StepTimers

__version__ = "0.1.0"

__all__ = [
    "CommError", "CommLog", "Mesh", "P", "PartitionSpec", "Plan", "ZeroConfig", "explain", "gather_params",
    "init_distributed", "parallel", "pipeline", "shutdown_distributed", "tensor_slicing", "UnitParams", "zero",
    "MemoryEstimate", "OffloadOptimizerConfig", "OffloadParamConfig", "estimate_memory",
    "checkpoint", "data", "sparse", "NonFiniteError", "TrainStep",
    "DonatedStateError", "Flat", "FlatLayout", "LooseGrads", "LossScaleAtMinimumError", "LossScaleState", "Model",
    "Engine", "add_config_arguments", "TrainState", "causal_lm_loss", "functionalize", "initialize", "init_train_state", "make_eval_step", "make_train_step", "models",
    "monitor", "optim", "precision", "profile", "StepTimers",
    "to_module", "tp_plan_from", "tree_flatten_with_paths", "tree_map", "tree_paths",
    "BudgetChoice", "Remat", "RematPolicy", "RematProfile", "remat_name", "measure_activations", "remat",
    "remat_policies", "remat_within_budget", "retain_freed_host_memory",
]
