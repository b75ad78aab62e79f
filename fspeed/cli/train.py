"""`fspeed-train`: the Hydra app that trains the reference GPT from config.

    fspeed-train                                        # the default job (char GPT on the stdlib)
    fspeed-train optimizer=lamb precision=bf16 scheduler=one_cycle train.steps=500 train.grad_accum=4
    fspeed-train deepspeed_config=ds_config.json        # a DeepSpeed config, translated
    fspeed-train --cfg job                              # print the composed config

    fspeed-train --debug ...                            # tracebacks instead of one-line errors
    fspeed-train --help                                 # these flags, then Hydra's help (groups, keys)

Overrides are checked against fspeed's schema before Hydra composes them, and the composed
config is validated again (types, ranges, unknown keys, the batch triad) before any work starts;
so are the corpus (`run_data`) and the checkpoint directory (writable, with room for one
checkpoint). A user's error is one message and exit code 2 (`user_errors`); with `--launch`
these checks run once, before the ranks start. Nothing is lost once training runs: SIGTERM or
SIGINT stop after the current step (`stop_requests`), a divergence stops before the bad step is
applied, and with `checkpoint.save_on_failure` (the default) the last good step is saved first.
With `--launch --max_restarts N` a failed rank restarts the group, which resumes from the newest
checkpoint by itself (`restarts`); every run ends with its goodput (`goodput`). The run itself,
on each rank, is `training_run`.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from .. import checkpoint
from ..checkpoint import CheckpointError
from ..config import ConfigError, Problem, prepare_overrides, to_run_config
from ..config.schema import RunConfig
from ..config.targets import TargetConfig
from ..host_memory import retain_freed_host_memory
from ..parallel import shutdown_distributed
from .restarts import restart_count, restarts_possible
from .resume import resumable_tag, saved_tokenizer
from .run_data import prepare_data
from .stop_requests import TrainingStopped
from .training_run import run_training
from .user_errors import DEBUG_ENV, USER_ERRORS, debug_requested, exit_with_user_error, raised_on_every_rank

_LAUNCH_HINT = "start the ranks with fspeed-train --launch (or fspeed --num_gpus N, or torchrun)"
_RESTARTED_HINT = ("a restart came back with another world (fspeed --nnodes); parallel.data=-1 continues on the ranks "
                   "that remain")


def data_parallel_size(cfg: DictConfig) -> int:
    """The data-parallel degree of a launch: from WORLD_SIZE and parallel.tensor x parallel.pipe / parallel.data."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tensor, pipe, data_size = int(cfg.parallel.tensor), int(cfg.parallel.get("pipe", 1)), int(cfg.parallel.data)
    model = tensor * pipe
    names = [f"parallel.{k}={v}" for k, v in (("tensor", tensor), ("pipe", pipe)) if v > 1]
    key = "parallel.pipe" if pipe > 1 and tensor == 1 else "parallel.tensor"
    if data_size == -1:
        if world % model:
            both = f" ({' x '.join(names)})" if len(names) > 1 else ""
            raise ConfigError([Problem(key, f"needs {model} ranks per model replica{both}, and the world size {world} "
                                       f"is not a multiple of {model}", pipe if key == "parallel.pipe" else tensor,
                                       hint=_LAUNCH_HINT if world == 1 else f"launch a multiple of {model} ranks")])
        return world // model
    if data_size * model != world:
        product = " x ".join([f"parallel.data={data_size}", *names])
        raise ConfigError([Problem("parallel.data", f"{product} = {data_size * model} ranks, but the world size is "
                                   f"{world}", data_size, f"{world // model} or -1" if world % model == 0 else None,
                                   _RESTARTED_HINT if restart_count() > 0 else _LAUNCH_HINT if world == 1 else None)])
    return data_size


@hydra.main(config_path="pkg://fspeed.conf", config_name="train", version_base=None)
def _hydra_app(cfg: DictConfig) -> Optional[float]:
    rank = int(os.environ.get("RANK", "0"))
    run: Optional[RunConfig] = None
    try:
        run = to_run_config(cfg, dp_world_size=data_parallel_size(cfg))
        summary = run_training(run, Path(HydraConfig.get().runtime.output_dir))
    except TrainingStopped as stop:
        _leave_together()
        if rank == 0:
            saved = getattr(stop, "final_checkpoint", None)
            print(f"fspeed-train: {stop}" + (f"; saved {saved}" if saved else ""), file=sys.stderr, flush=True)
        sys.exit(128 + stop.signum)
    except USER_ERRORS as err:
        if debug_requested():
            raise
        if raised_on_every_rank(err):
            _leave_together()
        exit_with_user_error(err, rank, run.train.gradient_clipping if run is not None else None)
    except Exception as err:
        before = getattr(err, "repeated_in_attempt", None)
        if before is None or debug_requested():
            raise
        print(f"fspeed-train (rank {rank}): {type(err).__name__}: {err} (again: attempt {before} failed the same "
              "way at the same step; its traceback is above)", file=sys.stderr, flush=True)
        sys.exit(1)
    shutdown_distributed()
    return summary["val_loss_end"]


