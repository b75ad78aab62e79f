"""`fs.initialize`: DeepSpeed's entry point for any `nn.Module` (or fspeed Model) and a ds_config.

    engine, optimizer, loader, schedule = fs.initialize(model=my_module, config="ds_config.json",
                                                        loss_fn=lambda out, batch: out.loss,
                                                        training_data=my_dataset)
    for batch in loader:
        loss = engine(batch)          # a DeepSpeed user's loop runs unchanged
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint("ck")

Every key of the config is applied through the same path fspeed-train takes (translation,
Hydra's composition, validation): the batch triad and gradient accumulation, precision, the ZeRO
plan and mesh, tensor slicing (`tensor_parallel.autotp_size`, for modules with a tp_plan),
clipping, the optimizer and its lr schedule, the comm log, and fspeed-train's monitors (CSV,
TensorBoard, W&B), wall-clock breakdown and progress line every `steps_per_print` steps
(`engine_monitor`). A client optimizer (an fspeed one, a torch optimizer instance or a callable
building one) gets the config's clipping and scheduler, and a client `lr_scheduler` replaces the
config's, as in DeepSpeed (`engine_optimizer`). An external Megatron-style `mpu` gives the mesh
its groups (`Mesh.from_mpu`). The `Engine` is a thin stateful shell
over the functional core: `engine.state` is the TrainState, `engine.train_step` the step;
`engine(batch)` runs one micro-batch's forward and backward (its gradient goes where the plan
reduces it) and returns its loss, `backward` checks the loop's order, `step` applies the update
at the accumulation boundary. A config's `curriculum_learning` cuts each batch to the step's
length and `progressive_layer_drop` adds the step's `LayerDrop` (`_efficiency`), as DeepSpeed's
engine passes `curriculum_seqlen` and `pld_theta` to the model.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from . import checkpoint
from .host_memory import retain_freed_host_memory
from .data.curriculum import difficulty_at, truncate_to_seqlen
from .models import Model, functionalize, to_module, traced_layers
from .models.decoder_layers import decoder_layers_to_module, sliceable_layers
from .models.layer_drop import PLD_BATCH_KEY, step_layer_drop, supports_layer_drop
from .models.module import ModuleLoss, output_loss
from .engine_monitor import EngineMonitor
from .engine_optimizer import engine_optimizer
from .eval_step import make_eval_step
from .micro_batches import stack_micro_batches
from .optim.base import GradientTransformation
from .parallel import CommLog, Mesh, Plan, gather_params, init_distributed, profiled_partition, tensor_slicing, zero
from .pytree import PyTree
from .train_init import init_train_state
from .train_state import TrainState
from .train_step import TrainStep, make_train_step

log = logging.getLogger("fspeed")


class Engine:
    """DeepSpeed's engine methods over a TrainState and a TrainStep (module docstring)."""

    def __init__(self, model: Model, module: Optional[nn.Module], state: TrainState, train_step: TrainStep,
                 plan: Optional[Plan], mesh: Optional[Mesh], run, schedule,
                 into_module: Callable[[PyTree, nn.Module, PyTree], nn.Module] = to_module,
                 monitor: Optional[EngineMonitor] = None):
        self.model, self._module, self.state, self.train_step = model, module, state, train_step
        self._into_module = into_module  # how `module` puts the model's parameters into the nn.Module
        self.plan, self.mesh, self.config = plan, mesh, run
        self.lr_schedule = schedule
        piped = plan is not None and plan.find("pipeline") is not None
        self.eval_step = make_eval_step(model if piped else model.loss, plan=plan, mesh=mesh)
        self._step = None  # the step in progress
        self._pending_loss: Optional[torch.Tensor] = None
        self.metrics: dict[str, Any] = {}
        self._curriculum = run.curriculum.to_schedule()
        self._pld = run.progressive_layer_drop if run.progressive_layer_drop.enabled else None
        self._monitor = monitor if monitor is not None else EngineMonitor(run, lead=False)

    def _efficiency(self, batch: PyTree) -> PyTree:
        """The batch as this step's curriculum length and layer drop make it (DeepSpeed passes them
        to the model's forward as curriculum_seqlen / pld_theta)."""
        step = self.state.step
        if self._curriculum is not None:
            batch = truncate_to_seqlen(batch, difficulty_at(self._curriculum, step))
        if self._pld is not None:
            if not isinstance(batch, dict):
                raise TypeError(f"progressive_layer_drop needs dict batches (the step's LayerDrop goes under "
                                f"{PLD_BATCH_KEY!r}), got {type(batch).__name__}")
            batch = {**batch, PLD_BATCH_KEY: step_layer_drop(step, self.config.train.seed, self._pld.theta,
                                                             self._pld.gamma)}
        return batch

    def _efficiency_metrics(self, step: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self._curriculum is not None:
            out["curriculum_seqlen"] = difficulty_at(self._curriculum, step)
        if self._pld is not None:
            out["pld_theta"] = step_layer_drop(step, self.config.train.seed, self._pld.theta, self._pld.gamma).theta
        return out

    # -- DeepSpeed's loop ------------------------------------------------------------------

    def __call__(self, batch: PyTree = None, /, **inputs: Any) -> torch.Tensor:
        """One micro-batch's forward and backward; returns its loss (a 0-d tensor). `engine(**batch)`
        is `engine(batch)` for a dict batch (the module is called with its keys either way)."""
        if inputs:
            if batch is not None:
                raise TypeError("engine(batch) or engine(**batch): pass the micro-batch one way, not both")
            batch = inputs
        if self._pending_loss is not None:
            raise RuntimeError("engine(batch) was called twice without engine.backward(loss) in between "
                               "(DeepSpeed's loop: loss = engine(batch); engine.backward(loss); engine.step())")
        if self._step is None:
            self._monitor.step_begins()
            self._step = self.train_step.begin(self.state)
        self._pending_loss = self.train_step.micro(self._step, self.state, self._efficiency(batch))
        return self._pending_loss

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """DeepSpeed's backward: the gradient was computed with the forward (torch.func takes both
        at once); this checks that `loss` is the one `engine(batch)` returned."""
        if self._pending_loss is None or loss is not self._pending_loss:
            raise RuntimeError("engine.backward(loss) takes the loss the last engine(batch) returned, once")
        self._pending_loss = None

    def step(self) -> None:
        """At the gradient-accumulation boundary, apply the update (a no-op before it, as DeepSpeed's)."""
        if self._pending_loss is not None:
            raise RuntimeError("engine.step() before engine.backward(loss)")
        if self.is_gradient_accumulation_boundary():
            step = self.state.step
            self.state, self.metrics = self.train_step.boundary(self._step, self.state)
            self.metrics.update(self._efficiency_metrics(step))
            self._step = None
            self._monitor.step_done(self.state, self.metrics)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-batches of this step are all in (the next `step()` applies them)."""
        return self._step is not None and len(self._step.losses) == self.train_step.grad_accum

    def train_batch(self, data_iter: Optional[Iterator] = None, batch: Optional[PyTree] = None) -> float:
        """One whole step: `gradient_accumulation_steps` micro-batches from `data_iter`, or a
        stacked `batch` of them; returns the mean loss (DeepSpeed's pipeline-engine call)."""
        if (data_iter is None) == (batch is None):
            raise ValueError("train_batch: pass data_iter= or batch= (one of them)")
        if data_iter is not None and self.train_step.pipelined is not None:
            # a pipeline interleaves the micro-batches itself: they enter the step together
            batch = stack_micro_batches([next(data_iter) for _ in range(self.train_step.grad_accum)])
        if batch is not None:
            step = self.state.step
            self._monitor.step_begins()
            self.state, self.metrics = self.train_step(self.state, self._efficiency(batch))
            self.metrics.update(self._efficiency_metrics(step))
            self._monitor.step_done(self.state, self.metrics)
        else:
            for _ in range(self.train_step.grad_accum):
                self.backward(self(next(data_iter)))
            self.step()
        return self.metrics["loss"]

    def eval_batch(self, batch: PyTree) -> float:
        """The loss of `batch` without gradients, in eval mode (a collective under a plan)."""
        return self.eval_step(self.state, batch)

    def close(self) -> None:
        """Close the monitors (after the comm log's totals, under a plan); DeepSpeed's `destroy`."""
        self._monitor.close(self.mesh)

    destroy = close

    # -- state -------------------------------------------------------------------------------

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (the launcher's LOCAL_RANK; 0 on one process)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    @property
    def device(self) -> torch.device:
        """Where the step computes (the parameters' device): move a batch's tensors here, or let the step."""
        return self.state.params.buffer.device

    def fp16_enabled(self) -> bool:
        return self.state.precision.name == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.state.precision.name == "bf16"

    def get_lr(self) -> list[float]:
        return [self.state.lr]

    @property
    def global_steps(self) -> int:
        return self.state.step

    def gradient_accumulation_steps(self) -> int:
        return self.train_step.grad_accum

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch.micro_batch_size

    def train_batch_size(self) -> int:
        return self.config.batch.train_batch_size

    def zero_optimization_stage(self) -> int:
        return self.state.layout.stage

    @property
    def module(self) -> nn.Module:
        """The `nn.Module` holding the current weights and buffers (gathered: a collective)."""
        if self._module is None:
            raise AttributeError("this engine trains an fspeed Model, not an nn.Module; use engine.state")
        params = gather_params(self.state, self.mesh) if self.mesh is not None else self.state.master_params.tree()
        return self._into_module(params, self._module, self.state.buffers)

    def save_checkpoint(self, save_dir, tag: Optional[str] = None, client_state: Optional[dict] = None):
        """DeepSpeed's save_checkpoint (every rank calls it under a plan); returns the path."""
        if self._step is not None:
            raise RuntimeError("save_checkpoint in the middle of a step (between micro-batches); call it after "
                               "engine.step() at the accumulation boundary")
        return checkpoint.save_checkpoint(save_dir, self.state, tag=tag, client_state=client_state or {},
                                          mesh=self.mesh if self.plan is not None else None)

    def load_checkpoint(self, load_dir, tag: Optional[str] = None, load_optimizer_states: bool = True):
        """DeepSpeed's load_checkpoint: (path, client_state). A checkpoint DeepSpeed saved (ZeRO 0-3, a
        PipelineModule's too, given this engine's model of its layers) is imported
        (`fs.checkpoint.import_deepspeed`): a DeepSpeed user's resume runs unchanged."""
        from .checkpoint.deepspeed_import import (  # noqa: PLC0415
            fill_from_deepspeed, find_deepspeed_checkpoint, read_deepspeed)

        found = find_deepspeed_checkpoint(load_dir, tag)
        if found is not None:
            if not load_optimizer_states:
                raise ValueError(f"load_checkpoint({str(load_dir)!r}, load_optimizer_states=False): importing a DeepSpeed "
                                 "checkpoint takes its Adam moments too; convert it once (fspeed-import-deepspeed "
                                 f"{load_dir} <dir>) and load that with load_optimizer_states=False")
            ds = read_deepspeed(found, self.model)  # one read: the state and the client's entries
            self.state = fill_from_deepspeed(ds, self.state)
            return str(found), ds.client_state
        self.state, client = checkpoint.load_checkpoint(load_dir, self.state, tag=tag,
                                                        load_optimizer_states=load_optimizer_states,
                                                        mesh=self.mesh if self.plan is not None else None)
        tag = tag or checkpoint.latest_tag(load_dir)
        return f"{load_dir}/{tag}", client


def initialize(model: Union[nn.Module, Model], config: Any = None, *, args: Any = None, config_params: Any = None,
               loss_fn: Optional[Callable] = None,
               model_parameters: Optional[Sequence] = None, optimizer: Any = None, lr_scheduler: Any = None,
               training_data: Any = None, collate_fn: Optional[Callable] = None, overrides: Sequence[str] = (),
               tp_plan: Union[str, dict, None] = None, mesh: Optional[Mesh] = None, mpu: Any = None,
               fused_ops: bool = True) -> tuple[Engine, GradientTransformation, Any, Any]:
    """DeepSpeed's `initialize` (module docstring): returns (engine, optimizer, training data
    loader or None, lr schedule or None). `config` is a ds_config (a dict or a JSON path) or None
    (fspeed's defaults); `overrides` are fspeed's Hydra keys on top. `loss_fn(outputs, batch)` is an
    `nn.Module`'s loss (default: `outputs.loss`, as a Hugging Face model given labels returns, or a
    scalar output; a Model has its own). `model_parameters`: torch-style parameter groups.
    `optimizer`: None (the config's), an fspeed GradientTransformation, a torch optimizer instance
    or a callable `optimizer(params)` building one; `lr_scheduler`: a torch LR scheduler, a callable
    `lr_scheduler(optimizer)` building one, or an fspeed schedule of the step (`engine_optimizer`).
    `mpu`: a Megatron-style model-parallel unit whose groups become the mesh (`Mesh.from_mpu`).
    `fused_ops`: an `nn.Module`'s Python tanh-GELUs run as torch's fused kernel (`functionalize`'s
    argument; False runs the module's own ops). `args`: DeepSpeed's parsed arguments, whose
    `deepspeed_config` (`add_config_arguments`) is the config; `config_params` is DeepSpeed's older
    name for `config`."""
    from .config.build import (  # noqa: PLC0415
        apply_activation_checkpointing, build_device, build_precision, build_zero_config,
    )
    from .cli.observe import step_timers  # noqa: PLC0415
    from .config.compose import compose_run_config  # noqa: PLC0415

    if mpu is not None and mesh is not None:
        raise ValueError("initialize: pass mesh= or mpu=, not both (a Mesh serves the mpu interface itself)")
    config = _deepspeed_config(args, config, config_params)
    retain_freed_host_memory()  # host_memory's docstring
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else _env_world()
    if world > 1 and not torch.distributed.is_initialized():
        init_distributed()

    def compose(extra: Sequence[str], data: int):
        return compose_run_config(config, [*overrides, *extra], dp_world_size=data, defaults=ENGINE_DEFAULTS,
                                  run_dir=".")[0]

    extra: list[str] = []
    probe = compose(extra, 1)
    if lr_scheduler is not None:
        extra += _client_scheduler_overrides(probe, overrides)
    if mpu is not None:
        mesh = Mesh.from_mpu(mpu, log=CommLog(enabled=probe.comms_logger.enabled, verbose=probe.comms_logger.verbose))
        extra += _mpu_overrides(probe, mesh)
        data, tensor, pipe = mesh.size("data"), mesh.size("model"), mesh.size("pipe")
    else:
        tensor, pipe = probe.parallel.tensor, probe.parallel.pipe
        data = probe.parallel.data if probe.parallel.data > 0 else max(1, world // (tensor * pipe))
    run = compose(extra, data)
    _refuse_cli_only(run)
    module = model if isinstance(model, nn.Module) else None
    example = None  # the first micro-batch, when one is taken (tracing a module into pipeline layers)
    into_module = to_module  # how engine.module puts the trained parameters back into the module
    device = build_device(run)  # None: the state stays where the model's parameters are
    if module is not None:
        if device is not None:
            module.to(device)  # with every buffer, as DeepSpeed moves the module to its device
        if pipe > 1 and tensor > 1:  # sliced stages: a Llama-family module's own layers and tp_plan
            model = sliceable_layers(module, loss_fn, fused_ops=fused_ops)
            into_module = lambda params, into, buffers: decoder_layers_to_module(params, into)  # noqa: E731
        elif pipe > 1:  # stages need layers: the module's forward, traced on one micro-batch and cut at its blocks
            example = _example_micro_batch(training_data, collate_fn, run.batch.micro_batch_size, pipe)
            model = traced_layers(module, example, loss_fn or output_loss, fused_ops=fused_ops)
        else:
            model = functionalize(module, loss_fn or output_loss, tp_plan=tp_plan if tp_plan is not None else
                                  ("auto" if tensor > 1 else None), fused_ops=fused_ops)
    elif loss_fn is not None:
        raise ValueError("initialize: loss_fn is for nn.Modules; an fspeed Model brings its own loss")
    elif not fused_ops:
        raise ValueError("initialize: fused_ops=False is for nn.Modules; an fspeed Model was built with its own ops "
                         "(pass fused_ops=False where you built it: fs.functionalize, sequential, traced_layers)")
    if run.curriculum.enabled and run.curriculum.curriculum_type != "seqlen":
        raise ValueError(f"initialize: curriculum.curriculum_type={run.curriculum.curriculum_type} chooses samples, "
                         "which the engine's loader does not: build fs.data.loader(..., sampler=fs.data."
                         "CurriculumSampler(...)) and set curriculum.enabled=false")
    if run.progressive_layer_drop.enabled and not supports_layer_drop(model):
        raise ValueError(f"initialize: progressive_layer_drop is enabled but the model {model.name} does not read "
                         f"the batch's {PLD_BATCH_KEY!r} (a module's forward must take layer_drop; see "
                         "fspeed.models.layer_drop)")
    model, _ = apply_activation_checkpointing(run, model)  # its profile: fspeed-train reports it
    precision = build_precision(run)
    optimizer, schedule = engine_optimizer(optimizer, lr_scheduler, module, model_parameters, run)
    if pipe > 1 and model.layers is None:
        raise ValueError(f"initialize: parallel.pipe={pipe} (DeepSpeed's pipeline stages) cuts the model at its "
                         f"layers, and {model.name} has none: pass the nn.Module itself (traced into layers), "
                         "fs.models.traced_layers(module, example), fs.models.sequential([...], loss_fn=...) "
                         "(DeepSpeed's PipelineModule) or the reference GPT")
    plan = None
    if world > 1 or run.zero.stage > 0 or tensor > 1 or pipe > 1:
        mesh = mesh or Mesh(data=run.parallel.data, model=tensor, pipe=pipe,
                            log=CommLog(enabled=run.comms_logger.enabled, verbose=run.comms_logger.verbose))
        plan = zero(build_zero_config(run))
        if tensor > 1:
            plan = plan | tensor_slicing(fs_rules(model))
        if pipe > 1:
            interval = run.pipeline.activation_checkpoint_interval
            plan = plan | run.pipeline.to_library(run.batch.grad_accum,
                                                  run.activation_checkpointing.to_library() if interval else None)
            plan = profiled_partition(plan, model, lambda: example if example is not None else _example_micro_batch(
                training_data, collate_fn, run.batch.micro_batch_size, pipe, profile=True), pipe, device)
    params = model.init(torch.Generator().manual_seed(run.train.seed))
    state = init_train_state(params, optimizer, precision=precision, seed=run.train.seed, device=device, plan=plan,
                             mesh=mesh if plan is not None else None, model=model)
    step = make_train_step(model if pipe > 1 else model.loss, optimizer, grad_accum=run.batch.grad_accum, plan=plan,
                           mesh=mesh if plan is not None else None,
                           timers=step_timers(run))  # the breakdown: in engine.metrics and the progress line
    lead = plan is None or mesh.rank == 0
    efficiency = (("curriculum_seqlen",) if run.curriculum.enabled else ()) + \
        (("pld_theta",) if run.progressive_layer_drop.enabled else ())
    engine = Engine(model, module, state, step, plan, mesh if plan is not None else None, run, schedule, into_module,
                    EngineMonitor(run, lead, efficiency))
    loader = _loader(training_data, collate_fn, run, mesh if plan is not None else None)
    log.info("initialize: %s, %s, batch %s, optimizer %s, precision %s", model.name,
             f"{plan!r} on {mesh!r}" if plan is not None else "one process", run.batch.derivation, optimizer,
             precision.name)
    return engine, optimizer, loader, engine.lr_schedule


def _example_micro_batch(training_data: Any, collate_fn: Optional[Callable], rows: int, pipe: int,
                         profile: bool = False) -> Any:
    """The first micro-batch of `training_data`, which `traced_layers` traces the module's forward on
    (`profile`: on which pipeline.partition=profile times each layer)."""
    if profile:
        what, instead = ("pipeline.partition=profile times each layer on the first micro-batch",
                         "or give the layer counts per stage (pipeline.partition='4,4')")
    else:
        what, instead = (f"parallel.pipe={pipe} cuts an nn.Module into stages by tracing its forward on the first "
                         "micro-batch", "or pass a Model with layers (fs.models.traced_layers(module, "
                         "example_micro_batch) or fs.models.sequential([...], loss_fn=...))")
    if training_data is None:
        raise ValueError(f"initialize: {what}: pass training_data=, {instead}")
    from torch.utils.data import default_collate  # noqa: PLC0415

    if not (hasattr(training_data, "__len__") and hasattr(training_data, "__getitem__")):
        raise ValueError(f"initialize: {what}, which needs a map-style dataset (len and indexing), not "
                         f"{type(training_data).__name__}; {instead}")
    return (collate_fn or default_collate)([training_data[i] for i in range(min(rows, len(training_data)))])


ENGINE_DEFAULTS = ("monitor.csv=false", "monitor.progress_bar=false")
"""The engine's own defaults under the config: DeepSpeed's monitors are off unless a block turns
them on (fspeed-train writes metrics.csv by default), and the engine draws no progress bar."""


def _refuse_cli_only(run) -> None:
    """What only fspeed-train's loop runs is an error when a config asks the engine for it."""
    from .config import ConfigError, Problem  # noqa: PLC0415

    problems = []
    if run.flops_profiler.enabled:
        problems.append(Problem("flops_profiler.enabled", "profiles inside fspeed-train's loop; with initialize(), "
                                "profile with fs.profile.flops(...)", True, "false"))
    if run.monitor.progress_bar:
        problems.append(Problem("monitor.progress_bar", "needs the run's length, which the engine does not know; it "
                                "prints a progress line every train.steps_per_print steps", True, "false"))
    if problems:
        raise ConfigError(problems)


def _client_scheduler_overrides(probe, overrides: Sequence[str]) -> list[str]:
    """A client lr_scheduler replaces the config's scheduler (DeepSpeed): the run's scheduler becomes
    constant; a scheduler the config chose is named in a warning, one in `overrides` is an error."""
    import warnings  # noqa: PLC0415

    if any(o.lstrip("+~").startswith("scheduler") for o in overrides):
        raise ValueError("initialize: lr_scheduler= and scheduler overrides both set the lr schedule; pass one")
    if probe.scheduler.name != "constant":
        warnings.warn(f"initialize: the config's scheduler ({probe.scheduler.name}) is not used: lr_scheduler= "
                      "replaces it, as in DeepSpeed", stacklevel=3)
    return ["scheduler=constant"]


def _mpu_overrides(probe, mesh: Mesh) -> list[str]:
    """The parallel sizes of the mpu's mesh as overrides; a config that says otherwise is an error
    (a pipeline must be declared in the config: its stages need the pipeline block)."""
    from .config import ConfigError, Problem  # noqa: PLC0415

    out, problems = [], []
    for key, have, axis, unset in (("parallel.tensor", probe.parallel.tensor, "model", 1),
                                   ("parallel.pipe", probe.parallel.pipe, "pipe", None),
                                   ("parallel.data", probe.parallel.data, "data", -1)):
        want = mesh.size(axis)
        if have == want:
            continue
        if have == unset:
            out.append(f"{key}={want}")
        else:
            problems.append(Problem(key, f"disagrees with the mpu's {axis} parallel size {want}", have, str(want)))
    if problems:
        raise ConfigError(problems)
    return out


def fs_rules(model: Model):
    """The tensor-slicing rules that fit `model`: a tp_plan's (a functionalized module's or a layer
    list's), or the GPT's."""
    from .models import GPT_RULES, MODULE_TP_RULES  # noqa: PLC0415

    if isinstance(model.loss, ModuleLoss) and not model.loss.tp_styles:
        raise ValueError("initialize: tensor slicing needs a tp_plan for this module (a transformers model's "
                         "own, or tp_plan={submodule pattern: style})")
    named = {axis for spec in model.logical_axes.values() for axis in spec if axis}
    tp_plan_axes = {axis for axis, _ in MODULE_TP_RULES} - {axis for axis, _ in GPT_RULES}  # only a tp_plan names
    return MODULE_TP_RULES if isinstance(model.loss, ModuleLoss) or named & tp_plan_axes else GPT_RULES


def _env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's `add_config_arguments`: `--deepspeed` (a flag for the script's own use) and
    `--deepspeed_config FILE`, which `initialize(args=...)` reads (and the deprecated `--deepscale`,
    `--deepscale_config`); returns the parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script's own code)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    return parser


def _deepspeed_config(args: Any, config: Any, config_params: Any) -> Any:
    """The config `initialize` was given: `config`, `config_params` or `args.deepspeed_config`
    (DeepSpeed's three ways; more than one is an error, as in DeepSpeed)."""
    if config_params is not None:
        if config is not None:
            raise ValueError("initialize: pass config= or config_params= (DeepSpeed's older name), not both")
        config = config_params
    path = None if args is None else \
        getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if path is not None:
        if config is not None:
            raise ValueError(f"initialize: args.deepspeed_config ({path}) and config= both give the config; pass one")
        config = path
    return config


def _loader(dataset, collate_fn, run, mesh: Optional[Mesh]):
    """DeepSpeed's training_data loader (`deepspeed_io`) as `fs.data.loader`: micro-batches of this
    data rank's share, shuffled by the run's seed and a new order each epoch, the last partial
    batch dropped; each `for` loop over it is one epoch, and its `state_dict()` resumes mid-epoch."""
    if dataset is None:
        return None
    from .data import loader  # noqa: PLC0415

    return loader(dataset, micro_batch_size=run.batch.micro_batch_size, mesh=mesh, collate=collate_fn,
                  shuffle=True, seed=run.train.seed, drop_last=True, epoch_per_loop=True)


__all__ = ["Engine", "add_config_arguments", "initialize"]
