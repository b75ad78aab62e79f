"""What fspeed knows about DeepSpeed ``ds_config.json`` keys: defaults, aliases, and which are translated.

Defaults are DeepSpeed's *code* defaults (0.19.x, reference section 17), which the translator
must follow where they differ from the published docs. The tables here are data only; the
translation rules live in `fspeed.config.deepspeed`.
"""

from __future__ import annotations

from typing import Any

REQUIRED = object()
"""Marks a DeepSpeed parameter without a default (DeepSpeed raises when it is absent)."""

# -------------------------------------------------------------------- translated top-level keys

TRIAD = {
    "train_batch_size": "train.train_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
}
GRADIENT_CLIPPING_DEFAULT = 1.0  # was 0.0 before DeepSpeed PR #8068

FP16_KEYS: dict[str, Any] = {  # DeepSpeed key -> default; all but enabled map to precision.<key>
    "enabled": False,
    "loss_scale": 0.0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}
FP16_UNSUPPORTED = {"auto_cast": False, "fp16_master_weights_and_grads": False}

BF16_KEYS: dict[str, Any] = {"enabled": False, "check_grad_overflow": True}
BF16_UNSUPPORTED = {"bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}
BF16_NO_EFFECT = {
    "immediate_grad_update": "when BF16_Optimizer folds gradients into fp32 buffers (hooks vs. after "
                             "backward); fspeed's functional step accumulates in grad_accum_dtype either way",
}
DATA_TYPES_KEYS = {"grad_accum_dtype": None, "param_dtype": None, "buffer_dtype": None}
DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}

# ---------------------------------------------------------------------------------- optimizers

_ADAM_PARAMS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True}
_ONEBIT_PARAMS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
OPTIMIZER_PARAMS: dict[str, dict[str, Any]] = {  # fspeed kind -> DeepSpeed params and defaults
    "adam": _ADAM_PARAMS,
    "adamw": _ADAM_PARAMS,  # FusedAdam with adam_w_mode; weight_decay default 0 (not 0.01)
    "lamb": {**_ADAM_PARAMS, "eps_inside_sqrt": False, "max_coeff": 10.0, "min_coeff": 0.01},
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},  # torch.optim.SGD
    "onebit_adam": {**_ONEBIT_PARAMS, "freeze_step": 100000},
    "zero_one_adam": {**_ONEBIT_PARAMS, "var_freeze_step": 100000, "var_update_scaler": 16,
                      "local_step_scaler": 32678, "local_step_clipper": 16},
    "onebit_lamb": {**_ONEBIT_PARAMS, "freeze_step": 100000, "max_coeff": 10.0, "min_coeff": 0.01, "coeff_beta": 0.9,
                    "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1},
}
ONEBIT_TYPES = {"onebitadam": "onebit_adam", "zerooneadam": "zero_one_adam", "onebitlamb": "onebit_lamb"}
TORCH_ADAM_PARAMS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}  # torch.optim.Adam / AdamW
TORCH_ADAM_WEIGHT_DECAY = {"adam": 0.0, "adamw": 0.01}  # torch's own defaults differ from FusedAdam's
OPTIMIZER_UNSUPPORTED_PARAMS: dict[str, dict[str, Any]] = {  # accepted only at these values
    "adam": {"amsgrad": False, "maximize": False},
    "lamb": {"amsgrad": False},
    "sgd": {"maximize": False},
    **{kind: {"amsgrad": False} for kind in ("onebit_adam", "zero_one_adam", "onebit_lamb")},
}
_ONEBIT_NO_EFFECT = {
    "bias_correction": "DeepSpeed's 1-bit optimizers ignore it too (they never bias-correct)",
    "eps_inside_sqrt": "DeepSpeed's 1-bit optimizers ignore it too (eps is added after the sqrt)",
    "cuda_aware": "not applicable: an MPI-backend flag; fspeed's compressed all-reduce runs on the mesh's "
                  "torch.distributed group",
    "comm_backend_name": "not applicable: fspeed's compressed all-reduce always uses the mesh's torch.distributed "
                         "group (nccl on GPUs, gloo on CPUs); nccl/mpi/hccl/compressed all map to it",
}
OPTIMIZER_NO_EFFECT_PARAMS: dict[str, dict[str, str]] = {
    "adam": {
        "set_grad_none": "fspeed has no .grad buffers to reset",
        "foreach": "implementation choice; fspeed picks its own kernels",
        "fused": "implementation choice; fspeed picks its own kernels",
        "capturable": "CUDA-graph capture flag of torch.optim",
        "differentiable": "autograd-through-the-step flag of torch.optim",
    },
    "lamb": {},
    "sgd": {
        "foreach": "implementation choice; fspeed picks its own kernels",
        "fused": "implementation choice; fspeed picks its own kernels",
        "differentiable": "autograd-through-the-step flag of torch.optim",
    },
    **{kind: _ONEBIT_NO_EFFECT for kind in ("onebit_adam", "zero_one_adam", "onebit_lamb")},
}
OPTIMIZER_BLOCK_KEYS = {"type", "params", "legacy_fusion"}
DEEPSPEED_ONLY_OPTIMIZERS = (  # DeepSpeed names fspeed does not translate yet
    "adagrad", "lion", "muon", "muadam", "muadamw", "musgd",
)

