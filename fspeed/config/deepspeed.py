"""Translate a DeepSpeed ``ds_config.json`` into Hydra overrides of fspeed's config.

Translated: the batch triad, ``fp16`` / ``bf16`` (alias ``bfloat16``) and
``data_types.grad_accum_dtype``, ``optimizer`` (Adam, AdamW, Lamb, SGD, the 1-bit family),
``scheduler`` (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR),
``gradient_clipping``, ``steps_per_print``, the monitors (``csv_monitor``, ``tensorboard``, ``wandb``),
``wall_clock_breakdown``, ``flops_profiler``, ``comms_logger.enabled`` /
``verbose``, ``tensor_parallel.autotp_size``, ``sparse_attention``, ``curriculum_learning`` (seqlen),
``progressive_layer_drop``, ``elasticity`` (an elastic global batch, DeepSpeed's rules),
``activation_checkpointing`` and ``zero_optimization`` (stage,
buckets, ``overlap_comm``, parameter and model persistence thresholds, prefetch on/off, and the
``offload_optimizer`` / ``offload_param`` blocks with device cpu, also from the legacy
``cpu_offload`` booleans). Every other key is accounted for by name:

* unknown keys (typos) are errors with a did-you-mean;
* a key accepted "with no effect" is listed in the summary with the reason, which is one of two:
  DeepSpeed itself ignores the key in fspeed's setting (an NVMe-only key with device cpu, a
  stage-3 key at stage 2, ...), or the value is DeepSpeed's default and fspeed does what DeepSpeed
  does at it. Any other value is an error naming the key, the value and what is allowed;
* ``"auto"`` (a Hugging Face Trainer placeholder) is an error: resolve it first.

All problems are reported together in one `DeepSpeedConfigError`. DeepSpeed semantics matched:
optimizer type is case-insensitive; type "Adam" means AdamW unless ``adam_w_mode: false``;
``torch_adam`` switches to torch.optim defaults (AdamW weight_decay 0.01); ``max_grad_norm`` in
optimizer params is an error; absent ``gradient_clipping`` is 1.0; no scheduler block means a
constant lr; no fp16/bf16 block means fp32; Lamb or SGD under ZeRO needs
``zero_allow_untested_optimizer: true``. Deviations: an unknown ``warmup_type`` falls back to
"log" as in DeepSpeed but is reported as a note; fspeed accumulates bf16/fp16 gradients in fp32
unless ``data_types.grad_accum_dtype`` says otherwise (DeepSpeed #2768); fspeed's comms logger
follows ``comms_logger.enabled`` (DeepSpeed 0.19 turns it on whenever the block is present).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import deepspeed_keys as K
from .deepspeed_efficiency import (translate_curriculum_learning, translate_data_efficiency,
                                   translate_progressive_layer_drop)
from .deepspeed_elasticity import elasticity_enabled, translate_elasticity
from .errors import ConfigError, Problem, allowed_names, did_you_mean, show_value
from .overrides import format_override

AUTO_HINT = ('"auto" is a placeholder the Hugging Face Trainer fills in; fspeed reads the file as it is, '
             "so replace it with a value")


class DeepSpeedConfigError(ConfigError):
    """A ds_config.json that fspeed cannot translate; lists every offending key."""

    title = "cannot use this DeepSpeed config"


@dataclass(frozen=True)
class DeepSpeedTranslation:
    """Hydra overrides equivalent to a ds_config, and an account of every key in it."""

    overrides: tuple[str, ...]
    mapping: tuple[tuple[str, str], ...]  # (DeepSpeed key, fspeed override it became)
    no_effect: tuple[str, ...]  # keys accepted without effect, with the reason
    notes: tuple[str, ...]  # semantic remarks (DeepSpeed defaults and quirks applied)
    superseded: tuple[str, ...] = ()  # overrides the command line replaced

    def summary(self) -> str:
        lines = [f"DeepSpeed config translated into {len(self.overrides)} overrides:"]
        lines += [f"  {ds_key} -> {override}" for ds_key, override in self.mapping]
        if self.superseded:
            lines.append("superseded by the command line: " + ", ".join(self.superseded))
        if self.no_effect:
            lines.append("accepted, no effect:")
            lines += [f"  {item}" for item in self.no_effect]
        if self.notes:
            lines.append("notes:")
            lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


@dataclass
class _Ledger:
    """What the translation has produced so far, and every key accounted for."""

    overrides: list[str] = field(default_factory=list)
    mapping: list[tuple[str, str]] = field(default_factory=list)
    no_effect: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def emit(self, ds_key: str, fspeed_key: str, value: Any) -> None:
        if _has_auto(value):
            self.problems.append(Problem(ds_key, "unresolved placeholder", value, hint=AUTO_HINT))
            return
        if isinstance(value, (Mapping, set)):
            self.problems.append(Problem(ds_key, "expected a single value, not a mapping", value))
            return
        try:
            override = format_override(fspeed_key, list(value) if isinstance(value, tuple) else value)
        except TypeError:
            self.problems.append(Problem(ds_key, "expected a number, string, boolean or list of those", value))
            return
        self.overrides.append(override)
        self.mapping.append((ds_key, override))

    def accept(self, ds_key: str, value: Any, reason: str) -> None:
        self.no_effect.append(f"{ds_key} = {show_value(value)} ({reason})")

    def unsupported(self, ds_key: str, value: Any, allowed: str, what: str = "not supported by fspeed yet") -> None:
        self.problems.append(Problem(ds_key, what, value, allowed, AUTO_HINT if _has_auto(value) else None))

    def unknown(self, ds_key: str, value: Any, known: Any) -> None:
        self.problems.append(Problem(ds_key, "unknown DeepSpeed key", value, allowed_names(known),
                                     suggestion=did_you_mean(ds_key.rsplit(".", 1)[-1], known)))

    def known_block(self, ds_key: str, value: Any, keys: Any) -> Mapping[str, Any] | None:
        """`block(ds_key, value)` with every key outside `keys` reported unknown."""
        block = self.block(ds_key, value)
        for key, item in (block or {}).items():
            if key not in keys:
                self.unknown(f"{ds_key}.{key}", item, keys)
        return block

    def block(self, ds_key: str, value: Any) -> Mapping[str, Any] | None:
        """`value` if it is a mapping, else a problem and None."""
        if isinstance(value, Mapping):
            return value
        self.problems.append(Problem(ds_key, "expected a mapping (JSON object)", value))
        return None


def _has_auto(value: Any) -> bool:
    if isinstance(value, str):
        return value == "auto"
    if isinstance(value, (list, tuple)):
        return any(_has_auto(v) for v in value)
    return False


def _same(value: Any, default: Any) -> bool:
    if isinstance(default, Mapping):
        return isinstance(value, Mapping) and set(value) <= set(default) and all(
            _same(v, default[k]) for k, v in value.items())
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(value) == list(default)
    def is_number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if is_number(value) and is_number(default):
        return value == default  # 1 == 1.0, as JSON means it
    return type(value) is type(default) and value == default


def _at_default(w: _Ledger, ds_key: str, value: Any, default: Any, reason: str,
                allowed_note: str = "DeepSpeed's default") -> None:
    """Accept `value` if it equals `default` (listed as no effect), else report it unsupported."""
    if _same(value, default):
        w.accept(ds_key, value, reason)
    else:
        w.unsupported(ds_key, value, f"{show_value(default)} ({allowed_note})")


def _fixed(w: _Ledger, ds_key: str, value: Any, fixed: K.Fixed, unread: str | None = None) -> None:
    """A key fspeed accepts only at DeepSpeed's default (`fixed.why` says why that changes nothing);
    `unread` is the reason any value is fine when DeepSpeed does not read the key in this config."""
    if _same(value, fixed.default):
        w.accept(ds_key, value, fixed.why)
    elif unread is not None and not _has_auto(value):
        w.accept(ds_key, value, unread)
    else:
        w.unsupported(ds_key, value, f"{show_value(fixed.default)} (DeepSpeed's default)", fixed.refused)


def _check_defaults(w: _Ledger, prefix: str, block: Mapping[str, Any], defaults: Mapping[str, Any]) -> bool:
    """Report every key of `block` that is unknown or not at its default (nested blocks too);
    True when there is none."""
    ok = True
    for key, value in block.items():
        name = f"{prefix}.{key}"
        if key not in defaults:
            w.unknown(name, value, defaults)
            ok = False
        elif isinstance(defaults[key], Mapping) and isinstance(value, Mapping):
            ok = _check_defaults(w, name, value, defaults[key]) and ok
        elif not _same(value, defaults[key]):
            w.unsupported(name, value, f"{show_value(defaults[key])} (DeepSpeed's default)")
            ok = False
    return ok


# ------------------------------------------------------------------------------ sections


def _batch(ds: Mapping[str, Any], w: _Ledger) -> None:
    if elasticity_enabled(ds):
        return  # the elastic batch replaces these keys (translate_elasticity says what happens to them)
    if not any(k in ds for k in K.TRIAD):
        w.notes.append("no batch-size keys: fspeed's train.micro_batch_size / grad_accum are used "
                       "(DeepSpeed itself needs train_batch_size or train_micro_batch_size_per_gpu)")
        return
    for ds_key, fspeed_key in K.TRIAD.items():  # absent ones are derived, so they are emitted as null
        w.emit(ds_key if ds_key in ds else f"{ds_key} (absent)", fspeed_key, ds.get(ds_key))


def _train_scalars(ds: Mapping[str, Any], w: _Ledger) -> None:
    if "gradient_clipping" not in ds:
        w.notes.append(f"gradient_clipping absent: DeepSpeed's current default {K.GRADIENT_CLIPPING_DEFAULT} is "
                       "used (it was 0.0, i.e. off, before DeepSpeed PR #8068)")
    w.emit("gradient_clipping", "train.gradient_clipping", ds.get("gradient_clipping", K.GRADIENT_CLIPPING_DEFAULT))
    w.emit("steps_per_print", "train.steps_per_print", ds.get("steps_per_print"))


def _precision(ds: Mapping[str, Any], w: _Ledger) -> None:
    if "bf16" in ds and "bfloat16" in ds:
        w.problems.append(Problem("bfloat16", "both bf16 and its legacy alias bfloat16 are set; DeepSpeed reads only "
                                  "bf16 and ignores bfloat16: keep one", ds["bfloat16"]))
    bf16_name = "bf16" if "bf16" in ds else "bfloat16"
    blocks = {"fp16": (ds.get("fp16"), K.FP16_KEYS, K.FP16_UNSUPPORTED, {}),
              bf16_name: (ds.get(bf16_name), K.BF16_KEYS, K.BF16_UNSUPPORTED, K.BF16_NO_EFFECT)}
    enabled: list[str] = []
    for name, (raw, keys, unsupported, no_effect) in blocks.items():
        if raw is None or (block := w.block(name, raw)) is None:
            continue
        for key, value in block.items():
            if key not in keys and key not in unsupported and key not in no_effect:
                w.unknown(f"{name}.{key}", value, [*keys, *unsupported, *no_effect])
        on = block.get("enabled", False)
        if _has_auto(on):
            w.problems.append(Problem(f"{name}.enabled", "unresolved placeholder", on, hint=AUTO_HINT))
        elif on is True:
            enabled.append(name)
        elif on is not False:
            w.problems.append(Problem(f"{name}.enabled", "expected true or false", on))
        elif block:
            w.accept(name, dict(block), "block disabled")
    if len(enabled) > 1:
        w.problems.append(Problem("fp16.enabled", "fp16 and bf16 cannot both be enabled (DeepSpeed asserts this too)", True))
        return
    mode = {"fp16": "fp16", bf16_name: "bf16"}[enabled[0]] if enabled else "fp32"
    w.overrides.insert(0, format_override("precision", mode))
    w.mapping.insert(0, (f"{enabled[0]}.enabled" if enabled else "fp16/bf16 (absent or disabled)",
                         f"precision={mode}"))
    if enabled:
        name = enabled[0]
        raw, keys, unsupported, no_effect = blocks[name]
        for key, default in keys.items():
            if key != "enabled":
                w.emit(f"{name}.{key}", f"precision.{key}", raw.get(key, default))
        for key, default in unsupported.items():
            if key in raw:
                _at_default(w, f"{name}.{key}", raw[key], default, "DeepSpeed's default")
        for key, reason in no_effect.items():
            if key in raw:
                w.accept(f"{name}.{key}", raw[key], reason)
    _data_types(ds, mode, w)


def _dtype(w: _Ledger, ds_key: str, value: Any) -> str | None:
    name = K.DTYPE_ALIASES.get(value) if isinstance(value, str) else None
    if name is None:
        w.unsupported(ds_key, value, "fp32, fp16, bf16", "unknown dtype")
    return name


def _data_types(ds: Mapping[str, Any], mode: str, w: _Ledger) -> None:
    block = w.block("data_types", ds["data_types"]) if "data_types" in ds else {}
    if block is None:
        return
    for key, value in block.items():
        if key not in K.DATA_TYPES_KEYS:
            w.unknown(f"data_types.{key}", value, K.DATA_TYPES_KEYS)
    accum = block.get("grad_accum_dtype")
    if accum is None:
        if mode != "fp32":
            w.notes.append(f"data_types.grad_accum_dtype unset: DeepSpeed would accumulate gradients in {mode}; "
                           f"fspeed accumulates in fp32 (DeepSpeed #2768). Set it to \"{mode}\" to match DeepSpeed")
    elif (name := _dtype(w, "data_types.grad_accum_dtype", accum)) is not None:
        if mode == "fp32":
            _at_default(w, "data_types.grad_accum_dtype", name, "fp32", "fp32 training accumulates in fp32",
                        "fp32 training accumulates in fp32")
        else:
            w.emit("data_types.grad_accum_dtype", "precision.grad_accum_dtype", name)
    for key in ("param_dtype", "buffer_dtype"):
        value = block.get(key)
        if value is not None and (name := _dtype(w, f"data_types.{key}", value)) is not None:
            _at_default(w, f"data_types.{key}", name, mode, f"matches the {mode} precision mode",
                        f"must match the {mode} precision mode")


def _optimizer(ds: Mapping[str, Any], w: _Ledger) -> None:
    if "optimizer" not in ds:
        w.notes.append("no optimizer block (DeepSpeed would expect a client optimizer): fspeed's configured "
                       "optimizer is used")
        return
    block = w.block("optimizer", ds["optimizer"])
    if block is None:
        return
    for key, value in block.items():
        if key not in K.OPTIMIZER_BLOCK_KEYS:
            w.unknown(f"optimizer.{key}", value, K.OPTIMIZER_BLOCK_KEYS)
    if "legacy_fusion" in block:
        _at_default(w, "optimizer.legacy_fusion", block["legacy_fusion"], False, "DeepSpeed's default")
    ds_type = block.get("type")
    params = w.block("optimizer.params", block.get("params") or {})
    if params is None:
        return
    if "type" not in block:
        w.problems.append(Problem("optimizer.type", "missing", allowed="Adam, AdamW, Lamb, SGD"))
        return
    if not isinstance(ds_type, str):
        w.problems.append(Problem("optimizer.type", "expected a string", ds_type, "Adam, AdamW, Lamb, SGD"))
        return
    if "max_grad_norm" in params:
        w.problems.append(Problem("optimizer.params.max_grad_norm", "not supported as an optimizer parameter "
                                  "(DeepSpeed rejects it too); use the top-level gradient_clipping",
                                  params["max_grad_norm"]))
    lower = ds_type.lower()
    consumed: set[str] = set()
    if lower in ("adam", "adamw"):
        consumed = {"torch_adam", "adam_w_mode", "max_grad_norm"}
        torch_adam = params.get("torch_adam", False)
        adam_w_mode = params.get("adam_w_mode", True)
        kind = "adamw" if lower == "adamw" or adam_w_mode else "adam"
        if lower == "adam" and "adam_w_mode" not in params:
            w.notes.append('optimizer type "Adam" without adam_w_mode is AdamW in DeepSpeed (adam_w_mode defaults to '
                           'true): translated to optimizer=adamw; set "adam_w_mode": false for classic L2 Adam')
        if lower == "adamw" and adam_w_mode is False:
            w.notes.append('optimizer type "AdamW" is AdamW in DeepSpeed whatever adam_w_mode says')
        family = "adam"
        defaults = dict(K.OPTIMIZER_PARAMS[kind])
        if torch_adam:
            defaults = {**K.TORCH_ADAM_PARAMS, "weight_decay": K.TORCH_ADAM_WEIGHT_DECAY[kind], "bias_correction": True}
            w.notes.append(f"torch_adam: true uses torch.optim.{'AdamW' if kind == 'adamw' else 'Adam'} defaults "
                           f"(weight_decay {defaults['weight_decay']}); numerics match fspeed's {kind}")
            if "bias_correction" in params:
                w.problems.append(Problem("optimizer.params.bias_correction", "not a parameter of torch.optim's "
                                          "Adam/AdamW (torch_adam: true); DeepSpeed would fail too",
                                          params["bias_correction"]))
    elif lower in ("lamb", "sgd"):
        kind = family = lower
        defaults = dict(K.OPTIMIZER_PARAMS[kind])
        consumed = {"max_grad_norm"}
        if lower == "sgd" and ds_type != "SGD":
            w.notes.append(f"optimizer type {ds_type!r} read as SGD (DeepSpeed looks up torch.optim.SGD case-sensitively)")
    elif lower in K.ONEBIT_TYPES:
        kind = family = K.ONEBIT_TYPES[lower]
        defaults = dict(K.OPTIMIZER_PARAMS[kind])
        consumed = {"max_grad_norm"}
    else:
        what = ("a DeepSpeed optimizer fspeed does not translate yet" if lower in K.DEEPSPEED_ONLY_OPTIMIZERS
                else "unknown optimizer type")
        guess = did_you_mean(ds_type, ["Adam", "AdamW", "Lamb", "SGD", "OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
        w.problems.append(Problem("optimizer.type", what, ds_type, "Adam, AdamW, Lamb, SGD, OneBitAdam, ZeroOneAdam, "
                                  "OneBitLamb (case-insensitive)",
                                  f"did you mean {guess!r}?" if guess and lower not in K.DEEPSPEED_ONLY_OPTIMIZERS else None))
        return
    w.overrides.insert(0, format_override("optimizer", kind))
    w.mapping.insert(0, ("optimizer.type", f"optimizer={kind}"))
    unsupported = K.OPTIMIZER_UNSUPPORTED_PARAMS[family]
    no_effect = K.OPTIMIZER_NO_EFFECT_PARAMS[family]
    for key, value in params.items():
        ds_key = f"optimizer.params.{key}"
        if key in consumed or key in defaults:
            continue
        if key in unsupported:
            _at_default(w, ds_key, value, unsupported[key], "DeepSpeed's default")
        elif key in no_effect:
            w.accept(ds_key, value, no_effect[key])
        else:
            w.unknown(ds_key, value, [*defaults, *unsupported, *no_effect, *(consumed - {"max_grad_norm"})])
    for key, default in defaults.items():
        value = params.get(key, default)
        if key == "lr" and isinstance(value, list):
            w.unsupported(f"optimizer.params.{key}", value, "a single number", "per-parameter-group values are not supported")
            continue
        w.emit(f"optimizer.params.{key}" if key in params else f"optimizer.params.{key} (default)", f"optimizer.{key}", value)
    if kind == "adam":
        w.emit("optimizer.params.adam_w_mode", "optimizer.adam_w_mode", False)


def _scheduler(ds: Mapping[str, Any], w: _Ledger) -> None:
    if "scheduler" not in ds:
        w.overrides.insert(0, format_override("scheduler", "constant"))
        w.mapping.insert(0, ("scheduler (absent)", "scheduler=constant"))
        w.notes.append("no scheduler block: DeepSpeed keeps the optimizer's lr constant, so scheduler=constant")
        return
    block = w.block("scheduler", ds["scheduler"])
    if block is None:
        return
    for key, value in block.items():
        if key not in K.SCHEDULER_BLOCK_KEYS:
            w.unknown(f"scheduler.{key}", value, K.SCHEDULER_BLOCK_KEYS)
    ds_type = block.get("type")
    params = w.block("scheduler.params", block.get("params") or {})
    if params is None:
        return
    if ds_type not in K.SCHEDULERS:
        guess = did_you_mean(str(ds_type), K.SCHEDULERS)
        w.problems.append(Problem("scheduler.type", "not a scheduler fspeed translates (DeepSpeed matches the name "
                                  "exactly, then tries torch.optim.lr_scheduler)", ds_type, ", ".join(K.SCHEDULERS),
                                  f"did you mean {guess!r}?" if guess else None))
        return
    option, defaults = K.SCHEDULERS[ds_type]
    w.overrides.insert(0, format_override("scheduler", option))
    w.mapping.insert(0, ("scheduler.type", f"scheduler={option}"))
    for key, value in params.items():
        if key == "last_batch_iteration":
            _at_default(w, f"scheduler.params.{key}", value, -1, "a fresh schedule; resume with checkpoint.resume")
        elif key not in defaults:
            w.unknown(f"scheduler.params.{key}", value, [*defaults, "last_batch_iteration"])
    for key, default in defaults.items():
        ds_key = f"scheduler.params.{key}"
        if key not in params:
            if default is K.REQUIRED:
                w.problems.append(Problem(ds_key, f"missing; DeepSpeed's {ds_type} requires it"))
                continue
            ds_key += " (default)"
        value = params.get(key, default)
        if key in K.SCHEDULER_PER_GROUP and isinstance(value, list):
            if len(value) != 1:
                w.unsupported(ds_key, value, "a single number", "per-parameter-group values are not supported")
                continue
            value = value[0]
        if key == "warmup_type" and isinstance(value, str) and value not in K.WARMUP_TYPES and value != "auto":
            w.notes.append(f"{ds_key} = {value!r} is not 'log' or 'linear'; DeepSpeed warns and uses 'log', so does fspeed")
            value = "log"
        w.emit(ds_key, f"scheduler.{key}", value)


def _zero(ds: Mapping[str, Any], w: _Ledger) -> None:
    raw = ds["zero_optimization"]
    if isinstance(raw, bool):  # legacy form
        _at_default(w, "zero_optimization", raw, False, "ZeRO disabled")
        return
    block = w.block("zero_optimization", raw)
    if block is None:
        return
    for key, value in block.items():
        if key in K.FSPEED_ONLY_ZERO_KEYS:
            w.problems.append(Problem(f"zero_optimization.{key}", "not a DeepSpeed key", value,
                                      hint=K.FSPEED_ONLY_ZERO_KEYS[key]))
        elif key not in K.ZERO_KEYS:
            w.unknown(f"zero_optimization.{key}", value, K.ZERO_KEYS)
    for first, second in K.ZERO_ALIASES:
        if first in block and second in block:
            w.problems.append(Problem(f"zero_optimization.{second}", f"set together with zero_optimization.{first}, "
                                      "its other spelling (DeepSpeed reads one field from either); keep one",
                                      block[second]))
    stage = block.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        w.problems.append(Problem("zero_optimization.stage", "not a ZeRO stage", stage, "0, 1, 2, 3"))
        return
    w.emit("zero_optimization.stage", "zero.stage", stage)
    for ds_key, key in K.ZERO_TRANSLATED.items():
        if ds_key in block:
            w.emit(f"zero_optimization.{ds_key}", f"zero.{key}", block[ds_key])
    _prefetch(block, stage, w)
    for ds_key, fixed in K.ZERO_FIXED.items():
        if ds_key in block:
            _fixed(w, f"zero_optimization.{ds_key}", block[ds_key], fixed, _unread(ds_key, stage))
    for ds_key, reason in K.ZERO_NO_EFFECT.items():
        if ds_key in block:
            w.accept(f"zero_optimization.{ds_key}", block[ds_key], reason)
    for ds_key in ("offload_optimizer", "offload_param"):
        if ds_key in block and block[ds_key] is None:
            w.accept(f"zero_optimization.{ds_key}", None, "null: nothing offloaded (DeepSpeed's default)")
        elif ds_key in block:
            _offload(ds_key, block[ds_key], w)
    _legacy_offload(block, w)


def _unread(ds_key: str, stage: int) -> str | None:
    """Why any value of zero_optimization.`ds_key` has no effect at `stage` (DeepSpeed does not read
    it there), or None when DeepSpeed reads it."""
    stages = K.ZERO_READ_AT.get(ds_key, (1, 2, 3))
    if stage in stages:
        return None
    return f"DeepSpeed reads it only at stage {'/'.join(map(str, stages))}; this config is stage {stage}"


def _prefetch(block: Mapping[str, Any], stage: int, w: _Ledger) -> None:
    """stage3_prefetch_bucket_size (or prefetch_bucket_size) -> zero.prefetch: 0 turns prefetching
    off; DeepSpeed's default turns it on (fspeed prefetches one block ahead). Other sizes cannot be
    honoured, so they are errors where DeepSpeed reads them (stage 3)."""
    for ds_key in K.PREFETCH_KEYS:
        if ds_key not in block:
            continue
        name, value = f"zero_optimization.{ds_key}", block[ds_key]
        if _same(value, 0) or _same(value, K.PREFETCH_BUCKET_DEFAULT):
            w.emit(name, "zero.prefetch", bool(value))
            if value and stage == 3:
                w.notes.append(f"{name} = {show_value(value)} (DeepSpeed's default): fspeed prefetches one block "
                               "ahead rather than up to that many elements")
        elif (unread := _unread(ds_key, stage)) is not None and not _has_auto(value):
            w.accept(name, value, unread)
        else:
            w.unsupported(name, value, f"0 (no prefetch) or {K.PREFETCH_BUCKET_DEFAULT} (DeepSpeed's default: "
                          "prefetch on)", "fspeed prefetches exactly one block ahead, not a number of elements")


def _offload(name: str, raw: Any, w: _Ledger) -> None:
    """An offload block: device cpu / none and pin_memory (and ratio 1.0) translate; NVMe-only and
    tuning keys are accepted by name as having no effect; nvme, partial offload and unknown keys are errors."""
    ds_name = f"zero_optimization.{name}"
    block = w.block(ds_name, raw)
    if block is None:
        return
    translated, no_effect, unsupported = K.OFFLOAD_TRANSLATED[name], K.OFFLOAD_NO_EFFECT[name], K.OFFLOAD_UNSUPPORTED[name]
    known = [*translated, *no_effect, *unsupported]
    for key, value in block.items():
        if key not in known:
            w.unknown(f"{ds_name}.{key}", value, known)
    device = block.get("device", "none")
    device = "none" if device is None else device
    if device == "nvme":
        w.unsupported(f"{ds_name}.device", device, "'none', 'cpu'", "NVMe offload is not supported by fspeed")
        return
    if device not in ("none", "cpu"):
        w.unsupported(f"{ds_name}.device", device, "'none', 'cpu'", "not an offload device")
        return
    if device == "none":
        w.accept(ds_name, dict(block), "device none: nothing offloaded")
        return
    for key in translated:
        if key == "ratio" and key in block and not _same(block[key], 1.0):
            w.unsupported(f"{ds_name}.ratio", block[key], "1.0", "partial offload is not supported by fspeed")
        elif key in block:
            w.emit(f"{ds_name}.{key}", f"zero.{name}.{key}", block[key])
    for key, reason in no_effect.items():
        if key in block:
            w.accept(f"{ds_name}.{key}", block[key], reason)
    for key, default in unsupported.items():
        if key in block:
            _at_default(w, f"{ds_name}.{key}", block[key], default, "not supported by fspeed")


def _legacy_offload(block: Mapping[str, Any], w: _Ledger) -> None:
    """DeepSpeed's deprecated booleans: cpu_offload, cpu_offload_param, cpu_offload_use_pin_memory."""
    pin = block.get("cpu_offload_use_pin_memory")
    for ds_key, name in K.LEGACY_OFFLOAD.items():
        if ds_key not in block:
            continue
        value = block[ds_key]
        if not isinstance(value, bool):
            w.unsupported(f"zero_optimization.{ds_key}", value, "true, false", "expected a boolean")
        elif value and isinstance(block.get(name), Mapping):
            w.problems.append(Problem(f"zero_optimization.{ds_key}", f"conflicts with zero_optimization.{name}; "
                                      "set only the block (the boolean is deprecated)", value))
        elif value:
            w.emit(f"zero_optimization.{ds_key}", f"zero.{name}.device", "cpu")
            if pin is not None:
                w.emit("zero_optimization.cpu_offload_use_pin_memory", f"zero.{name}.pin_memory", pin)
        else:
            w.accept(f"zero_optimization.{ds_key}", value, "nothing offloaded")
    if pin is not None and not any(block.get(k) is True for k in K.LEGACY_OFFLOAD):
        w.accept("zero_optimization.cpu_offload_use_pin_memory", pin, "nothing offloaded by the legacy booleans")


