"""Turn a validated `RunConfig` into library objects: optimizer (with its schedule), precision, model config.

This is the one place where config becomes calls; the library itself takes plain arguments.
"""

from __future__ import annotations

import logging
import warnings
from typing import Optional

import torch

import fspeed.optim as optim
import fspeed.precision as precision
from fspeed.models import GPTConfig, pad_vocab
from fspeed.optim import schedules
from fspeed.parallel.config import ZeroConfig
from fspeed.parallel.mesh import local_device

from .errors import ConfigError, Problem
from .schema import RunConfig

log = logging.getLogger(__name__)


def one_cycle_first_step_size(run: RunConfig) -> int:
    """OneCycle's first half-cycle: the configured size, or half of train.steps when null (fspeed default)."""
    size = run.scheduler.cycle_first_step_size
    return size if size is not None else max(1, run.train.steps // 2)


def build_lr_schedule(run: RunConfig, lr: Optional[float] = None) -> schedules.Schedule:
    """The learning rate as a function of the number of applied updates.

    DeepSpeed semantics: WarmupLR/WarmupDecayLR with warmup_max_lr null warm up to the optimizer's
    lr; WarmupCosineLR scales the optimizer's lr; OneCycle and LRRangeTest set the lr themselves
    (the optimizer's lr is ignored, as in DeepSpeed). total_num_steps null = train.steps. `lr`: the
    optimizer's lr when it is not the config's (a client optimizer's); None: optimizer.lr.
    """
    sched, lr = run.scheduler, run.optimizer.lr if lr is None else lr
    total = getattr(sched, "total_num_steps", None) or run.train.steps
    if sched.name in ("warmup_decay", "warmup_cosine"):
        with warnings.catch_warnings():  # said below in config terms instead of the library's UserWarning
            warnings.filterwarnings("ignore", "total_num_steps .* is less than warmup steps", UserWarning)
            schedule = _warmup_then_decay(sched, lr, total)
        if total < sched.warmup_num_steps:
            source = "scheduler.total_num_steps" if sched.total_num_steps else "train.steps"
            log.warning("scheduler.warmup_num_steps=%d is longer than the run (%s=%d): the learning rate is still "
                        "warming up when training ends; lower scheduler.warmup_num_steps to decay within the run",
                        sched.warmup_num_steps, source, total)
        return schedule
    if sched.name == "constant":
        return schedules.constant(lr)
    if sched.name == "warmup":
        max_lr = sched.warmup_max_lr if sched.warmup_max_lr is not None else lr
        return schedules.warmup(sched.warmup_min_lr, max_lr, sched.warmup_num_steps, sched.warmup_type)
    if sched.name == "one_cycle":
        log.info("scheduler one_cycle sets the lr (%g..%g); optimizer.lr=%g is not used, as in DeepSpeed",
                 sched.cycle_min_lr, sched.cycle_max_lr, lr)
        return schedules.one_cycle(sched.cycle_min_lr, sched.cycle_max_lr, sched.decay_lr_rate,
                                   one_cycle_first_step_size(run), sched.cycle_second_step_size,
                                   sched.cycle_first_stair_count, sched.cycle_second_stair_count,
                                   sched.decay_step_size)
    if sched.name == "lr_range_test":
        log.info("scheduler lr_range_test sets the lr from %g; optimizer.lr=%g is not used, as in DeepSpeed",
                 sched.lr_range_test_min_lr, lr)
        return schedules.lr_range_test(sched.lr_range_test_min_lr, sched.lr_range_test_step_size,
                                       sched.lr_range_test_step_rate, sched.lr_range_test_staircase)
    raise ValueError(f"scheduler {sched.name!r} has no builder; allowed: constant, warmup, warmup_decay, "
                     "warmup_cosine, one_cycle, lr_range_test")


def _warmup_then_decay(sched, lr: float, total: int) -> schedules.Schedule:
    """WarmupDecayLR or WarmupCosineLR over `total` updates."""
    if sched.name == "warmup_decay":
        max_lr = sched.warmup_max_lr if sched.warmup_max_lr is not None else lr
        return schedules.warmup_decay(total, sched.warmup_min_lr, max_lr, sched.warmup_num_steps, sched.warmup_type)
    return schedules.warmup_cosine(lr, total, sched.warmup_min_ratio, sched.warmup_num_steps, sched.cos_min_ratio,
                                   sched.warmup_type)


def _betas(run: RunConfig) -> tuple[float | schedules.Schedule, float]:
    """(beta1, beta2), with OneCycle's momentum cycling applied the way DeepSpeed does it."""
    opt, sched = run.optimizer, run.scheduler
    b1, b2 = opt.betas
    if sched.name != "one_cycle" or not sched.cycle_momentum:
        return b1, b2
    momentum = schedules.one_cycle_momentum(sched.cycle_min_mom, sched.cycle_max_mom, sched.decay_mom_rate,
                                            one_cycle_first_step_size(run), sched.cycle_second_step_size,
                                            sched.cycle_first_stair_count, sched.cycle_second_stair_count,
                                            sched.decay_step_size)
    log.info("one_cycle cycles beta1 between %g and %g and forces beta2=%g instead of %g (DeepSpeed writes "
             "betas=(momentum, %g))", sched.cycle_max_mom, sched.cycle_min_mom, schedules.ONE_CYCLE_BETA2, b2,
             schedules.ONE_CYCLE_BETA2)
    return momentum, schedules.ONE_CYCLE_BETA2


def build_optimizer(run: RunConfig) -> optim.GradientTransformation:
    """The configured optimizer with its lr schedule, behind global-norm clipping when
    train.gradient_clipping > 0.

    OneCycle with cycle_momentum drives Adam/AdamW/LAMB's beta1 and forces beta2 to
    `schedules.ONE_CYCLE_BETA2` (DeepSpeed quirk, logged). On SGD DeepSpeed disables momentum
    cycling with a warning (torch's SGD has no `betas`); fspeed does the same.
    """
    opt, sched = run.optimizer, run.scheduler
    lr = build_lr_schedule(run)
    if opt.name == "sgd":
        if sched.name == "one_cycle" and sched.cycle_momentum:
            log.warning("one_cycle: cycle_momentum is disabled because sgd has no betas (DeepSpeed does the same); "
                        "momentum stays at optimizer.momentum=%g", opt.momentum)
        transform = optim.sgd(lr, opt.momentum, dampening=opt.dampening, weight_decay=opt.weight_decay,
                              nesterov=opt.nesterov)
    else:
        b1, b2 = _betas(run)
        if opt.name == "adam":
            transform = optim.adam(lr, b1, b2, opt.eps, opt.weight_decay, bias_correction=opt.bias_correction,
                                   adam_w_mode=opt.adam_w_mode)
        elif opt.name == "adamw":
            transform = optim.adamw(lr, b1, b2, opt.eps, opt.weight_decay, bias_correction=opt.bias_correction)
        elif opt.name == "lamb":
            transform = optim.lamb(lr, b1, b2, opt.eps, opt.weight_decay, bias_correction=opt.bias_correction,
                                   eps_inside_sqrt=opt.eps_inside_sqrt, max_coeff=opt.max_coeff,
                                   min_coeff=opt.min_coeff)
        elif opt.name in ("onebit_adam", "zero_one_adam", "onebit_lamb"):
            transform = build_onebit(run, lr)
        else:
            raise ValueError(f"optimizer {opt.name!r} has no builder; allowed: adam, adamw, lamb, sgd, onebit_adam, "
                             "zero_one_adam, onebit_lamb")
    if run.train.gradient_clipping > 0:
        return optim.chain(optim.clip_by_global_norm(run.train.gradient_clipping), transform)
    return transform


def build_onebit(run: RunConfig, lr: schedules.Schedule) -> optim.GradientTransformation:
    """1-bit Adam, 0/1 Adam or 1-bit LAMB. Their beta1 is a number (no OneCycle momentum cycling);
    the error buffers are sized for parallel.data (the process group's size when -1)."""
    opt, sched = run.optimizer, run.scheduler
    if sched.name == "one_cycle" and sched.cycle_momentum:
        log.warning("one_cycle: cycle_momentum is ignored by %s (its beta1 is fixed at %g)", opt.name, opt.betas[0])
    b1, b2 = opt.betas
    world = run.parallel.data if run.parallel.data > 0 else None
    common = dict(b1=b1, b2=b2, eps=opt.eps, weight_decay=opt.weight_decay, world_size=world)
    if opt.name == "onebit_adam":
        return optim.onebit_adam(lr, opt.freeze_step, **common)
    if opt.name == "zero_one_adam":
        return optim.zero_one_adam(lr, **common, var_freeze_step=opt.var_freeze_step,
                                   var_update_scaler=opt.var_update_scaler, local_step_scaler=opt.local_step_scaler,
                                   local_step_clipper=opt.local_step_clipper)
    return optim.onebit_lamb(lr, opt.freeze_step, **common, max_coeff=opt.max_coeff, min_coeff=opt.min_coeff,
                             coeff_beta=opt.coeff_beta, factor_max=opt.factor_max, factor_min=opt.factor_min,
                             factor_threshold=opt.factor_threshold)


def build_precision(run: RunConfig) -> precision.Precision:
    """The precision policy for run.precision (fp32, bf16 or fp16 with DeepSpeed's loss scaler)."""
    p = run.precision
    if p.name == "fp32":
        return precision.fp32()
    if p.name == "bf16":
        return precision.bf16(grad_accum_dtype=p.grad_accum_dtype, check_grad_overflow=p.check_grad_overflow)
    if p.name == "fp16":
        return precision.fp16(
            loss_scale=p.loss_scale, initial_scale_power=p.initial_scale_power, loss_scale_window=p.loss_scale_window,
            hysteresis=p.hysteresis, consecutive_hysteresis=p.consecutive_hysteresis,
            min_loss_scale=p.min_loss_scale, raise_at_min_scale=p.raise_at_min_scale,
            grad_accum_dtype=p.grad_accum_dtype, unscale_with_updated_scale=p.unscale_with_updated_scale,
        )
    raise ValueError(f"precision {p.name!r} has no builder; allowed: fp32, bf16, fp16")


def build_device(run: RunConfig) -> Optional[torch.device]:
    """Where this rank's step computes (`train.device`): the CPU, or this rank's GPU, cuda:LOCAL_RANK,
    which becomes the current device; None when unset: where the model's parameters are."""
    if run.train.device is None:
        return None
    if run.train.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError([Problem("train.device", "needs a CUDA GPU, and this torch sees none "
                                   "(torch.cuda.is_available() is False: a CPU-only build, or no GPU visible)",
                                   "cuda", "cpu")])
    if run.activation_checkpointing.budget_mib is not None:
        raise ConfigError([Problem("activation_checkpointing.budget_mib", "measures host (malloc) memory, so it "
                                   "chooses a policy for the CPU only; with train.device=cuda pick the policy "
                                   "(activation_checkpointing.policy)", run.activation_checkpointing.budget_mib)])
    device = local_device()
    if device.index >= torch.cuda.device_count():
        raise ConfigError([Problem("train.device", f"is this rank's GPU cuda:{device.index} (LOCAL_RANK), and only "
                                   f"{torch.cuda.device_count()} are visible: launch at most that many processes "
                                   "per node", "cuda")])
    torch.cuda.set_device(device)
    return device


def build_zero_config(run: RunConfig) -> ZeroConfig:
    """The ZeRO plan options of run.zero (stage, buckets, persistence, prefetch, offload blocks)."""
    return run.zero.to_library()


def build_model_config(run: RunConfig, vocab_size: int) -> GPTConfig:
    """The GPT architecture of run.model; vocab_size comes from the tokenizer (padded to a multiple of
    8 x parallel.tensor)."""
    m = run.model
    # padded so that tensor slicing splits the vocabulary evenly (the extra ids are never used)
    vocab_size = pad_vocab(vocab_size, 8 * run.parallel.tensor)
    return GPTConfig(vocab_size=vocab_size, seq_len=m.seq_len, n_layer=m.n_layer, n_head=m.n_head,
                     d_model=m.d_model, d_ff=m.d_ff, dropout=m.dropout, tie_embeddings=m.tie_embeddings,
                     init_std=m.init_std, attention=m.attention,
                     sparse_attention=run.sparse_attention.to_library() if m.attention == "sparse" else None)


def apply_activation_checkpointing(run: RunConfig, model):
    """(`model` with the run's activation checkpointing (`fspeed.rematerialization`), its
    timing profile or None); `model` unchanged with policy none."""
    from ..rematerialization import apply_remat  # noqa: PLC0415

    remat = run.activation_checkpointing.to_library()
    if remat is None:
        return model, None
    return apply_remat(model, remat), remat.profile
