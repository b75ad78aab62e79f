"""The device mesh: named axes `pipe`, `data`, `model` over the process group, and their sub-groups.

Ranks are laid out with `model` varying fastest, then `data`, then `pipe` (Megatron's order: the
ranks of one tensor-parallel group are neighbours). A `Mesh` holds one `AxisComm` per axis, so
every collective is issued on an explicit axis and recorded in the mesh's `CommLog`. It also
serves Megatron's `mpu` interface, so Megatron-style code can be handed a Mesh, and
`Mesh.from_mpu(mpu)` builds one over an external mpu's groups.

    fs.init_distributed()                 # from torchrun's environment (RANK, WORLD_SIZE, ...)
    mesh = fs.Mesh(data=2, model=2)       # -1 for one axis means "the rest of the world"
"""

from __future__ import annotations

import atexit
import datetime
import gc
import itertools
import os
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .comm import AxisComm, CommLog, all_gather_objects
from .mpu import mpu_axes

AXES = ("pipe", "data", "model")


def init_distributed(backend: Optional[str] = None, timeout_s: float = 300.0) -> None:
    """Initialize the default process group from torchrun's environment, if not done already.

    `backend` defaults to gloo without CUDA. With CUDA it is nccl for CUDA tensors and gloo for
    CPU ones (`"cpu:gloo,cuda:nccl"`): host-side collectives (offloaded state, scalars, objects,
    a run on the CPU) stay valid, and each rank's current device is `cuda:LOCAL_RANK`. A collective
    that waits longer than `timeout_s` fails with `CommError` instead of hanging.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "init_distributed: RANK/WORLD_SIZE are not set; launch with `fspeed --num_gpus N script.py` or "
            "`torchrun --nproc_per_node N script.py` (a single process needs no process group)"
        )
    backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    device = local_device()
    if "nccl" in backend and torch.cuda.is_available() and device.index < torch.cuda.device_count():
        torch.cuda.set_device(device)  # NCCL binds a rank to its current device
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def local_device() -> torch.device:
    """This process's GPU, `cuda:LOCAL_RANK` (the launcher's local rank; 0 without one)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def shutdown_distributed() -> None:
    """Leave together and tear the default process group down (a no-op without one).

    Call it at the end of a distributed script: a rank that exits while its gloo threads still
    run can die in std::terminate (seen as a SIGABRT at exit, a failed run after a good one).
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    release_sub_groups()


def release_sub_groups() -> None:
    """Drop the sub-groups `process_group` made, while the interpreter still runs (also at exit).

    A gloo thread can still hold the last reference to a finished collective, whose tensors it frees
    under the GIL; if that happens while the interpreter finalizes (a group kept alive until then),
    the thread dies inside a destructor and the process aborts ("terminate called without an
    active exception", a SIGABRT after a complete run). So first the GIL is left free for a moment
    (those threads finish and go idle), then the groups are freed, their threads joined.
    """
    if not _SUB_GROUPS:
        return
    for _ in range(5):
        time.sleep(0.01)
    _SUB_GROUPS.clear()
    gc.collect()


class Mesh:
    """Named axes over the default process group (see module docstring)."""

    def __init__(self, data: int = -1, model: int = 1, pipe: int = 1, *, log: Optional[CommLog] = None,
                 timeout_s: Optional[float] = None):
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        sizes = {"pipe": pipe, "data": data, "model": model}
        fill = [axis for axis, size in sizes.items() if size == -1]
        if len(fill) > 1:
            raise ValueError(f"Mesh: at most one axis may be -1 (fill), got {fill}")
        for axis, size in sizes.items():
            if size != -1 and (not isinstance(size, int) or size < 1):
                raise ValueError(f"Mesh: {axis}={size!r} must be a positive integer or -1")
        known = 1
        for axis, size in sizes.items():
            if size != -1:
                known *= size
        if fill:
            if world % known:
                raise ValueError(f"Mesh: world size {world} is not divisible by {known} "
                                 f"(the product of the fixed axes {sizes})")
            sizes[fill[0]] = world // known
        if sizes["pipe"] * sizes["data"] * sizes["model"] != world:
            raise ValueError(
                f"Mesh: pipe x data x model = {sizes['pipe']} x {sizes['data']} x {sizes['model']} = "
                f"{sizes['pipe'] * sizes['data'] * sizes['model']}, but the world size is {world}"
            )
        self.sizes = sizes
        self.world_size = world
        self.rank = rank
        self.log = log if log is not None else CommLog(enabled=False)
        # sub-groups would otherwise get torch's 30-minute default, whatever the world's timeout is
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else _world_timeout()
        self.coords = dict(zip(AXES, _unravel(rank, [sizes[a] for a in AXES])))
        self.comms = {axis: self._axis_comm(axis) for axis in AXES}

    @classmethod
    def single(cls, log: Optional[CommLog] = None) -> "Mesh":
        """A mesh of this process alone (every axis of size 1), whatever process group exists:
        what a state built without a plan trains on."""
        mesh = cls.__new__(cls)
        mesh.sizes = {axis: 1 for axis in AXES}
        mesh.world_size, mesh.rank = 1, 0
        mesh.log = log if log is not None else CommLog(enabled=False)
        mesh.timeout = None
        mesh.coords = {axis: 0 for axis in AXES}
        mesh.comms = {axis: AxisComm(axis, None, [0], mesh.log, 0) for axis in AXES}
        return mesh

    @classmethod
    def from_mpu(cls, mpu: Any, *, log: Optional[CommLog] = None) -> "Mesh":
        """A mesh over an external Megatron-style mpu's process groups (DeepSpeed's
        `initialize(mpu=...)`); every rank calls it. See `fspeed.parallel.mpu`."""
        axes = mpu_axes(mpu, _ravel)
        mesh = cls.__new__(cls)
        mesh.sizes = {axis: size for axis, (size, _, _, _) in axes.items()}
        mesh.world_size = dist.get_world_size() if dist.is_initialized() else 1
        mesh.rank = dist.get_rank() if dist.is_initialized() else 0
        mesh.log = log if log is not None else CommLog(enabled=False)
        mesh.timeout = _world_timeout()
        mesh.coords = {axis: coord for axis, (_, coord, _, _) in axes.items()}
        mesh.comms = {axis: AxisComm(axis, group, ranks, mesh.log, mesh.rank)
                      for axis, (_, _, ranks, group) in axes.items()}
        return mesh

    def _axis_comm(self, axis: str) -> AxisComm:
        """Create every group of `axis` (all ranks must create all groups, in the same order)."""
        shape = [self.sizes[a] for a in AXES]
        i = AXES.index(axis)
        mine, my_group = None, None
        if shape[i] > 1:
            others = [range(s) if a != axis else [0] for a, s in zip(AXES, shape)]
            for fixed in itertools.product(*others):
                ranks = []
                for k in range(shape[i]):
                    coord = list(fixed)
                    coord[i] = k
                    ranks.append(_ravel(coord, shape))
                group = process_group(ranks, self.timeout)
                if self.rank in ranks:
                    mine, my_group = ranks, group
        return AxisComm(axis, my_group, mine or [self.rank], self.log, self.rank)

    def all_gather_objects(self, obj: Any, what: str) -> list:
        """Every rank's small picklable `obj`, in global rank order (for agreeing on decisions)."""
        return all_gather_objects(obj, what, self.world_size, self.rank)

    def all_reduce_scalar(self, value: float, op: str = "sum") -> float:
        """`value` reduced over the whole world (axis by axis): the same answer on every rank."""
        for axis in AXES:
            value = self.comms[axis].all_reduce_scalar(value, op)
        return float(value)

    def background_gather(self) -> Callable[[Any, str], list]:
        """`all_gather_objects` over a gloo group of the whole world kept for one background thread
        (an asynchronous checkpoint save), so that its collectives never interleave with training's
        on the main thread's groups. Every rank calls it (the first call creates the group)."""
        if self.world_size == 1:
            return self.all_gather_objects
        group = process_group(list(range(self.world_size)), self.timeout, backend="gloo", purpose="background")
        return lambda obj, what: all_gather_objects(obj, what, self.world_size, self.rank, group=group)

    def comm(self, axis: str) -> AxisComm:
        try:
            return self.comms[axis]
        except KeyError:
            raise ValueError(f"unknown mesh axis {axis!r}; axes are {AXES}") from None

    def size(self, axis: str) -> int:
        return self.sizes[axis]

    def coordinate(self, axis: str) -> int:
        return self.coords[axis]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self.sizes[a]}" for a in AXES if self.sizes[a] > 1 or a == "data")
        coords = ", ".join(f"{a}={self.coords[a]}" for a in AXES)
        return f"Mesh({sizes}; rank {self.rank} of {self.world_size} at {coords})"

    # -- Megatron's mpu interface ------------------------------------------------------------

    def get_model_parallel_rank(self) -> int:
        return self.coords["model"]

    def get_model_parallel_world_size(self) -> int:
        return self.sizes["model"]

    def get_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.comms["model"].group

    def get_data_parallel_rank(self) -> int:
        return self.coords["data"]

    def get_data_parallel_world_size(self) -> int:
        return self.sizes["data"]

    def get_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.comms["data"].group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.coords["pipe"]

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.sizes["pipe"]

    def get_pipeline_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.comms["pipe"].group