def _leave_together() -> None:
    """Tear the process group down after an error every rank raised alike (a no-op without one)."""
    try:
        shutdown_distributed()
    except Exception:  # a peer already gone: nothing more to do together
        pass


USAGE = """\
usage: fspeed-train [--launch] [--debug] [Hydra flags] [key=value ...]

Train the reference GPT (or model._target_ / data._target_: your own) from fspeed's config; every
key can be set on the command line. The config, the corpus and the checkpoint directory are
checked before any work starts: a mistake is one message naming the key, and exit code 2.

fspeed-train's flags:
  --launch       run parallel.data x parallel.tensor x parallel.pipe ranks of this command on this
                 machine (the fspeed launcher, torchrun underneath), after checking everything once
  --max_restarts N
                 with --launch: after a failure (a rank dies, fails, or stops responding) restart
                 every rank from the newest checkpoint, up to N times (default 0: the run ends)
  --debug        tracebacks (the ranks' and torchrun's) instead of one-line errors and summaries

Hydra's flags (--hydra-help lists them all):
  --cfg job      print the composed config and exit
  --hydra-help   Hydra's own help

examples:
  fspeed-train train.steps=200 optimizer=lamb precision=bf16
  fspeed-train --launch parallel.data=2 zero.stage=3
  fspeed-train --launch --max_restarts 3 parallel.data=2 checkpoint.save_every=100
  fspeed-train deepspeed_config=ds_config.json
  fspeed-train checkpoint.dir=outputs/run1/checkpoints checkpoint.resume=required
  fspeed-export outputs/run1/checkpoints model.safetensors     # the trained weights

The config groups and every key with its default follow (Hydra's help).
"""


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point: check (and expand DeepSpeed-config) overrides, then run the Hydra app.

    `--launch` starts parallel.data x parallel.tensor ranks of this same command through the
    `fspeed` launcher (torchrun underneath) instead of training in this process, after checking
    the config, the corpus and the checkpoint directory once. `--debug` shows tracebacks.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # model._target_ / data._target_ import from here, as with python -m
    launch = "--launch" in argv
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"  # Hydra's own switch; the ranks of --launch inherit it
    argv = [a for a in argv if a not in ("--launch", "--debug")]
    try:
        argv, max_restarts = _max_restarts_flag(argv, launch)
    except ConfigError as err:
        exit_with_user_error(err)
    args = get_args_parser().parse_args(argv)
    if args.help:  # fspeed-train's own flags first; Hydra's help (groups, the composed config) follows
        print(USAGE, flush=True)
        argv.append("hydra.help.app_name=fspeed-train")
        args.overrides.append(argv[-1])
    own_config_dir = args.config_dir is not None or args.config_path is not None
    _autotune_if_asked(args.overrides, launch)
    try:
        overrides, translation = prepare_overrides(args.overrides, check_group_options=not own_config_dir)
        if launch:
            sys.exit(_launch(overrides, [a for a in argv if a not in args.overrides], max_restarts))
        if restarts_possible() and not own_config_dir and not any(o.startswith("hydra.run.dir=") for o in overrides):
            raise ConfigError([Problem("hydra.run.dir", "a run torchrun may restart (its --max-restarts is above 0) "
                                       "needs one run directory for every rank and attempt, to resume from and "
                                       "to keep its restart records in", hint="set hydra.run.dir=<directory> "
                                       "(fspeed-train --launch sets it)")])
    except USER_ERRORS as err:
        if debug_requested():
            raise
        exit_with_user_error(err, int(os.environ.get("RANK", "0")))
    if translation is not None and int(os.environ.get("RANK", "0")) == 0:
        print(translation.summary(), file=sys.stderr)
    flags = [a for a in argv if a not in args.overrides]
    if int(os.environ.get("RANK", "0")) > 0:
        overrides = [*overrides, "hydra.output_subdir=null"]  # rank 0 alone records the config
    sys.argv = [sys.argv[0], *flags, *overrides]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    retain_freed_host_memory()  # host_memory's docstring: ~5% of a CPU step otherwise goes to page faults
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        _hydra_app()
        return
    try:
        _hydra_app()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    _end_rank(code)


