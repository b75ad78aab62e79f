"""The run configuration as frozen dataclasses: what keys exist, their types, defaults and ranges.

This is the single source of truth for validation; the Hydra tree in ``conf/`` supplies the
values of the default job (its option files must match these classes, a test checks it). Key
names follow DeepSpeed wherever DeepSpeed has the concept (``bias_correction``, ``warmup_num_steps``,
``loss_scale_window``, ...). Defaults of the optimizer, scheduler and precision classes are
DeepSpeed's code defaults; the YAML options tune a few of them for the small default job.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional, Union

from ..batch_triad import BatchTriad, BatchTriadError, resolve_batch_triad
from ..sparse.config import SparseAttentionConfig
from .efficiency import CurriculumSection, ProgressiveLayerDropSection
from .elastic_section import ElasticitySection, elastic_triad
from .errors import ConfigError, Problem
from .targets import TargetConfig
from .fields import (
    Check,
    NON_EMPTY,
    NON_NEGATIVE,
    OPEN_UNIT_INTERVAL,
    POSITIVE,
    UNIT_INTERVAL,
    ValidatedConfig,
    at_most,
    each,
    required,
    setting,
)

if TYPE_CHECKING:
    from fspeed.parallel.config import ZeroConfig

Betas = tuple[float, float]
WarmupType = Literal["log", "linear"]

# ----------------------------------------------------------------------------------- model


@dataclass(frozen=True, kw_only=True)
class ModelConfig(ValidatedConfig):
    """A decoder-only GPT. vocab_size is not configured: it comes from the tokenizer."""

    name: str = "char_gpt"
    n_layer: int = setting(4, POSITIVE)  # transformer blocks
    n_head: int = setting(4, POSITIVE)  # attention heads per block
    d_model: int = setting(128, POSITIVE)  # width of the residual stream
    d_ff: Optional[int] = setting(None, POSITIVE)  # None = 4 * d_model
    seq_len: int = setting(128, POSITIVE)  # context length in tokens
    dropout: float = setting(0.0, UNIT_INTERVAL)  # dropout probability (embeddings and residual branches)
    tie_embeddings: bool = True  # the output head reuses the token embedding
    init_std: float = setting(0.02, POSITIVE)  # standard deviation of the weights' normal initialisation
    attention: Literal["dense", "sparse"] = "dense"  # "sparse": block-sparse with the sparse_attention section

    def relation_problems(self) -> list[Problem]:
        if self.d_model % self.n_head:
            return [Problem("d_model", f"must be divisible by n_head={self.n_head}", self.d_model)]
        return []


# ------------------------------------------------------------------------------- optimizers


@dataclass(frozen=True, kw_only=True)
class AdamFamilyConfig(ValidatedConfig):
    """The FusedAdam/FusedLamb parameters Adam, AdamW and LAMB share."""

    lr: float = setting(1e-3, POSITIVE)
    betas: Betas = setting((0.9, 0.999), each(UNIT_INTERVAL))
    eps: float = setting(1e-8, POSITIVE)
    weight_decay: float = setting(0.0, NON_NEGATIVE)
    bias_correction: bool = True


@dataclass(frozen=True, kw_only=True)
class AdamConfig(AdamFamilyConfig):
    """Adam (FusedAdam params). Classic L2 decay unless adam_w_mode; DeepSpeed's own "Adam" type
    defaults to adam_w_mode=True, which the ds_config translator maps to `adamw`."""

    name: Literal["adam"] = "adam"
    adam_w_mode: bool = False


@dataclass(frozen=True, kw_only=True)
class AdamWConfig(AdamFamilyConfig):
    """AdamW: Adam with decoupled weight decay (FusedAdam with adam_w_mode=True)."""

    name: Literal["adamw"] = "adamw"
    weight_decay: float = setting(0.01, NON_NEGATIVE)


@dataclass(frozen=True, kw_only=True)
class LambConfig(AdamFamilyConfig):
    """LAMB with FusedLamb's parameters (trust ratio clamped to [min_coeff, max_coeff])."""

    name: Literal["lamb"] = "lamb"
    eps_inside_sqrt: bool = False
    max_coeff: float = setting(10.0, POSITIVE)
    min_coeff: float = setting(0.01, POSITIVE)

    def relation_problems(self) -> list[Problem]:
        if self.min_coeff > self.max_coeff:
            return [Problem("min_coeff", f"must be <= max_coeff={self.max_coeff}", self.min_coeff)]
        return []


@dataclass(frozen=True, kw_only=True)
class SGDConfig(ValidatedConfig):
    """SGD with torch.optim.SGD semantics (DeepSpeed forwards "SGD" to torch.optim)."""

    name: Literal["sgd"] = "sgd"
    lr: float = setting(1e-3, POSITIVE)
    momentum: float = setting(0.0, UNIT_INTERVAL)
    dampening: float = setting(0.0, NON_NEGATIVE)
    weight_decay: float = setting(0.0, NON_NEGATIVE)
    nesterov: bool = False

    def relation_problems(self) -> list[Problem]:
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            return [Problem("nesterov", "needs momentum > 0 and dampening == 0 "
                            f"(got momentum={self.momentum}, dampening={self.dampening})", True)]
        return []


