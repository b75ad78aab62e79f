"""Pytree helpers on optree, plus the one rule torch.func imposes.

`torch.func` only knows `torch.utils._pytree` nodes, so every fspeed node class is registered with
both registries through `register_node`. Every tree operation in fspeed goes through the helpers
here, which pass fspeed's optree namespace.

Parameter paths are dotted strings (`blocks.3.attn.wqkv`): dict keys, sequence indices and
NamedTuple field names joined by dots. They are the stable names used in specs, checkpoints and logs.
"""

from __future__ import annotations

import functools

from typing import Any, Callable, Iterable

import optree
import torch
import torch.utils._pytree as torch_pytree

NAMESPACE = "fspeed"

PyTree = Any


def register_node(
    cls: type,
    flatten: Callable[[Any], tuple[Iterable[Any], Any]],
    unflatten: Callable[[Any, Iterable[Any]], Any],
    child_names: Callable[[Any], tuple[str, ...]] | None = None,
) -> type:
    """Register `cls` as a pytree node with optree (fspeed namespace) and torch's registry.

    `flatten(obj) -> (children, aux)` and `unflatten(aux, children) -> obj`; `aux` must be hashable.
    `child_names(aux)` names the children in paths (defaults to their indices).
    """

    def optree_flatten(obj):
        children, aux = flatten(obj)
        children = tuple(children)
        names = child_names(aux) if child_names else None
        return children, aux, names

    optree.register_pytree_node(
        cls, optree_flatten, lambda aux, children: unflatten(aux, children), namespace=NAMESPACE
    )
    def torch_flatten(obj):
        children, aux = flatten(obj)
        return list(children), aux

    torch_pytree.register_pytree_node(
        cls,
        torch_flatten,
        lambda children, aux: unflatten(aux, children),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
    )
    return cls


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf=None) -> PyTree:
    """`fn` applied leaf-wise over `tree` and matching `rest` trees (None stays None)."""
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_leaves(tree: PyTree, is_leaf=None) -> list[Any]:
    return optree.tree_leaves(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_flatten(tree: PyTree, is_leaf=None) -> tuple[list[Any], optree.PyTreeSpec]:
    return optree.tree_flatten(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_unflatten(treedef: optree.PyTreeSpec, leaves: Iterable[Any]) -> PyTree:
    return optree.tree_unflatten(treedef, leaves)


def _entry_name(entry: Any) -> str:
    if isinstance(entry, optree.NamedTupleEntry):
        return str(entry.field)
    if isinstance(entry, (optree.MappingEntry, optree.SequenceEntry)):
        return str(entry.entry)
    return str(entry.entry)


def tree_flatten_with_paths(
    tree: PyTree, is_leaf=None
) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """(dotted paths, leaves, treedef) of `tree`, in optree's leaf order."""
    leaves, treedef = optree.tree_flatten(tree, is_leaf=is_leaf, namespace=NAMESPACE)
    return list(_paths_of(treedef)), leaves, treedef


@functools.lru_cache(maxsize=4096)
def _paths_of(treedef: optree.PyTreeSpec) -> tuple[str, ...]:
    """The dotted paths of a tree structure's leaves (a step flattens the same few structures each
    time: naming their entries once saves most of the flatten's cost)."""
    return tuple(".".join(_entry_name(e) for e in accessor) for accessor in treedef.accessors())


def tree_paths(tree: PyTree, is_leaf=None) -> list[str]:
    return tree_flatten_with_paths(tree, is_leaf=is_leaf)[0]


def subtree(tree: PyTree, path: str) -> PyTree:
    """The subtree of nested dicts/lists at a dotted path (`blocks.3` -> tree["blocks"][3])."""
    for part in path.split(".") if path else ():
        tree = tree[int(part)] if isinstance(tree, (list, tuple)) else tree[part]
    return tree


def tensor_leaves(tree: PyTree) -> list[torch.Tensor]:
    """The tensor leaves of `tree` (non-tensor leaves such as step counters are skipped)."""
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def tree_zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    return tree_map(lambda x: torch.zeros_like(x, dtype=dtype), tree)


def tree_allclose(a: PyTree, b: PyTree, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """Same structure and every tensor leaf allclose (non-tensors compared with ==)."""
    leaves_a, def_a = tree_flatten(a)
    leaves_b, def_b = tree_flatten(b)
    if def_a != def_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.shape != y.shape:
                return False
            if not torch.allclose(x.float(), y.float(), rtol=rtol, atol=atol, equal_nan=True):
                return False
        elif x != y:
            return False
    return True
