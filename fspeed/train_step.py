"""`make_train_step`: one optimizer step over `grad_accum` micro-batches, as a function.

    step = make_train_step(model.loss, optimizer, grad_accum=4)
    state, metrics = step(state, batch)

Per micro-batch, autograd differentiates `loss * loss_scale / grad_accum` with respect to a 0-d
anchor (plain autograd rather than `torch.func.grad_and_value`: the same function and the same
gradients, but torch.func accumulates the gradients of multiply-used activations out of place,
which cost 2-4% of a Hugging Face GPT-2 step): each unit of parameters enters the model through
an identity whose backward delivers the unit's gradients to the runtime's gradient sink as soon
as they are complete (`fspeed.parallel.grads`), which accumulates them in
`precision.grad_accum_dtype` and, by ZeRO stage, reduces them over the data axis in buckets
during backward (overlapped with it when `overlap_comm` is on). At the boundary, as DeepSpeed does:

1. one norm of the scaled gradients gives both the overflow check and the grad norm;
2. the loss scaler updates (every attempt counts); on overflow the step is skipped: params,
   masters and optimizer state are untouched and the schedule does not advance;
3. unscaling and clipping are one multiply: when the optimizer chain starts with
   `clip_by_global_norm`, its coefficient is folded into the unscale factor;
4. the optimizer updates the fp32 masters in place and, when the compute copy is the masters'
   local image, writes it, cast, in the same pass (`cast_to`: the CPU Adam kernel fuses both and
   reads bf16/fp16 accumulated gradients as they are, with no fp32 copy); ZeRO-1/2 instead cast
   the updated partition and start its gather (broadcasts of `allgather_bucket_size` pieces in the
   forward's order, started piece by piece as an elementwise optimizer updates them), which the
   next forward waits for unit by unit, so it overlaps compute (Megatron's overlap_param_gather);
   reading `state.params` in between waits for all of it.

Metrics: loss (mean over micro-batches), lr (used by this step), grad_norm (unscaled, before
clipping), loss_scale (that produced the gradients), skipped. Where nothing reads the norm before
the update (no overflow check, loss scale, divergence guard or clipping: fp32 by default), an
optimizer that sums the squared gradients in its own pass (AdamW's CPU kernels) gives it, and no
pass of its own reads the gradient (on one process, on data ranks up to ZeRO-2, and on pipeline
stages that hold their whole gradient: ZeRO-0, or one data rank).

Divergence guard (`on_nonfinite`): where no dynamic loss scaler handles inf/NaN (fp32, bf16, fp16
with a static scale), a step whose loss or gradient norm is not finite either raises
`NonFiniteError` before anything changes ("stop") or is skipped like an overflow ("skip").
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
from typing import Any, Callable, NamedTuple, Optional

import torch

from .flat import Flat, LooseGrads
from .loss_scale import LossScaleState, update_loss_scale
from .micro_batches import batch_rows, on_device, split_micro_batches
from .models.model import Model, accepts_keyword
from .optim.base import GradientTransformation, chain, needs_full_allreduce, optimizer_step
from .optim.clipping import clip_coefficient
from .parallel.mesh import Mesh
from .parallel.pipeline_runtime import PipelineExecutor
from .parallel.plan import Plan
from .parallel.replicated_grads import check_replicated_grads, replicated_over_model
from .parallel.runtime import ParallelRuntime, check_optimizer
from .precision import Precision
from .pytree import PyTree
from .rng import dropout_seed, layer_generator
from .timers import StepTimers
from .train_state import TrainState

log = logging.getLogger("fspeed")

LossFn = Callable[..., torch.Tensor]
ON_NONFINITE = ("stop", "skip")


class NonFiniteError(FloatingPointError):
    """A step's loss or gradient norm was inf/NaN with on_nonfinite="stop": training diverged.

    Raised before the step changes anything: the state passed in is still valid (not donated).
    """

    def __init__(self, step: int, loss: float, grad_norm: float, precision: str):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(f"step {step}: the loss is {loss:g} and the gradient norm {grad_norm:g} ({precision}): "
                         f"training diverged. The step was not applied; the state is still that of step {step - 1}")


def make_train_step(
    loss_fn: LossFn | Model, optimizer: GradientTransformation, *, grad_accum: int = 1,
    plan: Optional[Plan] = None, mesh=None, on_nonfinite: Optional[str] = None,
    timers: Optional[StepTimers] = None, pause_gc: bool = True,
) -> "TrainStep":
    """Build `train_step(state, batch) -> (state, metrics)`; see the module docstring.

    `loss_fn(params, micro_batch, *, rng)` returns a scalar loss; `params` is the structured tree of
    compute-dtype parameters, `rng` a torch.Generator for dropout. `batch` holds
    `grad_accum` micro-batches stacked along dim 0 (this data rank's share of the global batch).

    With a `plan` and `mesh` (the same as the state was built with), gradients are reduced over the
    `data` axis during backward as the ZeRO stage says (`fspeed.parallel.grads`). A loss that
    accepts `ops=` is parallel-aware: it gets the plan's ops (tensor slicing, ZeRO-3 just-in-time
    gathering, per-layer gradient delivery) and each unit of its parameters as a `UnitParams` to
    pass to `ops.param` / `ops.scan`. Metrics are global: the loss is averaged over data ranks,
    the grad norm counts every element once.

    `on_nonfinite` ("stop" or "skip") is the divergence guard of the module docstring; None keeps
    the precision's own rule (DeepSpeed's: fp16 and bf16 skip inf/NaN gradients, fp32 applies them).

    `timers` (a `fspeed.timers.StepTimers`) adds the wall-clock breakdown to the metrics (`fwd_ms`,
    `bwd_ms`, `bwd_inner_ms`, `bwd_allreduce_ms`, `step_ms`, `allgather_ms`); without it no timer is called.

    A `Model` may be passed instead of its loss; a plan with `fs.pipeline(...)` needs it (its layer
    sequence is what the stages run, `fspeed.parallel.pipeline_runtime`). The pipeline's micro-batches
    are the gradient accumulation: `grad_accum` is then `micro_batches` (or must equal it), and the loss
    and grad norm are the whole model's on every stage.
    """
    model = loss_fn if isinstance(loss_fn, Model) else None
    pipe = plan.find("pipeline") if plan is not None else None
    if pipe is not None:
        if model is None or model.layers is None:
            raise ValueError("a pipeline plan needs the model's layer sequence: pass the Model itself "
                             "(make_train_step(model, opt, plan=plan, mesh=mesh)), one with Model.layers")
        if grad_accum not in (1, pipe.micro_batches):
            raise ValueError(f"grad_accum={grad_accum} but the pipeline runs micro_batches={pipe.micro_batches}: "
                             "the pipeline's micro-batches are the gradient accumulation; pass one of them")
        grad_accum = pipe.micro_batches
    if on_nonfinite is not None and on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite={on_nonfinite!r}; allowed: None, {', '.join(map(repr, ON_NONFINITE))}")
    if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
        raise ValueError(f"grad_accum={grad_accum!r} must be a positive integer")
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(f"optimizer must be a GradientTransformation, got {type(optimizer).__name__}")
    if (plan is None) != (mesh is None):
        raise ValueError("make_train_step: pass both plan= and mesh= (or neither)")
    return TrainStep(model.loss if model is not None else loss_fn, optimizer, grad_accum=grad_accum, plan=plan,
                     mesh=mesh, model=model, on_nonfinite=on_nonfinite, timers=timers, pause_gc=pause_gc)


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector held off inside (`make_train_step`'s `pause_gc`);
    re-entrant, and a collector the caller turned off stays off."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class _Step:
    """One step in progress: its runtime, the micro-batch losses so far, the rows seen."""

    __slots__ = ("runtime", "allreduce", "generator", "anchor", "losses", "rows")

    def __init__(self, runtime: ParallelRuntime, allreduce: bool, generator: torch.Generator, anchor: torch.Tensor):
        self.runtime, self.allreduce, self.generator, self.anchor = runtime, allreduce, generator, anchor
        self.losses: list[torch.Tensor] = []
        self.rows = 0


class _Verdict(NamedTuple):
    """What the boundary learns before it changes anything: the mean loss, the scaled gradient norm,
    whether the step overflowed, whether the divergence guard decides that, and the factor that
    turns a local gradient's norm into its mean's (`local_scale`)."""

    mean_loss: float
    scaled_norm: float
    overflow: bool
    guarded: bool
    local_scale: float


class TrainStep:
    """`train_step(state, batch) -> (state, metrics)` (what `make_train_step` returns).

    Its phases are public for engines that drive a step micro-batch by micro-batch (a
    DeepSpeed-style `engine(batch); engine.backward(loss); engine.step()` loop, `fs.initialize`):
    `begin(state)`, `micro(step, state, micro_batch) -> loss` `grad_accum` times, then
    `boundary(step, state) -> (state, metrics)`, which donates `state`. A pipeline runs its
    micro-batches together: `pipelined(step, state, micro_batches)` in place of the `micro` calls
    (None without a pipeline plan).

    It keeps the parallel runtime of the layout it last stepped (`runtime_for`), which holds the
    gradient buffers between steps (`persistent_grad_bytes`).
    """

    def __init__(self, loss_fn: LossFn, optimizer: GradientTransformation, *, grad_accum: int,
                 plan: Optional[Plan], mesh: Optional[Mesh], model: Optional[Model], on_nonfinite: Optional[str],
                 timers: Optional[StepTimers], pause_gc: bool):
        self.loss_fn, self.grad_accum, self.plan, self.mesh, self.model = loss_fn, grad_accum, plan, mesh, model
        self.pipe = plan.find("pipeline") if plan is not None else None
        self.on_nonfinite, self.timers = on_nonfinite, timers
        self.optimizer = optimizer
        # a leading clip_by_global_norm is folded into the unscaling multiply; `rest` is the update
        self.clip_norm, self.rest = _split_leading_clip(optimizer)
        self.parallel_aware = accepts_keyword(loss_fn, "ops")
        # module state (functionalize's BatchNorm statistics) must enter the transformed function as an
        # input to be updated in place under torch.func: the state's buffers, passed as an argument
        self.takes_buffers = accepts_keyword(loss_fn, "buffers")
        self._paused = gc_paused if pause_gc else contextlib.nullcontext
        self._runtimes: dict = {}
        self._executors: dict = {}  # a pipeline's, by the same key
        self._last: tuple = (None, None, None)  # the previous call's layout, precision and runtime: the usual case
        self._replicated_checked = False  # tensor slicing's first-step check (fspeed.parallel.replicated_grads)

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        micro_batches = split_micro_batches(batch, self.grad_accum)
        step = self.begin(state)
        if self.pipe is not None:
            self.pipelined(step, state, micro_batches)
            return self.boundary(step, state)
        for micro_batch in micro_batches:
            self.micro(step, state, micro_batch)
        return self.boundary(step, state)

    # -- the runtime ------------------------------------------------------------------------

    def runtime_for(self, state: TrainState) -> ParallelRuntime:
        """The parallel runtime of `state`'s layout and precision (made on first use, then kept)."""
        layout = state.layout
        last_layout, last_precision, last_runtime = self._last
        if layout is last_layout and state.precision is last_precision:  # hashing a layout walks every parameter
            return last_runtime
        step_mesh = self._mesh_for(state)
        check_optimizer(self.optimizer, layout)
        if layout.tensor_axes and not self.parallel_aware and self.pipe is None:
            raise ValueError("tensor slicing needs a parallel-aware loss (one that accepts ops=, like the "
                             "reference GPT's, fs.functionalize(module, tp_plan=...)'s or "
                             "fs.models.sequential(layers, tp_plan=...)'s)")
        key = (layout, state.precision)
        if key not in self._runtimes:
            self._runtimes.clear()
            self._runtimes[key] = ParallelRuntime(layout, step_mesh, state.precision, state.params,
                                                  loose_grads=self.rest.capabilities.loose_grads,
                                                  norm_in_update=self._norm_in_update(state.precision))
            if self.pipe is not None:
                self._executors.clear()
                self._executors[key] = PipelineExecutor(layout, step_mesh, self.model.layers,
                                                        state.precision.grad_accum_dtype)
        self._last = (layout, state.precision, self._runtimes[key])
        return self._runtimes[key]

    def _mesh_for(self, state: TrainState) -> Mesh:
        """The mesh this step runs `state` on, once its layout is checked against the step's plan."""
        layout = state.layout
        if self.plan is None:
            if not layout.is_local:
                raise ValueError(f"this state was built with a plan ({layout.describe()}); pass plan= and mesh= to "
                                 "make_train_step too")
            _warn_if_distributed()
            return Mesh.single()
        if layout.is_local and self.plan != layout.plan:
            raise ValueError("make_train_step was given a plan, but the state was built without one; "
                             "pass the same plan= and mesh= to init_train_state")
        if self.plan != layout.plan or dict(self.mesh.sizes) != dict(layout.mesh_sizes):
            raise ValueError(f"make_train_step's plan {self.plan!r} on mesh {self.mesh.sizes} does not match the "
                             f"state's ({layout.describe()})")
        return self.mesh

    def _norm_in_update(self, precision: Precision) -> bool:
        """Whether nothing reads the grad norm before the update (no overflow check, loss scale,
        divergence guard or clipping), so the optimizer's own pass over the gradient may give it
        (`Capabilities.sums_grad_squares`): one read of the gradient fewer."""
        return (self.rest.capabilities.sums_grad_squares and self.clip_norm is None and self.on_nonfinite is None
                and not precision.check_overflow and precision.loss_scale is None)

    def persistent_grad_bytes(self, where: str = "all") -> int:
        """Bytes held between steps for gradients (accumulators, partitions, buckets): on the
        "device", the "host" (offload_param's accumulator) or "all"."""
        held = [r.held_grad_bytes() for r in self._runtimes.values()]
        return sum(h["device"] + h["host"] if where == "all" else h[where] for h in held)

    # -- forward and backward ---------------------------------------------------------------

    def begin(self, state: TrainState) -> _Step:
        """A step's start: its runtime, whether its gradient is all-reduced, the shared buffers."""
        with self._paused():
            runtime = self.runtime_for(state)
            runtime.broadcast_buffers(state.buffers)  # every data rank starts from rank 0's, as DDP does
            if self.timers is not None:  # (after that broadcast: `allgather_ms` counts the parameter gather's only)
                self.timers.begin_step(runtime.data.log)
            # optimizers that communicate themselves (1-bit family) may take the local gradient instead
            opt_state = state.opt_state[1:] if self.clip_norm is not None else state.opt_state
            allreduce = needs_full_allreduce(self.rest, opt_state)
            runtime.begin_step(allreduce, self.grad_accum)
            device = runtime.compute_device(_params(state, runtime))
            return _Step(runtime, allreduce, torch.Generator(device=device), torch.zeros((), device=device))

    def micro(self, step: _Step, state: TrainState, micro_batch: PyTree) -> torch.Tensor:
        """One micro-batch's forward and backward; its gradient goes to the runtime's sink."""
        with self._paused():
            if self.pipe is not None:
                raise RuntimeError("a pipeline runs whole steps (all micro-batches interleaved by its schedule): "
                                   "call train_step(state, batch) (the engine's train_batch), not micro-batch by "
                                   "micro-batch")
            i = len(step.losses)
            if i >= self.grad_accum:
                raise RuntimeError(f"this step already has its {self.grad_accum} micro-batches (grad_accum); "
                                   "finish it first")
            runtime = step.runtime
            multiplier = state.loss_scale.scale / (self.grad_accum * runtime.n)  # summed over data ranks = the mean
            step.generator.manual_seed(self._micro_seed(state, runtime, i))
            micro_batch = on_device(micro_batch, step.anchor.device)
            runtime.begin_micro(i)
            loss = self._grad_and_loss(step.anchor, _params(state, runtime), micro_batch, step.generator,
                                       multiplier, state.buffers, runtime)
            runtime.end_micro()
            step.losses.append(loss)
            step.rows += batch_rows(micro_batch)
            return loss

    @property
    def pipelined(self) -> Optional[Callable[[_Step, TrainState, list[PyTree]], None]]:
        """`pipelined(step, state, micro_batches)` under a pipeline plan, else None."""
        return self._run_pipeline if self.pipe is not None else None

    def _run_pipeline(self, step: _Step, state: TrainState, micro_batches: list[PyTree]) -> None:
        """All micro-batches through this stage's part of the pipeline schedule; the stage's summed
        gradient goes to the runtime's sink as one micro-batch."""
        with self._paused():
            runtime, timers = step.runtime, self.timers
            executor = self._executors[(state.layout, state.precision)]
            runtime.settle_params()  # ZeRO-1/2's gather of the last update
            multiplier = state.loss_scale.scale / (self.grad_accum * runtime.n)

            def layer_rng(m: int, i: int) -> torch.Generator:
                return layer_generator(self._micro_seed(state, runtime, m), i, step.generator.device)
            if timers is not None:
                timers.start("fwd")  # forward and backward interleave: the schedule's time is fwd_ms
            micro_batches = [on_device(mb, step.anchor.device) for mb in micro_batches]
            into = runtime.summed_grad_buffer()
            final = runtime.begin_summed(step.allreduce)  # with overlap_comm: each sum reduced as it completes
            losses, grads = executor.step(state.params, micro_batches, multiplier, layer_rng, into=into,
                                          final=final, buffers=state.buffers)
            if timers is not None:
                timers.stop("fwd")
            runtime.deliver_summed(grads, step.allreduce)
            step.losses = losses or [torch.zeros(()) for _ in micro_batches]
            step.rows = sum(batch_rows(mb) for mb in micro_batches)

    def _micro_seed(self, state: TrainState, runtime: ParallelRuntime, i: int) -> int:
        """The dropout seed of this data rank's micro-batch i: micro-batch rank * grad_accum + i of the
        global batch, so its masks are the ones a run with fewer data ranks and more accumulation
        draws for the same rows."""
        return dropout_seed(state.rng_seed, state.step, runtime.rank * self.grad_accum + i)

    def _micro_loss(self, anchor: torch.Tensor, params: Flat, micro_batch: PyTree, rng: torch.Generator,
                    multiplier: float, buffers, runtime: ParallelRuntime) -> tuple[torch.Tensor, torch.Tensor]:
        """(the scaled loss that backward starts from, the loss itself) of one micro-batch."""
        ops = runtime.ops(anchor)
        tree = runtime.view(params, ops, self.parallel_aware)
        extra = {"buffers": buffers} if self.takes_buffers else {}
        if self.parallel_aware:
            loss = self.loss_fn(tree, micro_batch, rng=rng, ops=ops, **extra)
        else:
            loss = self.loss_fn(tree, micro_batch, rng=rng, **extra)
        if loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar, got shape {list(loss.shape)}")
        return loss.float() * multiplier, loss.detach().float()

    def _grad_and_loss(self, anchor: torch.Tensor, params: Flat, micro_batch: PyTree, rng: torch.Generator,
                       multiplier: float, buffers, runtime: ParallelRuntime) -> torch.Tensor:
        """Forward and backward of one micro-batch (plain autograd, module docstring); the
        gradients reach the runtime's sink, the anchor's own is not needed."""
        anchor = anchor.detach().requires_grad_()
        args = (params, micro_batch, rng, multiplier, buffers, runtime)
        timers = self.timers
        if timers is None:
            scaled, loss = self._micro_loss(anchor, *args)
            torch.autograd.backward(scaled, inputs=runtime.backward_inputs(anchor))
            return loss
        timers.start("fwd")
        scaled, loss = self._micro_loss(anchor, *args)
        timers.stop("fwd")
        timers.start("bwd_inner")
        torch.autograd.backward(scaled, inputs=runtime.backward_inputs(anchor))
        timers.stop("bwd_inner")
        return loss

    # -- the boundary -----------------------------------------------------------------------

    def boundary(self, step: _Step, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """The end of a step (module docstring): overflow check, clipping, the update."""
        with self._paused():
            if len(step.losses) != self.grad_accum:
                raise RuntimeError(f"a step needs {self.grad_accum} micro-batches (grad_accum), got "
                                   f"{len(step.losses)}")
            runtime, precision, scaler = step.runtime, state.precision, state.loss_scale
            grads = self._reduced_grads(runtime)
            verdict = self._verdict(step, grads, precision)
            if verdict.overflow and verdict.guarded and self.on_nonfinite == "stop":
                raise NonFiniteError(state.step + 1, verdict.mean_loss,
                                     verdict.scaled_norm * verdict.local_scale / scaler.scale, precision.name)
            new_scaler = update_loss_scale(precision.loss_scale, scaler, verdict.overflow)  # may raise at min scale
            lr = state.lr
            samples = state.samples + step.rows * runtime.n
            state.donate()  # from here on the input's buffers are reused
            fields = {name: object.__getattribute__(state, name) for name in
                      ("params", "master", "opt_state", "step", "skipped_steps", "rng_seed", "buffers")}
            metrics = dict(step=fields["step"] + 1, loss=verdict.mean_loss, lr=lr, loss_scale=scaler.scale,
                           skipped=verdict.overflow)
            if verdict.overflow:
                self._log_skipped(fields["step"] + 1, verdict, scaler, new_scaler, precision)
                metrics["grad_norm"] = verdict.scaled_norm
                return _next_state(state, fields, new_scaler, samples, skipped=1), self._timed(metrics)
            unscale = new_scaler.scale if precision.unscale_with_updated_scale else scaler.scale
            metrics["grad_norm"], gather = self._update(runtime, grads, fields, verdict, unscale)
            return (_next_state(state, fields, new_scaler, samples, skipped=0).with_params_in_flight(gather),
                    self._timed(metrics))

    def _reduced_grads(self, runtime: ParallelRuntime) -> Any:
        """The step's gradient, its reduction over the data axis finished (the first step under tensor
        slicing also checks that the parameters each tensor rank keeps whole got the same gradient)."""
        timers = self.timers
        if timers is not None:
            timers.start("bwd_allreduce")
        grads = runtime.finish()
        if runtime.model.size > 1 and not self._replicated_checked:
            check_replicated_grads(replicated_over_model(grads, runtime.layout), runtime.model)
            self._replicated_checked = True
        if timers is not None:
            timers.stop("bwd_allreduce")
            timers.start("step")
        return grads

    def _verdict(self, step: _Step, grads: Any, precision: Precision) -> _Verdict:
        """The loss and gradient norm (one synchronization with the device) and, from them, whether
        the step overflowed: every data rank reaches the same verdict."""
        runtime = step.runtime
        if runtime.norm_in_update:  # the optimizer's pass gives the norm (`_update`)
            local_loss, scaled_norm = torch.stack(step.losses).mean().item(), 0.0
        else:  # the loss and the gradient norm reach the host together: one synchronization with the device
            norm = runtime.grad_norm(grads)
            local_loss, scaled_norm = torch.stack([torch.stack(step.losses).mean().to(norm), norm]).tolist()
        mean_loss = runtime.mean_loss(local_loss)
        dynamic_scaler = precision.loss_scale is not None and precision.loss_scale.dynamic
        guarded = self.on_nonfinite is not None and not dynamic_scaler
        if guarded:
            overflow = not (math.isfinite(scaled_norm) and math.isfinite(mean_loss))
        else:
            overflow = precision.check_overflow and not math.isfinite(scaled_norm)
        local_scale = 1 if step.allreduce else runtime.n  # a local gradient of the pre-divided loss is 1/n of its mean
        if not step.allreduce and (precision.check_overflow or guarded) and runtime.n > 1:
            # ranks must agree on skipping: DeepSpeed all-reduces the overflow flag (MAX) in this mode too
            overflow = runtime.data.all_reduce_scalar(float(overflow), "max") > 0
        return _Verdict(mean_loss, scaled_norm, overflow, guarded, local_scale)

    def _log_skipped(self, step_number: int, verdict: _Verdict, scaler: LossScaleState,
                     new_scaler: LossScaleState, precision: Precision) -> None:
        if verdict.guarded:
            log.warning("step %d: the loss is %g and the gradient norm %g (%s); step skipped "
                        "(on_nonfinite='skip')", step_number, verdict.mean_loss,
                        verdict.scaled_norm * verdict.local_scale / scaler.scale, precision.name)
        else:
            log.warning("step %d: %s gradient overflow (inf/NaN); step skipped, loss scale %g -> %g",
                        step_number, precision.name, scaler.scale, new_scaler.scale)

    def _update(self, runtime: ParallelRuntime, grads: Any, fields: dict, verdict: _Verdict,
                unscale: float) -> tuple[float, Any]:
        """Unscale and clip (one multiply), the optimizer's update of the masters in place, and the
        write-back of the compute copy (`fields` gets the new optimizer state): (the unscaled grad
        norm, the parameter gather left in flight, or None)."""
        # a local gradient's own norm (DeepSpeed clips by it too)
        grad_norm = verdict.scaled_norm * verdict.local_scale / unscale
        factor = verdict.local_scale / unscale
        if self.clip_norm is not None:
            factor *= clip_coefficient(grad_norm, self.clip_norm)
        if factor != 1.0:  # unscale and clip in one pass
            if isinstance(grads, LooseGrads):
                torch._foreach_mul_(grads.tensors, factor)
            else:
                grads.buffer.mul_(factor)
        master = fields["master"] if fields["master"] is not None else fields["params"]
        cast_to = runtime.cast_target(master, fields["params"])  # never a device tensor for a CPU (offload) update
        opt_state = fields["opt_state"]
        head, opt_state = (opt_state[:1], opt_state[1:]) if self.clip_norm is not None else ((), opt_state)
        # with the norm from the update pass (no loss scale: the norm is the reduced gradient's own) the
        # optimizer appends the sums of squares to grad_sq; else optimizers that communicate get the data axis
        grad_sq = [] if self.clip_norm is None and runtime.norm_in_update else None
        copies_sq = runtime.tied_copies_sq(grads) if grad_sq is not None else 0.0
        kwargs = dict(grad_sq=grad_sq) if grad_sq is not None else dict(comm=runtime.data if runtime.n > 1 else None)

        def update(g, s, m, c):
            return optimizer_step(self.rest, g, s, m, cast_to=c, **kwargs)

        norms: list = []

        def take_norm() -> None:  # (a collective: before what a gather leaves queued behind it)
            if grad_sq is not None:
                norms.append(runtime.norm_from_update(grad_sq, copies_sq))

        if runtime.updates_by_piece(self.rest, grads, opt_state, master):  # ZeRO-1/2: gathered piece by piece
            master, opt_state, gather = runtime.update_and_gather(update, grads, opt_state, master,
                                                                  fields["params"], cast_to, then=take_norm)
        else:
            master, opt_state = update(grads, opt_state, master, cast_to)
            take_norm()
            gather = runtime.write_back(master, fields["params"], cast_to)  # cast/upload; ZeRO-1/2 start their gather
        fields["opt_state"] = head + tuple(opt_state) if self.clip_norm is not None else opt_state
        return (norms[0] if norms else grad_norm), gather

    def _timed(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The metrics, with the step's wall-clock breakdown when timers are on."""
        if self.timers is not None:
            self.timers.stop("step")
            metrics.update(self.timers.end_step())
        return metrics


def _split_leading_clip(optimizer: GradientTransformation) -> tuple[float | None, GradientTransformation]:
    """(max_norm, rest) when the optimizer is a composition whose first part only clips by global
    norm (folded into the unscaling multiply); (None, optimizer) otherwise."""
    children = optimizer.children
    if children and children[0].capabilities.clip_norm is not None:
        return children[0].capabilities.clip_norm, chain(*children[1:])
    return None, optimizer


def _warn_if_distributed() -> None:
    """A step without a plan in a world of several ranks trains one independent copy per rank."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world > 1:
        log.warning("train_step without plan= and mesh= in a process group of %d ranks: each rank trains its own "
                    "copy, nothing is averaged. For data parallelism pass plan=fs.zero(0) (or any plan) and "
                    "mesh=fs.Mesh(data=-1) to init_train_state and make_train_step.", world)


def _params(state: TrainState, runtime: ParallelRuntime) -> Flat:
    """The state's params for this step's forward: still being all-gathered when this runtime
    started the gather in the last step (its forward waits unit by unit), else complete."""
    params = state.params_gathering(runtime.param_gather)
    return params if params is not None else state.params


def _next_state(old: TrainState, fields: dict, scaler: LossScaleState, samples: int, skipped: int) -> TrainState:
    return TrainState(
        params=fields["params"],
        master=fields["master"],
        opt_state=fields["opt_state"],
        loss_scale=scaler,
        step=fields["step"] + 1,
        skipped_steps=fields["skipped_steps"] + skipped,
        samples=samples,
        rng_seed=fields["rng_seed"],
        buffers=fields["buffers"],
        precision=old.precision,
        layout=old.layout,
    )
