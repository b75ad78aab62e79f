"""What fspeed knows about DeepSpeed ``ds_config.json`` keys: defaults, aliases, and which are translated.

Defaults are DeepSpeed's *code* defaults (0.19.x, reference section 17), which the translator
must follow where they differ from the published docs. The tables here are data only; the
translation rules live in `fspeed.config.deepspeed`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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
#
# The rule for every key accepted without an effect: that must be what DeepSpeed itself does with
# the value in fspeed's setting (it ignores the key there), or the value is DeepSpeed's default and
# fspeed does what DeepSpeed does at it. The reason shown in the summary says which. Any other value
# is an error naming the key, the value and what is allowed.


class Fixed(NamedTuple):
    """A DeepSpeed key fspeed accepts at one value only: DeepSpeed's default."""

    default: Any
    why: str  # why the default changes nothing: what DeepSpeed and fspeed both do (summary line)
    refused: str = "not supported by fspeed"  # why any other value is an error


NO_EFFECT: dict[str, str] = {  # accepted whatever the value: DeepSpeed ignores it in fspeed's setting
    "zero_force_ds_cpu_optimizer": "DeepSpeed checks it only for a client optimizer object; fspeed builds the "
                                   "optimizer from the config",
    "vocabulary_size": "DeepSpeed only warns when it is not a multiple of 8; fspeed takes the vocabulary from the "
                       "tokenizer and pads it to a multiple of 8",
    "aio": "read only by NVMe offload and the fast checkpoint writer, neither of which fspeed accepts",
    "disable_allgather": "DeepSpeed 0.19 reads it but nothing uses it",
    "fp32_allreduce": "a removed key: DeepSpeed 0.19 does not read it",
    "seq_parallel_communication_data_type": "read only by sequence parallelism, which needs sequence_parallel_size > 1",
    "use_data_before_expert_parallelism": "orders the expert-parallel (MoE) groups; fspeed's models have no MoE layers",
}
UNTESTED_ZERO_OPTIMIZERS = ("lamb", "sgd")  # translated types outside DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS
"""With ZeRO (stage >= 1) DeepSpeed asserts for these unless ``zero_allow_untested_optimizer`` is true
(FusedLamb and torch.optim.SGD are not in its tested list; Adam/AdamW are)."""

SCALAR_DEFAULTS: dict[str, Fixed] = {  # top-level keys accepted only at DeepSpeed's default
    "managed_gradient_accumulation": Fixed(True, "the optimizer steps every gradient_accumulation_steps micro-steps, "
                                                 "as in fspeed", "fspeed always counts micro-steps itself"),
    "dump_state": Fixed(False, "no dump of the engine state at start-up", "not supported; fspeed-train --cfg job "
                                                                         "prints the resolved config"),
    "memory_breakdown": Fixed(False, "no allocator statistics around phases; fspeed prints none either",
                              "allocator statistics per phase are not implemented"),
    "prescale_gradients": Fixed(False, "gradients are averaged over data ranks, as in fspeed (it divides the loss "
                                       "by the data size before the reduction)",
                                "fspeed's gradient averaging is not configurable"),
    "gradient_predivide_factor": Fixed(1.0, "no extra scaling around the gradient reduction, as in fspeed",
                                       "a predivide factor is not implemented"),
    "gradient_allreduce_op": Fixed("mean", "gradients are averaged over data ranks, as in fspeed",
                                   "fspeed always averages gradients over data ranks"),
    "communication_data_type": Fixed(None, "reductions run in the gradients' dtype (in fspeed: "
                                           "data_types.grad_accum_dtype)",
                                     "a separate reduction dtype is not implemented; set data_types.grad_accum_dtype"),
    "sequence_parallel_size": Fixed(1, "no sequence parallelism, as in fspeed", "sequence parallelism is not "
                                                                                "implemented"),
    "sparse_gradients": Fixed(False, "embedding gradients are reduced dense, as in fspeed",
                              "sparse gradient reduction is not implemented"),
    "dataloader_drop_last": Fixed(False, "read only by DeepSpeed's own dataloader (deepspeed_io), which fspeed-train "
                                         "does not use", "fspeed-train does not use DeepSpeed's dataloader"),
    "graph_harvesting": Fixed(False, "no CUDA-graph capture of the optimizer's kernels; fspeed captures none",
                              "CUDA-graph capture is not implemented"),
    "compression_training": Fixed(None, "no compression training", "compression training is not implemented"),
    "weight_quantization": Fixed(None, "no weight quantization", "weight quantization is not implemented"),
    "log_level": Fixed(None, "DeepSpeed's logger keeps its level",
                       "fspeed logs through Hydra; use hydra.verbose=fspeed for debug output"),
}

