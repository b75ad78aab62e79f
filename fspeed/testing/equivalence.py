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
draws the same masks (a micro-batch's seed is its index in the global batch). The ranks'
gathered fp32 parameters must agree with each other and with the reference (`rtol`, `atol`), and
so must the losses. Module state (BatchNorm running statistics) follows DDP's rule under a plan
(data rank 0's), which a one-process run cannot reproduce: it is not compared.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from .world import GlooWorld


class Trained(NamedTuple):
    """A run's outcome: fp32 parameters by path, and the loss of every step."""

    params: dict[str, torch.Tensor]
    losses: list[float]


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


def train_on_world(build_model: Callable, plan, make_batch: Callable, *, tensor: int = 1, pipe: int = 1, steps: int = 3,
                   grad_accum: int = 1, micro_batch: int = 2, optimizer: Optional[Callable] = None,
                   precision: str = "fp32", loss_fn: Optional[Callable] = None, tp_plan=None, seed: int = 0) -> Trained:
    """One rank's side of the comparison (runs in every process of a GlooWorld)."""
    import fspeed as fs

    model, opt = _model(build_model, loss_fn, tp_plan), _optimizer(optimizer)
    mesh = fs.Mesh(data=-1, model=tensor, pipe=pipe)
    data, rank = mesh.size("data"), mesh.coordinate("data")
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(seed)), opt, precision=getattr(fs.precision, precision)(), seed=seed,
                                plan=plan, mesh=mesh, model=model)
    step = fs.make_train_step(model, opt, grad_accum=grad_accum, plan=plan, mesh=mesh)
    losses = []
    for i in range(steps):
        batch = make_batch(micro_batch * grad_accum * data, seed + i)
        state, metrics = step(state, _share(batch, data, rank))
        losses.append(metrics["loss"])
    params = fs.gather_params(state, mesh)
    return Trained(dict(zip(fs.tree_paths(params), fs.pytree.tree_leaves(params))), losses)


def _reference(build_model: Callable, make_batch: Callable, data: int, *, steps: int, grad_accum: int,
               micro_batch: int, optimizer: Optional[Callable], precision: str, loss_fn: Optional[Callable],
               tp_plan, seed: int) -> Trained:
    """The one-process run on the same global batches (one micro-batch per data rank and step)."""
    import fspeed as fs

    model, opt = _model(build_model, loss_fn, tp_plan), _optimizer(optimizer)
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(seed)), opt, precision=getattr(fs.precision, precision)(), seed=seed,
                                model=model)
    step = fs.make_train_step(model.loss, opt, grad_accum=grad_accum * data)
    losses = []
    for i in range(steps):
        state, metrics = step(state, make_batch(micro_batch * grad_accum * data, seed + i))
        losses.append(metrics["loss"])
    params = state.master_params.tree()
    return Trained(dict(zip(fs.tree_paths(params), fs.pytree.tree_leaves(params))), losses)


def assert_trains_like_one_process(build_model: Callable, plan, *, make_batch: Callable, world_size: int = 2,
                                   tensor: int = 1, pipe: int = 1, steps: int = 3, grad_accum: int = 1, micro_batch: int = 2,
                                   optimizer: Optional[Callable] = None, precision: str = "fp32",
                                   loss_fn: Optional[Callable] = None, tp_plan: Union[str, dict, None] = None,
                                   seed: int = 0, rtol: float = 1e-5, atol: float = 1e-6,
                                   world: Optional[GlooWorld] = None) -> Trained:
    """Train under `plan` on `world_size` gloo ranks (or on `world`, reused) and on one process;
    raise AssertionError naming the first parameter or loss that differs (module docstring).
    Returns the distributed run's outcome (rank 0's)."""
    if world_size % (tensor * pipe):
        raise ValueError(f"tensor={tensor} x pipe={pipe} must divide world_size={world_size}")
    data = world_size // (tensor * pipe)
    pipeline = plan.find("pipeline")
    if pipeline is not None:  # the pipeline's micro-batches are the accumulation
        grad_accum = pipeline.micro_batches
    options = dict(steps=steps, grad_accum=grad_accum, micro_batch=micro_batch, optimizer=optimizer,
                   precision=precision, loss_fn=loss_fn, tp_plan=tp_plan, seed=seed)
    own = world is None
    world = world or GlooWorld(world_size)
    try:
        if world.world_size != world_size:
            raise ValueError(f"the world has {world.world_size} ranks, not world_size={world_size}")
        results = world.run(train_on_world, build_model, plan, make_batch, tensor=tensor, pipe=pipe, **options)
    finally:
        if own:
            world.close()
    reference = _reference(build_model, make_batch, data, **options)
    first = results[0]
    for rank, result in enumerate(results[1:], start=1):
        for path, value in result.params.items():
            if not torch.equal(value, first.params[path]):
                raise AssertionError(f"rank {rank} and rank 0 disagree on {path!r} after {steps} steps under {plan!r}")
    for path, want in reference.params.items():
        got = first.params.get(path)
        if got is None:
            raise AssertionError(f"parameter {path!r} of the one-process run is missing under {plan!r}")
        if not torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol):
            worst = float((got.float() - want.float()).abs().max())
            raise AssertionError(f"{path!r} differs from the one-process run by {worst:.3g} after {steps} steps under "
                                 f"{plan!r} (rtol={rtol}, atol={atol})")
    for i, (got, want) in enumerate(zip(first.losses, reference.losses)):
        if not math.isclose(got, want, rel_tol=max(rtol, 1e-5), abs_tol=atol):
            raise AssertionError(f"the loss of step {i + 1} is {got} under {plan!r}, {want} on one process")
    return first


__all__ = ["Trained", "assert_trains_like_one_process", "train_on_world"]
