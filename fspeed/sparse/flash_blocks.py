"""Block-sparse attention through torch's fused CPU flash-attention kernel, one row chunk at a time.

Each chunk of a `BlockPlan` is R query blocks, each with C key blocks. Gathered, that is a dense
attention problem with R "heads": queries [B, R, block, D] against keys and values
[B, R, C * block, D]. torch's CPU flash kernel (`aten::_scaled_dot_product_flash_attention_for_cpu`,
and its backward) solves it fused: online softmax, fp32 accumulation for fp16/bf16 inputs, no
score tensor in memory, and a backward pass that recomputes the probabilities from the saved
log-sum-exp. What stays in fspeed: choosing the blocks (gather), the masks of the chunk (padding
slots, the causal diagonal block, key padding, attention mask) as one additive tensor broadcast
as far as it can be, and scattering key/value gradients back (`index_add_`).

Available where the op exists (torch >= 2.3 on CPU); `available()` says so. A fully masked row
gives 0 (the kernel's convention, the same as fspeed's).
"""

from __future__ import annotations

from typing import Optional

import torch

from .plan import BlockPlan, RowChunk
from .torch_blocks import _batch_slices, _slice_bias, row_blocks_buffer, rows_of_batch

_ops = torch.ops.aten


def available() -> bool:
    return hasattr(_ops, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        _ops, "_scaled_dot_product_flash_attention_for_cpu_backward")