ENABLED_BLOCKS = (  # accepted when absent, empty or {"enabled": false, ...}
    "amp", "torch_autocast", "comet", "eigenvalue",
    "quantize_training", "hybrid_engine", "compile", "nebula", "datastates", "expert_parallel",
)
ENABLED_BLOCK_REASON = "disabled: DeepSpeed does not use the feature either"

BLOCK_DEFAULTS: dict[str, tuple[dict[str, Any], str]] = {  # accepted when every key is at its default
    "checkpoint": ({
        "tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False,
        "parallel_write": {"pipeline_stage": False},
    }, "DeepSpeed's defaults: ordinary (not universal, not node-local) checkpoints, as fspeed writes"),
    "timers": ({"throughput": {"enabled": True, "synchronized": True}},
               "DeepSpeed's defaults: throughput reporting on; fspeed's log lines report tokens/s"),
}
PIPELINE_KEYS: dict[str, Any] = {  # DeepSpeed's defaults
    "stages": "auto", "partition": "best", "seed_layers": False, "activation_checkpoint_interval": 0,
    "pipe_partitioned": True, "grad_partitioned": True,
}
PIPELINE_PARTITIONED_REASON = ("DeepSpeed splits an activation sent between stages over the tensor-slicing ranks and "
                               "gathers it on the receiver; fspeed's tensor ranks each send their whole copy: the same "
                               "values, more bytes")
ACTIVATION_CHECKPOINTING_KEYS: dict[str, Any] = {  # DeepSpeed's defaults
    "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
    "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False,
}
ACTIVATION_CHECKPOINTING_DEFAULT_REASON = (
    "DeepSpeed's defaults: checkpointed activations stay whole on the device, no extra syncs or profiling; the block "
    "only configures the checkpointing a model turns on (fspeed: activation_checkpointing.policy)")
ACTIVATION_CHECKPOINTING_TRANSLATED = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                                      "profile", "synchronize_checkpoint_boundary")  # -> activation_checkpointing.<key>