def _tensor_parallel(ds: Mapping[str, Any], w: _Ledger) -> None:
    block = w.block("tensor_parallel", ds["tensor_parallel"])
    if block is None:
        return
    for key, value in block.items():
        if key == "autotp_size":
            if value:
                w.emit("tensor_parallel.autotp_size", "parallel.tensor", value)
            else:
                w.accept("tensor_parallel.autotp_size", value, "0: tensor parallelism off")
        else:
            w.unsupported(f"tensor_parallel.{key}", value, "autotp_size only (fspeed slices by logical-axis rules)")


def _comms_logger(ds: Mapping[str, Any], w: _Ledger) -> None:
    """`comms_logger` -> fspeed's comm log (comms_logger.enabled / verbose). fspeed logs every
    collective under its op name: prof_all and debug only at DeepSpeed's defaults."""
    block = w.block("comms_logger", ds["comms_logger"])
    if block is None:
        return
    for key, value in block.items():
        if key not in K.COMMS_LOGGER_KEYS:
            w.unknown(f"comms_logger.{key}", value, K.COMMS_LOGGER_KEYS)
    for key in K.COMMS_LOGGER_TRANSLATED:
        if key in block:
            w.emit(f"comms_logger.{key}", f"comms_logger.{key}", block[key])
    for key, fixed in K.COMMS_LOGGER_FIXED.items():
        if key in block:
            _fixed(w, f"comms_logger.{key}", block[key], fixed)
    if "prof_ops" in block and _same(block.get("prof_all", True), True):
        w.accept("comms_logger.prof_ops", block["prof_ops"], "no effect while prof_all is true: every op is logged")
    if block.get("enabled", False) is False:
        w.notes.append("comms_logger.enabled is false: DeepSpeed 0.19 turns its comms logger on whenever the "
                       "comms_logger block is present (it reads only the block's presence); fspeed follows enabled")