# Process-group state beside torch's own registry: the sub-groups made so far, by their default group.
_SUB_GROUPS: dict[tuple[Any, tuple[int, ...], Optional[datetime.timedelta]], dist.ProcessGroup] = {}


def process_group(ranks: list[int], timeout: Optional[datetime.timedelta], *,
                  backend: Optional[str] = None, purpose: str = "") -> dist.ProcessGroup:
    """The process group of `ranks` (global ranks) with `timeout`, made once per default group and
    shared by every Mesh and pipeline that asks for it: a group per Mesh would hold its sockets and
    threads for the life of the process (5 descriptors a group on gloo), and a loop that builds
    meshes would run out of file descriptors. Like `dist.new_group`, every rank asks for every
    group, in the same order. `purpose` names a group kept apart from the others of the same ranks
    (a background thread's collectives must not share a group with training's)."""
    world = dist.group.WORLD
    key = (world, tuple(ranks), timeout, backend, purpose)
    if key not in _SUB_GROUPS:
        for stale in [k for k in _SUB_GROUPS if k[0] is not world]:  # groups of a destroyed world
            del _SUB_GROUPS[stale]
        if not _SUB_GROUPS:
            atexit.unregister(release_sub_groups)
            atexit.register(release_sub_groups)  # a script that never calls shutdown_distributed
        _SUB_GROUPS[key] = dist.new_group(list(ranks), timeout=timeout, backend=backend)
    return _SUB_GROUPS[key]


def _world_timeout() -> Optional[datetime.timedelta]:
    """The default process group's timeout (what `init_distributed(timeout_s=...)` set), if readable."""
    if not dist.is_initialized():
        return None
    try:
        group = dist.distributed_c10d._get_default_group()
        # NCCL alone: its timeout; gloo, alone or beside NCCL (cpu:gloo,cuda:nccl): gloo's
        device = torch.device("cuda") if str(dist.get_backend()) == "nccl" else torch.device("cpu")
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _unravel(index: int, shape: list[int]) -> list[int]:
    coords = []
    for size in reversed(shape):
        coords.append(index % size)
        index //= size
    return list(reversed(coords))


def _ravel(coords: list[int], shape: list[int]) -> int:
    index = 0
    for c, size in zip(coords, shape):
        index = index * size + c
    return index
