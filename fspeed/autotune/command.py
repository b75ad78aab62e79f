"""`fspeed-autotune`: the fastest layout of an fspeed-train run, from the command line.

    fspeed-autotune train.train_batch_size=64 --nproc 2 autotune.memory_per_rank=8GiB
    fspeed-autotune model._target_=my_pkg.build data._target_=my_pkg.data train.train_batch_size=64 \\
        --nproc 8 autotune.space.zero_stage=[1,2] autotune.strategy=model
    fspeed-train $(cat autotune/best.overrides)          # or: --config-dir autotune --config-name best

Keys under `autotune.` are the tuner's (`AUTOTUNE_KEYS`, and `autotune.space.<axis>` for each axis
of `SearchSpace`); every other key=value is fspeed-train's, the base every candidate starts from.
A `deepspeed_config=` whose `autotuning` block is enabled sets the tuning from that block
(`deepspeed_block`); autotune keys on the command line win over it.
The table is printed and written (results.csv, results.json) with the best layout's files
(best.overrides, best.yaml, ds_config.json) to `autotune.dir`; the trials' results.jsonl there
lets a tuning that was interrupted resume. Exit code 0 with a best layout, 1 when no trial ran
successfully (the table says why), 2 for a mistake in the command.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional

from .deepspeed_block import autotuning_enabled, translate_block, write_base
from .memory_model import parse_bytes
from .space import SearchSpace
from .trials import TrialSettings
from .tuner import STRATEGIES, TuneSettings, tune

AUTOTUNE_KEYS = {
    "nproc": "ranks of the world to tune for (also --nproc N); default 1",
    "memory_per_rank": "bytes a rank may hold (70GiB, 512MiB); default: a share of this machine's memory",
    "strategy": f"{' | '.join(STRATEGIES)}; default model",
    "max_trials": "at most this many trials; default 8",
    "noise": "relative measurement noise the model strategy's stop allows for; default 0.05",
    "seed": "the random strategy's seed; default 0",
    "dir": "where results and the best layout go (and a tuning resumes from); default autotune",
    "warm_steps": "steps of a trial before measuring; default 2",
    "measured_steps": "steps of a trial measured; default 3",
    "timeout_s": "a trial running longer is stopped and recorded as a hang; default 600",
    "metric": "throughput (samples/s) | latency (s per step); default throughput",
    "patience": "stop after this many trials in a row without a better one; default: the strategy's",
    "fast_micro_batches": "micro-batches per ZeRO stage of the fast strategy; default 3",
    "resume": "take the finished trials of autotune.dir (false: start again); default true",
}
SPACE_AXES = tuple(f.name for f in dataclasses.fields(SearchSpace))

USAGE = """\
usage: fspeed-autotune [--nproc N] [autotune.KEY=VALUE ...] [fspeed-train KEY=VALUE ...]

Find the fastest layout (ZeRO stage, micro-batch and accumulation at the global batch, remat,
offload, tensor and pipeline sizes) of an fspeed-train run for N ranks on this machine: every
candidate's memory and step time is predicted, what cannot fit is left out with the reason, and
the most promising run as short real trials.

autotune keys:
{keys}
  autotune.space.AXIS   restrict an axis: one value or a list, e.g. autotune.space.zero_stage=[1,2];
                        axes: {axes}