@dataclass(frozen=True, kw_only=True)
class OneBitConfig(ValidatedConfig):
    """What DeepSpeed's 1-bit optimizers share: Adam's numbers (no bias correction: DeepSpeed ignores
    it), and they compress the data-parallel all-reduce themselves (ZeRO stage 0, no tensor slicing)."""

    lr: float = setting(1e-3, POSITIVE)
    betas: Betas = setting((0.9, 0.999), each(UNIT_INTERVAL))
    eps: float = setting(1e-8, POSITIVE)
    weight_decay: float = setting(0.0, NON_NEGATIVE)


@dataclass(frozen=True, kw_only=True)
class OneBitAdamConfig(OneBitConfig):
    """1-bit Adam (DeepSpeed OnebitAdam): freeze_step warmup steps of Adam, then frozen variance and
    1-bit compressed momentum all-reduce."""

    name: Literal["onebit_adam"] = "onebit_adam"
    freeze_step: int = setting(100000, NON_NEGATIVE)


@dataclass(frozen=True, kw_only=True)
class ZeroOneAdamConfig(OneBitConfig):
    """0/1 Adam (DeepSpeed ZeroOneAdam): sparser variance updates until var_freeze_step, then 1-bit
    synchronised local steps."""

    name: Literal["zero_one_adam"] = "zero_one_adam"
    var_freeze_step: int = setting(100000, NON_NEGATIVE)
    var_update_scaler: int = setting(16, POSITIVE)
    local_step_scaler: int = setting(32678, POSITIVE)
    local_step_clipper: int = setting(16, POSITIVE)


@dataclass(frozen=True, kw_only=True)
class OneBitLambConfig(OneBitConfig):
    """1-bit LAMB (DeepSpeed OnebitLamb): LAMB warmup, then a frozen trust coefficient scaled by a
    bounded factor and one fused 1-bit all-reduce of all momenta."""

    name: Literal["onebit_lamb"] = "onebit_lamb"
    freeze_step: int = setting(100000, NON_NEGATIVE)
    max_coeff: float = setting(10.0, POSITIVE)
    min_coeff: float = setting(0.01, POSITIVE)
    coeff_beta: float = setting(0.9, UNIT_INTERVAL)
    factor_max: float = setting(4.0, POSITIVE)
    factor_min: float = setting(0.5, POSITIVE)
    factor_threshold: float = setting(0.1, UNIT_INTERVAL)

    def relation_problems(self) -> list[Problem]:
        if self.min_coeff > self.max_coeff:
            return [Problem("min_coeff", f"must be <= max_coeff={self.max_coeff}", self.min_coeff)]
        if self.factor_min > self.factor_max:
            return [Problem("factor_min", f"must be <= factor_max={self.factor_max}", self.factor_min)]
        return []


ONEBIT_OPTIMIZERS = ("onebit_adam", "zero_one_adam", "onebit_lamb")

OptimizerConfig = Union[AdamConfig, AdamWConfig, LambConfig, SGDConfig, OneBitAdamConfig, ZeroOneAdamConfig,
                        OneBitLambConfig]

# ------------------------------------------------------------------------------- schedulers


@dataclass(frozen=True, kw_only=True)
class ConstantConfig(ValidatedConfig):
    """Constant lr = optimizer.lr (DeepSpeed with no scheduler block)."""

    name: Literal["constant"] = "constant"


@dataclass(frozen=True, kw_only=True)
class WarmupConfig(ValidatedConfig):
    """DeepSpeed WarmupLR. warmup_max_lr None = the optimizer's lr (DeepSpeed code default)."""

    name: Literal["warmup"] = "warmup"
    warmup_min_lr: float = setting(0.0, NON_NEGATIVE)
    warmup_max_lr: Optional[float] = setting(None, NON_NEGATIVE)
    warmup_num_steps: int = setting(1000, POSITIVE)
    warmup_type: WarmupType = "log"

    def relation_problems(self) -> list[Problem]:
        if self.warmup_max_lr is not None and self.warmup_min_lr > self.warmup_max_lr:
            return [Problem("warmup_min_lr", f"must be <= warmup_max_lr={self.warmup_max_lr}", self.warmup_min_lr)]
        return []


@dataclass(frozen=True, kw_only=True)
class WarmupDecayConfig(WarmupConfig):
    """DeepSpeed WarmupDecayLR: WarmupLR then linear decay; total_num_steps None = train.steps."""

    name: Literal["warmup_decay"] = "warmup_decay"
    total_num_steps: Optional[int] = setting(None, POSITIVE)


@dataclass(frozen=True, kw_only=True)
class WarmupCosineConfig(ValidatedConfig):
    """DeepSpeed WarmupCosineLR (ratios of the optimizer's lr); total_num_steps None = train.steps."""

    name: Literal["warmup_cosine"] = "warmup_cosine"
    total_num_steps: Optional[int] = setting(None, POSITIVE)
    warmup_min_ratio: float = setting(0.0, NON_NEGATIVE, at_most(1.0))
    warmup_num_steps: int = setting(1000, POSITIVE)
    cos_min_ratio: float = setting(1e-4, NON_NEGATIVE, at_most(1.0))
    warmup_type: WarmupType = "log"


