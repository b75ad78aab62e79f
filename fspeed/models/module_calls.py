"""An `nn.Module`'s forward run as a layer's pure function (`module_sequence`'s and `traced`'s layers).

`computing` swaps forwards for one call (tensor-sliced submodules through the ops, fp32 and fused
ones by their given forwards); `seeded` forks torch's global generator for the modules' dropout;
`state_of` picks a layer's state tensors out of the model's buffer tree; `ModuleCall` makes
`call(module, x)` a module, so `torch.func.functional_call` can swap its parameters.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from ..pytree import PyTree, subtree
from .module import TP_AXES, restore_forwards, set_forwards
from .module_tp import explain_failure, tp_forward


@contextlib.contextmanager
def computing(sliced: Sequence[tuple[nn.Module, str, str]], computes: Mapping[nn.Module, Callable],
               ops: Any) -> Iterator[None]:
    """For one call: the sliced submodules (module, style, path) compute through `ops`
    (`module_tp.tp_forward`) when the ops slice; the `computes` ones by their given forwards (fp32
    ones, `module.fp32_forward`; fused ones, `fused_ops`)."""
    sliced = sliced if set(ops.tensor_axes) & TP_AXES else []
    overrides = {m: tp_forward(m, style, ops, path) for m, style, path in sliced}
    overrides.update(computes)
    if not overrides:
        yield
        return
    before = set_forwards(overrides)
    try:
        yield
    except (RuntimeError, ValueError, TypeError) as err:
        if sliced and type(err) in (RuntimeError, ValueError, TypeError):  # torch's, not fspeed's own errors
            raise explain_failure(err) from err
        raise
    finally:
        restore_forwards(before)


def state_of(buffers: Optional[PyTree], prefix: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """A layer's state tensors by name (relative to its module) from the model's buffer tree."""
    if not names:
        return {}
    try:
        flat = flat_named(subtree(buffers, prefix)) if buffers is not None else {}
    except (KeyError, IndexError, TypeError):
        flat = {}
    missing = [n for n in names if n not in flat]
    if missing:
        raise ValueError(f"layer {prefix!r} has state buffers ({missing[0]!r}, ...) that were not given: build the "
                         "state with fs.init_train_state(..., model=model) (or buffers=model.init_buffers()) and "
                         "call the model's loss with buffers=")
    return {n: flat[n] for n in names}


def flat_named(tree: PyTree, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested dict by their dotted paths (under `prefix`)."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    out: dict[str, torch.Tensor] = {}
    for key, sub in tree.items():
        out.update(flat_named(sub, f"{prefix}.{key}" if prefix else key))
    return out


class ModuleCall(nn.Module):
    """`call(inner, x)` as a module's forward, so functional_call can swap `inner`'s parameters for a
    forward other than `inner.forward` (a tied embedding used as the head)."""

    def __init__(self, inner: nn.Module, call: Callable):
        super().__init__()
        self.inner = inner
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(self.inner, x)


def seed_of(rng: Optional[torch.Generator]) -> Optional[int]:
    """A seed for torch's global generator drawn from `rng` (None without one)."""
    if rng is None:
        return None
    return int(torch.randint(0, 2**62, (1,), generator=rng, device=rng.device))


class seeded:
    """Dropout in torch modules draws from the global generator: fork it, seeded with `seed`."""

    def __init__(self, seed: Optional[int]):
        self.seed = seed
        self.fork = None

    def __enter__(self):
        if self.seed is None:
            return
        self.fork = torch.random.fork_rng(devices=[])
        self.fork.__enter__()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        if self.fork is not None:
            self.fork.__exit__(*exc)


__all__ = ["ModuleCall", "computing", "flat_named", "seed_of", "seeded", "state_of"]
