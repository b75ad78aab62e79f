"""Epochs over any dataset: a seeded, rank-aware sampler and a resumable loader (`fspeed.data.loader`).

    loader = fs.data.loader(my_dataset, micro_batch_size=8, grad_accum=4, mesh=mesh, collate=my_collate,
                            shuffle=True, seed=0, drop_last=True)
    for batch in loader: state, m = step(state, batch)       # loader.state_dict() goes in the checkpoint

Map-style datasets: epoch ``e`` visits the samples in the order ``randperm(N)`` drawn from a
generator keyed by ``(seed, e)`` (or ``0..N-1`` without shuffling). Step ``i`` of the epoch takes
the global batch ``order[i*G:(i+1)*G]`` with ``G = micro_batch_size * grad_accum * data_size``, and
data rank ``r`` its contiguous share ``[r*b, (r+1)*b)``, ``b = G / data_size``: the data ranks
together see exactly what one process would, every sample once per epoch. ``drop_last`` drops the
last partial global batch; without it the batch is completed from the start of the same epoch's
order (as torch's `DistributedSampler` pads), so every batch has the same shape. The indices of a
step are a pure function of (seed, step), so resuming needs only the step count, which
`state_dict` holds (with what the order depends on, checked on `load_state_dict`). The position
counts global batches and holds no rank or data-parallel size: a run resumed on another number of
data ranks with the same global batch continues the same order, no sample repeated or skipped.

Only the mesh's data axis splits the data: tensor-slicing and pipeline ranks at the same data
coordinate load identical batches. (DeepSpeed's `DistributedSampler` deals samples round-robin
instead; fspeed keeps the contiguous shares, which make N ranks train like one.)

Iterable datasets are read in order, each data rank keeping its share of every global batch;
an epoch ends when the iterator does (its last partial global batch dropped). Resume re-reads
and skips the samples already used. They cannot be shuffled by the loader (shuffle them in the
dataset) and are read in this process (`num_workers=0`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from fspeed.data.loader import DatasetRows, TokenWindows, _as_int, _generator

_STATE_KEYS = ("kind", "num_samples", "global_batch_size", "seed", "shuffle", "drop_last")


class EpochSampler:
    """The sample indices of every step: epochs of seeded permutations, cut into global batches,
    sliced by data rank. A pure function of (seed, step); it caches the current epoch's order."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0, *, shuffle: bool = True,
                 drop_last: bool = True, rank: int = 0, world_size: int = 1) -> None:
        self.num_samples = _as_int("num_samples", num_samples, minimum=1)
        self.global_batch_size = _as_int("global_batch_size", global_batch_size, minimum=1)
        self.seed = _as_int("seed", seed)
        self.world_size = _as_int("world_size", world_size, minimum=1)
        self.rank = _as_int("rank", rank)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got rank={self.rank}")
        if self.global_batch_size % self.world_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by the data-parallel "
                             f"size {self.world_size}")
        if drop_last and self.num_samples < self.global_batch_size:
            raise ValueError(f"the dataset holds {self.num_samples} samples, fewer than one global batch of "
                             f"{self.global_batch_size} (micro_batch_size x grad_accum x data ranks): with "
                             "drop_last=True no step would have data; use drop_last=False or a smaller batch")
        self._cached: tuple[int, torch.Tensor] | None = None

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Every sample index once, in epoch ``epoch``'s order."""
        epoch = _as_int("epoch", epoch, minimum=0)
        if self._cached is None or self._cached[0] != epoch:
            order = torch.randperm(self.num_samples, generator=_generator("epoch", self.seed, epoch)) \
                if self.shuffle else torch.arange(self.num_samples)
            self._cached = (epoch, order)
        return self._cached[1]

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of ``step``."""
        return divmod(_as_int("step", step, minimum=0), self.steps_per_epoch)

    def global_indices(self, step: int) -> torch.Tensor:
        """The whole global batch of ``step`` (all data ranks), shape ``[global_batch_size]``."""
        epoch, i = self.position(step)
        order, size = self.epoch_order(epoch), self.global_batch_size
        batch = order[i * size:(i + 1) * size]
        if batch.numel() < size:  # drop_last=False: complete it from the epoch's start, as often as needed
            batch = torch.cat([batch, order.repeat(-(-size // self.num_samples))[:size - batch.numel()]])
        return batch

    def indices(self, step: int) -> torch.Tensor:
        """This data rank's contiguous share of ``global_indices(step)``."""
        begin = self.rank * self.local_batch_size
        return self.global_indices(step)[begin:begin + self.local_batch_size].clone()


