"""Block layouts: `layout(config, seq_len, seed=0) -> int64 [heads, blocks, blocks]` of 0/1.

Row = query block, column = key block. Construction follows DeepSpeed's `sparsity_config.py`
rule by rule, including its quirks:

* with `different_layout_per_head=False` only head 0 is built and copied to every head;
* random blocks come from `random.Random(seed).sample(range(n), k)`, drawn in the order DeepSpeed
  draws them (head by head, row by row), so a layout equals DeepSpeed's after `random.seed(seed)`;
* variable mode repeats the *last* local window size for the rest of the sequence, counting from
  the sum of all listed sizes; global indices past the sequence are skipped;
* bigbird and bslongformer apply `tril` to the whole layout when unidirectional (random, window
  and global blocks alike); fixed and variable only restrict their local and global parts;
* fixed mode's global blocks are each window's last `num_global_blocks` blocks, shifted left by
  `num_global_blocks` per pattern (`h % num_different_global_patterns`), with a partial last
  window handled separately.

The one divergence: where DeepSpeed silently indexes with negative slices (fixed mode with fewer
blocks than `num_global_blocks`), fspeed raises.
"""

from __future__ import annotations

import random
from typing import Optional, Union

import numpy as np
import torch

from .config import (
    AnySparsityConfig,
    BigBirdConfig,
    BSLongformerConfig,
    DenseConfig,
    FixedConfig,
    LocalSlidingWindowConfig,
    SparseAttentionConfig,
    VariableConfig,
)

Seed = Union[int, random.Random]