def _chunk_mask(ch: RowChunk, plan: BlockPlan, key_bias: Optional[torch.Tensor], attn_bias: Optional[torch.Tensor],
                dtype: torch.dtype, device) -> Optional[torch.Tensor]:
    """The chunk's additive mask, [1 or B, R or 1, block or 1, C * block], or None if nothing is masked."""
    blk, R, C = plan.block, ch.num_rows, ch.width
    mask = None

    def add(term: torch.Tensor) -> None:
        nonlocal mask
        mask = term if mask is None else mask + term

    if ch.pad is not None:
        pad = torch.zeros(R, C * blk, dtype=dtype, device=device)
        add(pad.masked_fill_(ch.pad.repeat_interleave(blk, dim=1), float("-inf"))[None, :, None, :])
    if plan.causal and ch.diag_slots is not None:
        if ch.all_diag_last:
            tri = torch.zeros(blk, C * blk, dtype=dtype, device=device)
            tri[:, -blk:].masked_fill_(torch.ones(blk, blk, dtype=torch.bool, device=device).triu_(1), float("-inf"))
            add(tri[None, None])
        else:
            tri = torch.zeros(R * blk * C * blk, dtype=dtype, device=device)
            add(tri.index_fill_(0, ch.diag_offsets, float("-inf")).view(1, R, blk, C * blk))
    if key_bias is not None:
        kb = key_bias.view(key_bias.shape[0], plan.num_blocks, blk).index_select(1, ch.col_index)
        add(kb.view(key_bias.shape[0], R, 1, C * blk).to(dtype))
    if attn_bias is not None:
        Bm, Hm = attn_bias.shape[:2]
        a6 = attn_bias.view(Bm, Hm, plan.num_blocks, blk, plan.num_blocks, blk).permute(0, 1, 2, 4, 3, 5)
        heads = ch.heads if Hm > 1 else torch.zeros_like(ch.heads)
        g = a6[:, heads[:, None], ch.rows[:, None], ch.cols]  # [Bm, R, C, blk, blk]
        add(g.permute(0, 1, 3, 2, 4).reshape(Bm, R, blk, C * blk).to(dtype))
    return mask  # the kernel broadcasts size-1 dims


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float,
            key_bias: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None):
    """(out [B,H,S,D] in q's dtype, lse [B,H,S] fp32 or fp64) for CPU tensors q, k, v [B,H,S,D]."""
    B, H, S, D = q.shape
    blk, n = plan.block, H * plan.num_blocks
    q2, k2, v2 = (x.contiguous().view(B * n, blk * D) for x in (q, k, v))
    out = row_blocks_buffer(plan, B, blk * D, q.dtype, q.device)
    lse = row_blocks_buffer(plan, B, blk, _acc_dtype(q.dtype), q.device)
    for b in _batch_slices(plan, B):
        Bs = b.stop - b.start
        kb, ab = _slice_bias(key_bias, b), _slice_bias(attn_bias, b)
        for ch in plan.chunks:
            R, C = ch.num_rows, ch.width
            q_at, kv_at = (rows_of_batch(index, b, n) for index in (ch.q_index, ch.kv_index_rows))
            q_rows = q2.index_select(0, q_at).view(Bs, R, blk, D)
            k_cols = k2.index_select(0, kv_at).view(Bs, R, C * blk, D)
            v_cols = v2.index_select(0, kv_at).view(Bs, R, C * blk, D)
            mask = _chunk_mask(ch, plan, kb, ab, _acc_dtype(q.dtype), q.device)
            o, row_lse = _ops._scaled_dot_product_flash_attention_for_cpu(
                q_rows, k_cols, v_cols, 0.0, False, attn_mask=mask, scale=scale)
            out.index_copy_(0, q_at, o.reshape(Bs * R, blk * D))
            lse.index_copy_(0, q_at, row_lse.reshape(Bs * R, blk))
    return out.view(B, H, S, D), lse.view(B, H, S)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, plan: BlockPlan, scale: float, key_bias: Optional[torch.Tensor] = None,
             attn_bias: Optional[torch.Tensor] = None):
    """(dq, dk, dv) in the inputs' dtype; the kernel recomputes probabilities from `lse`."""
    B, H, S, D = q.shape
    blk, n = plan.block, H * plan.num_blocks
    q2, k2, v2, o2, do2 = (x.contiguous().view(B * n, blk * D) for x in (q, k, v, out, dout))
    lse2 = lse.reshape(B * n, blk)
    acc = _acc_dtype(q.dtype)
    dq = row_blocks_buffer(plan, B, blk * D, q.dtype, q.device)
    dk = torch.zeros(B * n, blk * D, dtype=acc)
    dv = torch.zeros(B * n, blk * D, dtype=acc)
    for b in _batch_slices(plan, B):
        Bs = b.stop - b.start
        kb, ab = _slice_bias(key_bias, b), _slice_bias(attn_bias, b)
        for ch in plan.chunks:
            R, C = ch.num_rows, ch.width
            q_at, kv_at = (rows_of_batch(index, b, n) for index in (ch.q_index, ch.kv_index_rows))
            rows = lambda x: x.index_select(0, q_at).view(Bs, R, blk, D)  # noqa: E731
            k_cols = k2.index_select(0, kv_at).view(Bs, R, C * blk, D)
            v_cols = v2.index_select(0, kv_at).view(Bs, R, C * blk, D)
            row_lse = lse2.index_select(0, q_at).view(Bs, R, blk)
            mask = _chunk_mask(ch, plan, kb, ab, acc, q.device)
            g_q, g_k, g_v = _ops._scaled_dot_product_flash_attention_for_cpu_backward(
                rows(do2), rows(q2), k_cols, v_cols, rows(o2), row_lse, 0.0, False, attn_mask=mask, scale=scale)
            dq.index_copy_(0, q_at, g_q.reshape(Bs * R, blk * D))
            dk.index_add_(0, kv_at, g_k.reshape(Bs * R * C, blk * D).to(acc))
            dv.index_add_(0, kv_at, g_v.reshape(Bs * R * C, blk * D).to(acc))
    shape = (B, H, S, D)
    return dq.view(shape), dk.view(shape).to(k.dtype), dv.view(shape).to(v.dtype)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernel's log-sum-exp dtype, also used for masks and key/value gradient sums."""
    return torch.float64 if dtype == torch.float64 else torch.float32
