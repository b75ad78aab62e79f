"""Sparsity configurations: DeepSpeed's five layout families and its `sparse_attention` JSON block.

One frozen dataclass per DeepSpeed `*SparsityConfig` class, with the same parameter names and
class defaults, plus `SparseAttentionConfig`, which mirrors the `sparse_attention` block of a
DeepSpeed config (its defaults are the JSON defaults, which differ from the class defaults: e.g.
`num_random_blocks` is 0 in JSON but 1 in `BigBirdSparsityConfig`).

Validation happens at construction and raises `ValueError` naming the parameter, the value and what
is allowed. Checks that depend on the sequence length (number of blocks) happen in `layout()`.
DeepSpeed's own checks are all kept; fspeed adds the ones DeepSpeed lacks (non-positive sizes,
an unknown `attention` in bslongformer, bigbird's unidirectional random sampling that crashes in
DeepSpeed with more than one random block).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Optional, Union

ATTENTION_TYPES = ("unidirectional", "bidirectional")
MODES = ("dense", "fixed", "variable", "bigbird", "bslongformer")


def _positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r} must be a positive integer")


def _non_negative_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner}.{name}={value!r} must be a non-negative integer")


def _attention(owner: str, value: Any) -> None:
    if value not in ATTENTION_TYPES:
        raise ValueError(f"{owner}.attention={value!r} must be one of {ATTENTION_TYPES}")


def _bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name}={value!r} must be a bool")


def _int_tuple(owner: str, name: str, value: Any, *, positive: bool) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{owner}.{name}={value!r} must be a list of integers")
    items = tuple(value)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < (1 if positive else 0):
            kind = "positive" if positive else "non-negative"
            raise ValueError(f"{owner}.{name}={list(items)!r}: every entry must be a {kind} integer, got {item!r}")
    return items


def _global_ranges(owner: str, starts: tuple[int, ...], ends: Optional[tuple[int, ...]]) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(
            f"{owner}: global_block_indices has {len(starts)} entries but global_block_end_indices has "
            f"{len(ends)}; they must have the same length"
        )
    for start, end in zip(starts, ends):
        if start >= end:
            raise ValueError(
                f"{owner}: global block range [{start}, {end}) is empty; each global_block_indices entry "
                f"must be smaller than its global_block_end_indices entry"
            )


@dataclass(frozen=True)
class SparsityConfig:
    """Fields shared by every layout family (DeepSpeed's `SparsityConfig`)."""

    mode: ClassVar[str] = ""
    num_heads: int
    block: int = 16
    different_layout_per_head: bool = False

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _positive_int(owner, "num_heads", self.num_heads)
        _positive_int(owner, "block", self.block)
        _bool(owner, "different_layout_per_head", self.different_layout_per_head)

    @property
    def num_layout_heads(self) -> int:
        """How many heads are built; the others copy head 0 (DeepSpeed's propagation rule)."""
        return self.num_heads if self.different_layout_per_head else 1


@dataclass(frozen=True)
class DenseConfig(SparsityConfig):
    """Every block present (DeepSpeed's `DenseSparsityConfig`), for comparison."""

    mode: ClassVar[str] = "dense"


@dataclass(frozen=True)
class FixedConfig(SparsityConfig):
    """Sparse Transformer's fixed pattern: local windows plus per-window global summary blocks."""

    mode: ClassVar[str] = "fixed"
    num_local_blocks: int = 4
    num_global_blocks: int = 1
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _positive_int(owner, "num_local_blocks", self.num_local_blocks)
        _positive_int(owner, "num_global_blocks", self.num_global_blocks)
        _positive_int(owner, "num_different_global_patterns", self.num_different_global_patterns)
        _bool(owner, "horizontal_global_attention", self.horizontal_global_attention)
        if self.num_local_blocks % self.num_global_blocks:
            raise ValueError(
                f"{owner}: num_local_blocks={self.num_local_blocks} must be divisible by "
                f"num_global_blocks={self.num_global_blocks}"
            )
        _attention(owner, self.attention)
        if self.horizontal_global_attention and self.attention != "bidirectional":
            raise ValueError(f"{owner}: horizontal_global_attention=True needs attention='bidirectional', "
                             f"got {self.attention!r}")
        if self.num_different_global_patterns > 1 and not self.different_layout_per_head:
            raise ValueError(
                f"{owner}: num_different_global_patterns={self.num_different_global_patterns} > 1 needs "
                "different_layout_per_head=True (one layout cannot hold several global patterns)"
            )
        most = self.num_local_blocks // self.num_global_blocks
        if self.num_different_global_patterns > most:
            raise ValueError(
                f"{owner}: num_different_global_patterns={self.num_different_global_patterns} must be at most "
                f"num_local_blocks // num_global_blocks = {self.num_local_blocks} // {self.num_global_blocks} = {most}"
            )


@dataclass(frozen=True)
class VariableConfig(SparsityConfig):
    """Random blocks, local windows of listed sizes (the last repeats), and listed global blocks."""

    mode: ClassVar[str] = "variable"
    num_random_blocks: int = 0
    local_window_blocks: tuple[int, ...] = (4,)
    global_block_indices: tuple[int, ...] = (0,)
    global_block_end_indices: Optional[tuple[int, ...]] = None
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _non_negative_int(owner, "num_random_blocks", self.num_random_blocks)
        windows = _int_tuple(owner, "local_window_blocks", self.local_window_blocks, positive=True)
        if not windows:
            raise ValueError(f"{owner}.local_window_blocks=[] must list at least one window size")
        object.__setattr__(self, "local_window_blocks", windows)
        starts = _int_tuple(owner, "global_block_indices", self.global_block_indices, positive=False)
        object.__setattr__(self, "global_block_indices", starts)
        if self.global_block_end_indices is not None:
            ends = _int_tuple(owner, "global_block_end_indices", self.global_block_end_indices, positive=False)
            object.__setattr__(self, "global_block_end_indices", ends)
        _global_ranges(owner, self.global_block_indices, self.global_block_end_indices)
        _attention(owner, self.attention)
        _bool(owner, "horizontal_global_attention", self.horizontal_global_attention)
        if self.horizontal_global_attention and self.attention != "bidirectional":
            raise ValueError(f"{owner}: horizontal_global_attention=True needs attention='bidirectional', "
                             f"got {self.attention!r}")


@dataclass(frozen=True)
class BigBirdConfig(SparsityConfig):
    """BigBird: random blocks, a sliding window and leading global blocks (rows and columns)."""

    mode: ClassVar[str] = "bigbird"
    num_random_blocks: int = 1
    num_sliding_window_blocks: int = 3
    num_global_blocks: int = 1
    attention: str = "bidirectional"

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _non_negative_int(owner, "num_random_blocks", self.num_random_blocks)
        _positive_int(owner, "num_sliding_window_blocks", self.num_sliding_window_blocks)
        _non_negative_int(owner, "num_global_blocks", self.num_global_blocks)
        _attention(owner, self.attention)
        if self.attention == "unidirectional" and self.num_random_blocks > 1:
            # DeepSpeed samples row r's random blocks from the first r+1 blocks, so row 0 has one
            # candidate: random.sample raises for more. Say so up front instead.
            raise ValueError(
                f"{owner}: num_random_blocks={self.num_random_blocks} with attention='unidirectional' is "
                "impossible: row 0 can only draw from block 0, so at most 1 random block is allowed "
                "(DeepSpeed fails inside random.sample here)"
            )


@dataclass(frozen=True)
class BSLongformerConfig(SparsityConfig):
    """Block-sparse Longformer: a sliding window plus global blocks (rows and columns)."""

    mode: ClassVar[str] = "bslongformer"
    num_sliding_window_blocks: int = 3
    global_block_indices: tuple[int, ...] = (0,)
    global_block_end_indices: Optional[tuple[int, ...]] = None
    attention: str = "bidirectional"

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _positive_int(owner, "num_sliding_window_blocks", self.num_sliding_window_blocks)
        starts = _int_tuple(owner, "global_block_indices", self.global_block_indices, positive=False)
        object.__setattr__(self, "global_block_indices", starts)
        if self.global_block_end_indices is not None:
            ends = _int_tuple(owner, "global_block_end_indices", self.global_block_end_indices, positive=False)
            object.__setattr__(self, "global_block_end_indices", ends)
        _global_ranges(owner, self.global_block_indices, self.global_block_end_indices)
        _attention(owner, self.attention)  # DeepSpeed accepts any string here and treats it as bidirectional


@dataclass(frozen=True)
class LocalSlidingWindowConfig(SparsityConfig):
    """Sliding window only (DeepSpeed's `LocalSlidingWindowSparsityConfig`; not a JSON mode)."""

    mode: ClassVar[str] = "local_sliding_window"
    num_sliding_window_blocks: int = 3
    attention: str = "unidirectional"

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        if self.different_layout_per_head:
            raise ValueError(f"{owner}.different_layout_per_head=True is not a parameter of this layout "
                             "(DeepSpeed's class does not take it)")
        _positive_int(owner, "num_sliding_window_blocks", self.num_sliding_window_blocks)
        _attention(owner, self.attention)


AnySparsityConfig = Union[DenseConfig, FixedConfig, VariableConfig, BigBirdConfig, BSLongformerConfig,
                          LocalSlidingWindowConfig]

# Which JSON keys each mode reads (DeepSpeed's runtime/config.py get_sparse_*_config). Quirk kept:
# the engine's parser does not read `attention` for bigbird and bslongformer, so a DeepSpeed run
# built from JSON always gets their class default, "bidirectional".
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "dense": ("block",),
    "fixed": ("block", "different_layout_per_head", "num_local_blocks", "num_global_blocks", "attention",
              "horizontal_global_attention", "num_different_global_patterns"),
    "variable": ("block", "different_layout_per_head", "num_random_blocks", "local_window_blocks",
                 "global_block_indices", "global_block_end_indices", "attention", "horizontal_global_attention"),
    "bigbird": ("block", "different_layout_per_head", "num_random_blocks", "num_sliding_window_blocks",
                "num_global_blocks"),
    "bslongformer": ("block", "different_layout_per_head", "num_sliding_window_blocks", "global_block_indices",
                     "global_block_end_indices"),
}
_MODE_CLASSES = {"dense": DenseConfig, "fixed": FixedConfig, "variable": VariableConfig,
                 "bigbird": BigBirdConfig, "bslongformer": BSLongformerConfig}


