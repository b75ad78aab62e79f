"""What a forward keeps for backward, measured, and the cheapest remat that fits a memory budget.

    kept = fs.measure_activations(model, params, micro_batch)              # bytes, no remat
    model, choice = fs.remat_within_budget(model, params, micro_batch, budget_bytes=2 << 30)
    print(choice)    # every candidate's kept bytes and recompute time, and the one chosen

Activation memory depends on the model's code, not only its shapes (a Hugging Face layer and the
reference GPT keep different tensors), so it is measured: one micro-batch through the real
train_step on one process, the allocator's in-use bytes (CUDA's, else malloc's) when backward
starts over those before the forward. The budget choice tries the policies from cheapest
recompute to smallest memory (none, save_matmuls every 4, 2, 1, full every 4, 2, 1), timing each
candidate's recompute with a `RematProfile`, and takes the first that fits (DeepSpeed has no
such mode: there the user picks `number_checkpoints` by hand).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .rematerialization import RematProfile, remat
from .host_memory import live_host_bytes
from .models.model import Model
from .optim.sgd import sgd
from .pytree import PyTree
from .train_init import init_train_state
from .train_step import gc_paused, make_train_step

CANDIDATES: tuple[tuple[Optional[str], int], ...] = (
    (None, 1), ("save_matmuls", 4), ("save_matmuls", 2), ("save_matmuls", 1), ("full", 4), ("full", 2), ("full", 1),
)


def _in_use(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return live_host_bytes()


def bytes_kept_for_backward(run: Callable[[], Any], device: torch.device = torch.device("cpu")) -> tuple[int, float]:
    """(the allocator's in-use bytes on `device` when `run`'s first autograd backward starts, over
    those before `run`; seconds `run` took): what its forward keeps for backward. Garbage is
    collected first and the collector held off meanwhile (garbage freed mid-forward would hide
    what it keeps)."""
    real = torch.autograd.backward  # Tensor.backward calls it too
    kept: list[int] = []

    def measuring(tensors, *args, **kwargs):
        if not kept:
            kept.append(_in_use(device) - before)
        return real(tensors, *args, **kwargs)

    gc.collect()
    before = _in_use(device)
    if before is None:
        raise RuntimeError("measuring activations counts the allocator's bytes: CUDA's, or glibc's malloc on CPU")
    torch.autograd.backward = measuring
    start = time.perf_counter()
    try:
        with gc_paused():
            run()
    finally:
        torch.autograd.backward = real
    if not kept:
        raise RuntimeError("measuring activations: the function ran no autograd backward")
    return kept[0], time.perf_counter() - start


def warmed_up_step(model: Model, params: PyTree, micro_batch: Any, *, seed: int = 0) -> tuple[Any, Any]:
    """(a plain `make_train_step` of `model` (SGD at lr 0), its state after one step on `micro_batch`):
    what measuring a micro-batch starts from, its first-step allocations (buffers, caches) made."""
    opt = sgd(0.0)
    state = init_train_state(params, opt, seed=seed, model=model if model.init_buffers is not None else None)
    step = make_train_step(model.loss, opt)
    state, _ = step(state, micro_batch)
    return step, state


def measure_activations(model: Model, params: PyTree, micro_batch: Any, *, seed: int = 0) -> tuple[int, float]:
    """(bytes one micro-batch's forward keeps for backward, seconds of its forward and backward),
    measured through `make_train_step` on one process, after one warm-up step (module docstring)."""
    step, state = warmed_up_step(model, params, micro_batch, seed=seed)
    s = step.begin(state)
    return bytes_kept_for_backward(lambda: step.micro(s, state, micro_batch), state.master_params.buffer.device)


@dataclass(frozen=True)
class BudgetChoice:
    """Every candidate tried (policy, every, kept bytes, recompute ms) and the one chosen."""

    budget_bytes: int
    tried: tuple[tuple[Optional[str], int, int, float], ...]
    chosen: Optional[tuple[Optional[str], int]]

    def __str__(self) -> str:
        lines = [f"activation checkpointing for a budget of {self.budget_bytes / 2**20:.1f} MiB per micro-batch:",
                 f"  {'policy':<14} {'every':>5} {'kept MiB':>9} {'recompute ms':>13}"]
        for policy, every, kept, ms in self.tried:
            mark = "  <- chosen" if (policy, every) == self.chosen else ""
            lines.append(f"  {policy or 'none':<14} {every:>5} {kept / 2**20:9.1f} {ms:13.1f}{mark}")
        return "\n".join(lines)


def remat_within_budget(model: Model, params: PyTree, micro_batch: Any,
                        budget_bytes: int) -> tuple[Model, BudgetChoice]:
    """`model` with the cheapest activation checkpointing whose forward keeps at most
    `budget_bytes` for one micro-batch like `micro_batch` (module docstring). Raises ValueError
    naming the smallest it measured when even full remat of every block does not fit."""
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    tried = []
    for policy, every in CANDIDATES:
        profile = RematProfile()
        candidate = model if policy is None else remat(model, policy, every, profile=profile)
        kept, _ = measure_activations(candidate, params, micro_batch)
        recompute = sum(row["recompute"] for row in profile.take().values())
        tried.append((policy, every, kept, recompute))
        if kept <= budget_bytes:
            return candidate, BudgetChoice(budget_bytes, tuple(tried), (policy, every))
    smallest = min(k for _, _, k, _ in tried)
    table = BudgetChoice(budget_bytes, tuple(tried), None)
    raise ValueError(f"no activation checkpointing fits {budget_bytes / 2**20:.1f} MiB per micro-batch: full remat of "
                     f"every block keeps {smallest / 2**20:.1f} MiB; use a smaller micro-batch (or sequence), or "
                     f"partition_activations with tensor slicing\n{table}")


__all__ = ["BudgetChoice", "bytes_kept_for_backward", "measure_activations", "remat_within_budget", "warmed_up_step"]