@dataclass(frozen=True, kw_only=True)
class OneCycleConfig(ValidatedConfig):
    """DeepSpeed OneCycle. cycle_first_step_size None = train.steps // 2 (fspeed addition)."""

    name: Literal["one_cycle"] = "one_cycle"
    cycle_min_lr: float = required(NON_NEGATIVE)
    cycle_max_lr: float = required(NON_NEGATIVE)
    decay_lr_rate: float = setting(0.0, NON_NEGATIVE)
    cycle_first_step_size: Optional[int] = setting(2000, POSITIVE)
    cycle_second_step_size: Optional[int] = setting(None, POSITIVE)
    cycle_first_stair_count: int = setting(0, NON_NEGATIVE)
    cycle_second_stair_count: Optional[int] = setting(None, NON_NEGATIVE)
    decay_step_size: int = setting(0, NON_NEGATIVE)
    cycle_momentum: bool = True
    cycle_min_mom: float = setting(0.8, UNIT_INTERVAL)
    cycle_max_mom: float = setting(0.9, UNIT_INTERVAL)
    decay_mom_rate: float = setting(0.0, NON_NEGATIVE)

    def relation_problems(self) -> list[Problem]:
        problems = []
        if self.cycle_min_lr > self.cycle_max_lr:
            problems.append(Problem("cycle_min_lr", f"must be <= cycle_max_lr={self.cycle_max_lr}", self.cycle_min_lr))
        if self.cycle_min_mom > self.cycle_max_mom:
            problems.append(Problem("cycle_min_mom", f"must be <= cycle_max_mom={self.cycle_max_mom}", self.cycle_min_mom))
        return problems


@dataclass(frozen=True, kw_only=True)
class LRRangeTestConfig(ValidatedConfig):
    """DeepSpeed LRRangeTest: lr = min_lr * (1 + step_rate * interval), linear growth."""

    name: Literal["lr_range_test"] = "lr_range_test"
    lr_range_test_min_lr: float = setting(1e-3, POSITIVE)
    lr_range_test_step_size: int = setting(2000, POSITIVE)
    lr_range_test_step_rate: float = setting(1.0, NON_NEGATIVE)
    lr_range_test_staircase: bool = False


SchedulerConfig = Union[ConstantConfig, WarmupConfig, WarmupDecayConfig, WarmupCosineConfig, OneCycleConfig,
                        LRRangeTestConfig]

# -------------------------------------------------------------------------------- precision


@dataclass(frozen=True, kw_only=True)
class Fp32Config(ValidatedConfig):
    name: Literal["fp32"] = "fp32"


@dataclass(frozen=True, kw_only=True)
class Bf16Config(ValidatedConfig):
    """DeepSpeed's bf16 block plus data_types.grad_accum_dtype (fp32 by default: DeepSpeed #2768)."""

    name: Literal["bf16"] = "bf16"
    grad_accum_dtype: Literal["fp32", "bf16"] = "fp32"
    check_grad_overflow: bool = True


@dataclass(frozen=True, kw_only=True)
class Fp16Config(ValidatedConfig):
    """DeepSpeed's fp16 block (dynamic loss scaling when loss_scale == 0).

    unscale_with_updated_scale=True reproduces DeepSpeed's ordering quirk (gradients unscaled
    with the scale after update_scale, halving the update on a growth step); fspeed's default
    unscales with the scale that produced the gradients.
    """

    name: Literal["fp16"] = "fp16"
    loss_scale: float = setting(0.0, NON_NEGATIVE)
    initial_scale_power: int = setting(16, NON_NEGATIVE, at_most(64))
    loss_scale_window: int = setting(1000, POSITIVE)
    hysteresis: int = setting(2, POSITIVE)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = setting(1.0, POSITIVE)
    raise_at_min_scale: bool = True
    grad_accum_dtype: Literal["fp32", "fp16"] = "fp32"
    unscale_with_updated_scale: bool = False


PrecisionConfig = Union[Fp32Config, Bf16Config, Fp16Config]

# --------------------------------------------------------------------------- plain sections


@dataclass(frozen=True, kw_only=True)
class TrainConfig(ValidatedConfig):
    """Step budget, batch triad (DeepSpeed names in comments), seed, clipping and logging cadence."""

    steps: int = setting(600, POSITIVE)
    train_batch_size: Optional[int] = setting(None, POSITIVE)  # train_batch_size
    micro_batch_size: Optional[int] = setting(32, POSITIVE)  # train_micro_batch_size_per_gpu
    grad_accum: Optional[int] = setting(None, POSITIVE)  # gradient_accumulation_steps
    seed: int = setting(0, NON_NEGATIVE)  # initialisation, data order and dropout
    gradient_clipping: float = setting(1.0, NON_NEGATIVE)  # 0 disables; DeepSpeed's default is 1.0
    steps_per_print: Optional[int] = setting(None, POSITIVE)
    eval_every: int = setting(100, NON_NEGATIVE)  # 0 = only at the end
    eval_batches: int = setting(8, POSITIVE)
    log_every: int = setting(10, POSITIVE)
    # a step whose loss or gradient norm is inf/NaN, where no dynamic loss scaler handles it (fp32,
    # bf16, fp16 with a static scale): "stop" raises naming the step (the state stays at the last
    # good step), "skip" skips it as an fp16 overflow is skipped
    on_nonfinite: Literal["stop", "skip"] = "stop"
    # where the step computes: "cuda" is this rank's GPU (cuda:LOCAL_RANK), batches are moved there;
    # None: where the model is (fspeed-train builds it on the CPU; fs.initialize: the module's device)
    device: Optional[Literal["cpu", "cuda"]] = None