CSV_MONITOR_KEYS = {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"}
TENSORBOARD_KEYS = {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"}
EVENT_DIRS = {  # monitor block -> (fspeed switch, fspeed directory key, where fspeed writes by default)
    "csv_monitor": ("monitor.csv", "monitor.csv_dir", "${hydra:runtime.output_dir}"),
    "tensorboard": ("monitor.tensorboard", "monitor.tensorboard_dir", "${hydra:runtime.output_dir}/tensorboard"),
}
WANDB_KEYS = {"enabled": False, "group": None, "team": None, "project": "deepspeed"}
WANDB_TRANSLATED = {"group": "monitor.wandb_group", "team": "monitor.wandb_team", "project": "monitor.wandb_project"}
FLOPS_PROFILER_KEYS = {"enabled": False, "recompute_fwd_factor": 0.0, "profile_step": 1, "module_depth": -1,
                       "top_modules": 1, "detailed": True, "output_file": None}  # -> flops_profiler.<key>

COMMS_LOGGER_KEYS: dict[str, Any] = {"enabled": False, "verbose": False, "prof_all": True, "debug": False,
                                     "prof_ops": []}
COMMS_LOGGER_TRANSLATED = ("enabled", "verbose")  # -> comms_logger.<key>
COMMS_LOGGER_FIXED: dict[str, Fixed] = {
    "prof_all": Fixed(True, "every collective is logged, as in fspeed", "fspeed logs every collective; choosing ops "
                                                                          "(prof_ops) is not implemented"),
    "debug": Fixed(False, "records are named by op, as in fspeed", "caller names in records are not implemented"),
}

# -------------------------------------------------------------------------- zero_optimization

ZERO_TRANSLATED = {  # zero_optimization key -> fspeed zero.<key>
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "model_persistence_threshold": "model_persistence_threshold",
    "overlap_comm": "overlap_comm",
}
PREFETCH_KEYS = ("stage3_prefetch_bucket_size", "prefetch_bucket_size")  # -> zero.prefetch (0 or the default)
PREFETCH_BUCKET_DEFAULT = 50_000_000
ZERO_ALIASES = (  # DeepSpeed reads one field from either spelling: a config sets at most one
    ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
    ("stage3_param_persistence_threshold", "param_persistence_threshold"),
    ("stage3_model_persistence_threshold", "model_persistence_threshold"),
    ("stage3_max_live_parameters", "max_live_parameters"),
    ("stage3_max_reuse_distance", "max_reuse_distance"),
    ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"),
    ("stage3_module_granularity_threshold", "module_granularity_threshold"),
    ("stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params"),
    ("stage3_allgather_sequential", "allgather_sequential"),
)

_LIVE = Fixed(1_000_000_000, "a cap on gathered elements; fspeed holds at most the gathered block in use and the "
                             "next one", "fspeed's limit is fixed: the gathered block in use and the next one")
_REUSE = Fixed(1_000_000_000, "a caching hint (numerics unchanged); fspeed gathers a block again at each use",
               "fspeed gathers a block again at each use (no reuse cache)")
_SAVE_16BIT = Fixed(False, "used only by save_16bit_model(), which fspeed does not have",
                    "fspeed has no save_16bit_model(); fspeed.gather_params returns the full weights")
_GRANULARITY = Fixed(0, "no coarsening of DeepSpeed's per-module gathers; fspeed gathers one block at a time",
                     "fspeed's gather unit is fixed (one block)")
_FETCH_ALL_REDUCE = Fixed(False, "parameters are gathered with all-gather, as in fspeed",
                          "fspeed gathers parameters with all-gather only")
_SEQUENTIAL = Fixed(False, "bucketed gathers, as in fspeed", "per-parameter sequential gathers are not implemented")

ZERO_FIXED: dict[str, Fixed] = {  # zero_optimization keys accepted only at DeepSpeed's default
    "contiguous_gradients": Fixed(True, "gradients are accumulated in one contiguous flat buffer, as in fspeed",
                                  "fspeed always accumulates gradients in one contiguous flat buffer"),
    "reduce_scatter": Fixed(True, "each rank receives the reduced gradient of its own partition, as in fspeed",
                            "fspeed always reduce-scatters gradients to their owners (all-reduce then slice is not "
                            "implemented)"),
    "use_multi_rank_bucket_allreduce": Fixed(True, "each rank gets its partition of the summed gradient bucket; fspeed "
                                                   "reduce-scatters the bucket",
                                             "fspeed always reduce-scatters gradient buckets (per-owner reduce is not "
                                             "implemented)"),
    "load_from_fp32_weights": Fixed(True, "fspeed checkpoints restore the fp32 master weights",
                                    "fspeed always restores the fp32 masters saved in its checkpoints"),
    "elastic_checkpoint": Fixed(False, "a ZeRO checkpoint loads only on the same data-parallel size, as in fspeed",
                                "fspeed loads a sharded checkpoint only with the same plan and mesh sizes"),
    "ignore_unused_parameters": Fixed(True, "unused parameters do not stop training; fspeed gives them zero gradients",
                                      "fspeed gives unused parameters zero gradients and does not raise"),
    "round_robin_gradients": Fixed(False, "parameters are partitioned in their order, as in fspeed",
                                   "round-robin gradient partitioning is not implemented"),
    "legacy_stage1": Fixed(False, "the current stage 1", "DeepSpeed >= 0.5.9 raises for it too"),
    "sub_group_size": Fixed(1_000_000_000, "tiles the stage-3 optimizer step (numerics unchanged); fspeed steps each "
                                           "rank's whole shard at once",
                            "fspeed steps each rank's whole shard at once (no sub-groups)"),
    "stage3_max_live_parameters": _LIVE,
    "max_live_parameters": _LIVE,
    "stage3_max_reuse_distance": _REUSE,
    "max_reuse_distance": _REUSE,
    "stage3_gather_16bit_weights_on_model_save": _SAVE_16BIT,
    "gather_16bit_weights_on_model_save": _SAVE_16BIT,
    "stage3_gather_fp16_weights_on_model_save": _SAVE_16BIT,
    "stage3_module_granularity_threshold": _GRANULARITY,
    "module_granularity_threshold": _GRANULARITY,
    "stage3_use_all_reduce_for_fetch_params": _FETCH_ALL_REDUCE,
    "use_all_reduce_for_fetch_params": _FETCH_ALL_REDUCE,
    "stage3_allgather_sequential": _SEQUENTIAL,
    "allgather_sequential": _SEQUENTIAL,
    "zero_hpz_partition_size": Fixed(1, "no secondary (hierarchical) partition, as in fspeed",
                                     "ZeRO++ hierarchical partitioning (hpZ) is not implemented"),
    "zero_quantized_weights": Fixed(False, "weights are gathered at full precision, as in fspeed",
                                    "ZeRO++ quantized weight gathers (qwZ) are not implemented"),
    "zero_quantized_gradients": Fixed(False, "gradients are reduced at full precision, as in fspeed",
                                      "ZeRO++ quantized gradient reduction (qgZ) is not implemented"),
    "zero_quantized_nontrainable_weights": Fixed(False, "frozen weights are stored at full precision, as in fspeed",
                                                 "quantized storage of frozen weights is not implemented"),
    "zeropp_loco_param": Fixed(None, "no LoCo error feedback", "LoCo-ZeRO++ is not implemented"),
    "mics_shard_size": Fixed(-1, "MiCS off: parameters are sharded over all data ranks, as in fspeed",
                             "MiCS (sharding within sub-groups) is not implemented"),
    "mics_hierarchical_params_gather": Fixed(False, "MiCS off", "MiCS is not implemented"),
    "memory_efficient_linear": Fixed(True, "linear layers keep no gathered weight for backward; fspeed gathers a "
                                           "block's weights again in backward too",
                                     "fspeed always gathers a block's weights again for backward"),
    "pipeline_loading_checkpoint": Fixed(False, "the ranks of a node load a checkpoint together, as in fspeed",
                                         "serial rank-by-rank checkpoint loading is not implemented"),
    "override_module_apply": Fixed(True, "Module.apply sees whole parameters; fspeed initialises whole parameters "
                                         "before sharding them", "fspeed has no zero.Init"),
    "log_trace_cache_warnings": Fixed(False, "no trace-cache warnings; fspeed prefetches in block order, no trace "
                                             "cache", "fspeed has no trace cache"),
    "enable_sanity_checks": Fixed(False, "no extra checks", "DeepSpeed's internal stage-3 sanity checks are not "
                                                            "implemented"),
    "leaf_module": Fixed({}, "DeepSpeed's built-in leaf modules; fspeed gathers whole blocks",
                         "fspeed gathers whole blocks; custom leaf modules do not apply"),
    "zenflow": Fixed(None, "ZenFlow off", "ZenFlow is not implemented"),
}
ZERO_NO_EFFECT: dict[str, str] = {  # zero_optimization keys accepted whatever the value: DeepSpeed ignores them
    "allgather_partitions": "DeepSpeed 0.19 reads it but nothing uses it; updated partitions are always "
                            "all-gathered, as in fspeed",
    "save_muon_momentum_buffer_in_memory": "used only by the Muon optimizer with NVMe offload, neither of which "
                                           "fspeed accepts",
}
_STAGE_1_2 = (1, 2)
_STAGE_3 = (3,)
ZERO_READ_AT: dict[str, tuple[int, ...]] = {  # the stages at which DeepSpeed reads a key (default: 1, 2, 3)
    **{key: _STAGE_1_2 for key in ("round_robin_gradients", "ignore_unused_parameters",
                                   "use_multi_rank_bucket_allreduce")},
    **{key: _STAGE_3 for key in (
        *PREFETCH_KEYS, "sub_group_size", "stage3_max_live_parameters", "max_live_parameters",
        "stage3_max_reuse_distance", "max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
        "stage3_module_granularity_threshold", "module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
        "use_all_reduce_for_fetch_params", "stage3_allgather_sequential", "allgather_sequential",
        "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
        "zero_quantized_nontrainable_weights", "zeropp_loco_param", "mics_shard_size",
        "mics_hierarchical_params_gather",
        "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
        "enable_sanity_checks", "leaf_module")},
}
FSPEED_ONLY_ZERO_KEYS = {  # fspeed's own zero.<key>s, not DeepSpeed keys: set on the command line
    "recompute_blocks": "fspeed's own key, not DeepSpeed's: set zero.recompute_blocks=true on the fspeed-train "
                        "command line",
    "prefetch": "fspeed's own key, not DeepSpeed's: use stage3_prefetch_bucket_size (0 turns prefetch off)",
}
OFFLOAD_TRANSLATED = {  # offload block -> its keys fspeed translates to zero.<block>.<key>
    "offload_optimizer": ("device", "pin_memory", "ratio"),
    "offload_param": ("device", "pin_memory"),
}
OFFLOAD_NO_EFFECT: dict[str, dict[str, str]] = {  # accepted at any value with device cpu: DeepSpeed ignores them
    "offload_optimizer": {
        "nvme_path": "NVMe only; with device cpu DeepSpeed ignores it",
        "buffer_count": "NVMe swap buffers; with device cpu DeepSpeed ignores it",
        "pipeline_read": "NVMe read overlap; with device cpu DeepSpeed ignores it",
        "pipeline_write": "NVMe write overlap; with device cpu DeepSpeed ignores it",
        "fast_init": "NVMe initialisation shortcut; with device cpu DeepSpeed ignores it",
        "cpuadam_cores_perc": "read only by SuperOffload (super_offload), which is off",
    },
    "offload_param": {
        "nvme_path": "NVMe only; with device cpu DeepSpeed ignores it",
        "buffer_count": "NVMe swap buffers; with device cpu DeepSpeed ignores it",
        "buffer_size": "NVMe swap buffer size; with device cpu DeepSpeed ignores it",
        "max_in_cpu": "NVMe only; with device cpu every parameter shard is in CPU memory",
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

ZERO_KEYS = (  # zero_optimization keys (reference 2.3, DeepSpeedZeroConfig 0.19)
    "stage", *ZERO_TRANSLATED, *PREFETCH_KEYS, *ZERO_FIXED, *ZERO_NO_EFFECT, "offload_param", "offload_optimizer",
    "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
)

TRANSLATED_TOP_LEVEL = (
    *TRIAD, "gradient_clipping", "steps_per_print", "fp16", "bf16", "bfloat16", "data_types", "optimizer",
    "scheduler", "zero_optimization", "csv_monitor", "comms_logger", "tensor_parallel", "sparse_attention",
    "activation_checkpointing",
    "tensorboard", "wandb", "flops_profiler", "wall_clock_breakdown",
    "curriculum_learning", "progressive_layer_drop", "data_efficiency", "pipeline", "elasticity",
)
ALL_TOP_LEVEL = tuple(sorted({*TRANSLATED_TOP_LEVEL, *NO_EFFECT, "zero_allow_untested_optimizer", *SCALAR_DEFAULTS,
                              *ENABLED_BLOCKS, *BLOCK_DEFAULTS, "autotuning"}))