def _activation_checkpointing(ds: Mapping[str, Any], w: _Ledger) -> None:
    """`activation_checkpointing` -> fspeed's (fspeed.rematerialization). In DeepSpeed the
    block configures the checkpointing a model's code turns on; a block that turns a setting on
    turns fspeed's checkpointing on (policy full, every block) for the model fspeed trains.
    number_checkpoints sizes DeepSpeed's contiguous buffers; fspeed's buffer sizes itself."""
    defaults = K.ACTIVATION_CHECKPOINTING_KEYS
    block = w.known_block("activation_checkpointing", ds["activation_checkpointing"], defaults)
    if block is None:
        return
    if all(key in defaults and _same(value, defaults[key]) for key, value in block.items()):
        w.accept("activation_checkpointing", dict(block), K.ACTIVATION_CHECKPOINTING_DEFAULT_REASON)
        return
    if block.get("number_checkpoints") is not None:
        w.accept("activation_checkpointing.number_checkpoints", block["number_checkpoints"],
                 "sizes DeepSpeed's contiguous checkpoint buffers; fspeed's buffer grows to what a step keeps")
    for key in K.ACTIVATION_CHECKPOINTING_TRANSLATED:
        if key in block:
            w.emit(f"activation_checkpointing.{key}", f"activation_checkpointing.{key}", block[key])
    if any(block.get(key) is True for key in K.ACTIVATION_CHECKPOINTING_TRANSLATED):
        w.emit("activation_checkpointing (a setting on)", "activation_checkpointing.policy", "full")