@dataclass(frozen=True, kw_only=True)
class DataConfig(ValidatedConfig):
    """Corpus ("stdlib" = the Python standard library's sources, or a text file path) and tokenizer."""

    corpus: str = setting("stdlib", NON_EMPTY)
    max_bytes: Optional[int] = setting(4_000_000, POSITIVE)  # None = the whole corpus
    tokenizer: Literal["char", "byte"] = "char"
    val_fraction: float = setting(0.05, OPEN_UNIT_INTERVAL)
    errors: Literal["strict", "replace"] = "strict"  # char tokenizer: invalid UTF-8 is an error, or U+FFFD
    # epochs over non-overlapping windows (fspeed.data.loader); None = windows drawn with replacement
    epochs: Optional[int] = setting(None, POSITIVE)
    shuffle: bool = True  # with epochs: a seeded new order each epoch
    drop_last: bool = True  # with epochs: drop an epoch's last partial global batch (else complete it)
    num_workers: int = setting(0, NON_NEGATIVE)  # with epochs: DataLoader worker processes

    def relation_problems(self) -> list[Problem]:
        if self.epochs is None:
            changed = [(k, v, d) for k, v, d in (("shuffle", self.shuffle, True), ("drop_last", self.drop_last, True),
                                                  ("num_workers", self.num_workers, 0)) if v != d]
            if changed:
                key, value, default = changed[0]
                return [Problem(key, "applies to epochs only; without data.epochs windows are drawn with replacement",
                                value, f"{default}, or set data.epochs")]
        if self.errors != "strict" and self.tokenizer == "byte":
            return [Problem("errors", "only applies to the char tokenizer; the byte tokenizer reads the corpus' "
                            "bytes as they are", self.errors, "strict with data.tokenizer=byte")]
        return []


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(ValidatedConfig):
    """Where and how often to save; resume loads `latest` from dir (true: when present, saying so
    when it is not; required: an error when it is not); how many to keep; whether a failing or
    interrupted run saves where it stopped; whether periodic saves are written in the background
    (the state copied to host memory at the step boundary; the final save always blocks)."""

    dir: str = required(NON_EMPTY)  # where checkpoints are written and resumed from
    save_every: int = setting(0, NON_NEGATIVE)  # 0 = only at the end
    resume: Union[bool, Literal["required"]] = False
    keep_last: int = setting(0, NON_NEGATIVE)  # keep the N newest global_step<N> checkpoints; 0 = all
    save_on_failure: bool = True  # on SIGTERM/SIGINT or a divergence stop, save the last good step first
    async_save: bool = False  # save_every's checkpoints written in the background (at most one in flight)
    init_from: str = ""  # a safetensors file or directory (fspeed-export, HF): start from its weights (fine-tuning)


@dataclass(frozen=True, kw_only=True)
class MonitorConfig(ValidatedConfig):
    """Metric sinks: a CSV file, TensorBoard event files, a W&B run (rank 0 writes), and a progress
    bar. Directories default to the run directory (TensorBoard's: its `tensorboard/`); the wandb_*
    keys are DeepSpeed's `wandb` block (team = W&B entity), offline unless wandb_mode=online."""

    csv: bool = True
    progress_bar: bool = True
    tensorboard: bool = False
    wandb: bool = False
    csv_dir: Optional[str] = setting(None, NON_EMPTY)
    tensorboard_dir: Optional[str] = setting(None, NON_EMPTY)
    wandb_dir: Optional[str] = setting(None, NON_EMPTY)  # the W&B run's files (None: <run dir>/wandb)
    wandb_project: str = setting("fspeed", NON_EMPTY)
    wandb_team: Optional[str] = None
    wandb_group: Optional[str] = None
    wandb_name: Optional[str] = None  # the W&B run's name (None: W&B picks one)
    wandb_mode: Literal["offline", "online"] = "offline"