def data_coordinates(mesh: Any) -> tuple[int, int]:
    """(data rank, data-parallel size) of a `Mesh` (or None: one process): the data axis only."""
    if mesh is None:
        return 0, 1
    if not (hasattr(mesh, "size") and hasattr(mesh, "coordinate")):
        raise TypeError(f"mesh must be an fspeed Mesh (or None), got {type(mesh).__name__}")
    return mesh.coordinate("data"), mesh.size("data")


class _Steps:
    """A batch sampler for torch's DataLoader: the index lists of steps ``start, start+1, ... stop``."""

    def __init__(self, sampler: EpochSampler, start: int, stop: Optional[int]) -> None:
        self.sampler, self.start, self.stop = sampler, start, stop

    def __iter__(self) -> Iterator[list[int]]:
        steps = itertools.count(self.start) if self.stop is None else range(self.start, self.stop)
        for step in steps:
            yield self.sampler.indices(step).tolist()


class EpochLoader:
    """Batches of this data rank's share of every global batch, epoch after epoch; resumable.

    Iterating yields the batches from the current position on (``epochs`` epochs in all, endless
    with None; to the end of the current epoch with ``epoch_per_loop``, as torch's DataLoader does)
    and advances it, so a loop broken off and started again continues where it was.
    ``state_dict()`` is the position; put it in the checkpoint's client_state and hand it to
    ``load_state_dict`` to resume exactly, mid-epoch included.
    """

    def __init__(self, dataset: Any, *, micro_batch_size: int, grad_accum: int = 1, mesh: Any = None,
                 collate: Optional[Callable[[list], Any]] = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, num_workers: int = 0, epochs: Optional[int] = None,
                 epoch_per_loop: bool = False, sampler: Any = None) -> None:
        micro_batch_size = _as_int("micro_batch_size", micro_batch_size, minimum=1)
        grad_accum = _as_int("grad_accum", grad_accum, minimum=1)
        self.num_workers = _as_int("num_workers", num_workers, minimum=0)
        self.epochs = None if epochs is None else _as_int("epochs", epochs, minimum=1)
        rank, size = data_coordinates(mesh)
        if isinstance(dataset, DatasetRows):
            dataset, collate = dataset.dataset, collate or dataset.collate_fn
        self.dataset, self.collate = dataset, collate
        self.iterable = isinstance(dataset, IterableDataset) or (
            hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__"))
        self.local_batch_size = micro_batch_size * grad_accum
        self.global_batch_size = self.local_batch_size * size
        self.seed, self.shuffle, self.drop_last = _as_int("seed", seed), bool(shuffle), bool(drop_last)
        self.rank, self.world_size = rank, size
        if self.iterable:
            for key, value, allowed in (("shuffle", shuffle, False), ("drop_last", drop_last, True),
                                        ("num_workers", num_workers, 0)):
                if value != allowed:
                    raise ValueError(f"{key}={value!r} with an iterable dataset ({type(dataset).__name__}); allowed: "
                                     f"{allowed!r} (an iterable dataset is read in order, in this process, and its "
                                     "last partial batch dropped; shuffle it in the dataset itself)")
            self.sampler = None
        else:
            if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
                raise TypeError(f"dataset must be a map-style Dataset (__len__ and __getitem__) or an iterable one, "
                                f"got {type(dataset).__name__}")
            self.sampler = sampler if sampler is not None else EpochSampler(
                len(dataset), self.global_batch_size, self.seed, shuffle=shuffle, drop_last=drop_last, rank=rank,
                world_size=size)
            given = (self.sampler.num_samples, self.sampler.global_batch_size, self.sampler.rank,
                     self.sampler.world_size)
            if given != (len(dataset), self.global_batch_size, rank, size):
                raise ValueError(f"the sampler covers {given[0]} samples with global batches of {given[1]} for data "
                                 f"rank {given[2]} of {given[3]}; this loader has {len(dataset)} samples, global "
                                 f"batches of {self.global_batch_size}, data rank {rank} of {size}")
        self.epoch_per_loop = bool(epoch_per_loop)
        self.step = 0  # batches taken so far (all epochs)
        self._epoch, self._in_epoch = 0, 0  # iterable datasets: where the stream is

    def __repr__(self) -> str:
        return (f"EpochLoader({type(self.dataset).__name__}, batch {self.local_batch_size} x {self.world_size} data "
                f"ranks, shuffle={self.shuffle}, drop_last={self.drop_last}, seed={self.seed}, step={self.step})")

    def __len__(self) -> int:
        """Steps per epoch (map-style datasets)."""
        if self.sampler is None:
            raise TypeError("an iterable dataset's epoch length is not known before it is read")
        return self.sampler.steps_per_epoch

    @property
    def epoch(self) -> int:
        return self.sampler.position(self.step)[0] if self.sampler is not None else self._epoch

    def _stop(self) -> Optional[int]:
        spe = self.sampler.steps_per_epoch
        end = None if self.epochs is None else self.epochs * spe
        if self.epoch_per_loop:  # this loop ends with the current epoch
            current = (self.step // spe + 1) * spe
            end = current if end is None else min(end, current)
        return end

    def batch(self, step: int) -> Any:
        """This rank's batch of ``step`` (map-style datasets), read in this process; the position is unchanged."""
        if self.sampler is None:
            raise TypeError("an iterable dataset's batches can only be read in order: iterate the loader")
        return self._read(self.sampler.indices(step))

    def _read(self, indices: torch.Tensor) -> Any:
        if self.collate is None and isinstance(self.dataset, (TokenWindows, DatasetRows)):
            return self.dataset.get(indices)  # one gather instead of a collate of rows
        return (self.collate or default_collate)([self.dataset[i] for i in indices.tolist()])

    def __iter__(self) -> Iterator[Any]:
        return self._iter_iterable() if self.sampler is None else self._iter_map()

    def _iter_map(self) -> Iterator[Any]:
        stop = self._stop()
        if self.num_workers == 0:
            while stop is None or self.step < stop:
                batch = self.batch(self.step)
                self.step += 1
                yield batch
            return
        batches = DataLoader(self.dataset, batch_sampler=_Steps(self.sampler, self.step, stop),
                             collate_fn=self.collate or default_collate, num_workers=self.num_workers)
        for batch in batches:
            self.step += 1
            yield batch

    def _iter_iterable(self) -> Iterator[Any]:
        collate = self.collate or default_collate
        G, b = self.global_batch_size, self.local_batch_size
        last = None if self.epochs is None else self.epochs
        if self.epoch_per_loop:
            last = self._epoch + 1 if last is None else min(last, self._epoch + 1)
        while last is None or self._epoch < last:
            stream = iter(self.dataset)
            for _ in itertools.islice(stream, self._in_epoch * G):  # resume: skip what was used
                pass
            while True:
                rows = list(itertools.islice(stream, G))
                if len(rows) < G:
                    break
                self._in_epoch += 1
                self.step += 1
                yield collate(rows[self.rank * b:(self.rank + 1) * b])
            if self._in_epoch == 0:
                raise ValueError(f"the iterable dataset {type(self.dataset).__name__} ran out before one global "
                                 f"batch of {G} samples")
            self._epoch, self._in_epoch = self._epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The position (steps taken; epoch and batch for iterable data) and what the order depends on."""
        num_samples = None if self.sampler is None else self.sampler.num_samples
        return {"kind": "iterable" if self.sampler is None else "map", "num_samples": num_samples,
                "global_batch_size": self.global_batch_size, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "step": self.step, "epoch": self.epoch,
                "batch_in_epoch": self.sampler.position(self.step)[1] if self.sampler else self._in_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`; ValueError naming what differs if it came from other data."""
        mine = self.state_dict()
        missing = [k for k in (*_STATE_KEYS, "step") if k not in state]
        if missing:
            raise ValueError(f"not a loader state (missing {missing}); expected the keys of EpochLoader.state_dict()")
        differ = [f"{k}: saved {state[k]!r}, now {mine[k]!r}" for k in _STATE_KEYS if state[k] != mine[k]]
        if differ:
            raise ValueError("the saved loader position belongs to other data or settings, so resuming from it would "
                             "not continue the same order: " + "; ".join(differ))
        self.step = _as_int("step", state["step"], minimum=0)
        if self.sampler is None:
            self._epoch, self._in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])


def loader(dataset: Any, *, micro_batch_size: int, grad_accum: int = 1, mesh: Any = None,
           collate: Optional[Callable[[list], Any]] = None, shuffle: bool = True, seed: int = 0,
           drop_last: bool = True, num_workers: int = 0, epochs: Optional[int] = None,
           epoch_per_loop: bool = False, sampler: Any = None) -> EpochLoader:
    """An `EpochLoader` over any map-style or iterable dataset (see the module docstring); ``sampler``
    replaces the epoch sampler (e.g. a data-efficiency `CurriculumSampler`)."""
    return EpochLoader(dataset, micro_batch_size=micro_batch_size, grad_accum=grad_accum, mesh=mesh, collate=collate,
                       shuffle=shuffle, seed=seed, drop_last=drop_last, num_workers=num_workers, epochs=epochs,
                       epoch_per_loop=epoch_per_loop, sampler=sampler)


__all__ = ["EpochLoader", "EpochSampler", "data_coordinates", "loader"]