# ---------------------------------------------------------------------------------- schedulers

SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {  # DeepSpeed type -> (fspeed option, params)
    "LRRangeTest": ("lr_range_test", {
        "lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False,
    }),
    "OneCycle": ("one_cycle", {
        "cycle_min_lr": REQUIRED, "cycle_max_lr": REQUIRED, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
        "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
        "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
    }),
    "WarmupLR": ("warmup", {
        "warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
    }),
    "WarmupDecayLR": ("warmup_decay", {
        "total_num_steps": REQUIRED, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
        "warmup_type": "log",
    }),
    "WarmupCosineLR": ("warmup_cosine", {
        "total_num_steps": REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 1e-4,
        "warmup_type": "log",
    }),
}
SCHEDULER_PER_GROUP = {"warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "cycle_min_mom",
                       "cycle_max_mom", "lr_range_test_min_lr"}  # DeepSpeed accepts per-param-group lists
SCHEDULER_BLOCK_KEYS = {"type", "params"}
WARMUP_TYPES = ("log", "linear")

# ------------------------------------------------------------ known keys fspeed does not translate

NO_EFFECT: dict[str, str] = {  # accepted whatever the value, with the reason it has no effect
    "zero_allow_untested_optimizer": "fspeed does not restrict optimizers",
    "zero_force_ds_cpu_optimizer": "fspeed does not restrict optimizers",
    "vocabulary_size": "fspeed takes vocab_size from the tokenizer",
    "timers": "fspeed reports its own step timings",
    "aio": "async I/O tuning for NVMe offload, which fspeed does not have",
    "log_level": "fspeed logs through Hydra's logging configuration",
}

SCALAR_DEFAULTS: dict[str, Any] = {  # accepted only at DeepSpeed's default
    "managed_gradient_accumulation": True,
    "dump_state": False,
    "wall_clock_breakdown": False,
    "memory_breakdown": False,
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "gradient_allreduce_op": "mean",
    "communication_data_type": None,
    "seq_parallel_communication_data_type": "fp32",
    "sparse_gradients": False,
    "disable_allgather": False,
    "fp32_allreduce": False,
    "use_data_before_expert_parallelism": False,
    "dataloader_drop_last": False,
    "graph_harvesting": False,
    "compression_training": None,
    "weight_quantization": None,
}

ENABLED_BLOCKS = (  # accepted when absent, empty or {"enabled": false, ...}
    "amp", "torch_autocast", "curriculum_learning", "data_efficiency", "progressive_layer_drop",
    "flops_profiler", "tensorboard", "wandb", "comet", "autotuning", "eigenvalue",
    "elasticity", "quantize_training", "hybrid_engine", "compile", "nebula", "datastates", "expert_parallel",
)