def _autotune_if_asked(overrides: list[str], launch: bool) -> None:
    """A deepspeed_config with an enabled autotuning block runs fspeed-autotune (as DeepSpeed's
    `--autotuning tune`) on the world --launch would start, then exits with the tuner's code."""
    if not any(o.startswith("deepspeed_config=") for o in overrides):
        return
    from ..autotune.command import main as autotune_main  # noqa: PLC0415
    from ..autotune.deepspeed_block import tuner_argv  # noqa: PLC0415

    try:
        argv = tuner_argv(overrides, launch)
    except ValueError as err:
        exit_with_user_error(ConfigError([Problem("autotuning", str(err))]))
    if argv is not None:
        autotune_main(argv)
        sys.exit(0)


def _end_rank(code: int) -> None:
    """End a rank of a distributed run once its work is done and written: the exit handlers run (the
    monitors', fspeed's wait for what is in flight and the process group's teardown), then the
    process exits without the interpreter's teardown. There, a gloo thread that drops the last
    reference to a finished collective frees its tensors while the interpreter is finalizing, which
    ends the process in std::terminate (a SIGABRT after a complete run, rare: seen in 2-rank test
    runs after the final checkpoint was saved)."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _max_restarts_flag(argv: list[str], launch: bool) -> tuple[list[str], int]:
    """(argv without `--max_restarts N` / `--max_restarts=N`, N; 0 without the flag). N must be an
    integer >= 0, and the flag needs --launch (under torchrun, its own flag sets the limit)."""
    rest, value = [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--max_restarts":
            value = argv[i + 1] if i + 1 < len(argv) else ""
            i += 2
            continue
        if arg.startswith("--max_restarts="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if value is None:
        return rest, 0
    if not value.isdigit():
        raise ConfigError([Problem("--max_restarts", "must be a whole number of restarts", value, "0, 1, 2, ...")])
    if not launch:
        raise ConfigError([Problem("--max_restarts", "restarts are torchrun's: this flag needs --launch", int(value),
                                   hint="fspeed-train --launch --max_restarts N ..., or fspeed --max_restarts N")])
    return rest, int(value)


def _launch(overrides: list[str], flags: list[str], max_restarts: int = 0) -> int:
    """Run this command on parallel.data x parallel.tensor local ranks through the fspeed launcher
    (torchrun restarting the group up to `max_restarts` times after a failure), once the config, the
    corpus and the checkpoint directory pass the checks the ranks would make."""
    from .launch import launch

    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        # one run directory for every rank (each rank's Hydra would otherwise pick its own timestamp)
        run_dir = Path("outputs").resolve() / time.strftime("%Y-%m-%d/%H-%M-%S")
        overrides = [*overrides, f"hydra.run.dir={run_dir}"]
    cfg = _compose_as_the_ranks_will(overrides)
    data_size, tensor = int(cfg.parallel.data), int(cfg.parallel.tensor) * int(cfg.parallel.get("pipe", 1))
    if data_size == -1 and tensor > 1:
        data_size = 1  # parallel.tensor x parallel.pipe ranks, one model replica
    if data_size == -1:
        raise ConfigError([Problem("parallel.data", "--launch needs the number of data-parallel ranks", -1,
                                   "a positive integer, e.g. parallel.data=2")])
    run = to_run_config(cfg, dp_world_size=data_size)
    ckpt_dir = Path(run.checkpoint.dir)
    resume_tag = resumable_tag(run, Path(cfg.hydra.runtime.output_dir))
    if not isinstance(run.data, TargetConfig):  # a user's data target runs the user's code: the ranks build it
        prepare_data(run, saved_tokenizer(ckpt_dir, resume_tag))
    try:
        checkpoint.probe_directory(ckpt_dir)
    except CheckpointError as e:
        raise ConfigError([Problem("checkpoint.dir", str(e))]) from None
    debug = ["--debug"] if debug_requested() else []
    return launch(["--num_gpus", str(data_size * tensor), "--max_restarts", str(max_restarts), *debug, "--module",
                   "fspeed.cli.train", *flags, *overrides])


def _compose_as_the_ranks_will(overrides: list[str]) -> DictConfig:
    """The composed config with `${hydra:runtime.output_dir}` resolving to the run directory."""
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    with initialize_config_module("fspeed.conf", version_base=None):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(Path(cfg.hydra.run.dir).resolve())
    HydraConfig.instance().set_config(cfg)
    return cfg


if __name__ == "__main__":
    main()