def _checkpointing_on(ds: Mapping[str, Any]) -> bool:
    """Whether the `activation_checkpointing` block turns a setting on (see `_activation_checkpointing`)."""
    block = ds.get("activation_checkpointing")
    return isinstance(block, Mapping) and any(block.get(key) is True for key in K.ACTIVATION_CHECKPOINTING_TRANSLATED)


def _pipeline(ds: Mapping[str, Any], w: _Ledger) -> None:
    """`pipeline` -> parallel.pipe and the pipeline section. DeepSpeed's engine runs 1F1B with
    gradient_accumulation_steps micro-batches, as fspeed's default; `partition` "best" is its
    PipelineModule default, partition_method "parameters"; fspeed always seeds every layer from
    (seed, step, micro-batch, layer), which is what seed_layers asks for."""
    block = w.known_block("pipeline", ds["pipeline"], K.PIPELINE_KEYS)
    if block is None:
        return
    if all(key in K.PIPELINE_KEYS and _same(value, K.PIPELINE_KEYS[key]) for key, value in block.items()):
        w.accept("pipeline", dict(block), "DeepSpeed's defaults: stages from the model (fspeed: parallel.pipe), "
                 "partition by parameters, no layer checkpointing")
        return
    stages = block.get("stages", "auto")
    if stages != "auto":
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            w.unsupported("pipeline.stages", stages, '"auto" or a positive integer')
        else:
            w.emit("pipeline.stages", "parallel.pipe", stages)
    partition = block.get("partition", "best")
    if partition == "best":
        w.accept("pipeline.partition", partition, "DeepSpeed's default: PipelineModule's partition_method "
                 "'parameters', fspeed's pipeline.partition default")
    elif isinstance(partition, str) and (partition.lower() in ("uniform", "parameters", "profile") or
                                         partition.lower().startswith("type:")):
        w.emit("pipeline.partition", "pipeline.partition", partition)  # profile: DeepSpeed names it, fspeed runs it
    else:
        w.unsupported("pipeline.partition", partition, "best, uniform, parameters, type:<regex>, profile")
    if "seed_layers" in block:
        w.accept("pipeline.seed_layers", block["seed_layers"], "fspeed always seeds each layer from (seed, step, "
                 "micro-batch, layer): the masks do not depend on the stage a layer runs on")
    if "activation_checkpoint_interval" in block:
        w.emit("pipeline.activation_checkpoint_interval", "pipeline.activation_checkpoint_interval",
               block["activation_checkpoint_interval"])
    elif isinstance(stages, int) and stages > 1 and _checkpointing_on(ds):
        # the activation_checkpointing block turns fspeed's checkpointing on for every block; the stages
        # checkpoint their layers one by one (DeepSpeed's PipelineModule interval 1)
        w.emit("pipeline (with activation_checkpointing on)", "pipeline.activation_checkpoint_interval", 1)
    for key in ("pipe_partitioned", "grad_partitioned"):
        if key in block:
            w.accept(f"pipeline.{key}", block[key], K.PIPELINE_PARTITIONED_REASON)


