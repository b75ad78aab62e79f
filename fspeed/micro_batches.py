"""Micro-batches: a step's batch split along its rows, stacked back, and put where the step computes.

    micro_batches = split_micro_batches(batch, grad_accum)      # views, grad_accum equal parts
    batch = stack_micro_batches(micro_batches)                  # the inverse
    micro_batch = on_device(micro_batch, device)                # a CPU loader's batch for a GPU step

A batch is any pytree; its tensors share their leading (row) dimension, and its other leaves are
passed along unchanged to every micro-batch.
"""

from __future__ import annotations

import torch

from .pytree import PyTree, tree_flatten_with_paths, tree_map, tree_unflatten


def split_micro_batches(batch: PyTree, n: int) -> list[PyTree]:
    """Split every tensor of `batch` along dim 0 into `n` equal micro-batches (views)."""
    paths, leaves, treedef = tree_flatten_with_paths(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if len(sizes) != 1:
        shapes = {p: list(leaf.shape) for p, leaf in zip(paths, leaves) if isinstance(leaf, torch.Tensor)}
        raise ValueError(f"batch tensors must share their leading (batch) dim; got shapes {shapes}")
    rows = sizes.pop()
    if rows % n:
        raise ValueError(
            f"batch has {rows} rows, which grad_accum={n} does not divide; "
            f"pass a batch of grad_accum x micro_batch_size rows (e.g. {n * max(1, rows // n)})"
        )
    chunks = [leaf.split(rows // n) if isinstance(leaf, torch.Tensor) else [leaf] * n for leaf in leaves]
    return [tree_unflatten(treedef, [chunk[i] for chunk in chunks]) for i in range(n)]


def stack_micro_batches(micro_batches: list[PyTree]) -> PyTree:
    """The inverse of `split_micro_batches`: the micro-batches' tensors concatenated along dim 0 (other
    leaves from the first); they must have equal row counts, so the step splits them back as given."""
    flat = [tree_flatten_with_paths(mb) for mb in micro_batches]
    rows = {leaf.shape[0] for _, leaves, _ in flat for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim()}
    if len(rows) > 1 or any(f[2] != flat[0][2] for f in flat):
        raise ValueError(f"the micro-batches of a pipeline step need one structure and equal row counts; got rows "
                         f"{sorted(rows)}")
    leaves = [torch.cat(group) if isinstance(group[0], torch.Tensor) and group[0].dim() else group[0]
              for group in zip(*(f[1] for f in flat))]
    return tree_unflatten(flat[0][2], leaves)


def on_device(batch: PyTree, device: torch.device) -> PyTree:
    """`batch` with its tensors on `device`, where the step computes: a CPU loader's batch for a
    GPU step, copied asynchronously (from pinned memory). On the CPU it is `batch` itself."""
    if device.type == "cpu":
        return batch
    return tree_map(lambda t: t.to(device, non_blocking=True)
                    if isinstance(t, torch.Tensor) and t.device != device else t, batch)


def batch_rows(batch: PyTree) -> int:
    """The number of rows of `batch` (its first tensor's leading dimension)."""
    leaves = tree_flatten_with_paths(batch)[1]
    return next(leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0)


__all__ = ["batch_rows", "on_device", "split_micro_batches", "stack_micro_batches"]
