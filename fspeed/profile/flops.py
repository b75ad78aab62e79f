"""The flops profiler: per-module parameters, MACs, flops and forward latency of one forward pass.

    prof = fs.profile.flops(model, params, batch)       # also usable as `with ... as prof:`
    print(prof.table(depth=2, top=5))                     # DeepSpeed's aggregated profile
    prof.total_flops, prof.modules["blocks.0"].flops

Flops are counted by torch's own `torch.utils.flop_counter.FlopCounterMode` (matmuls, convolutions,
attention kernels: `2 x MACs`; elementwise ops are not counted), attributed to modules by
parameter path:

- a `functionalize`d `nn.Module`: its submodules, named as in `named_modules()` (the names of its
  parameters less `.weight`), through forward hooks;
- the reference GPT (any Model whose loss takes `ops=`): each unit of `ops.scan` / `ops.call`
  (`blocks.3`) and each `ops.linear` / `ops.embedding` by its weight's path (`blocks.3.attn.wqkv`);
  other flops (attention's matmuls) count for the enclosing unit.

A module's flops include its descendants'; its parameters are those under its path; its latency is
the wall time of its forward (CUDA synchronised around it), summed over its calls.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..models.model import Model, accepts_keyword
from ..models.ops import DenseOps, block_generators
from ..pytree import PyTree, tree_flatten_with_paths
from ..torch_internals import flop_counter_with_scopes
from .report import FlopsProfile, ModuleProfile


class _Scopes:
    """The open module scopes (a stack of paths); `parents` (every prefix of an open path, and
    "Global") is what FlopCounterMode attributes an op's flops to. Times each scope's forward."""

    def __init__(self, sync_cuda: bool):
        self.sync_cuda = sync_cuda
        self.stack: list[str] = []
        self.parents: set[str] = {"Global"}
        self.latency: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._starts: list[float] = []

    def __enter__(self) -> "_Scopes":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _now(self) -> float:
        if self.sync_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def push(self, path: str) -> None:
        self.stack.append(path)
        self._starts.append(self._now())
        self._update()

    def pop(self) -> None:
        path = self.stack.pop()
        self.latency[path] += self._now() - self._starts.pop()
        self.calls[path] += 1
        self._update()

    def _update(self) -> None:
        parts = {"Global"}
        for path in self.stack:
            pieces = path.split(".")
            parts.update(".".join(pieces[:i]) for i in range(1, len(pieces) + 1))
        self.parents = parts

    @contextlib.contextmanager
    def scope(self, path: Optional[str]) -> Iterator[None]:
        if path is None:
            yield
            return
        self.push(path)
        try:
            yield
        finally:
            self.pop()


class _ScopedOps(DenseOps):
    """Dense ops that open a scope per unit (`scan`, `call`) and per weight (`linear`, `embedding`)."""

    def __init__(self, scopes: _Scopes, names: dict[int, str]):
        self.scopes, self.names = scopes, names

    def _prefix(self, tree: Any) -> Optional[str]:
        paths = [self.names[id(t)] for t in tree_flatten_with_paths(tree)[1] if id(t) in self.names]
        if not paths:
            return None
        common = paths[0].split(".")
        for path in paths[1:]:
            pieces = path.split(".")
            n = 0
            while n < min(len(common), len(pieces)) and common[n] == pieces[n]:
                n += 1
            common = common[:n]
        return ".".join(common) or None

    def linear(self, x, w, b=None, **axes):
        with self.scopes.scope(self.names.get(id(w))):
            return super().linear(x, w, b, **axes)

    def embedding(self, ids, w, **kwargs):
        with self.scopes.scope(self.names.get(id(w))):
            return super().embedding(ids, w, **kwargs)

    def head_loss(self, x, w, targets, **kwargs):
        with self.scopes.scope(self.names.get(id(w))):
            return super().head_loss(x, w, targets, **kwargs)

    def call(self, p, fn, *args, **kwargs):
        with self.scopes.scope(self._prefix(p)):
            return super().call(p, fn, *args, **kwargs)

    def scan(self, fn, blocks, x, rng=None, *, first=0, after=None):
        for block, rng_i in zip(blocks, block_generators(rng, len(blocks))):
            with self.scopes.scope(self._prefix(block)):
                x = fn(block, x, rng_i)
        return x


@contextlib.contextmanager
def _module_scopes(root: nn.Module, scopes: _Scopes) -> Iterator[None]:
    """Open a scope (its `named_modules` path) around the forward of each of `root`'s submodules."""
    names = {id(m): path for path, m in root.named_modules() if path}

    def enter(module, args):
        if id(module) in names:
            scopes.push(names[id(module)])

    def leave(module, args, output):
        if id(module) in names:
            scopes.pop()

    pre = nn.modules.module.register_module_forward_pre_hook(enter)
    post = nn.modules.module.register_module_forward_hook(leave)
    try:
        yield
    finally:
        pre.remove()
        post.remove()