def _event_monitor(ds: Mapping[str, Any], name: str, w: _Ledger) -> None:
    """`csv_monitor` / `tensorboard`: enabled -> the monitor's switch; output_path/job_name -> its
    directory `<output_path>/<job_name>` (DeepSpeed's layout). With output_path empty fspeed writes
    in the run directory (or its `tensorboard/`), under job_name when job_name is not the default."""
    keys = K.CSV_MONITOR_KEYS if name == "csv_monitor" else K.TENSORBOARD_KEYS
    block = w.known_block(name, ds[name], keys)
    if block is None:
        return
    switch, dir_key, default_dir = K.EVENT_DIRS[name]
    w.emit(f"{name}.enabled", switch, block.get("enabled", False))
    path, job = block.get("output_path", ""), block.get("job_name", keys["job_name"])
    if not isinstance(path, str) or not isinstance(job, str) or not job:
        w.problems.append(Problem(f"{name}.output_path/job_name", "expected a directory and a non-empty job name "
                                  "(strings)", {"output_path": path, "job_name": job}))
    elif path:
        w.emit(f"{name}.output_path/job_name", dir_key, f"{path.rstrip('/')}/{job}")
    elif _same(job, keys["job_name"]):
        if "output_path" in block or "job_name" in block:
            w.accept(f"{name}.output_path/job_name", {"output_path": path, "job_name": job},
                     "DeepSpeed's defaults; fspeed writes in the run directory")
    else:
        w.emit(f"{name}.job_name", dir_key, f"{default_dir}/{job}")