@dataclass(frozen=True)
class SparseAttentionConfig:
    """DeepSpeed's `sparse_attention` block, with its JSON defaults, plus fspeed's `seed`.

    `to_sparsity_config(num_heads)` builds the layout family of `mode` from the keys that mode reads,
    as DeepSpeed's model code does (`*SparsityConfig(num_heads=..., **params)`). `attention` is
    honoured for every mode that has it; `from_deepspeed` reproduces DeepSpeed's parser, which
    drops it for bigbird and bslongformer. `seed` draws the random blocks (DeepSpeed uses the
    global `random` module and broadcasts rank 0's layout; a seed makes every rank agree with no
    communication).
    """

    mode: str = "fixed"
    block: int = 16
    different_layout_per_head: bool = False
    num_local_blocks: int = 4
    num_global_blocks: int = 1
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = 1
    num_random_blocks: int = 0
    local_window_blocks: tuple[int, ...] = (4,)
    global_block_indices: tuple[int, ...] = (0,)
    global_block_end_indices: Optional[tuple[int, ...]] = None
    num_sliding_window_blocks: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"SparseAttentionConfig.mode={self.mode!r} must be one of {MODES}")
        for name in ("local_window_blocks", "global_block_indices", "global_block_end_indices"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                    raise ValueError(f"SparseAttentionConfig.{name}={value!r} must be a list of integers")
                object.__setattr__(self, name, tuple(value))
        _non_negative_int("SparseAttentionConfig", "seed", self.seed)
        self.to_sparsity_config(num_heads=1)  # validate the keys this mode reads now, not at first use

    def to_sparsity_config(self, num_heads: int) -> AnySparsityConfig:
        """The layout family for `num_heads` heads, built from the keys `mode` reads."""
        keys = MODE_KEYS[self.mode] + (("attention",) if self.mode in ("bigbird", "bslongformer") else ())
        return _MODE_CLASSES[self.mode](num_heads=num_heads, **{k: getattr(self, k) for k in keys})

    @classmethod
    def from_deepspeed(cls, block: dict, *, seed: int = 0) -> "SparseAttentionConfig":
        """Parse a DeepSpeed `sparse_attention` dict the way DeepSpeed's engine does.

        Missing keys take the JSON defaults; keys the mode does not read are ignored, as DeepSpeed
        ignores them (`attention` included, for bigbird and bslongformer). An unknown mode is an error.
        """
        if not isinstance(block, dict):
            raise ValueError(f"sparse_attention must be a mapping, got {type(block).__name__}: {block!r}")
        mode = block.get("mode", cls.mode)
        if mode not in MODES:
            raise ValueError(f"sparse_attention.mode={mode!r} must be one of {MODES}")
        known = {f.name for f in fields(cls)} - {"seed", "mode"}
        values = {k: block[k] for k in MODE_KEYS[mode] if k in block and k in known}
        return cls(mode=mode, seed=seed, **values)
