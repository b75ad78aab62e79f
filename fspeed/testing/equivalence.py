"""`assert_trains_like_one_process`: train a model under a plan on a gloo world and on one process,
on the same global batches, and compare.

    assert_trains_like_one_process(my_pkg.build_model, fs.zero(3) | fs.tensor_slicing(...),
                                   make_batch=my_pkg.make_batch, world_size=4, tensor=2)
    assert_trains_like_one_process(my_pkg.build_model, fs.zero(1) | fs.pipeline(micro_batches=4),
                                   make_batch=my_pkg.make_batch, world_size=4, pipe=2)

`build_model()` returns an `nn.Module` (with `loss_fn`) or an fspeed `Model`; it and
`make_batch(rows, seed)` (a dict or tuple of tensors, rows along dim 0) run in every rank's process,
so they must be importable top-level functions. Each data rank trains on its share of every global
batch; the one-process reference takes the whole batch with one micro-batch per (data rank x
accumulation step), so that per-micro-batch statistics (BatchNorm) see the same rows and dropout
draws the same masks (a micro-batch's seed is its index in the global batch).

What is compared. A plan changes the order of floating-point sums (tensor slicing splits a matmul's
reduction, ZeRO reduces over ranks), so a correct plan's gradients differ from one process's by
rounding. SGD keeps rounding as rounding: its update is linear in the gradient. Adam does not: its
first update is about `lr * sign(g)`, so an entry whose true gradient is near zero (an attention key
bias: exactly zero) moves by up to `2 * lr` when rounding flips its sign. Comparing Adam-trained
parameters elementwise therefore fails correct plans. The check is made of four comparisons, each
named when it fails, with the parameter, the step and the magnitude:

- gradients: the first step's gradient of every parameter (one SGD step of learning rate 1: the
  parameters move by exactly the gradient), `max|diff| <= rtol * max|g| + atol` per tensor. This is
  the tight check that catches a wrong gradient, scaled or not.
- SGD trajectory: `steps` steps of SGD (`sgd_lr`) after that one, each step's parameters against one
  process's, `max|diff| <= rtol * max|displacement| + atol` per tensor (the displacement is how far
  one process's parameters moved from the start: what a wrong update would get wrong).
- optimizer trajectory: `steps` steps of the user's optimizer (default AdamW with clipping), each
  step's parameters compared on the entries where the optimizer is well-conditioned: those whose
  first gradient on one process is at least `noise_floor` times the model's largest gradient entry,
  `max|diff| <= optimizer_rtol * max|displacement| + atol` per tensor; every entry must be finite.
  An optimizer that is linear in the gradient (SGD, with or without clipping) is compared on every
  entry with `rtol`, and the SGD trajectory is then its own.
- loss: every step's loss of both runs, relative `max(rtol, 1e-5)` and absolute `atol`.

The ranks' gathered fp32 parameters must also agree with each other exactly, and start equal to one
process's. Module state (BatchNorm running statistics) follows DDP's rule under a plan (data rank
0's), which a one-process run cannot reproduce: it is not compared.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from .world import GlooWorld


class Trained(NamedTuple):
    """A run's outcome: fp32 parameters by path and the loss of every step under the optimizer;
    `gradients`, the first step's gradient of every parameter, and `sgd_losses`, the losses of the
    SGD trajectory (both from `assert_trains_like_one_process`; None from `train_on_world`)."""

    params: dict[str, torch.Tensor]
    losses: list[float]
    gradients: Optional[dict[str, torch.Tensor]] = None
    sgd_losses: Optional[list[float]] = None


class _Run(NamedTuple):
    """One training run: the parameters before the first step, after each step, and the losses."""

    start: dict[str, torch.Tensor]
    params: list[dict[str, torch.Tensor]]
    losses: list[float]


class _UnitStepThen:
    """An SGD learning rate: 1 for the first step (the parameters move by exactly the gradient), then `lr`."""

    def __init__(self, lr: float):
        self.lr = lr

    def __call__(self, count: int) -> float:
        return 1.0 if count == 0 else self.lr


# parts of an optimizer whose update is linear in the gradient (clipping scales it by a global norm)
_LINEAR_PARTS = frozenset({"sgd", "clip_by_global_norm"})
# below this fraction of the largest first-gradient entry, rounding may flip an entry's sign
_NOISE_FLOOR = {"fp32": 1e-4, "bf16": 0.1, "fp16": 0.1}


def _model(build_model: Callable, loss_fn: Optional[Callable], tp_plan):
    import fspeed as fs

    built = build_model()
    if isinstance(built, fs.Model):
        if tp_plan is not None:
            raise ValueError("assert_trains_like_one_process: tp_plan= is for an nn.Module that build_model returns; "
                             f"it returned the Model {built.name}: pass tp_plan to its functionalize instead")
        return built
    if loss_fn is None:
        raise ValueError("assert_trains_like_one_process: build_model returned an nn.Module; pass loss_fn=")
    return fs.functionalize(built, loss_fn, tp_plan=tp_plan)


def _share(batch: Any, parts: int, index: int) -> Any:
    if isinstance(batch, dict):
        return {k: v.chunk(parts)[index] for k, v in batch.items()}
    return tuple(v.chunk(parts)[index] for v in batch)


def _optimizer(optimizer: Optional[Callable]):
    import fspeed as fs

    if optimizer is not None:
        return optimizer()
    return fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(1e-3, weight_decay=0.01))


def _is_linear(opt) -> bool:
    """Whether `opt`'s update is linear in the gradient (rounding in, rounding out)."""
    return all(part.info is not None and part.info.name in _LINEAR_PARTS for part in opt.parts)