def _wandb(ds: Mapping[str, Any], w: _Ledger) -> None:
    """`wandb`: enabled, group, team (W&B entity), project (DeepSpeed's default "deepspeed")."""
    block = w.known_block("wandb", ds["wandb"], K.WANDB_KEYS)
    if block is None:
        return
    on = block.get("enabled", False)
    w.emit("wandb.enabled", "monitor.wandb", on)
    for key, fspeed_key in K.WANDB_TRANSLATED.items():
        if key in block or (key == "project" and on is True):
            w.emit(f"wandb.{key}", fspeed_key, block.get(key, K.WANDB_KEYS[key]))
    if on is True:
        w.notes.append("wandb: fspeed runs W&B offline (no network; `wandb sync` uploads the run later); "
                       "monitor.wandb_mode=online logs live as DeepSpeed does")


def _flops_profiler(ds: Mapping[str, Any], w: _Ledger) -> None:
    """`flops_profiler` -> the flops_profiler section, key for key."""
    block = w.known_block("flops_profiler", ds["flops_profiler"], K.FLOPS_PROFILER_KEYS)
    for key, value in (block or {}).items():
        if key in K.FLOPS_PROFILER_KEYS:
            w.emit(f"flops_profiler.{key}", f"flops_profiler.{key}", value)