BLOCK_DEFAULTS: dict[str, dict[str, Any]] = {  # accepted when every key is at its default
    "activation_checkpointing": {
        "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
        "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False,
    },
    "pipeline": {
        "stages": "auto", "partition": "best", "seed_layers": False, "activation_checkpoint_interval": 0,
        "pipe_partitioned": True, "grad_partitioned": True,
    },
    "checkpoint": {
        "tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False,
        "parallel_write": {"pipeline_stage": False},
    },
}
CSV_MONITOR_KEYS = {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"}

ZERO_TRANSLATED = {  # zero_optimization key -> fspeed zero.<key>
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "param_persistence_threshold": "param_persistence_threshold",
}
ZERO_NO_EFFECT = {  # keys whose DeepSpeed default is what fspeed does anyway (or a pure performance hint)
    "contiguous_gradients": (True, "gradients always live in one contiguous flat buffer"),
    "reduce_scatter": (True, "stages 1-2 always reduce-scatter"),
    "allgather_partitions": (True, "stages 1-2 always all-gather the updated slices"),
    "use_multi_rank_bucket_allreduce": (True, "DeepSpeed's default"),
    "load_from_fp32_weights": (True, "fspeed checkpoints restore the fp32 masters"),
    "elastic_checkpoint": (False, "DeepSpeed's default"),
    "ignore_unused_parameters": (True, "unused parameters get zero gradients"),
    "round_robin_gradients": (False, "DeepSpeed's default"),
    "memory_efficient_linear": (True, "DeepSpeed's default"),
    "overlap_comm": (None, "buckets are launched asynchronously; compute overlap is fspeed's own choice"),
    "sub_group_size": (1_000_000_000, "DeepSpeed's default"),
    "stage3_max_live_parameters": (1_000_000_000, "fspeed keeps at most the current and the next layer"),
    "max_live_parameters": (1_000_000_000, "fspeed keeps at most the current and the next layer"),
    "stage3_max_reuse_distance": (1_000_000_000, "DeepSpeed's default"),
    "max_reuse_distance": (1_000_000_000, "DeepSpeed's default"),
    "stage3_gather_16bit_weights_on_model_save": (False, "DeepSpeed's default"),
    "gather_16bit_weights_on_model_save": (False, "DeepSpeed's default"),
}
OFFLOAD_TRANSLATED = {  # offload block -> its keys fspeed translates to zero.<block>.<key>
    "offload_optimizer": ("device", "pin_memory", "ratio"),
    "offload_param": ("device", "pin_memory"),
}
OFFLOAD_NO_EFFECT: dict[str, dict[str, str]] = {  # accepted at any value, reported by name with the reason
    "offload_optimizer": {
        "nvme_path": "NVMe only; fspeed offloads to CPU memory",
        "buffer_count": "NVMe swap buffers; fspeed offloads to CPU memory",
        "pipeline_read": "NVMe read overlap; fspeed offloads to CPU memory",
        "pipeline_write": "NVMe write overlap; fspeed offloads to CPU memory",
        "fast_init": "NVMe initialisation shortcut; fspeed offloads to CPU memory",
        "cpuadam_cores_perc": "fspeed's CPU Adam uses torch's thread count (torch.set_num_threads / OMP_NUM_THREADS)",
    },
    "offload_param": {
        "nvme_path": "NVMe only; fspeed offloads to CPU memory",
        "buffer_count": "NVMe swap buffers; fspeed offloads to CPU memory",
        "buffer_size": "NVMe swap buffer size; fspeed offloads to CPU memory",
        "max_in_cpu": "NVMe only (parameters kept in CPU memory); with device cpu every shard is in CPU memory",
    },
}
OFFLOAD_UNSUPPORTED: dict[str, dict[str, Any]] = {  # accepted only at DeepSpeed's default
    "offload_optimizer": {"super_offload": False},
    "offload_param": {},
}
LEGACY_OFFLOAD = {  # deprecated zero_optimization booleans -> the block whose device they set to cpu
    "cpu_offload": "offload_optimizer",
    "cpu_offload_param": "offload_param",
}

ZERO_KEYS = (  # zero_optimization keys (reference 2.3)
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights",
    "elastic_checkpoint", "offload_param", "offload_optimizer", "sub_group_size", "stage3_prefetch_bucket_size",
    "prefetch_bucket_size", "stage3_param_persistence_threshold", "param_persistence_threshold",
    "stage3_model_persistence_threshold", "model_persistence_threshold", "stage3_max_live_parameters",
    "max_live_parameters", "stage3_max_reuse_distance", "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold", "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
    "ignore_unused_parameters", "round_robin_gradients", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_gradients", "zero_quantized_nontrainable_weights", "mics_shard_size",
    "mics_hierarchical_params_gather", "memory_efficient_linear", "pipeline_loading_checkpoint",
    "override_module_apply", "log_trace_cache_warnings", "cpu_offload", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "zenflow",
)

TRANSLATED_TOP_LEVEL = (
    *TRIAD, "gradient_clipping", "steps_per_print", "fp16", "bf16", "bfloat16", "data_types", "optimizer",
    "scheduler", "zero_optimization", "csv_monitor", "tensor_parallel", "sparse_attention",
)
ALL_TOP_LEVEL = tuple(sorted({*TRANSLATED_TOP_LEVEL, *NO_EFFECT, *SCALAR_DEFAULTS, *ENABLED_BLOCKS,
                              *BLOCK_DEFAULTS}))
