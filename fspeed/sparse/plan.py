"""A block layout compiled into the index tables the attention backends read.

`BlockPlan` holds, for one layout, block size and causality:

* CSR by query block (`row_ptr`, `col_idx`) and CSC by key block (`col_ptr`, `row_idx`), per head,
  int32, for the Numba kernels (forward and dQ walk rows; dK/dV walk columns, so nothing races);
* row chunks for the batched torch path: query-block rows grouped by how many key blocks they
  hold, each row's key blocks padded to the chunk's width at the front, and chunks cut so each
  one's score tile stays small enough to be reused from cache. Consecutive rows of one head whose
  key blocks (nearly) coincide form a group over the union of their key blocks, each row masking
  the ones it does not hold: a `fixed` or `variable` layout's local window, bidirectional (equal
  rows) or causal (nested rows). The group's keys are gathered once and its queries go through
  each matmul as one tall matrix, so the key/value gradient sum over the group happens inside the
  matmul instead of in a scatter.

With `causal=True` the blocks above the diagonal are dropped here: they would be fully masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

import numpy as np
import torch

# Largest number of (query block, key block) pairs one torch chunk holds at block 64, scaled by
# 64 / block for other block sizes. At block 64 the score tile is then at most 6 MiB per batch
# element, so the few workspace buffers are reused across chunks instead of page-faulting fresh
# memory each time. Measured on 2 threads (forward+backward): at block 64, 384 keeps a fixed
# layout's 16-block windows whole at S=8192 (420 ms against 510 at 256) and is 2-4% faster on
# bigbird at S >= 8192; smaller blocks make smaller matmuls, so a chunk holds more of them (less
# per-chunk overhead) but not the (64 / block)^2 more that equal tile bytes would allow: bigbird
# at S=4096, block 16: 174 ms with 384 pairs, 153 with 1536, 211 with 6144; at S=8192, block 128:
# 262 ms with 384, 246 with 192.
CHUNK_BLOCKS = 384
# A row joins a chunk when it holds at least this fraction of the chunk's widest row: the padding
# it adds (masked key blocks) is bounded by 1 / PAD_RATIO - 1 of the real work.
PAD_RATIO = 0.8
# Below block 64, a row joins the group before it while the group's rows hold at least this
# fraction of the (rows x union of their key blocks) the group computes; from block 64 up only
# equal rows are grouped. Measured on 2 threads (unidirectional fixed layout, 4-block windows,
# causal, S=4096, forward+backward): block 16 225 -> 167 ms, block 32 168 -> 150 ms, but block 64
# 150 -> 157 ms: there the ~10% masked blocks cost more than the taller matmuls gain.
GROUP_RATIO = 0.9


@dataclass(frozen=True)
class RowChunk:
    """Query-block rows sharing one padded width, for one batched gather + bmm; `group` rows in a
    row (same head, one union of key blocks) share one gather of their key blocks and one tall
    matmul."""

    q_index: torch.Tensor        # [R] long: head * blocks + row, the query blocks of this chunk, group by group
    kv_index: torch.Tensor       # [R / group * C] long: head * blocks + col, each group's key blocks (padding
                                 # repeats a real one)
    kv_index_rows: torch.Tensor  # [R * C] long: the same per row (= kv_index when group is 1)
    col_index: torch.Tensor      # [R * C] long: col alone, for key padding masks (shared by heads)
    heads: torch.Tensor          # [R] long
    rows: torch.Tensor           # [R] long
    cols: torch.Tensor           # [R, C] long
    pad: Optional[torch.Tensor]  # [R, C] bool, True where a slot is masked (padding, or a block of the group's
                                 # union the row does not hold); None if no slot is
    diag_slots: Optional[torch.Tensor]  # [R] long: the slot of the row's diagonal block, -1 if it has none
                                        # (causal only); None if no row has one
    all_diag_last: bool          # every row's diagonal block is its last slot (causal only)
    group: int = 1               # consecutive rows computed together (R is a multiple of it)
    diag_offsets: Optional[torch.Tensor] = None  # [n] long: flat offsets of the causally masked entries in
                                                 # one batch element's scores, when some row's diagonal
                                                 # block is not its last slot; else None

    @property
    def width(self) -> int:
        return self.cols.shape[1]

    @property
    def num_rows(self) -> int:
        return self.cols.shape[0]


@dataclass(frozen=True)
class BlockPlan:
    """Index tables of one layout; build with `make_plan` and reuse for every call."""

    num_heads: int
    num_blocks: int
    block: int
    causal: bool
    layout: torch.Tensor        # [H, nb, nb] int64, after the causal cut
    row_ptr: np.ndarray         # [H, nb + 1] int32
    col_idx: np.ndarray         # [nnz] int32, ascending within each row
    col_ptr: np.ndarray         # [H, nb + 1] int32
    row_idx: np.ndarray         # [nnz] int32, ascending within each column
    chunks: tuple[RowChunk, ...]
    max_rows: int               # largest chunk, in rows
    max_slots: int              # largest chunk, in (row, key block) slots
    empty_rows: torch.Tensor    # [E] long: head * blocks + row of the query blocks with no key block
    _copies: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # per device: `on`, tables

    def on(self, device) -> "BlockPlan":
        """This plan with its tensors (chunks' index tables and masks, `layout`, `empty_rows`) on
        `device`: copied on the first call per device and kept, so a backend's per-call loop starts
        no host-to-device copy (on CUDA each would block on pageable host memory)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        key = str(device)
        if key not in self._copies:
            chunks = tuple(replace(ch, **{f.name: getattr(ch, f.name).to(device) for f in fields(ch)
                                          if isinstance(getattr(ch, f.name), torch.Tensor)}) for ch in self.chunks)
            self._copies[key] = replace(self, layout=self.layout.to(device), chunks=chunks,
                                        empty_rows=self.empty_rows.to(device))
        return self._copies[key]

    @property
    def seq_len(self) -> int:
        return self.num_blocks * self.block

    @property
    def nnz(self) -> int:
        return int(self.col_idx.shape[0])

    def device_tables(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The CSR/CSC tables as int32 tensors on `device` (for kernels), copied once per device."""
        key = f"csr:{torch.device(device)}"
        if key not in self._copies:
            self._copies[key] = {name: torch.from_numpy(getattr(self, name)).to(device)
                                 for name in ("row_ptr", "col_idx", "col_ptr", "row_idx")}
        return self._copies[key]


def layout_array(layout) -> np.ndarray:
    """A layout (tensor or array) as a numpy array, also from inside torch.func transforms.

    Inside `torch.func.grad`/`vmap` even ops on plain tensors return wrapped tensors, which have
    no data pointer; the layout is constant data, so it is read with functorch disabled.
    """
    if isinstance(layout, np.ndarray):
        return layout
    with torch._C._DisableFuncTorch():
        return layout.detach().cpu().numpy()


def make_plan(layout, block: int, *, causal: bool = False, chunk_blocks: Optional[int] = None) -> BlockPlan:
    """Compile a `[heads, blocks, blocks]` 0/1 layout (tensor or array) for blocks of `block` tokens.

    `chunk_blocks` bounds the (query block, key block) pairs of one batched torch chunk; the
    default is CHUNK_BLOCKS * 64 // block."""
    if not isinstance(layout, (torch.Tensor, np.ndarray)) or layout.ndim != 3 or layout.shape[1] != layout.shape[2]:
        shape = tuple(layout.shape) if isinstance(layout, (torch.Tensor, np.ndarray)) else type(layout).__name__
        raise ValueError(f"layout must be a [heads, blocks, blocks] tensor, got {shape}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive integer")
    grid = layout_array(layout) != 0
    if causal:
        grid = np.tril(grid)
    H, nb, _ = grid.shape

    rows_of = [[np.flatnonzero(grid[h, r]) for r in range(nb)] for h in range(H)]
    counts = np.array([[len(c) for c in per_head] for per_head in rows_of], dtype=np.int64)
    row_ptr = np.zeros((H, nb + 1), dtype=np.int32)
    row_ptr[:, 1:] = np.cumsum(counts, axis=1)
    # Global offsets: head h's rows start after all earlier heads' blocks.
    head_offsets = np.concatenate([[0], np.cumsum(counts.sum(axis=1))[:-1]]).astype(np.int32)
    row_ptr = row_ptr + head_offsets[:, None]
    col_idx = np.concatenate([c for per_head in rows_of for c in per_head] or [np.zeros(0)]).astype(np.int32)

    grid_t = grid.transpose(0, 2, 1)
    col_counts = grid_t.sum(axis=2)
    col_ptr = np.zeros((H, nb + 1), dtype=np.int32)
    col_ptr[:, 1:] = np.cumsum(col_counts, axis=1)
    col_ptr = col_ptr + head_offsets[:, None]
    row_idx = np.concatenate([np.flatnonzero(grid_t[h, c]) for h in range(H) for c in range(nb)] or [np.zeros(0)])
    row_idx = row_idx.astype(np.int32)

    if chunk_blocks is None:
        chunk_blocks = max(1, CHUNK_BLOCKS * 64 // block)
    elif isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, int) or chunk_blocks < 1:
        raise ValueError(f"chunk_blocks={chunk_blocks!r} must be a positive integer (or None for the default)")
    chunks = _row_chunks(grid, counts, block, causal, chunk_blocks)
    return BlockPlan(
        num_heads=H, num_blocks=nb, block=block, causal=causal, layout=torch.from_numpy(grid.astype(np.int64)),
        row_ptr=row_ptr, col_idx=col_idx, col_ptr=col_ptr, row_idx=row_idx, chunks=tuple(chunks),
        max_rows=max((c.num_rows for c in chunks), default=0),
        max_slots=max((c.num_rows * c.width for c in chunks), default=0),
        empty_rows=torch.from_numpy(np.flatnonzero(counts.reshape(-1) == 0)),
    )


def _row_groups(grid: np.ndarray, counts: np.ndarray, block: int,
                chunk_blocks: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(head, rows, keys): runs of consecutive rows of one head computed over the union `keys` of
    their key blocks (`grid` [H, nb, nb] bool, `counts` its row sums). A row joins the run before
    it while the run's own blocks stay GROUP_RATIO of what it computes (below block 64: nested rows
    under causal masking; always: equal rows; never bigbird's random rows); a run is then cut into
    near-equal parts that fit the chunk budget, each over its own union."""
    ratio = GROUP_RATIO if block < 64 else 1.0
    runs = []
    for h in range(grid.shape[0]):
        start, union, real = None, None, 0
        for r in range(grid.shape[1] + 1):
            if start is not None and r < grid.shape[1] and counts[h, r]:
                joined = union | grid[h, r]
                if real + counts[h, r] >= ratio * (r - start + 1) * joined.sum():
                    union, real = joined, real + counts[h, r]
                    continue
            if start is not None:
                runs.append((h, np.arange(start, r), np.flatnonzero(union)))
            starts_run = r < grid.shape[1] and counts[h, r] > 0
            start, union, real = (r, grid[h, r], counts[h, r]) if starts_run else (None, None, 0)
    groups = []
    for h, run, keys in runs:
        parts = -(-len(run) // max(1, chunk_blocks // len(keys)))
        if parts == 1:
            groups.append((h, run, keys))
            continue
        size = -(-len(run) // parts)
        groups += [(h, rows, np.flatnonzero(grid[h, rows].any(axis=0))) for rows in
                   (run[i:i + size] for i in range(0, len(run), size))]
    return groups


def _row_chunks(grid: np.ndarray, counts: np.ndarray, block: int, causal: bool,
                chunk_blocks: int) -> list[RowChunk]:
    """Chunks of equal-size row groups, biggest groups and then widest first; a chunk takes groups
    down to PAD_RATIO of its widest one's width, up to the chunk budget."""
    groups = sorted(_row_groups(grid, counts, block, chunk_blocks),
                    key=lambda u: (-len(u[1]), -len(u[2]), u[0], u[1][0]))
    chunks: list[RowChunk] = []
    i = 0
    while i < len(groups):
        width, size = len(groups[i][2]), len(groups[i][1])
        groups_per_chunk = max(1, chunk_blocks // (width * size))
        if groups_per_chunk > 1:
            groups_per_chunk -= groups_per_chunk % 2  # an even matmul batch splits evenly over two threads
        max_rows = groups_per_chunk * size
        j, rows = i, 0
        while (j < len(groups) and rows + size <= max_rows and len(groups[j][1]) == size
               and len(groups[j][2]) >= PAD_RATIO * width):
            rows += size
            j += 1
        chunks.append(_make_chunk(grid, groups[i:j], width, causal, block))
        i = j
    return chunks


def _make_chunk(grid: np.ndarray, groups, width: int, causal: bool, block: int) -> RowChunk:
    nb = grid.shape[1]
    heads = np.concatenate([np.full(len(rows), h) for h, rows, _ in groups]).astype(np.int64)
    rows = np.concatenate([rows for _, rows, _ in groups]).astype(np.int64)
    R, size = len(rows), len(groups[0][1])
    cols = np.empty((R, width), dtype=np.int64)
    pad = np.zeros((R, width), dtype=bool)
    diag_slots = np.full(R, -1, dtype=np.int64)
    n = 0
    for h, group_rows, keys in groups:
        missing = width - len(keys)
        for r in group_rows:
            cols[n, :missing] = keys[0]
            cols[n, missing:] = keys
            pad[n, :missing] = True
            pad[n, missing:] = ~grid[h, r, keys]
            if causal and grid[h, r, r]:
                diag_slots[n] = missing + int(np.searchsorted(keys, r))
            n += 1
    kv_rows = (heads[:, None] * nb + cols)
    has_diag = diag_slots >= 0
    chunk = RowChunk(
        q_index=torch.from_numpy(heads * nb + rows), kv_index=torch.from_numpy(kv_rows[::size].reshape(-1).copy()),
        kv_index_rows=torch.from_numpy(kv_rows.reshape(-1)),
        col_index=torch.from_numpy(cols.reshape(-1).copy()), heads=torch.from_numpy(heads),
        rows=torch.from_numpy(rows), cols=torch.from_numpy(cols),
        pad=torch.from_numpy(pad) if pad.any() else None,
        diag_slots=torch.from_numpy(diag_slots) if has_diag.any() else None,
        all_diag_last=bool((diag_slots == width - 1).all()), group=size,
    )
    if chunk.diag_slots is None or chunk.all_diag_last:
        return chunk
    return replace(chunk, diag_offsets=_diagonal_mask_offsets(chunk, block))


def _diagonal_mask_offsets(chunk: RowChunk, block: int) -> torch.Tensor:
    """Flat offsets, in one batch element's [R, block, C * block] score tile of `chunk`, of the
    entries above the diagonal of each row's diagonal block: keys after the query (causal)."""
    C = chunk.width
    sel = (chunk.diag_slots >= 0).nonzero().squeeze(1)
    i, j = torch.triu_indices(block, block, 1)
    base = sel * (block * C * block) + chunk.diag_slots[sel] * block
    return (base[:, None] + (i * (C * block) + j)[None, :]).reshape(-1)