@dataclass(frozen=True, kw_only=True)
class FlopsProfilerConfig(ValidatedConfig):
    """DeepSpeed's `flops_profiler` block: at `profile_step`, per-module params, MACs, flops and
    forward latency (`fspeed.profile`); `peak_tflops` (fspeed's) is the per-rank peak that MFU is
    measured against (None: measured with a matmul at start-up)."""

    enabled: bool = False
    profile_step: int = setting(1, POSITIVE)
    module_depth: int = setting(-1, Check(lambda v: v == -1 or v >= 0, ">= 0, or -1 for all depths"))
    top_modules: int = setting(1, POSITIVE)
    detailed: bool = True
    output_file: Optional[str] = setting(None, NON_EMPTY)
    recompute_fwd_factor: float = setting(0.0, NON_NEGATIVE)
    peak_tflops: Optional[float] = setting(None, POSITIVE)


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerSection(ValidatedConfig):
    """DeepSpeed's `zero_optimization.offload_optimizer` (ZeRO-Offload): "cpu" keeps this rank's fp32
    masters and optimizer state in CPU memory and runs the optimizer there (stages 1-3)."""

    device: Literal["none", "cpu", "nvme"] = "none"  # nvme is DeepSpeed's; refused with a reason
    pin_memory: bool = True  # page-locked host buffers (where CUDA exists)
    ratio: float = setting(1.0, POSITIVE, at_most(1.0))  # only 1.0: partial offload is not supported


@dataclass(frozen=True, kw_only=True)
class OffloadParamSection(ValidatedConfig):
    """DeepSpeed's `zero_optimization.offload_param` (stage 3): "cpu" keeps the parameter shards in
    CPU memory; each goes to the device just before its gather."""

    device: Literal["none", "cpu", "nvme"] = "none"
    pin_memory: bool = True


@dataclass(frozen=True, kw_only=True)
class ZeroSection(ValidatedConfig):
    """DeepSpeed's `zero_optimization` keys that fspeed implements (same names and meanings)."""

    stage: int = setting(0, NON_NEGATIVE, at_most(3))
    reduce_bucket_size: int = setting(500_000_000, POSITIVE)  # elements
    allgather_bucket_size: int = setting(500_000_000, POSITIVE)
    param_persistence_threshold: int = setting(100_000, NON_NEGATIVE)  # stage3_param_persistence_threshold
    model_persistence_threshold: int = setting(sys.maxsize, NON_NEGATIVE)  # stage 3: cap on all persistent elements
    overlap_comm: Optional[bool] = None  # None = DeepSpeed's default: true for stage 3, false otherwise
    prefetch: bool = True  # stage 3: gather the next layer while one computes (prefetch_bucket_size > 0)
    recompute_blocks: bool = False  # fspeed's own, stage 3: recompute each block in backward (less memory)
    offload_optimizer: OffloadOptimizerSection = field(default_factory=OffloadOptimizerSection)
    offload_param: OffloadParamSection = field(default_factory=OffloadParamSection)

    def relation_problems(self) -> list[Problem]:
        try:
            self.to_library()
        except ValueError as err:  # the library's rules (stages, nvme, ratio, pairing); messages start "zero.<key>"
            message = str(err)
            named = re.match(r"zero\.([a-z_]+(?:\.[a-z_]+)?)", message)
            return [Problem(named.group(1) if named else "offload_optimizer", message)]
        return []

    def to_library(self) -> ZeroConfig:
        """The `fspeed.ZeroConfig` these keys describe (raises ValueError on a bad combination)."""
        from fspeed.parallel.config import ZeroConfig  # noqa: PLC0415 (the schema module stays free of torch imports)

        fields = ("stage", "reduce_bucket_size", "allgather_bucket_size", "param_persistence_threshold",
                  "model_persistence_threshold", "overlap_comm", "prefetch", "recompute_blocks")
        return ZeroConfig(**{f: getattr(self, f) for f in fields},
                                 offload_optimizer=dataclasses.asdict(self.offload_optimizer),
                                 offload_param=dataclasses.asdict(self.offload_param))


@dataclass(frozen=True, kw_only=True)
class SparseAttentionSection(ValidatedConfig):
    """DeepSpeed's `sparse_attention` block (its JSON defaults), used when model.attention=sparse.

    Which keys a mode reads is DeepSpeed's (fspeed.sparse.config.MODE_KEYS); `attention` also
    applies to bigbird and bslongformer here. `seed` draws the random blocks (fspeed addition).
    """

    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer"] = "fixed"
    block: int = setting(16, POSITIVE)
    different_layout_per_head: bool = False
    num_local_blocks: int = setting(4, POSITIVE)
    num_global_blocks: int = setting(1, NON_NEGATIVE)
    attention: Literal["unidirectional", "bidirectional"] = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = setting(1, POSITIVE)
    num_random_blocks: int = setting(0, NON_NEGATIVE)
    local_window_blocks: tuple[int, ...] = setting((4,), NON_EMPTY, each(POSITIVE))
    global_block_indices: tuple[int, ...] = setting((0,), each(NON_NEGATIVE))
    global_block_end_indices: Optional[tuple[int, ...]] = setting(None, each(NON_NEGATIVE))
    num_sliding_window_blocks: int = setting(3, POSITIVE)
    seed: int = setting(0, NON_NEGATIVE)

    def relation_problems(self) -> list[Problem]:
        try:
            self.to_library()
        except ValueError as err:  # the layout family's own check, e.g. num_local_blocks % num_global_blocks
            return [Problem("mode", f"{self.mode}: {err}", self.mode)]
        return []

    def to_library(self) -> SparseAttentionConfig:
        return SparseAttentionConfig(**{f: getattr(self, f) for f in self.__dataclass_fields__})


