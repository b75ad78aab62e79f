"""A short measurement of this machine's collectives: latency and bandwidth of each op, for the cost model.

    links = measure_collectives(world=2)        # CommCosts: per axis, per op, a LinkCost
    links.seconds("data", "all_reduce", 64 << 20, size=2)

`world` processes on this machine (`python -m fspeed.autotune.collectives`: gloo on the CPU, NCCL
on each rank's GPU with `device="cuda"`, as the run's ranks will use) run each collective of
`cost_model.COLLECTIVES` through fspeed's communication module at two message sizes, `repeats`
times after a warm-up; the median times give a line `latency + bytes x
s_per_byte` per op. One node has one transport, so every mesh axis gets the same links (a
multi-node mesh would measure each axis' group on its own).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from .cost_model import COLLECTIVES, CommCosts, LinkCost

AXES = ("data", "model", "pipe")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_op(comm, op: str, nbytes: int, world: int, rank: int, repeats: int,
             device: torch.device = torch.device("cpu")) -> float:
    """Median seconds of one `op` moving `nbytes` (module docstring's message size) on `comm`."""
    import torch.distributed as dist  # noqa: PLC0415

    from .profiling import synchronize  # noqa: PLC0415

    n = max(nbytes // 4, world)
    n -= n % world
    full, part = torch.ones(n, device=device), torch.ones(n // world, device=device)
    runs = {
        "all_reduce": lambda: comm.all_reduce_(full),
        "all_gather": lambda: comm.all_gather(part, full),
        "reduce_scatter": lambda: comm.reduce_scatter(full, part),
        "send": lambda: comm.start_send(full, 1).wait() if rank == 0 else comm.recv_(full, 0, "probe")
        if rank == 1 else None,
    }
    times = []
    for run in range(repeats + 1):
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        runs[op]()
        synchronize(device)
        if run:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank_main(rank: int, world: int, port: int, sizes: Sequence[int], repeats: int, out: str,
               device_type: str = "cpu") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from ..parallel.mesh import Mesh, init_distributed, local_device, shutdown_distributed  # noqa: PLC0415

    init_distributed(backend=None if device_type == "cuda" else "gloo", timeout_s=120)
    device = local_device() if device_type == "cuda" else torch.device("cpu")
    try:
        comm = Mesh(data=world).comm("data")
        measured = {op: [(size, _time_op(comm, op, size, world, rank, repeats, device)) for size in sizes]
                    for op in COLLECTIVES}
        if rank == 0:
            Path(out).write_text(json.dumps(measured))
    finally:
        shutdown_distributed()


def links_from_times(measured: dict[str, Sequence[tuple[int, float]]]) -> dict[str, LinkCost]:
    """One `LinkCost` per op from its (message bytes, seconds) points: the line through the smallest
    and largest message (latency clamped at 0, time per byte at a tiny positive number)."""
    links = {}
    for op, points in measured.items():
        (b0, t0), (b1, t1) = min(points), max(points)
        slope = (t1 - t0) / (b1 - b0) if b1 > b0 else t1 / max(b1, 1)
        slope = max(slope, 1e-15)
        links[op] = LinkCost(max(t0 - slope * b0, 0.0), slope)
    return links


def measure_collectives(world: int, sizes: Sequence[int] = (1 << 12, 1 << 22), repeats: int = 5,
                        timeout_s: float = 120.0, device_type: str = "cpu") -> CommCosts:
    """The collectives of `world` ranks on this machine, on `device_type` ("cpu" or "cuda"; module
    docstring); with one rank, nothing to measure: every collective costs nothing."""
    if world <= 1:
        free = LinkCost(0.0, 0.0)
        return CommCosts({axis: {op: free for op in COLLECTIVES} for axis in AXES})
    with tempfile.TemporaryDirectory(prefix="fspeed-collectives-") as tmp:
        out = str(Path(tmp) / "links.json")
        port = _free_port()
        args = [str(world), str(port), ",".join(map(str, sizes)), str(repeats), out, device_type]
        ranks = [subprocess.Popen([sys.executable, "-m", "fspeed.autotune.collectives", str(rank), *args],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(world)]
        try:
            outputs = [rank.communicate(timeout=timeout_s)[0] for rank in ranks]
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
        failed = [(r, o) for r, o in zip(ranks, outputs) if r.returncode != 0]
        if failed:
            raise RuntimeError(f"measuring the collectives failed (exit code {failed[0][0].returncode}):\n"
                               f"{failed[0][1][-2000:]}")
        measured = {op: [tuple(p) for p in points] for op, points in json.loads(Path(out).read_text()).items()}
    links = links_from_times(measured)
    return CommCosts({axis: dict(links) for axis in AXES})


__all__ = ["AXES", "links_from_times", "measure_collectives"]

if __name__ == "__main__":  # one rank of measure_collectives: rank world port sizes repeats out device
    _rank, _world, _port, _sizes, _repeats, _out, _device = sys.argv[1:8]
    _rank_main(int(_rank), int(_world), int(_port), [int(s) for s in _sizes.split(",")], int(_repeats), _out,
               _device)