"""


class UsageError(ValueError):
    """A mistake in the command line (exit code 2)."""


def _value(text: str) -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: PLC0415

    value = OverridesParser.create().parse_override(f"k={text}").value()
    return list(value) if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig" else value


def parse_command(argv: list[str]) -> TuneSettings:
    """The tuning a command line asks for (module docstring); UsageError naming a bad key or value."""
    argv = list(argv)
    tuner: dict[str, Any] = {}
    space: dict[str, Any] = {}
    base: list[str] = []
    while argv:
        arg = argv.pop(0)
        if arg == "--nproc":
            if not argv:
                raise UsageError("--nproc needs a number of ranks")
            arg = f"autotune.nproc={argv.pop(0)}"
        key, sep, text = arg.partition("=")
        if not key.startswith("autotune."):
            base.append(arg)
            continue
        if not sep:
            raise UsageError(f"{arg}: autotune keys take a value (autotune.KEY=VALUE)")
        name = key[len("autotune."):]
        if name.startswith("space."):
            axis = name[len("space."):]
            if axis not in SPACE_AXES:
                raise UsageError(f"{key}: unknown axis; allowed: {', '.join(SPACE_AXES)}")
            space[axis] = _value(text)
        elif name in AUTOTUNE_KEYS:
            tuner[name] = _value(text)
        else:
            raise UsageError(f"{key}: unknown autotune key; allowed: {', '.join(sorted(AUTOTUNE_KEYS))}, space.AXIS")
    try:
        base, ds_base = _deepspeed_block(base, tuner, space)
        settings = _settings(tuner, space, base)
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None
    if ds_base is None:
        return settings
    path = write_base(ds_base, settings.workdir)
    overrides = tuple(f"deepspeed_config={path}" if o.startswith("deepspeed_config=") else o for o in base)
    return dataclasses.replace(settings, base_overrides=overrides)


def _deepspeed_block(base: list[str], tuner: dict[str, Any], space: dict[str, Any]) -> tuple[list[str], Any]:
    """With a `deepspeed_config=` whose autotuning block is enabled: fill `tuner` and `space` from
    the block where the command line left them, print what each key became, and return the base
    ds_config to write (else None)."""
    from ..config.command_line import load_deepspeed_config  # noqa: PLC0415
    from ..config.overrides import override_value  # noqa: PLC0415

    path = override_value(base, "deepspeed_config")
    if path is None:
        return base, None
    ds = load_deepspeed_config(path)
    if not autotuning_enabled(ds):
        return base, None
    block_tuner, block_space, summary, ds_base = translate_block(ds)
    for key, value in block_tuner.items():
        tuner.setdefault(key, value)
    for key, value in block_space.items():
        space.setdefault(key, value)
    print(f"fspeed-autotune: the autotuning block of {path}:\n  " + "\n  ".join(summary), file=sys.stderr)
    return base, ds_base


def _settings(tuner: dict[str, Any], space: dict[str, Any], base: list[str]) -> TuneSettings:
    strategy = tuner.get("strategy", "model")
    for key, needs in (("seed", "random"), ("noise", "model")):
        if key in tuner and strategy != needs:
            raise ValueError(f"autotune.{key} applies to autotune.strategy={needs}, and the strategy is {strategy}")
    trial = {k: tuner[k] for k in ("warm_steps", "measured_steps", "timeout_s") if k in tuner}
    extra = {k: tuner[k] for k in ("metric", "patience", "fast_micro_batches") if k in tuner}
    resume = tuner.get("resume", True)
    if not isinstance(resume, bool):
        raise ValueError(f"autotune.resume={resume!r}: allowed: true, false")
    memory = tuner.get("memory_per_rank")
    world = tuner.get("nproc", 1)
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"autotune.nproc={world!r} must be a positive number of ranks")
    return TuneSettings(world=world, base_overrides=tuple(base), workdir=Path(str(tuner.get("dir", "autotune"))),
                        space=SearchSpace(**space), strategy=strategy,
                        memory_per_rank=parse_bytes(memory) if memory is not None else None,
                        max_trials=tuner.get("max_trials", 8), noise=float(tuner.get("noise", 0.05)),
                        seed=tuner.get("seed", 0), trial=TrialSettings(**trial), resume=resume, **extra)


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point (module docstring)."""
    from ..config.errors import ConfigError  # noqa: PLC0415
    from .outputs import write_best  # noqa: PLC0415

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        keys = "\n".join(f"  autotune.{k:<14} {v}" for k, v in AUTOTUNE_KEYS.items())
        print(USAGE.format(keys=keys, axes=", ".join(SPACE_AXES)))
        return
    try:
        settings = parse_command(argv)
        report = tune(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (UsageError, ConfigError, ValueError) as err:  # the tuning's own checks raise ValueError naming the key
        print(f"fspeed-autotune: {err}", file=sys.stderr)
        sys.exit(2)
    print(report.table())
    paths = report.write(settings.workdir)
    if report.best is None:
        print(f"\nno layout ran successfully; each row's status says why (rows: {paths['csv']})")
        sys.exit(1)
    best = write_best(settings.workdir, settings.base_overrides, report.best.candidate)
    print(f"\nbest: {report.best.candidate.label()}, {report.best.result.step_s:.4f} s per step "
          f"({report.trials_run} trials run, {report.trials_resumed} resumed)")
    print(f"  fspeed-train $(cat {best['overrides']})")
    print(f"  fspeed-train --config-dir {settings.workdir} --config-name best")
    print(f"  DeepSpeed part: {best['ds_config']}; every row: {paths['csv']}")


__all__ = ["AUTOTUNE_KEYS", "UsageError", "main", "parse_command"]

if __name__ == "__main__":
    main()