def _train(build_model: Callable, plan, make_batch: Callable, opt, *, data: Optional[int], tensor: int, pipe: int,
           steps: int, grad_accum: int, micro_batch: int, precision: str, loss_fn: Optional[Callable], tp_plan,
           seed: int, every_step: bool = True) -> _Run:
    """Train `steps` steps: under `plan` on this rank of the world (`data` None), or on one process
    with one micro-batch per (data rank x accumulation step) of the same global batches."""
    import fspeed as fs

    model = _model(build_model, loss_fn, tp_plan)
    init = model.init(torch.Generator().manual_seed(seed))
    kind = getattr(fs.precision, precision)()
    if data is None:
        mesh = fs.Mesh(data=-1, model=tensor, pipe=pipe)
        data, rank = mesh.size("data"), mesh.coordinate("data")
        state = fs.init_train_state(init, opt, precision=kind, seed=seed, plan=plan, mesh=mesh, model=model)
        step = fs.make_train_step(model, opt, grad_accum=grad_accum, plan=plan, mesh=mesh)
    else:
        mesh, rank = None, None
        state = fs.init_train_state(init, opt, precision=kind, seed=seed, model=model)
        step = fs.make_train_step(model.loss, opt, grad_accum=grad_accum * data)

    def gathered() -> dict[str, torch.Tensor]:  # copies: the step donates (updates in place) its state
        tree = fs.gather_params(state, mesh) if mesh is not None else state.master_params.tree()
        return {path: t.detach().clone() for path, t in zip(fs.tree_paths(tree), fs.pytree.tree_leaves(tree))}

    start, params, losses = gathered(), [], []
    for i in range(steps):
        batch = make_batch(micro_batch * grad_accum * data, seed + i)
        state, metrics = step(state, _share(batch, data, rank) if mesh is not None else batch)
        losses.append(float(metrics["loss"]))
        if every_step or i == steps - 1:
            params.append(gathered())
    return _Run(start, params, losses)


def _runs(build_model: Callable, plan, make_batch: Callable, *, optimizer: Optional[Callable], sgd_lr: float,
          sgd_steps: int, optimizer_steps: int, **options) -> tuple[_Run, Optional[_Run]]:
    """The SGD run (its first step of learning rate 1 gives the gradients) and the optimizer's run."""
    import fspeed as fs

    sgd = _train(build_model, plan, make_batch, fs.optim.sgd(_UnitStepThen(sgd_lr)), steps=sgd_steps, **options)
    trained = _train(build_model, plan, make_batch, _optimizer(optimizer), steps=optimizer_steps, **options) \
        if optimizer_steps else None
    return sgd, trained


def train_on_world(build_model: Callable, plan, make_batch: Callable, *, tensor: int = 1, pipe: int = 1, steps: int = 3,
                   grad_accum: int = 1, micro_batch: int = 2, optimizer: Optional[Callable] = None,
                   precision: str = "fp32", loss_fn: Optional[Callable] = None, tp_plan=None, seed: int = 0) -> Trained:
    """One rank's side of a plain run of the optimizer (runs in every process of a GlooWorld):
    the gathered parameters after `steps` steps and the losses."""
    run = _train(build_model, plan, make_batch, _optimizer(optimizer), data=None, tensor=tensor, pipe=pipe, steps=steps,
                 grad_accum=grad_accum, micro_batch=micro_batch, precision=precision, loss_fn=loss_fn,
                 tp_plan=tp_plan, seed=seed, every_step=False)
    return Trained(run.params[-1], run.losses)


