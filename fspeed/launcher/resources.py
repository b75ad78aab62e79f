"""The resource pool of a job and DeepSpeed's ways to trim it: `--include`/`--exclude`, `--num_nodes`, `--num_gpus`.

A pool maps host -> slot ids, in rank order (hosts in hostfile order, slots ascending). Slot ids
are device indices on that host: `worker-0 slots=4` gives (0, 1, 2, 3); a local node under
`CUDA_VISIBLE_DEVICES=2,3` gives (2, 3).

Filter grammar (DeepSpeed's `parse_resource_filter`): `NODE_SPEC[@NODE_SPEC...]` with
`NODE_SPEC = HOST[:SLOT[,SLOT...]]`; a host without slots means all of its slots. `--include`
keeps only what it names, `--exclude` removes what it names (a host left with no slot is
dropped); they are mutually exclusive, and neither combines with `--num_nodes`/`--num_gpus`.
Unknown hosts and slots are errors naming them. Two deliberate departures from DeepSpeed, both
where DeepSpeed silently does something surprising:

- DeepSpeed's `parse_inclusion_exclusion` seeds the pool of an included host with the included
  slots themselves, so `--include worker-0:7` on a 4-slot host is accepted; here it is an error.
- Naming a host twice merges its entries as a union (`h@h:0` is all of `h`); DeepSpeed lets the
  slot list win (`h@h:0` is slot 0 only).

`--num_nodes N` keeps the first N hosts, `--num_gpus N` the first N slots of every host (DeepSpeed
uses `range(N)`; the same for hostfile pools). Asking for more nodes or slots than exist is an
error here (DeepSpeed silently uses what it has, or invents slots).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Optional

from .hostfile import LaunchConfigError

__all__ = [
    "ResourceFilterError", "ResourcePool", "FILTER_GRAMMAR", "pool_from_slot_counts", "local_pool",
    "parse_node_specs", "filter_resources", "select_resources", "format_slots",
]

ResourcePool = dict[str, tuple[int, ...]]

FILTER_GRAMMAR = "HOST[:SLOT[,SLOT...]][@HOST[:SLOT[,SLOT...]]...], e.g. 'worker-0@worker-1:0,2'"

_SLOT = re.compile(r"^\d+$")


class ResourceFilterError(LaunchConfigError):
    """An `--include`/`--exclude` string, `--num_nodes` or `--num_gpus` is invalid for the pool."""


def pool_from_slot_counts(counts: Mapping[str, int]) -> ResourcePool:
    """Hostfile counts -> slot ids: `{'w0': 2}` -> `{'w0': (0, 1)}`."""
    return {host: tuple(range(count)) for host, count in counts.items()}


def local_pool(cuda_device_count: int, visible_devices: Optional[str], num_gpus: Optional[int],
               host: str = "localhost") -> ResourcePool:
    """The pool without a hostfile: this machine alone.

    With GPUs, its slots are the visible devices (`CUDA_VISIBLE_DEVICES` as a list of indices,
    DeepSpeed's `--include localhost:<list>` rule) or all devices. On a CPU-only machine there
    are no devices to count, so the slots are `--num_gpus` processes (1 if not given).
    """
    if cuda_device_count <= 0:
        count = 1 if num_gpus is None else num_gpus
        if count < 1:
            raise ResourceFilterError(f"--num_gpus {num_gpus}: the number of processes must be >= 1")
        return {host: tuple(range(count))}
    if visible_devices and visible_devices.strip():
        items = [item.strip() for item in visible_devices.split(",") if item.strip()]
        if all(_SLOT.match(item) for item in items):
            return {host: tuple(int(item) for item in items)}
    return {host: tuple(range(cuda_device_count))}


def format_slots(slots: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    runs: list[list[int]] = []
    for slot in sorted(slots):
        if runs and slot == runs[-1][1] + 1:
            runs[-1][1] = slot
        else:
            runs.append([slot, slot])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_node_specs(spec: str, flag: str = "--include") -> dict[str, Optional[tuple[int, ...]]]:
    """`'w0@w1:2,0'` -> `{'w0': None, 'w1': (0, 2)}`: None means every slot; repeats merge as a union."""
    nodes: dict[str, Optional[tuple[int, ...]]] = {}
    for node_spec in spec.strip().split("@"):
        node_spec = node_spec.strip()
        where = f"{flag} {spec!r}"
        if not node_spec:
            raise ResourceFilterError(f"{where} has an empty host entry; the format is {FILTER_GRAMMAR}")
        host, colon, slot_list = node_spec.partition(":")
        host = host.strip()
        if not host:
            raise ResourceFilterError(f"{where}: {node_spec!r} names no host; the format is {FILTER_GRAMMAR}")
        if not colon:
            nodes[host] = None
            continue
        slots = []
        for item in slot_list.split(","):
            item = item.strip()
            if not _SLOT.match(item):
                raise ResourceFilterError(
                    f"{where}: slot {item!r} of host {host!r} is not a non-negative integer; "
                    f"the format is {FILTER_GRAMMAR}"
                )
            slots.append(int(item))
        if host in nodes and nodes[host] is None:
            continue
        merged = set(nodes.get(host) or ()) | set(slots)
        nodes[host] = tuple(sorted(merged))
    return nodes


def _check_known(pool: Mapping[str, tuple[int, ...]], nodes: Mapping[str, Optional[tuple[int, ...]]],
                 flag: str, spec: str) -> None:
    for host, slots in nodes.items():
        if host not in pool:
            raise ResourceFilterError(
                f"{flag} {spec!r}: host {host!r} is not in the resource pool (hosts: {', '.join(pool)})"
            )
        missing = [slot for slot in slots or () if slot not in pool[host]]
        if missing:
            raise ResourceFilterError(
                f"{flag} {spec!r}: host {host!r} has no slot {', '.join(map(str, missing))} "
                f"(its slots: {format_slots(pool[host])})"
            )


def filter_resources(pool: Mapping[str, tuple[int, ...]], include: str = "", exclude: str = "") -> ResourcePool:
    """Apply `--include` or `--exclude` to a pool; the result keeps the pool's host and slot order."""
    if include.strip() and exclude.strip():
        raise ResourceFilterError(
            f"--include {include!r} and --exclude {exclude!r} are mutually exclusive; use one of them"
        )
    if include.strip():
        nodes = parse_node_specs(include, "--include")
        _check_known(pool, nodes, "--include", include)
        return {host: (slots if nodes[host] is None else tuple(s for s in slots if s in nodes[host]))
                for host, slots in pool.items() if host in nodes}
    if exclude.strip():
        nodes = parse_node_specs(exclude, "--exclude")
        _check_known(pool, nodes, "--exclude", exclude)
        kept: ResourcePool = {}
        for host, slots in pool.items():
            if host not in nodes:
                left = slots
            elif nodes[host] is None:
                left = ()
            else:
                left = tuple(slot for slot in slots if slot not in nodes[host])
            if left:
                kept[host] = left
        if not kept:
            raise ResourceFilterError(f"--exclude {exclude!r} removes every slot; nothing is left to run on")
        return kept
    return dict(pool)


def select_resources(pool: Mapping[str, tuple[int, ...]], *, include: str = "", exclude: str = "",
                     num_nodes: Optional[int] = None, num_gpus: Optional[int] = None) -> ResourcePool:
    """DeepSpeed's order: the filter, then the first `num_nodes` hosts, then the first `num_gpus` slots each."""
    if (num_nodes is not None or num_gpus is not None) and (include.strip() or exclude.strip()):
        raise ResourceFilterError(
            "--num_nodes/--num_gpus cannot be combined with --include/--exclude (as in DeepSpeed); "
            "name the hosts and slots in the filter instead"
        )
    selected = filter_resources(pool, include, exclude)
    if num_nodes is not None:
        if num_nodes < 1 or num_nodes > len(selected):
            raise ResourceFilterError(
                f"--num_nodes {num_nodes}: must be between 1 and the {len(selected)} host(s) available "
                f"({', '.join(selected)})"
            )
        selected = dict(list(selected.items())[:num_nodes])
    if num_gpus is not None:
        short = {host: len(slots) for host, slots in selected.items() if len(slots) < num_gpus}
        if num_gpus < 1 or short:
            detail = ", ".join(f"{host} has {count}" for host, count in short.items())
            raise ResourceFilterError(
                f"--num_gpus {num_gpus}: must be >= 1 and at most the slots of every host"
                + (f" ({detail})" if detail else "")
            )
        selected = {host: slots[:num_gpus] for host, slots in selected.items()}
    return selected
