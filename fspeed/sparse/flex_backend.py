"""Block-sparse attention through PyTorch's FlexAttention, driven by fspeed's block tables.

`block_mask(plan, device)` turns a `BlockPlan` into one `BlockMask` (`BlockMask.from_kv_blocks`),
cached per layout, sequence length and device: for each head and query tile, the key tiles the
layout holds, split into *full* tiles (every score kept: FlexAttention skips the mask there) and
*partial* tiles (the causal diagonal, or a tile that holds only some of the layout's blocks),
where its `mask_mod` decides per score. The tile is fspeed's block, except on CUDA for blocks that
are not a multiple of 128: FlexAttention's Triton kernels tile by up to 128 rows and columns
(torch 2.13 on H100/H200, bf16, head_dim 64: a 128x128 forward tile, 64x128 and 128x64 backward
tiles) and need the BlockMask's block to be a multiple of theirs, so the block mask is built at
the least common multiple of the block and 128 (`tile_for`: 128 for blocks 16, 32, 64), and the
fine layout stays exact through the mask_mod, which is only evaluated on the partial tiles.

The `mask_mod` is exact everywhere (layout block present, and the key not after the query when
causal), not only on the partial tiles: FlexAttention's eager path (what a compiled call falls
back to past Dynamo's recompile limit) ignores the block tables and applies the mask_mod to
every score, so it computes the same attention as the compiled kernels. Masks become a
`score_mod` adding the key padding bias and the attention bias (fspeed's additive masks); a row
left with no key gives 0, as in fspeed's other backends.

Where it runs:

* CUDA, plain autograd: `attention` calls `torch.compile(flex_attention)` directly, so the
  forward and backward are FlexAttention's fused Triton kernels (it keeps q, k, v, the output
  and the log-sum-exp, no probabilities). This is the default CUDA backend (`backend="auto"`).
* CUDA under torch.func transforms (grad, vjp, vmap, fspeed's remat): FlexAttention has no
  functorch rules, so the op goes through fspeed's `BlockSparseAttention` Function: the forward
  is compiled flex without autograd, the backward recomputes it with autograd on and takes flex's
  fused backward (one extra forward).
* CPU: torch 2.13's FlexAttention has no CPU backward (it refuses inputs that require grad), so
  the forward is compiled flex (Inductor's CPU template; fp32/fp16/bf16, fp64 through flex's
  eager path) and the backward is fspeed's "bmm" backward (it recomputes the probabilities and
  reads no log-sum-exp). Compiling takes seconds per new shape on the CPU.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import Callable, Optional

import numpy as np
import torch

from . import torch_blocks
from .plan import BlockPlan

# The BlockMask tile on CUDA for blocks below it: a multiple of every Triton tile FlexAttention picks by
# default (torch 2.13: forward up to 128x128, backward 64x128 / 128x64 on sm90 and sm100).
CUDA_TILE = 128
# False: FlexAttention's eager path everywhere (applies the mask_mod to all S x S scores: slow,
# O(S^2) memory, but no compile). For tests and debugging.
COMPILE = True

# BlockMasks kept by layout contents (each holds its block tables and the fine layout on its device).
MASK_CACHE_SIZE = 64

_compiled = None
_MASKS: OrderedDict = OrderedDict()
_AVAILABLE: dict = {}


def available(device) -> bool:
    """FlexAttention importable and able to run on `device` (CUDA needs Triton for its kernels)."""
    kind = torch.device(device).type
    if kind not in _AVAILABLE:
        _AVAILABLE[kind] = _available(kind)
    return _AVAILABLE[kind]


def _available(kind: str) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    if kind == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:
            return False
        return bool(has_triton())
    return kind == "cpu"


def supports(dtype: torch.dtype) -> bool:
    """Dtypes `backend="auto"` sends to flex on CUDA (fp64 stays on "bmm")."""
    return dtype in (torch.float32, torch.float16, torch.bfloat16)


def tile_for(block: int, device) -> int:
    """The BlockMask's tile for fspeed blocks of `block` tokens on `device`: the block itself, or on
    CUDA, for a block that is not a multiple of CUDA_TILE, the least common multiple of the two."""
    if torch.device(device).type == "cuda" and block % CUDA_TILE:
        return block * CUDA_TILE // math.gcd(block, CUDA_TILE)
    return block


def _flex_fn(dtype: torch.dtype, device: torch.device) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention
    if not COMPILE or (device.type == "cpu" and dtype == torch.float64):  # no fp64 in Inductor's CPU template
        return flex_attention
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _kv_tables(mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_num_blocks [1, H, rows], kv_indices [1, H, rows, cols]) int32 of a [H, rows, cols] bool
    grid: each row's present columns first, ascending."""
    counts = mask.sum(-1).astype(np.int32)
    order = np.argsort(~mask, axis=-1, kind="stable").astype(np.int32)
    return torch.from_numpy(counts[None].copy()), torch.from_numpy(order[None].copy())