def _amax(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


class _Miss(NamedTuple):
    """One tensor outside its tolerance."""

    path: str
    diff: float
    allowed: float
    scale: float

    def excess(self) -> float:
        return self.diff / self.allowed if self.allowed > 0 else math.inf


def _misses(got: dict, want: dict, scales: dict, rtol: float, atol: float, masks: Optional[dict] = None) -> list[_Miss]:
    """The tensors of `want` whose largest difference from `got` exceeds `rtol * scale + atol` (or
    that are missing, or not finite where `want` is); with `masks`, only the masked entries count."""
    out = []
    for path, w in want.items():
        g = got.get(path)
        if g is None or g.shape != w.shape:
            out.append(_Miss(path, math.inf, 0.0, scales[path]))
            continue
        g, w = g.float(), w.float()
        if not bool(torch.isfinite(g).all()) and bool(torch.isfinite(w).all()):
            out.append(_Miss(path, math.nan, 0.0, scales[path]))
            continue
        diff = (g - w).abs()
        if masks is not None:
            diff = diff[masks[path]]
        worst = _amax(diff)
        allowed = rtol * scales[path] + atol
        if worst > allowed or math.isnan(worst):
            out.append(_Miss(path, worst, allowed, scales[path]))
    return out


def _describe(misses: list[_Miss], what: str, scale_name: str) -> str:
    worst = max(misses, key=_Miss.excess)
    if math.isinf(worst.diff):
        return f"{worst.path!r} is missing or has another shape"
    if math.isnan(worst.diff):
        return f"{worst.path!r} is not finite"
    others = f" (and {len(misses) - 1} more tensors)" if len(misses) > 1 else ""
    return (f"{worst.path!r} {what} by {worst.diff:.3g} (allowed {worst.allowed:.3g}; {scale_name} "
            f"{worst.scale:.3g}){others}")


def _displacement(run: _Run, step: int) -> dict:
    return {p: _amax(t.float() - run.start[p].float()) for p, t in run.params[step].items()}


def assert_trains_like_one_process(build_model: Callable, plan, *, make_batch: Callable, world_size: int = 2,
                                   tensor: int = 1, pipe: int = 1, steps: int = 3, grad_accum: int = 1, micro_batch: int = 2,
                                   optimizer: Optional[Callable] = None, precision: str = "fp32",
                                   loss_fn: Optional[Callable] = None, tp_plan: Union[str, dict, None] = None,
                                   seed: int = 0, rtol: float = 1e-5, atol: float = 1e-6,
                                   world: Optional[GlooWorld] = None, sgd_lr: float = 0.1,
                                   optimizer_rtol: float = 1e-3, noise_floor: Optional[float] = None) -> Trained:
    """Train under `plan` on `world_size` gloo ranks (or on `world`, reused) and on one process, and
    compare the first step's gradients, an SGD trajectory, the optimizer's trajectory and the losses
    (module docstring); raise AssertionError naming each comparison that failed, with its parameter,
    step and magnitude. Returns the distributed run's outcome (rank 0's).

    `optimizer()` builds the optimizer (default AdamW, lr 1e-3, weight decay 0.01, clipped at global
    norm 1). `rtol`, `atol`: the tight tolerances (gradients, SGD trajectory, a linear optimizer's
    trajectory, losses; loosen them for bf16/fp16). `sgd_lr`: the SGD trajectory's learning rate.
    `optimizer_rtol`: a non-linear optimizer's trajectory, relative to how far each tensor moved.
    `noise_floor`: the first gradient's entries below this fraction of the model's largest one are
    left out of that comparison (default 1e-4, about a thousand fp32 roundings; 0.1 in bf16 and
    fp16, whose rounding is coarser)."""
    if world_size % (tensor * pipe):
        raise ValueError(f"tensor={tensor} x pipe={pipe} must divide world_size={world_size}")
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    if precision not in _NOISE_FLOOR:
        raise ValueError(f"precision={precision!r}; allowed: {', '.join(map(repr, _NOISE_FLOOR))}")
    data = world_size // (tensor * pipe)
    pipeline = plan.find("pipeline")
    if pipeline is not None:  # the pipeline's micro-batches are the accumulation
        grad_accum = pipeline.micro_batches
    opt = _optimizer(optimizer)
    linear = _is_linear(opt)
    floor = _NOISE_FLOOR[precision] if noise_floor is None else noise_floor
    options = dict(optimizer=optimizer, sgd_lr=sgd_lr, sgd_steps=1 if linear else 1 + steps, optimizer_steps=steps,
                   tensor=tensor, pipe=pipe, grad_accum=grad_accum, micro_batch=micro_batch, precision=precision,
                   loss_fn=loss_fn, tp_plan=tp_plan, seed=seed)
    own = world is None
    world = world or GlooWorld(world_size)
    try:
        if world.world_size != world_size:
            raise ValueError(f"the world has {world.world_size} ranks, not world_size={world_size}")
        results = world.run(_runs, build_model, plan, make_batch, data=None, **options)
    finally:
        if own:
            world.close()
    ref_sgd, ref_opt = _runs(build_model, None, make_batch, data=data, **options)
    (sgd, trained), under = results[0], f"under {plan!r}"

    name = " + ".join(part.info.name if part.info is not None else "?" for part in opt.parts)
    runs = (("SGD run", sgd, ref_sgd, 0), (f"{name} run", trained, ref_opt, 1))
    for rank, other in enumerate(results[1:], start=1):
        for label, mine, _, k in runs:
            for step, (a, b) in enumerate(zip([mine.start, *mine.params], [other[k].start, *other[k].params])):
                for path, value in a.items():
                    if not torch.equal(value, b[path]):
                        when = f"after step {step} of the {label}" if step else "before the first step"
                        raise AssertionError(f"rank {rank} and rank 0 disagree on {path!r} {when} {under}")

    failures = []
    starts = _misses(sgd.start, ref_sgd.start, {p: _amax(t) for p, t in ref_sgd.start.items()}, rtol, atol)
    if starts:
        failures.append("initial parameters: " + _describe(starts, "differs", "max|p|"))
    grads = {p: sgd.start[p].float() - t.float() for p, t in sgd.params[0].items()}
    ref_grads = {p: ref_sgd.start[p].float() - t.float() for p, t in ref_sgd.params[0].items()}
    if not starts:
        missed = _misses(grads, ref_grads, {p: _amax(g) for p, g in ref_grads.items()}, rtol, atol)
        if missed:
            failures.append("gradients: " + _describe(missed, "differs at the first step", "max|g|"))

    def trajectory(label: str, got: _Run, want: _Run, first: int, tol: float, masks: Optional[dict] = None) -> None:
        for step in range(first, len(want.params)):
            missed = _misses(got.params[step], want.params[step], _displacement(want, step), tol, atol, masks)
            if missed:
                failures.append(f"{label}: " + _describe(missed, f"differs after step {step + 1}", "max|displacement|"))
                return

    # the SGD run's step 1 is the gradient step (learning rate 1); a linear optimizer's run is its trajectory
    trajectory(f"SGD trajectory (step 1 of lr 1, then lr {sgd_lr})", sgd, ref_sgd, 1, rtol)
    if linear:
        trajectory(f"optimizer trajectory ({name})", trained, ref_opt, 0, rtol)
    else:
        largest = max((_amax(g) for g in ref_grads.values()), default=0.0)
        masks = {p: g.abs() >= floor * largest for p, g in ref_grads.items()}
        trajectory(f"optimizer trajectory ({name}, on the entries whose first gradient is at least "
                   f"{floor:.2g} x the largest, {floor * largest:.3g})", trained, ref_opt, 0,
                   max(optimizer_rtol, rtol), masks)
    for label, got, want, _ in runs:
        for i, (a, b) in enumerate(zip(got.losses, want.losses)):
            if not math.isclose(a, b, rel_tol=max(rtol, 1e-5), abs_tol=atol):
                failures.append(f"loss: step {i + 1} of the {label} is {a:.7g}, {b:.7g} on one process "
                                f"(differs by {abs(a - b):.3g})")
                break
    if failures:
        raise AssertionError(f"training {under} differs from the one-process run (rtol={rtol}, atol={atol}):\n  "
                             + "\n  ".join(failures))
    return Trained(trained.params[-1], trained.losses, grads, sgd.losses)


__all__ = ["Trained", "assert_trains_like_one_process", "train_on_world"]
