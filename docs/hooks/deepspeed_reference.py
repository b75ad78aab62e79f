"""The DeepSpeed key table, generated from the translator (`fspeed.config.deepspeed`) and its key
tables (`fspeed.config.deepspeed_keys`).

Where a key goes is asked of the translator itself: probe configs that set every translated key
are translated, and each mapping it reports (DeepSpeed key -> fspeed override) becomes a row. The
keys accepted only at DeepSpeed's default, accepted with no effect, or refused come from the
tables the translator reads, with the reasons it prints.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Iterable

from fspeed.config import deepspeed_efficiency as E
from fspeed.config import deepspeed_elasticity as EL
from fspeed.config import deepspeed_keys as K
from fspeed.config.deepspeed import AUTOTUNING_HANDOVER, translate_deepspeed_config
from fspeed.sparse.config import MODE_KEYS

OPTIMIZER_TYPES = ("Adam", "AdamW", "Lamb", "SGD", "OneBitAdam", "ZeroOneAdam", "OneBitLamb")
_LOWER_TYPES = {"adam": "adamw", "adamw": "adamw", "lamb": "lamb", "sgd": "sgd", **K.ONEBIT_TYPES}


def _value(default: Any) -> Any:
    return 1.0 if default is K.REQUIRED else default


def probes() -> list[dict[str, Any]]:
    """DeepSpeed configs that between them set every key the translator takes."""
    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "steps_per_print": 10, "wall_clock_breakdown": True}
    out = [
        {**base, "fp16": {**K.FP16_KEYS, "enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
        {**base, "bf16": {**K.BF16_KEYS, "enabled": True}},
        {**base, "bfloat16": {**K.BF16_KEYS, "enabled": True}},
    ]
    for ds_type in OPTIMIZER_TYPES:
        params = dict(K.OPTIMIZER_PARAMS[_LOWER_TYPES[ds_type.lower()]])
        out.append({**base, "optimizer": {"type": ds_type, "params": params}})
    out.append({**base, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "torch_adam": True}}})
    for ds_type, (_, params) in K.SCHEDULERS.items():
        out.append({**base, "scheduler": {"type": ds_type, "params": {k: _value(v) for k, v in params.items()}}})
    zero_keys = [dict(stage=3)]
    for spelling in (0, 1):
        block: dict[str, Any] = {"stage": 3, K.PREFETCH_KEYS[spelling]: K.PREFETCH_BUCKET_DEFAULT}
        for ds_key in K.ZERO_TRANSLATED:
            aliases = [pair for pair in K.ZERO_ALIASES if ds_key in pair]
            if not aliases or aliases[0][spelling] == ds_key:
                block[ds_key] = 1000
        block["overlap_comm"] = True
        block["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": 1.0}
        block["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero_keys.append(block)
    zero_keys.append({"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True})
    zero_keys.append({"stage": 3, "cpu_offload": True, "cpu_offload_param": True})
    out += [{**base, "zero_optimization": block} for block in zero_keys]
    out.append({**base, **{name: {"enabled": True, "output_path": "out", "job_name": "job"}
                           for name in ("csv_monitor", "tensorboard")},
                "wandb": {"enabled": True, "group": "g", "team": "t", "project": "p"},
                "flops_profiler": {**K.FLOPS_PROFILER_KEYS, "enabled": True},
                "comms_logger": {"enabled": True, "verbose": True},
                "tensor_parallel": {"autotp_size": 2},
                "activation_checkpointing": {key: True for key in K.ACTIVATION_CHECKPOINTING_TRANSLATED
                                             if key != "contiguous_memory_optimization"},
                "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.001}})
    out.append({**base, "activation_checkpointing": {"contiguous_memory_optimization": True}})
    elastic = {k: v for k, v in EL.ELASTICITY_KEYS.items() if k != "min_time"}
    out.append({k: v for k, v in base.items() if k not in K.TRIAD} | {"elasticity": {**elastic, "enabled": True}})
    out.append({**base, "pipeline": {"stages": 2, "partition": "uniform", "activation_checkpoint_interval": 1}})
    for mode, keys in MODE_KEYS.items():
        from fspeed.sparse.config import SparseAttentionConfig  # noqa: PLC0415

        defaults = SparseAttentionConfig()
        out.append({**base, "sparse_attention": {"mode": mode, **{k: _json(getattr(defaults, k)) for k in keys}}})
    for kind, keys in E.SCHEDULE_KEYS.items():
        config = {"total_curriculum_step": 10, "difficulty_step": 8, "root_degree": 2, "difficulty": [8, 16],
                  "max_step": [5]}
        out.append({**base, "curriculum_learning": {
            "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 16,
            "schedule_type": kind, "schedule_config": {k: config[k] for k in keys}}})
    return out


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def taken() -> dict[str, list[str]]:
    """{DeepSpeed key: [fspeed keys it sets]}, as the translator reports on the probes."""
    found: dict[str, list[str]] = defaultdict(list)
    for ds in probes():
        for ds_key, override in translate_deepspeed_config(ds).mapping:
            ds_key = re.sub(r" \(.*\)$", "", ds_key)
            if "/" in ds_key and ds_key.startswith("fp16/"):
                continue  # "fp16/bf16 (absent)": fp32
            target = override.split("=", 1)[0]
            if override.startswith(("optimizer=", "scheduler=", "precision=")) or target == "model.attention":
                target = override
            if target not in found[ds_key]:
                found[ds_key].append(target)
    return dict(found)


# ------------------------------------------------------------------------------------- page


class Page:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.keys: set[str] = set()

    def section(self, title: str, text: str = "") -> None:
        self.lines += ["", f"## {title}", ""]
        if text:
            self.lines += [text, ""]
        self.lines += ["| DeepSpeed key | in fspeed | why |", "|---|---|---|"]

    def row(self, key: str, fate: str, why: str = "") -> None:
        self.keys.add(key)
        self.lines.append(f"| `{key}` | {_cell(fate)} | {_cell(why)} |")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict) and not value:
        return "{}"
    return str(value)


def _to(targets: Iterable[str]) -> str:
    return "taken: " + ", ".join(f"`{t}`" for t in targets)


def _kept(default: Any) -> str:
    return f"kept at DeepSpeed's default `{_show(default)}`; other values refused"


NO_EFFECT = "accepted, no effect"
TAKEN_WHY = {  # what a taken key's row needs said besides its target
    "activation_checkpointing": "a block that turns one of its settings on turns fspeed's checkpointing on "
                                "(policy full, every block)",
    "sparse_attention": "the block's presence: every layer's attention is block-sparse",
    "zero_optimization.stage3_prefetch_bucket_size": "0 turns prefetch off; DeepSpeed's default turns it on",
    "zero_optimization.prefetch_bucket_size": "0 turns prefetch off; DeepSpeed's default turns it on",
    "zero_optimization.cpu_offload": "DeepSpeed's legacy boolean: true is device cpu",
    "zero_optimization.cpu_offload_param": "DeepSpeed's legacy boolean: true is device cpu",
    "csv_monitor.output_path/job_name": "the directory <output_path>/<job_name>",
    "tensorboard.output_path/job_name": "the directory <output_path>/<job_name>",
    "tensor_parallel.autotp_size": "0 leaves tensor slicing off",
    "elasticity.enabled": "true: the global batch is DeepSpeed's elastic batch, the micro-batch and accumulation "
                          "are computed for the data-parallel world the run starts on (a world outside the valid "
                          "sizes is an error listing them)",
    "elasticity.ignore_non_elastic_batch_info": "false: train_batch_size, train_micro_batch_size_per_gpu or "
                                                "gradient_accumulation_steps beside an enabled block is an error, as "
                                                "in DeepSpeed; true: they are ignored",
    "elasticity.model_parallel_size": "version 0.2; must be 1 or parallel.tensor x parallel.pipe",
}


def render() -> str:
    """The DeepSpeed key page as Markdown."""
    t = taken()
    p = Page()
    p.lines += [
        "# DeepSpeed keys",
        "",
        "`fspeed-train deepspeed_config=ds_config.json` (and `fs.initialize(model, \"ds_config.json\")`) read a "
        "DeepSpeed config as it is. Each key is **taken** (translated into the fspeed key shown; "
        "[configuration reference](config.md)), **kept at DeepSpeed's default** (accepted only at the value "
        "where DeepSpeed does what fspeed does; any other value is an error), **accepted with no effect** "
        "(DeepSpeed itself ignores it in fspeed's setting), or **refused** with the reason. An unknown key is an "
        "error with a did-you-mean, and a Hugging Face `\"auto\"` placeholder is an error: resolve it first. "
        "Every translation prints its account (`ds_key -> override`, the keys with no effect and why).",
        "",
        "This page is generated from the translator (`fspeed/config/deepspeed.py`, "
        "`fspeed/config/deepspeed_keys.py`).",
    ]

    def taken_rows(prefix: str) -> None:
        for key in sorted(k for k in t if k == prefix or k.startswith(prefix + ".")):
            p.row(key, _to(t[key]), TAKEN_WHY.get(key, ""))

    p.section("Batch, clipping and logging")
    for key in (*K.TRIAD, "gradient_clipping", "steps_per_print", "wall_clock_breakdown"):
        why = {"gradient_clipping": f"absent: DeepSpeed's current default {K.GRADIENT_CLIPPING_DEFAULT}"}.get(key, "")
        p.row(key, _to(t[key]), why)
    p.row("zero_allow_untested_optimizer", "checked, as DeepSpeed checks it", "must be true for Lamb or SGD under "
          "ZeRO, as DeepSpeed requires; fspeed then runs SGD and refuses Lamb (its trust ratio needs whole tensors)")

    p.section("Precision: `fp16`, `bf16`, `data_types`",
              "With neither block enabled the run is fp32 (`precision=fp32`). `bfloat16` is DeepSpeed's legacy "
              "alias of `bf16`.")
    for name in ("fp16", "bf16", "bfloat16"):
        taken_rows(name)
    for name, table in (("fp16", K.FP16_UNSUPPORTED), ("bf16", K.BF16_UNSUPPORTED)):
        for key, default in table.items():
            p.row(f"{name}.{key}", _kept(default), "not supported by fspeed")
    for key, why in K.BF16_NO_EFFECT.items():
        p.row(f"bf16.{key}", NO_EFFECT, why)
    taken_rows("data_types")
    for key in ("param_dtype", "buffer_dtype"):
        p.row(f"data_types.{key}", "accepted when it matches the precision mode; other values refused",
              "fspeed computes in the precision mode's dtype")

    p.section("Optimizer", "The type is case-insensitive, as in DeepSpeed; `Adam` is AdamW unless "
              "`adam_w_mode` is false. Every type's `params.*` go to `optimizer.<same name>`.")
    for ds_type in OPTIMIZER_TYPES:
        kind = _LOWER_TYPES[ds_type.lower()]
        p.row(f"optimizer.type: {ds_type}", f"taken: `optimizer={kind}`",
              "adam_w_mode: false gives `optimizer=adam`" if ds_type == "Adam" else "")
    params = sorted({k for k in t if k.startswith("optimizer.params.")})
    for key in params:
        p.row(key, _to(t[key]))
    p.row("optimizer.params.torch_adam", NO_EFFECT.replace("no effect", "torch.optim's defaults"),
          "true: torch.optim.Adam/AdamW defaults (AdamW weight_decay 0.01); same numerics as fspeed's")
    p.row("optimizer.params.max_grad_norm", "refused", "DeepSpeed rejects it too; use the top-level gradient_clipping")
    p.row("optimizer.legacy_fusion", _kept(False))
    for kind, table in K.OPTIMIZER_UNSUPPORTED_PARAMS.items():
        for key, default in table.items():
            p.row(f"optimizer.params.{key} ({kind})", _kept(default), "not supported by fspeed")
    for kind, table in K.OPTIMIZER_NO_EFFECT_PARAMS.items():
        for key, why in table.items():
            p.row(f"optimizer.params.{key} ({kind})", NO_EFFECT, why)
    for name in K.DEEPSPEED_ONLY_OPTIMIZERS:
        p.row(f"optimizer.type: {name}", "refused", "a DeepSpeed optimizer fspeed does not translate")

    p.section("Scheduler", "No scheduler block means a constant lr (`scheduler=constant`), as in DeepSpeed. "
              "Per-parameter-group lists are accepted with one entry.")
    for ds_type, (option, _) in K.SCHEDULERS.items():
        p.row(f"scheduler.type: {ds_type}", f"taken: `scheduler={option}`")
    for key in sorted(k for k in t if k.startswith("scheduler.params.")):
        p.row(key, _to(t[key]))
    p.row("scheduler.params.last_batch_iteration", _kept(-1), "a fresh schedule; resume with checkpoint.resume")

    p.section("ZeRO: `zero_optimization`", "Keys DeepSpeed reads only at other stages than the config's are "
              "accepted with no effect at any value.")
    taken_rows("zero_optimization")
    for key, fixed in K.ZERO_FIXED.items():
        p.row(f"zero_optimization.{key}", _kept(fixed.default), f"{fixed.why}; otherwise: {fixed.refused}")
    for key, why in K.ZERO_NO_EFFECT.items():
        p.row(f"zero_optimization.{key}", NO_EFFECT, why)
    for block, table in K.OFFLOAD_NO_EFFECT.items():
        for key, why in table.items():
            p.row(f"zero_optimization.{block}.{key}", NO_EFFECT, why)
    for block, table in K.OFFLOAD_UNSUPPORTED.items():
        for key, default in table.items():
            p.row(f"zero_optimization.{block}.{key}", _kept(default), "not supported by fspeed")
    for block in K.OFFLOAD_TRANSLATED:
        p.row(f"zero_optimization.{block}.device: nvme", "refused", "NVMe offload is not supported by fspeed")
    p.row("zero_optimization.offload_optimizer.ratio (< 1)", "refused", "partial offload is not supported by fspeed")
    for key, why in K.FSPEED_ONLY_ZERO_KEYS.items():
        p.row(f"zero_optimization.{key}", "refused (not a DeepSpeed key)", why)
    for key in K.PREFETCH_KEYS:
        p.row(f"zero_optimization.{key} (other sizes)", "refused at stage 3",
              f"0 turns prefetch off, {K.PREFETCH_BUCKET_DEFAULT} (DeepSpeed's default) on; fspeed prefetches one "
              "block ahead, not a number of elements")

    p.section("Monitors and profilers")
    for name in ("csv_monitor", "tensorboard", "wandb", "flops_profiler", "comms_logger"):
        taken_rows(name)
    for key, fixed in K.COMMS_LOGGER_FIXED.items():
        p.row(f"comms_logger.{key}", _kept(fixed.default), f"{fixed.why}; otherwise: {fixed.refused}")
    p.row("comms_logger.prof_ops", NO_EFFECT, "while prof_all is true every op is logged")

    p.section("Parallelism and memory")
    for name in ("tensor_parallel", "pipeline", "activation_checkpointing"):
        taken_rows(name)
    p.row("tensor_parallel.<other keys>", "refused", "autotp_size only (fspeed slices by logical-axis rules)")
    p.row("pipeline.partition: best", NO_EFFECT, "DeepSpeed's default, partition by parameters as fspeed's default")
    p.row("pipeline.seed_layers", NO_EFFECT, "fspeed always seeds each layer from (seed, step, micro-batch, layer)")
    for key in ("pipe_partitioned", "grad_partitioned"):
        p.row(f"pipeline.{key}", NO_EFFECT, K.PIPELINE_PARTITIONED_REASON)
    p.row("activation_checkpointing.number_checkpoints", NO_EFFECT,
          "sizes DeepSpeed's contiguous checkpoint buffers; fspeed's buffer grows to what a step keeps")

    p.section("Sparse attention and training efficiency",
              "A `sparse_attention` block sets `model.attention=sparse`; the keys its mode does not read are "
              "accepted with no effect, as DeepSpeed's parser ignores them.")
    for name in ("sparse_attention", "curriculum_learning", "progressive_layer_drop"):
        taken_rows(name)
    p.row("curriculum_learning.curriculum_type (not seqlen)", "refused", "DeepSpeed's engine acts on seqlen only")
    p.row("data_efficiency", "accepted disabled; enabled refused", "fspeed's data-efficiency curriculum builds its "
          "own index: curriculum.curriculum_type=vocab_rarity")

    p.section("Elasticity", "An enabled `elasticity` block chooses the global batch with DeepSpeed's rules "
              "(`compute_elastic_config`, versions 0.1 and 0.2; [checkpoints guide](../guides/checkpoints.md) for "
              "resuming on another world size); a disabled one has no effect, as in DeepSpeed.")
    taken_rows("elasticity")
    p.row("elasticity.min_time", NO_EFFECT, EL.MIN_TIME_REASON + " (checked >= 0, as DeepSpeed checks it)")

    p.section("Other top-level keys")
    for key, why in K.NO_EFFECT.items():
        p.row(key, NO_EFFECT, why)
    for key, fixed in K.SCALAR_DEFAULTS.items():
        p.row(key, _kept(fixed.default), f"{fixed.why}; otherwise: {fixed.refused}")
    for key in K.ENABLED_BLOCKS:
        p.row(key, "accepted absent, empty or disabled; enabled refused", K.ENABLED_BLOCK_REASON)
    p.row("autotuning", "enabled: runs fspeed-autotune (the [launcher guide](../guides/launcher.md) says what "
          "each key becomes); disabled: no effect", "fspeed-train and fspeed-autotune hand an enabled block to "
          "the tuner; a training run refuses it: " + AUTOTUNING_HANDOVER)
    for key, (defaults, why) in K.BLOCK_DEFAULTS.items():
        p.row(key, "kept at DeepSpeed's defaults; other values refused", why)

    missing = [k for k in K.ALL_TOP_LEVEL if not any(_top(key) == k for key in p.keys)]
    if missing:
        raise RuntimeError(f"DeepSpeed keys missing from the generated table: {missing}")
    return "\n".join(p.lines) + "\n"


def _top(key: str) -> str:
    return re.split(r"[.: ]", key, maxsplit=1)[0]