def _sparse_attention(ds: Mapping[str, Any], w: _Ledger) -> None:
    """`sparse_attention` -> model.attention=sparse and the sparse_attention section, parsed as
    DeepSpeed's engine parses it: only the keys the mode reads count (bigbird and bslongformer
    do not read `attention`); the others are listed as having no effect."""
    from fspeed.sparse.config import MODE_KEYS, MODES

    block = w.block("sparse_attention", ds["sparse_attention"])
    if block is None:
        return
    mode = block.get("mode", "fixed")
    if mode not in MODES:
        w.problems.append(Problem("sparse_attention.mode", "not a sparsity mode (DeepSpeed raises "
                                  "NotImplementedError)", mode, ", ".join(MODES)))
        return
    known = {key for keys in MODE_KEYS.values() for key in keys} | {"mode", "attention"}
    w.emit("sparse_attention", "model.attention", "sparse")
    w.emit("sparse_attention.mode", "sparse_attention.mode", mode)
    for key, value in block.items():
        if key == "mode":
            continue
        if key not in known:
            w.unknown(f"sparse_attention.{key}", value, sorted(known))
        elif key in MODE_KEYS[mode]:
            w.emit(f"sparse_attention.{key}", f"sparse_attention.{key}", value)
        else:
            w.accept(f"sparse_attention.{key}", value, f"DeepSpeed's parser ignores it for mode {mode!r}")