FILL_OR_POSITIVE = Check(lambda v: v == -1 or v > 0, "> 0, or -1 for all remaining ranks")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(ValidatedConfig):
    """Mesh sizes: data-parallel ranks (-1 = the world divided by the rest), tensor-slicing ranks and
    pipeline stages."""

    data: int = setting(-1, FILL_OR_POSITIVE)
    tensor: int = setting(1, POSITIVE)
    pipe: int = setting(1, POSITIVE)  # pipeline stages (the `pipeline` section says how)
    timeout_s: float = setting(300.0, POSITIVE)  # a collective waiting longer fails with a clear error


@dataclass(frozen=True, kw_only=True)
class CommsLoggerConfig(ValidatedConfig):
    """DeepSpeed's `comms_logger`: log every collective (op, size, latency, algbw, busbw); rank 0
    prints the summary table at the end. `verbose` prints each op as it happens."""

    enabled: bool = False
    verbose: bool = False


# ---------------------------------------------------------------------------------- the run

OPTIMIZERS: dict[str, type] = {"adam": AdamConfig, "adamw": AdamWConfig, "lamb": LambConfig, "sgd": SGDConfig,
                               "onebit_adam": OneBitAdamConfig, "zero_one_adam": ZeroOneAdamConfig,
                               "onebit_lamb": OneBitLambConfig}
SCHEDULERS: dict[str, type] = {
    "constant": ConstantConfig,
    "warmup": WarmupConfig,
    "warmup_decay": WarmupDecayConfig,
    "warmup_cosine": WarmupCosineConfig,
    "one_cycle": OneCycleConfig,
    "lr_range_test": LRRangeTestConfig,
}
PRECISIONS: dict[str, type] = {"fp32": Fp32Config, "bf16": Bf16Config, "fp16": Fp16Config}

@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig(ValidatedConfig):
    """Activation checkpointing (`fspeed.rematerialization`): which blocks keep only what `policy` saves and are
    recomputed in backward; DeepSpeed's `activation_checkpointing` block translates here."""

    policy: Literal["none", "full", "save_matmuls"] = "none"  # none: every activation is kept
    every: int = setting(1, POSITIVE)  # checkpoint every k-th block
    cpu_checkpointing: bool = False  # DeepSpeed's: the saved block inputs live in host memory
    partition_activations: bool = False  # with parallel.tensor > 1: each rank keeps 1/t of each kept input
    contiguous_memory_optimization: bool = False  # kept inputs in one reused buffer
    profile: bool = False  # forward, recompute and backward time per checkpointed block
    synchronize_checkpoint_boundary: bool = False  # a device synchronize at each checkpointed block's ends
    budget_mib: Optional[float] = setting(None, POSITIVE)  # policy none: pick the cheapest remat keeping <= this

    def relation_problems(self) -> list[Problem]:
        problems = []
        if self.policy == "none":
            for key in ("cpu_checkpointing", "partition_activations", "contiguous_memory_optimization", "profile",
                        "synchronize_checkpoint_boundary"):
                if getattr(self, key):
                    problems.append(Problem(key, "applies to checkpointed blocks, and activation_checkpointing.policy "
                                            "is none", True, hint="set activation_checkpointing.policy=full (or "
                                                                   "save_matmuls)"))
            if self.every != 1:
                problems.append(Problem("every", "applies to checkpointed blocks, and activation_checkpointing.policy "
                                        "is none", self.every, hint="set activation_checkpointing.policy=full"))
        if self.budget_mib is not None and self.policy != "none":
            problems.append(Problem("budget_mib", "chooses the policy itself (the cheapest that fits); leave "
                                    "activation_checkpointing.policy at none", self.budget_mib))
        if self.contiguous_memory_optimization and (self.cpu_checkpointing or self.partition_activations):
            problems.append(Problem("contiguous_memory_optimization", "holds whole inputs on the device; with "
                                    "cpu_checkpointing or partition_activations it is not implemented", True, "false"))
        return problems

    def to_library(self):
        """The `fspeed.Remat` these keys describe (a fresh timing profile and buffer), or None (policy none)."""
        if self.policy == "none":
            return None
        # the schema module stays free of torch imports
        from fspeed.remat_blocks import ContiguousArena, Remat, RematProfile  # noqa: PLC0415

        return Remat(self.policy, self.every, self.cpu_checkpointing, self.partition_activations,
                     RematProfile() if self.profile else None,
                     ContiguousArena() if self.contiguous_memory_optimization else None,
                     self.synchronize_checkpoint_boundary)


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")  # fspeed.parallel.schedules.SCHEDULES


