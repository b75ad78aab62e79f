"""Optax-style gradient transformations over parameter pytrees (flat buffers make them one pass)."""

from .adam import AdamState, adam, adamw
from .base import (
    ELEMENTWISE,
    Capabilities,
    EmptyState,
    GradientTransformation,
    Schedule,
    ScalarOrSchedule,
    TransformInfo,
    apply_updates,
    chain,
    global_norm,
    learning_rate,
    needs_full_allreduce,
    optimizer_step,
    per_tensor_norms,
)
from .clipping import clip_by_global_norm
from .groups import (
    PAD_SUFFIX,
    ParamGroupsState,
    check_param_groups,
    hyperparameter_names,
    is_padding,
    param_groups,
    with_hparams,
)
from .lamb import LambState, lamb
from .masks import DEFAULT_NO_DECAY, Mask, masked_weight_decay, no_decay
from .onebit import OneBitAdamState, ZeroOneAdamState, onebit_adam, zero_one_adam
from .onebit_lamb import OneBitLambState, onebit_lamb
from .schedules import (
    ONE_CYCLE_BETA2,
    as_schedule,
    constant,
    lr_range_test,
    one_cycle,
    one_cycle_momentum,
    warmup,
    warmup_cosine,
    warmup_decay,
)
from .sgd import SGDState, sgd
from .torch_adapter import ELEMENTWISE_OPTIMIZERS, REFUSED_OPTIMIZERS, TorchOptimizerState, from_torch
from .torch_scheduler import TorchSchedule, from_torch_scheduler

__all__ = [
    "AdamState", "Capabilities", "ELEMENTWISE", "EmptyState", "GradientTransformation", "LambState", "ONE_CYCLE_BETA2", "OneBitAdamState",
    "OneBitLambState", "SGDState", "ZeroOneAdamState", "needs_full_allreduce", "onebit_adam", "onebit_lamb",
    "zero_one_adam",
    "ScalarOrSchedule", "Schedule", "TransformInfo", "adam", "adamw", "apply_updates", "as_schedule",
    "chain", "clip_by_global_norm", "constant", "global_norm", "lamb", "learning_rate", "lr_range_test",
    "one_cycle", "one_cycle_momentum", "optimizer_step", "per_tensor_norms", "sgd", "warmup",
    "warmup_cosine", "warmup_decay",
    "DEFAULT_NO_DECAY", "Mask", "PAD_SUFFIX", "ParamGroupsState", "check_param_groups", "hyperparameter_names",
    "is_padding", "masked_weight_decay", "no_decay", "param_groups", "with_hparams",
    "ELEMENTWISE_OPTIMIZERS", "REFUSED_OPTIMIZERS", "TorchOptimizerState", "TorchSchedule", "from_torch",
    "from_torch_scheduler",
]