AUTOTUNING_HANDOVER = ("an enabled block runs the tuner: fspeed-autotune deepspeed_config=<file> --nproc N, or "
                       "fspeed-train --launch deepspeed_config=<file> parallel.data=N; a training run takes the "
                       "tuned config (ds_config.json of the tuning) without the block")


def _other(key: str, value: Any, w: _Ledger) -> None:
    if key in K.NO_EFFECT:
        w.accept(key, value, K.NO_EFFECT[key])
    elif key in K.SCALAR_DEFAULTS:
        _fixed(w, key, value, K.SCALAR_DEFAULTS[key])
    elif key == "autotuning":  # fspeed-train and fspeed-autotune hand an enabled block to the tuner
        if value is None or value == {} or (isinstance(value, Mapping) and value.get("enabled") is False):
            w.accept(key, value, "disabled: no tuning, as in DeepSpeed")
        else:
            w.unsupported("autotuning.enabled", value.get("enabled", value) if isinstance(value, Mapping) else value,
                          "false (disabled) here", AUTOTUNING_HANDOVER)
    elif key in K.ENABLED_BLOCKS:
        if value is None or value == {} or (isinstance(value, Mapping) and value.get("enabled") is False):
            w.accept(key, value, K.ENABLED_BLOCK_REASON)
        else:
            shown = value.get("enabled", value) if isinstance(value, Mapping) else value
            w.unsupported(f"{key}.enabled" if isinstance(value, Mapping) else key, shown, "false (disabled)")
    elif key in K.BLOCK_DEFAULTS:
        block = w.block(key, value)
        defaults, why = K.BLOCK_DEFAULTS[key]
        if block is not None and _check_defaults(w, key, block, defaults):
            w.accept(key, dict(block), why)
    else:
        w.unknown(key, value, K.ALL_TOP_LEVEL)


def _untested_optimizer(ds: Mapping[str, Any], w: _Ledger) -> None:
    """zero_allow_untested_optimizer: DeepSpeed asserts under ZeRO (stage >= 1) for an optimizer
    outside its tested list (of the translated ones: Lamb and SGD) unless it is true. fspeed runs
    SGD there; Lamb's per-tensor trust ratio needs whole tensors, so fspeed refuses it under ZeRO."""
    key = "zero_allow_untested_optimizer"
    allow = ds.get(key, False)
    if not isinstance(allow, bool):
        w.unsupported(key, allow, "true, false", "expected a boolean")
        return
    zero, opt = ds.get("zero_optimization"), ds.get("optimizer")
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    kind = opt.get("type") if isinstance(opt, Mapping) else None
    untested = isinstance(kind, str) and kind.lower() in K.UNTESTED_ZERO_OPTIMIZERS \
        and stage in (1, 2, 3) and not isinstance(stage, bool)
    lamb = untested and kind.lower() == "lamb"
    if untested and not allow:
        w.problems.append(Problem(key, f"optimizer {kind!r} is not one of DeepSpeed's tested ZeRO optimizers; "
                                  f"DeepSpeed refuses it at zero_optimization.stage {stage} unless this is true", allow,
                                  "zero_optimization.stage 0 or optimizer Adam/AdamW (fspeed cannot run Lamb under "
                                  "ZeRO even with this flag)" if lamb else "true, or optimizer Adam/AdamW"))
        return
    if lamb:
        w.problems.append(Problem("optimizer.type", "Lamb's per-tensor trust ratio needs whole tensors: fspeed runs "
                                  f"it only without ZeRO, not at zero_optimization.stage {stage}", kind,
                                  "zero_optimization.stage 0, or optimizer Adam/AdamW/SGD"))
    if key in ds:
        w.accept(key, allow, f"lets {kind} run under ZeRO, as fspeed does" if untested else
                 "DeepSpeed checks it only for an optimizer outside its tested list under ZeRO; not the case here")


_BLOCKS = {  # top-level key -> its translator (the others: event monitors, wall_clock_breakdown, _other)
    "zero_optimization": _zero, "tensor_parallel": _tensor_parallel, "comms_logger": _comms_logger, "wandb": _wandb,
    "flops_profiler": _flops_profiler, "sparse_attention": _sparse_attention,
    "activation_checkpointing": _activation_checkpointing, "curriculum_learning": translate_curriculum_learning,
    "progressive_layer_drop": translate_progressive_layer_drop, "data_efficiency": translate_data_efficiency,
    "pipeline": _pipeline, "elasticity": translate_elasticity,
}
_HANDLED = {*K.TRIAD, "gradient_clipping", "steps_per_print", "fp16", "bf16", "bfloat16", "data_types",
            "optimizer", "scheduler", "zero_allow_untested_optimizer"}


def translate_deepspeed_config(ds: Mapping[str, Any]) -> DeepSpeedTranslation:
    """Hydra overrides equivalent to the DeepSpeed config `ds` (group choices first).

    Raises `DeepSpeedConfigError` listing every unknown, unsupported or unresolved ("auto") key.
    """
    if not isinstance(ds, Mapping):
        raise DeepSpeedConfigError([Problem("", "a DeepSpeed config is a JSON object", ds)])
    w = _Ledger()
    _batch(ds, w)
    _train_scalars(ds, w)
    _optimizer(ds, w)
    _scheduler(ds, w)
    _precision(ds, w)
    _untested_optimizer(ds, w)
    for key, value in ds.items():
        translate = _BLOCKS.get(key)
        if translate is not None:
            translate(ds, w)
        elif key in K.EVENT_DIRS:
            _event_monitor(ds, key, w)
        elif key == "wall_clock_breakdown":
            w.emit(key, key, value)
        elif key not in _HANDLED:
            _other(key, value, w)
    if w.problems:
        raise DeepSpeedConfigError(w.problems)
    return DeepSpeedTranslation(tuple(w.overrides), tuple(w.mapping), tuple(w.no_effect), tuple(w.notes))