def num_blocks(config: AnySparsityConfig, seq_len: int) -> int:
    """seq_len // block, or a ValueError when the block does not divide the sequence."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
    if seq_len % config.block:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by block={config.block}; pad the sequence to a multiple of "
            f"the block (fspeed.sparse.pad_to_block_size) or pick a block that divides it"
        )
    return seq_len // config.block


def layout(config: Union[AnySparsityConfig, SparseAttentionConfig], seq_len: int, *,
           seed: Optional[Seed] = None, num_heads: Optional[int] = None) -> torch.Tensor:
    """The `[num_heads, seq_len // block, seq_len // block]` int64 0/1 layout of `config`.

    `seed` (an int, or a `random.Random` to draw from) fixes the random blocks of variable and
    bigbird layouts; it defaults to 0, or to the config's own `seed` for a `SparseAttentionConfig`
    (the DeepSpeed JSON block), which also needs `num_heads`.
    """
    if isinstance(config, SparseAttentionConfig):
        if num_heads is None:
            raise ValueError("layout(SparseAttentionConfig, ...) needs num_heads=")
        seed = config.seed if seed is None else seed
        config = config.to_sparsity_config(num_heads)
    elif num_heads is not None and num_heads != config.num_heads:
        raise ValueError(f"num_heads={num_heads} disagrees with {type(config).__name__}.num_heads={config.num_heads}")
    nb = num_blocks(config, seq_len)
    seed = 0 if seed is None else seed
    rng = seed if isinstance(seed, random.Random) else random.Random(_check_seed(seed))
    out = np.zeros((config.num_heads, nb, nb), dtype=np.int64)
    builder = _BUILDERS.get(type(config))
    if builder is None:
        raise TypeError(f"layout() takes a sparsity config, got {type(config).__name__}")
    for h in range(config.num_layout_heads):
        builder(config, out, h, rng)
    if not config.different_layout_per_head:
        out[1:] = out[0]
    return torch.from_numpy(out)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} must be an int or a random.Random")
    return seed


def _local_windows(out: np.ndarray, h: int, start: int, stop: int, unidirectional: bool) -> None:
    """All (row, col) in [start, stop)^2, or only col <= row when unidirectional."""
    if stop <= start:
        return
    if unidirectional:
        out[h, start:stop, start:stop] |= np.tril(np.ones((stop - start, stop - start), dtype=np.int64))
    else:
        out[h, start:stop, start:stop] = 1


def _sliding_window(out: np.ndarray, h: int, window_blocks: int, *, causal_only: bool = False) -> None:
    nb = out.shape[1]
    if nb < window_blocks:
        raise ValueError(f"num_sliding_window_blocks={window_blocks} is more than the {nb} blocks of a row")
    w = window_blocks // 2
    for row in range(nb):
        out[h, row, max(0, row - w):(row + 1 if causal_only else min(row + w + 1, nb))] = 1


def _random_blocks(out: np.ndarray, h: int, count: int, rng: random.Random, unidirectional: bool) -> None:
    nb = out.shape[1]
    if nb < count:
        raise ValueError(f"num_random_blocks={count} is more than the {nb} blocks of a row")
    for row in range(nb):
        cols = rng.sample(range(0, row + 1 if unidirectional else nb), count)
        out[h, row, cols] = 1


def _dense(config: DenseConfig, out: np.ndarray, h: int, rng: random.Random) -> None:
    out[h] = 1


def _fixed(config: FixedConfig, out: np.ndarray, h: int, rng: random.Random) -> None:
    nb = out.shape[1]
    L, G = config.num_local_blocks, config.num_global_blocks
    uni = config.attention == "unidirectional"
    if nb < G:
        raise ValueError(f"num_global_blocks={G} is more than the {nb} blocks of the sequence")
    for start in range(0, nb, L):
        _local_windows(out, h, start, min(start + L, nb), uni)
    first = L - (1 + h % config.num_different_global_patterns) * G
    end = nb - nb % L

    def global_columns(lo: int, hi: int) -> None:
        out[h, (lo if uni else 0):, lo:hi] = 1
        if config.horizontal_global_attention:
            out[h, lo:hi, :] = 1

    for i in range(first, end, L):
        global_columns(i, i + G)
    if end < nb:  # a short last window still gets its global blocks, kept inside the sequence
        start = min(end + first, nb - G)
        global_columns(start, start + G)


def _global_ranges(starts, ends, nb: int):
    """(start, stop) block ranges inside the sequence; indices at or past nb are skipped."""
    if ends is None:
        return [(i, i + 1) for i in starts if i < nb]
    return [(s, min(e, nb)) for s, e in zip(starts, ends) if s < nb]


def _variable(config: VariableConfig, out: np.ndarray, h: int, rng: random.Random) -> None:
    nb = out.shape[1]
    uni = config.attention == "unidirectional"
    _random_blocks(out, h, config.num_random_blocks, rng, unidirectional=False)  # DeepSpeed ignores direction here
    start = 0
    for size in config.local_window_blocks:
        _local_windows(out, h, start, min(start + size, nb), uni)
        start += size
    last = config.local_window_blocks[-1]
    for i in range(start, nb, last):
        _local_windows(out, h, i, min(i + last, nb), uni)
    for lo, hi in _global_ranges(config.global_block_indices, config.global_block_end_indices, nb):
        if config.horizontal_global_attention:
            out[h, lo:hi, :] = 1
        out[h, (lo if uni else 0):, lo:hi] = 1


def _bigbird(config: BigBirdConfig, out: np.ndarray, h: int, rng: random.Random) -> None:
    nb = out.shape[1]
    uni = config.attention == "unidirectional"
    _random_blocks(out, h, config.num_random_blocks, rng, unidirectional=uni)
    _sliding_window(out, h, config.num_sliding_window_blocks)
    G = config.num_global_blocks
    if nb < G:
        raise ValueError(f"num_global_blocks={G} is more than the {nb} blocks of a row")
    out[h, :G, :] = 1
    out[h, :, :G] = 1
    if uni:
        out[:] = np.tril(out)  # DeepSpeed applies tril to the whole layout here


def _bslongformer(config: BSLongformerConfig, out: np.ndarray, h: int, rng: random.Random) -> None:
    nb = out.shape[1]
    _sliding_window(out, h, config.num_sliding_window_blocks)
    for lo, hi in _global_ranges(config.global_block_indices, config.global_block_end_indices, nb):
        out[h, lo:hi, :] = 1
        out[h, :, lo:hi] = 1
    if config.attention == "unidirectional":
        out[:] = np.tril(out)


def _local_sliding(config: LocalSlidingWindowConfig, out: np.ndarray, h: int, rng: random.Random) -> None:
    _sliding_window(out, h, config.num_sliding_window_blocks,
                    causal_only=config.attention == "unidirectional")


_BUILDERS = {
    DenseConfig: _dense, FixedConfig: _fixed, VariableConfig: _variable, BigBirdConfig: _bigbird,
    BSLongformerConfig: _bslongformer, LocalSlidingWindowConfig: _local_sliding,
}


def expand_layout(layout: torch.Tensor, block: int) -> torch.Tensor:
    """The token-level bool mask [heads, S, S] of a block layout (True = may attend)."""
    return layout.bool().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)


def density(layout: torch.Tensor) -> float:
    """Fraction of blocks present."""
    return float(layout.count_nonzero()) / layout.numel()