def build_block_mask(grid: np.ndarray, block: int, causal: bool, device, tile: Optional[int] = None):
    """A `BlockMask` for the [H, nb, nb] bool `grid` (query block x key block; above the diagonal
    already dropped when `causal`) of `block`-token blocks, at `tile` tokens (default `tile_for`)."""
    from torch.nn.attention.flex_attention import BlockMask

    device = torch.device(device)
    tile = tile_for(block, device) if tile is None else tile
    if tile % block:
        raise ValueError(f"tile={tile} must be a multiple of the layout's block={block}")
    H, nb, _ = grid.shape
    S = nb * block
    r = tile // block
    nt = -(-nb // r)
    fine = np.zeros((H, nt * r, nt * r), dtype=bool)  # padded: the mask_mod may look at a last tile's tail
    fine[:, :nb, :nb] = grid
    tiles = fine.reshape(H, nt, r, nt, r)
    any_ = tiles.any(axis=(2, 4))
    full = tiles.all(axis=(2, 4))  # a tile past the sequence's end holds padding (False): never full
    if causal and tile > 1:
        full &= ~np.eye(nt, dtype=bool)  # diagonal tiles hold keys after their queries
    partial = any_ & ~full
    kv_num, kv_idx = _kv_tables(partial)
    full_num, full_idx = _kv_tables(full)
    table = torch.from_numpy(fine).to(device)

    if causal:
        def mask_mod(b, h, q_idx, kv_idx):
            return table[h, q_idx // block, kv_idx // block] & (q_idx >= kv_idx)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return table[h, q_idx // block, kv_idx // block]

    return BlockMask.from_kv_blocks(kv_num.to(device), kv_idx.to(device), full_num.to(device), full_idx.to(device),
                                    BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(S, S))


def block_mask(plan: BlockPlan, device, tile: Optional[int] = None):
    """The plan's `BlockMask` on `device`. Cached per (layout, block, causal, sequence length, device,
    tile): on the plan, and by the layout's contents across plans (a layout passed as a tensor gets a
    new plan each call, the same BlockMask), the MASK_CACHE_SIZE most recently used."""
    device = torch.device(device)
    tile = tile_for(plan.block, device) if tile is None else tile
    memo = f"flex:{device}:{tile}"
    if memo in plan._copies:
        return plan._copies[memo]
    grid = plan.layout.cpu().numpy() != 0
    key = (hashlib.blake2b(np.packbits(grid).tobytes(), digest_size=16).digest(), grid.shape, plan.block,
           plan.causal, str(device), tile)
    mask = _MASKS.get(key)
    if mask is None:
        mask = _MASKS[key] = build_block_mask(grid, plan.block, plan.causal, device, tile)
        while len(_MASKS) > MASK_CACHE_SIZE:
            _MASKS.popitem(last=False)
    else:
        _MASKS.move_to_end(key)
    plan._copies[memo] = mask
    return mask


def _score_mod(key_bias: Optional[torch.Tensor], attn_bias: Optional[torch.Tensor]):
    """fspeed's additive masks as a score_mod (None when there are none). key_bias: [1 or B, S];
    attn_bias: [1 or B, 1 or H, S, S]."""
    if key_bias is None and attn_bias is None:
        return None
    kb = None if key_bias is None else key_bias.detach()
    ab = None if attn_bias is None else attn_bias.detach()
    kb_batched = kb is not None and kb.shape[0] > 1
    ab_batched = ab is not None and ab.shape[0] > 1
    ab_heads = ab is not None and ab.shape[1] > 1
    if kb is not None and not kb_batched:
        kb = kb[0]
    if ab is not None and not ab_batched:
        ab = ab[0]
    if ab is not None and not ab_heads:
        ab = ab[0] if not ab_batched else ab[:, 0]

    def score_mod(score, b, h, q_idx, kv_idx):
        if kb is not None:
            score = score + (kb[b, kv_idx] if kb_batched else kb[kv_idx])
        if ab is not None:
            if ab_batched and ab_heads:
                score = score + ab[b, h, q_idx, kv_idx]
            elif ab_batched:
                score = score + ab[b, q_idx, kv_idx]
            elif ab_heads:
                score = score + ab[h, q_idx, kv_idx]
            else:
                score = score + ab[q_idx, kv_idx]
        return score

    return score_mod


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float,
         key_bias: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FlexAttention over `mask` (a BlockMask from `block_mask`) with fspeed's masks, differentiable
    where FlexAttention is (CUDA). q, k, v: [B, H, S, D]."""
    fn = _flex_fn(q.dtype, q.device)
    return fn(q, k, v, score_mod=_score_mod(key_bias, attn_bias), block_mask=mask, scale=scale)


def direct(q: torch.Tensor) -> bool:
    """Whether `attention` can hand autograd to FlexAttention itself: off the CPU (no CPU backward in
    torch 2.13) and outside torch.func transforms (FlexAttention has no functorch rules)."""
    return q.device.type != "cpu" and not torch._C._are_functorch_transforms_active()


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float,
            key_bias: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None):
    """(out in q's dtype, an empty [B, H, 0] "lse"): neither backward below reads one."""
    q, k, v = q.detach(), k.detach(), v.detach()  # a Function's forward: no autograd here (and none on the CPU)
    out = flex(q, k, v, block_mask(plan, q.device), scale, key_bias, attn_bias)
    return out, torch.empty(q.shape[0], q.shape[1], 0, dtype=torch_blocks.compute_dtype(q.dtype), device=q.device)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, plan: BlockPlan, scale: float, key_bias: Optional[torch.Tensor] = None,
             attn_bias: Optional[torch.Tensor] = None):
    """(dq, dk, dv): on the CPU fspeed's "bmm" backward; elsewhere flex's own backward after
    recomputing its forward with autograd on."""
    if q.device.type == "cpu":
        return torch_blocks.backward(dout, q, k, v, out, lse, plan, scale, key_bias, attn_bias)
    with torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        again = flex(*inputs, block_mask(plan, q.device), scale, key_bias, attn_bias)
        return torch.autograd.grad(again, inputs, dout)