def flops(model: Model, params: PyTree, batch: PyTree, *, rng: Optional[torch.Generator] = None,
          warm_up: int = 2) -> FlopsProfile:
    """Profile one forward of `model.loss(params, batch)` (no gradients): per-module flops, MACs,
    parameters and latency (module docstring). One forward counts the flops; after `warm_up` more,
    one without the counter's overhead is timed."""
    paths, leaves, _ = tree_flatten_with_paths(params)
    device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), torch.device("cpu"))
    scopes = _Scopes(sync_cuda=device.type == "cuda")
    root = getattr(model.loss, "module", None)
    if isinstance(root, nn.Module):
        def forward():
            with _module_scopes(root, scopes):
                return model.loss(params, batch, rng=rng)
    else:
        ops = _ScopedOps(scopes, {id(t): p for p, t in zip(paths, leaves)})

        if not accepts_keyword(model.loss, "ops"):
            raise TypeError(f"the flops profiler needs a functionalize'd nn.Module or a Model whose loss takes ops= "
                            f"(as the reference GPT's), to name its modules; {model.name}'s loss takes neither")

        def forward():
            return model.loss(params, batch, rng=rng, ops=ops)
    with torch.no_grad():
        counter = flop_counter_with_scopes(scopes)
        with counter:  # counting dispatches every op through Python: timing is a pass of its own
            forward()
        for _ in range(warm_up):  # the counter's pass leaves kernels' caches cold
            forward()
        scopes.latency.clear()
        scopes.calls.clear()
        start = scopes._now()
        forward()
        latency = scopes._now() - start
    counts = {name: sum(by_op.values()) for name, by_op in counter.get_flop_counts().items()}
    names = (set(counts) | set(scopes.latency)) - {"Global"}
    sizes = {p: t.numel() for p, t in zip(paths, leaves) if isinstance(t, torch.Tensor)}
    modules = {name: ModuleProfile(name, _params_under(name, sizes), counts.get(name, 0),
                                   _latency(name, scopes.latency), scopes.calls.get(name, 0))
               for name in sorted(names)}
    rows = next((t.shape[0] for t in tree_flatten_with_paths(batch)[1] if isinstance(t, torch.Tensor) and t.dim()),
                0)
    return FlopsProfile(modules, counts.get("Global", 0), sum(sizes.values()), latency, rows)


def _params_under(path: str, sizes: dict[str, int]) -> int:
    return sum(n for p, n in sizes.items() if p == path or p.startswith(path + "."))


def _latency(path: str, measured: dict[str, float]) -> float:
    """`path`'s own measured time, else the sum over its outermost measured descendants."""
    if path in measured:
        return measured[path]
    inside = [p for p in measured if p.startswith(path + ".")]
    outermost = [p for p in inside if not any(p.startswith(q + ".") for q in inside)]
    return sum(measured[p] for p in outermost)


__all__ = ["FlopsProfile", "ModuleProfile", "flops"]