@dataclass(frozen=True, kw_only=True)
class PipelineSection(ValidatedConfig):
    """Pipeline parallelism (`fspeed.parallel.pipeline_transform`), used when parallel.pipe > 1. Its micro-batches
    are the gradient accumulation (train.grad_accum), as DeepSpeed's PipelineEngine."""

    micro_batches: Optional[int] = setting(None, POSITIVE)  # null: train.grad_accum; set: it is train.grad_accum
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    partition: str = "parameters"  # uniform | parameters | type:<regex> | profile | explicit counts "3,4,4,3"
    virtual_stages: int = setting(1, POSITIVE)  # model chunks per stage (interleaved_1f1b: >= 2)
    activation_checkpoint_interval: int = setting(0, NON_NEGATIVE)  # DeepSpeed's: checkpoint groups of k layers
    input_grad_first: bool = True  # the cooldown's backwards send the input's gradient before the weights'

    def relation_problems(self) -> list[Problem]:
        if (self.schedule == "interleaved_1f1b") != (self.virtual_stages > 1):
            return [Problem("virtual_stages", "must be >= 2 with schedule interleaved_1f1b and 1 otherwise",
                            self.virtual_stages)]
        if self.schedule == "zero_bubble" and not self.input_grad_first:
            return [Problem("input_grad_first", "must be true with schedule zero_bubble (its B is the input's "
                            "gradient alone); false applies to gpipe, 1f1b and interleaved_1f1b",
                            self.input_grad_first)]
        return []

    def to_library(self, micro_batches: int, remat=None):
        """The `fs.pipeline(...)` plan of these keys with the run's micro-batch count."""
        from fspeed.parallel.pipeline_transform import pipeline  # noqa: PLC0415 (the schema module stays free of torch)

        partition = self.partition
        if partition and partition[0].isdigit():
            partition = tuple(int(c) for c in partition.split(","))
        return pipeline(micro_batches, self.schedule, partition, self.virtual_stages,
                        self.activation_checkpoint_interval, remat, self.input_grad_first)


KINDS: dict[str, dict[str, type]] = {"optimizer": OPTIMIZERS, "scheduler": SCHEDULERS, "precision": PRECISIONS}
"""Config groups whose option is picked by the node's `name` field, and the class for each name."""

GROUPS: tuple[str, ...] = ("model", "data", *KINDS)
"""The Hydra config groups of the fspeed tree (choose an option with group=option)."""

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "monitor": MonitorConfig,
    "zero": ZeroSection,
    "parallel": ParallelConfig,
    "pipeline": PipelineSection,
    "comms_logger": CommsLoggerConfig,
    "sparse_attention": SparseAttentionSection,
    "activation_checkpointing": ActivationCheckpointingConfig,
    "flops_profiler": FlopsProfilerConfig,
    "curriculum": CurriculumSection,
    "progressive_layer_drop": ProgressiveLayerDropSection,
    "elasticity": ElasticitySection,
}
"""Sections with one fixed class (model and data are Hydra groups, but every packaged option is a
ModelConfig / DataConfig; their option `custom` is a user's callable, a `TargetConfig`)."""


def option_schema(group: str, option_name: str) -> type | None:
    """The config class for `group`'s option named `option_name`; None if fspeed does not know it."""
    if group in KINDS:
        return KINDS[group].get(option_name)
    return SECTIONS.get(group)


