"""Deterministic, rank-aware batches of token windows, stateless so that resume is exact.

A batch for step ``t`` is a pure function of ``(seed, t)``: the global batch's window starts are
drawn from a generator seeded by a hash of the pair, and data-parallel rank ``r`` of ``world``
takes the contiguous slice ``[r*B/world, (r+1)*B/world)``. Any step can be produced directly, so
resuming from a checkpoint needs only the step number, and the ranks' shares concatenated are
exactly the one-process batch: a run on N ranks sees the same global data as a run on one.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

Batch = dict[str, torch.Tensor]


def _as_int(name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as an int (TypeError if it is not one), at least ``minimum`` (ValueError)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def _generator(*key: int | str) -> torch.Generator:
    """A CPU generator seeded by a stable 64-bit hash of ``key`` (independent of PYTHONHASHSEED)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest, "little"))
    return generator


def _check_tokens(tokens: Any, name: str = "tokens") -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer torch.Tensor, got {type(tokens).__name__}")
    if tokens.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tokens.shape)}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {tokens.dtype}")
    return tokens


class TokenWindows:
    """Every window of ``seq_len + 1`` consecutive tokens; window ``i`` starts at token ``i * stride``.

    ``get`` turns window indices into ``inputs`` (the first ``seq_len`` tokens) and ``targets``
    (the same tokens shifted by one), each ``[B, seq_len]`` long. It is also a map-style dataset
    (``windows[i]`` is one window's pair), which `fspeed.data.loader` reads in epochs;
    ``stride=seq_len`` makes an epoch read each token once.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int = 1) -> None:
        tokens = _check_tokens(tokens).long()
        seq_len = _as_int("seq_len", seq_len, minimum=1)
        stride = _as_int("stride", stride, minimum=1)
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"the token stream holds {tokens.numel()} tokens, too short for one window of "
                f"seq_len + 1 = {seq_len + 1}; use a longer corpus or a smaller seq_len"
            )
        self._tokens = tokens.contiguous()
        self._seq_len, self._stride = seq_len, stride
        # A view, not a copy: row i is tokens[i*stride : i*stride + seq_len + 1].
        self._windows = self._tokens.unfold(0, seq_len + 1, stride)

    @property
    def tokens(self) -> torch.Tensor:
        return self._tokens

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def __len__(self) -> int:
        return self._windows.shape[0]

    def __getitem__(self, index: int) -> Batch:
        row = self._windows[index]
        return {"inputs": row[:-1], "targets": row[1:]}

    def __repr__(self) -> str:
        stride = f", stride={self._stride}" if self._stride != 1 else ""
        return (
            f"TokenWindows(num_tokens={self._tokens.numel()}, seq_len={self._seq_len}{stride}, "
            f"num_windows={len(self)})"
        )

    def get(self, starts: torch.Tensor) -> Batch:
        """The windows ``starts`` (1-D integer tensor of window indices in [0, len(self)))."""
        starts = _check_tokens(starts, "starts")
        if starts.numel():
            low, high = int(starts.min()), int(starts.max())
            if low < 0 or high >= len(self):
                bad = low if low < 0 else high
                raise ValueError(f"window start {bad} is out of range; allowed: [0, {len(self)})")
        rows = self._windows[starts.long()]
        return {"inputs": rows[:, :-1].contiguous(), "targets": rows[:, 1:].contiguous()}


def split_train_val(
    tokens: torch.Tensor, val_fraction: float = 0.1, *, min_tokens: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a token stream into a training head and a validation tail (contiguous, no shuffling).

    The tail holds ``round(len * val_fraction)`` tokens. Each side must hold at least
    ``min_tokens`` tokens; pass ``seq_len + 1`` to guarantee each side has a window.
    """
    tokens = _check_tokens(tokens)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
        raise TypeError(f"val_fraction must be a float, got {type(val_fraction).__name__} {val_fraction!r}")
    if not (math.isfinite(val_fraction) and 0.0 < val_fraction < 1.0):
        raise ValueError(f"val_fraction must be strictly between 0 and 1, got {val_fraction}")
    min_tokens = _as_int("min_tokens", min_tokens, minimum=1)
    total = tokens.numel()
    num_val = round(total * val_fraction)
    num_train = total - num_val
    if num_train < min_tokens or num_val < min_tokens:
        raise ValueError(
            f"splitting {total} tokens with val_fraction={val_fraction} gives {num_train} training and "
            f"{num_val} validation tokens; each side needs at least min_tokens={min_tokens}"
        )
    return tokens[:num_train], tokens[num_train:]