@dataclass(frozen=True, kw_only=True)
class RunConfig(ValidatedConfig):
    """A validated training run. `batch` is the batch triad resolved for `dp_world_size`
    (a runtime value, not a config key); changing either re-resolves it (dataclasses.replace)."""

    model: Union[ModelConfig, TargetConfig]
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    precision: PrecisionConfig
    train: TrainConfig
    data: Union[DataConfig, TargetConfig]
    checkpoint: CheckpointConfig
    monitor: MonitorConfig
    zero: ZeroSection
    parallel: ParallelConfig
    comms_logger: CommsLoggerConfig
    sparse_attention: SparseAttentionSection
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    curriculum: CurriculumSection = field(default_factory=CurriculumSection)
    progressive_layer_drop: ProgressiveLayerDropSection = field(default_factory=ProgressiveLayerDropSection)
    elasticity: ElasticitySection = field(default_factory=ElasticitySection)
    deepspeed_config: Optional[str] = None
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    wall_clock_breakdown: bool = False  # DeepSpeed's: per-step fwd/bwd/step times (fspeed.timers)
    dp_world_size: int = setting(1, POSITIVE)
    batch: BatchTriad = field(init=False)

    def relation_problems(self) -> list[Problem]:
        problems = self._pipeline_problems()
        if problems:
            return problems
        if self.activation_checkpointing.budget_mib is not None and (self.zero.stage == 3 or self.parallel.tensor > 1):
            return [Problem("activation_checkpointing.budget_mib", "measures the policies on one process with the whole "
                            "model, which zero.stage=3 and tensor slicing do not hold", self.activation_checkpointing.budget_mib,
                            hint="choose activation_checkpointing.policy and every yourself")]
        if self.activation_checkpointing.partition_activations and self.parallel.tensor == 1:
            return [Problem("activation_checkpointing.partition_activations", "splits each kept block input over the "
                            "tensor-slicing ranks, and parallel.tensor is 1", True, "false, or parallel.tensor > 1")]
        sched, lr = self.scheduler, getattr(self.optimizer, "lr", None)
        targets = [isinstance(self.model, TargetConfig), isinstance(self.data, TargetConfig)]
        if any(targets) and not all(targets):
            given, other = ("model", "data") if targets[0] else ("data", "model")
            return [Problem(f"{other}._target_", f"is needed with {given}._target_: the built-in corpus data is cut for "
                            "the built-in GPT (its model.seq_len and tokenizer), and the built-in GPT reads only it",
                            hint=f"set {other}._target_=my_pkg.build_{other}")]
        if self.optimizer.name in ONEBIT_OPTIMIZERS and (self.zero.stage >= 1 or self.parallel.tensor > 1):
            what = f"zero.stage={self.zero.stage}" if self.zero.stage >= 1 else f"parallel.tensor={self.parallel.tensor}"
            return [Problem("optimizer", f"{self.optimizer.name} compresses the all-reduce of whole replicated buffers "
                            f"and cannot run with {what} (DeepSpeed's 1-bit optimizers reject ZeRO too); allowed: "
                            "zero.stage=0 and parallel.tensor=1", self.optimizer.name)]
        if isinstance(self.precision, Bf16Config) and not self.precision.check_grad_overflow \
                and self.train.on_nonfinite == "skip":
            return [Problem("train.on_nonfinite", "has no effect with precision.check_grad_overflow=false, which "
                            "applies every step unchecked (DeepSpeed's meaning)", "skip",
                            "stop, or precision.check_grad_overflow=true")]
        if isinstance(sched, WarmupConfig) and sched.warmup_max_lr is None and lr is not None \
                and sched.warmup_min_lr > lr:
            return [Problem("scheduler.warmup_min_lr", f"must be <= the lr it warms up to (warmup_max_lr is null, "
                            f"so optimizer.lr={lr})", sched.warmup_min_lr)]
        return []

    def _pipeline_problems(self) -> list[Problem]:
        pipe, p = self.parallel.pipe, self.pipeline
        if pipe == 1:
            changed = [k for k in ("micro_batches", "activation_checkpoint_interval") if getattr(p, k)]
            changed += [k for k, default in (("schedule", "1f1b"), ("partition", "parameters"), ("virtual_stages", 1),
                                             ("input_grad_first", True)) if getattr(p, k) != default]
            if changed:
                return [Problem(f"pipeline.{changed[0]}", "applies to pipeline stages, and parallel.pipe is 1",
                                getattr(p, changed[0]), hint="set parallel.pipe > 1, or leave the pipeline section")]
            return []
        if self.zero.stage == 3:
            return [Problem("zero.stage", "3 cannot run with pipeline stages (parallel.pipe > 1); DeepSpeed allows "
                            "0-1, fspeed 0-2", 3, "0, 1 or 2")]
        if p.micro_batches is not None and self.train.grad_accum is not None and p.micro_batches != self.train.grad_accum:
            return [Problem("pipeline.micro_batches", f"is the gradient accumulation, and train.grad_accum is "
                            f"{self.train.grad_accum}", p.micro_batches, f"{self.train.grad_accum}, or null")]
        ac = self.activation_checkpointing
        if ac.policy != "none" and not p.activation_checkpoint_interval:
            return [Problem("activation_checkpointing.policy", "checkpoints the blocks of the model's loss, which "
                            "pipeline stages do not run; with parallel.pipe > 1 set "
                            "pipeline.activation_checkpoint_interval (the policy then says how each group of layers "
                            "is recomputed)", ac.policy, hint="pipeline.activation_checkpoint_interval=1")]
        if ac.every != 1:
            return [Problem("activation_checkpointing.every", "is not used by pipeline stages: their checkpointed "
                            "groups are pipeline.activation_checkpoint_interval layers", ac.every, "1")]
        if ac.budget_mib is not None:
            return [Problem("activation_checkpointing.budget_mib", "measures the whole model on one process; with "
                            "pipeline stages use pipeline.activation_checkpoint_interval", ac.budget_mib)]
        if self.progressive_layer_drop.enabled:
            return [Problem("progressive_layer_drop.enabled", "drops blocks of the whole model per step, which pipeline "
                            "stages do not run as one", True, "false with parallel.pipe > 1")]
        return []

    def __post_init__(self) -> None:
        if self.parallel.pipe > 1 and self.pipeline.micro_batches is not None and self.train.grad_accum is None:
            object.__setattr__(self, "train", dataclasses.replace(self.train, grad_accum=self.pipeline.micro_batches))
        super().__post_init__()
        t = self.train
        if self.elasticity.enabled:
            given = {"train_batch_size": t.train_batch_size, "grad_accum": t.grad_accum}
            batch = elastic_triad(self.elasticity, given, self.dp_world_size, self.parallel.tensor * self.parallel.pipe)
            object.__setattr__(self, "batch", batch)
            return
        try:
            batch = resolve_batch_triad(t.train_batch_size, t.micro_batch_size, t.grad_accum, self.dp_world_size)
        except BatchTriadError as err:
            raise ConfigError([Problem("train", str(err))]) from None
        object.__setattr__(self, "batch", batch)


RUNTIME_FIELDS = frozenset({"dp_world_size"})
"""RunConfig fields that come from the launch, not from the config file."""