@dataclass(frozen=True)
class BatchSampler:
    """Window starts for each step: counter-based (a pure function of seed and step) and rank-sliced.

    Windows are drawn uniformly with replacement (random windows, as nanoGPT does). ``starts(t)``
    on rank ``r`` is ``global_starts(t)[r*b:(r+1)*b]`` with ``b = global_batch_size // world_size``.
    """

    num_windows: int
    global_batch_size: int
    seed: int
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        num_windows = _as_int("num_windows", self.num_windows, minimum=1)
        global_batch_size = _as_int("global_batch_size", self.global_batch_size, minimum=1)
        seed = _as_int("seed", self.seed)
        world_size = _as_int("world_size", self.world_size, minimum=1)
        rank = _as_int("rank", self.rank)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got rank={rank}")
        if global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by world_size={world_size}; "
                f"choose a multiple of {world_size}"
            )
        # Store plain ints (numpy or tensor scalars would leak into reprs and checkpoint metadata).
        object.__setattr__(self, "num_windows", num_windows)
        object.__setattr__(self, "global_batch_size", global_batch_size)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "world_size", world_size)

    @property
    def local_batch_size(self) -> int:
        """The number of windows this rank gets per step."""
        return self.global_batch_size // self.world_size

    def global_starts(self, step: int) -> torch.Tensor:
        """The window starts of the whole global batch at ``step``, shape ``[global_batch_size]``."""
        step = _as_int("step", step, minimum=0)
        generator = _generator("train", self.seed, step)
        return torch.randint(0, self.num_windows, (self.global_batch_size,), generator=generator)

    def starts(self, step: int) -> torch.Tensor:
        """This rank's contiguous share of ``global_starts(step)``, shape ``[local_batch_size]``."""
        begin = self.rank * self.local_batch_size
        return self.global_starts(step)[begin : begin + self.local_batch_size].clone()


def eval_starts(num_windows: int, batch_size: int, num_batches: int, seed: int) -> torch.Tensor:
    """A fixed set of evaluation windows, shape ``[num_batches, batch_size]``, same on every call.

    Windows are distinct when there are enough of them (a random permutation's prefix), drawn with
    replacement otherwise. The stream is independent of the training stream with the same seed.
    """
    num_windows = _as_int("num_windows", num_windows, minimum=1)
    batch_size = _as_int("batch_size", batch_size, minimum=1)
    num_batches = _as_int("num_batches", num_batches, minimum=1)
    seed = _as_int("seed", seed)
    generator = _generator("eval", seed)
    total = batch_size * num_batches
    if total <= num_windows:
        flat = torch.randperm(num_windows, generator=generator)[:total]
    else:
        flat = torch.randint(0, num_windows, (total,), generator=generator)
    return flat.reshape(num_batches, batch_size)


class DatasetRows:
    """A map-style dataset (`torch.utils.data.Dataset`: `len` and `dataset[i]`) read by index
    tensors as `TokenWindows` is: `get(indices)` collates those samples into one batch."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any] | None = None) -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(f"a dataset needs __len__ and __getitem__ (a map-style torch Dataset), got "
                            f"{type(dataset).__name__}")
        if len(dataset) < 1:
            raise ValueError(f"the dataset {type(dataset).__name__} is empty")
        from torch.utils.data import default_collate  # noqa: PLC0415

        self.dataset, self.collate_fn = dataset, collate_fn or default_collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __repr__(self) -> str:
        return f"DatasetRows({type(self.dataset).__name__}, {len(self)} samples)"

    def get(self, indices: torch.Tensor) -> Any:
        return self.collate_fn([self.dataset[i] for i in indices.tolist()])


class Loader:
    """Batches of ``windows`` (`TokenWindows` or `DatasetRows`) at the starts ``sampler`` picks;
    holds no position, so resume is exact."""

    def __init__(self, windows: TokenWindows | DatasetRows, sampler: BatchSampler) -> None:
        if not isinstance(windows, (TokenWindows, DatasetRows)):
            raise TypeError(f"windows must be a TokenWindows or DatasetRows, got {type(windows).__name__}")
        if not isinstance(sampler, BatchSampler):
            raise TypeError(f"sampler must be a BatchSampler, got {type(sampler).__name__}")
        if sampler.num_windows != len(windows):
            raise ValueError(
                f"sampler.num_windows={sampler.num_windows} does not match the {len(windows)} windows "
                "it samples from; build the sampler with num_windows=len(windows)"
            )
        self.windows = windows
        self.sampler = sampler

    def __repr__(self) -> str:
        return f"Loader({self.windows!r}, {self.sampler!r})"

    def batch(self, step: int) -> Batch:
        """This rank's batch for ``step``: ``inputs`` and ``targets``, each ``[local_batch, seq_len]``."""
        return self.windows.get(self.sampler.starts(step))

    def iterate(self, start_step: int = 0) -> Iterator[Batch]:
        """The batches of steps ``start_step, start_step + 1, ...`` (endless)."""
        step = _as_int("start_step", start_step, minimum=0)
        while True:
            yield self.batch(step)
            step += 1

    def __iter__(self) -> Iterator[Batch]:
        return self.iterate(0)

    def eval_batches(self, num_batches: int, seed: int | None = None) -> list[Batch]:
        """Fixed evaluation batches (``eval_starts``), global batch size and rank slices as in training.

        Each rank gets its contiguous share of every global eval batch, so the ranks' shares
        together are the one-process eval set. ``seed`` defaults to the sampler's seed.
        """
        sampler = self.sampler
        starts = eval_starts(
            len(self.windows),
            sampler.global_batch_size,
            num_batches,
            sampler.seed if seed is None else seed,
        )
        begin = sampler.rank * sampler.local_batch_size
        local = starts[:, begin : begin + sampler.local_batch_size]
        return [self.windows.get(row) for row in local]
