"""Block-sparse attention in batched torch ops: gather the listed key blocks, bmm, softmax, bmm.

For each row chunk of a `BlockPlan`, the query blocks and their key/value blocks are gathered
with `index_select` (along dim 0 of [batch * blocks, block * D] views: a memcpy per block) into
reused workspace buffers, scores are one `bmm` over the chunk, the softmax runs in place over
each query row's concatenated key blocks (exact and numerically stable), and the output is a
second `bmm`; the matmuls apply the scale (`baddbmm_`'s alpha), so it costs no pass of its own.
A chunk's row groups (rows over one union of key blocks, each masking what it does not hold)
gather those blocks once and put all their queries through each `bmm` as one matrix. Memory
beyond inputs and outputs is the workspace: O(chunk x block^2), never O(seq^2). On 2 CPU threads
the bmms run at dense flash attention's FLOP rate; what is left is the gathers, the two softmax
passes and the gradient scatters.

The backward pass recomputes the scores and their softmax (flash attention's trade: no
probabilities kept between the passes), uses softmax's fused backward for dS, and scatters
key/value gradients with `index_add_`. Works on any device torch supports. Rows with no key left
(everything masked) give 0.
"""

from __future__ import annotations

from typing import Optional

import torch

from .plan import BlockPlan, RowChunk

# Largest batch slice times chunk slots processed at once (bounds the workspace for big batches).
WORKSPACE_SLOTS = 1024


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Workspace:
    """Flat buffers sized for the largest chunk, viewed per chunk (no fresh allocation per chunk)."""

    def __init__(self, plan: BlockPlan, batch: int, head_dim: int, dtype: torch.dtype, device, backward: bool):
        blk = plan.block
        rows, slots = plan.max_rows * batch, plan.max_slots * batch
        new = lambda n: torch.empty(max(n, 1), dtype=dtype, device=device)  # noqa: E731
        self.q = new(rows * blk * head_dim)
        self.k = new(slots * blk * head_dim)
        self.v = new(slots * blk * head_dim)
        self.s = new(slots * blk * blk)
        self.o = new(rows * blk * head_dim)
        if backward:
            self.do = new(rows * blk * head_dim)
            self.dp = new(slots * blk * blk)
            self.dkv = new(slots * blk * head_dim)

    @staticmethod
    def view(buf: torch.Tensor, *shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        return buf[:n].view(*shape)


def rows_of_batch(index: torch.Tensor, b: slice, blocks: int) -> torch.Tensor:
    """`index` (block numbers within one batch element of `blocks` blocks) as row numbers of the
    [batch * blocks, block * D] view, for every batch element of `b`. Gathering and scattering
    along dim 0 of a 2-D view is 2-4x faster than along dim 1 of the 3-D tensor (a memcpy per row)."""
    if b.stop - b.start == 1:
        return index + b.start * blocks if b.start else index
    return (torch.arange(b.start, b.stop, device=index.device)[:, None] * blocks + index).reshape(-1)


def row_blocks_buffer(plan: BlockPlan, batch: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised [batch * heads * blocks, width] buffer for per-query-block results, with the
    rows no chunk writes (query blocks without key blocks) set to 0: every other row is written by
    exactly one chunk, so zero-filling the whole buffer would be a wasted pass. `plan` is on
    `device` (`BlockPlan.on`)."""
    n = plan.num_heads * plan.num_blocks
    buf = torch.empty(batch * n, width, dtype=dtype, device=device)
    if plan.empty_rows.numel():
        buf.view(batch, n, width).index_fill_(1, plan.empty_rows, 0)
    return buf


def _batch_slices(plan: BlockPlan, batch: int) -> list[slice]:
    step = max(1, WORKSPACE_SLOTS // max(plan.max_slots, 1))
    return [slice(b, min(b + step, batch)) for b in range(0, batch, step)]


def _scores(ch: RowChunk, plan: BlockPlan, q2: torch.Tensor, k2: torch.Tensor, q_at: torch.Tensor,
            kv_at: torch.Tensor, B: int, scale: float, key_bias: Optional[torch.Tensor],
            attn_bias: Optional[torch.Tensor], ws: _Workspace, D: int):
    """Scaled, masked scores [B*G, group*blk, C*blk] of one chunk of G row groups, plus the gathered
    Q rows and K blocks (rows `q_at` and `kv_at` of the [batch * blocks, blk * D] views `q2`, `k2`);
    `ch` is on the scores' device.
    Viewed as [B, R, blk, C*blk] the scores are row by row, which is how the masks are applied."""
    blk, R, C, G = plan.block, ch.num_rows, ch.width, ch.num_rows // ch.group
    q_rows = torch.index_select(q2, 0, q_at, out=ws.view(ws.q, B * R, blk * D))
    k_cols = torch.index_select(k2, 0, kv_at, out=ws.view(ws.k, B * G * C, blk * D))
    s = ws.view(ws.s, B * G, ch.group * blk, C * blk)
    s.baddbmm_(q_rows.view(B * G, ch.group * blk, D), k_cols.view(B * G, C * blk, D).transpose(1, 2),
               beta=0, alpha=scale)  # the matmul applies the scale: no extra pass
    s4 = s.view(B, R, blk, C * blk)
    if ch.pad is not None:
        s4.masked_fill_(ch.pad.repeat_interleave(blk, dim=1)[None, :, None, :], float("-inf"))
    if plan.causal and ch.diag_slots is not None:
        if ch.all_diag_last:
            s4[..., -blk:].masked_fill_(torch.ones(blk, blk, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
        else:
            s.view(B, -1).index_fill_(1, ch.diag_offsets, float("-inf"))
    if key_bias is not None:
        kb = key_bias.view(key_bias.shape[0], plan.num_blocks, blk).index_select(1, ch.col_index)
        s4.add_(kb.view(key_bias.shape[0], R, 1, C * blk))
    if attn_bias is not None:
        Bm, Hm = attn_bias.shape[:2]
        a6 = attn_bias.view(Bm, Hm, plan.num_blocks, blk, plan.num_blocks, blk).permute(0, 1, 2, 4, 3, 5)
        heads = ch.heads if Hm > 1 else torch.zeros_like(ch.heads)
        g = a6[:, heads[:, None], ch.rows[:, None], ch.cols]  # [Bm, R, C, blk, blk]
        s4.add_(g.permute(0, 1, 3, 2, 4).reshape(Bm, R, blk, C * blk))
    return s, q_rows, k_cols


def _probabilities(s: torch.Tensor, rows_can_be_empty: bool) -> torch.Tensor:
    """Row softmax of the scores, in place (one fused pass). With `rows_can_be_empty` (masks that
    can leave a row with no key), rows whose every score is -inf become 0 instead of NaN."""
    empty = s.amax(-1, keepdim=True) == float("-inf") if rows_can_be_empty else None
    p = torch._softmax(s, -1, False, out=s)
    if empty is not None:
        p.masked_fill_(empty, 0.0)
    return p


def _slice_bias(bias: Optional[torch.Tensor], b: slice) -> Optional[torch.Tensor]:
    if bias is None or bias.shape[0] == 1:
        return bias
    return bias[b]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float,
            key_bias: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None):
    """(out [B,H,S,D] in q's dtype, an empty [B,H,0] "lse") for q, k, v [B,H,S,D]: this backend's
    backward recomputes whole rows, so it needs no log-sum-exp and none is computed."""
    B, H, S, D = q.shape
    cd = compute_dtype(q.dtype)
    blk, n = plan.block, H * plan.num_blocks
    q2 = q.to(cd).reshape(B * n, blk * D)
    k2 = k.to(cd).reshape(B * n, blk * D)
    v2 = v.to(cd).reshape(B * n, blk * D)
    masks_can_empty_rows = key_bias is not None or attn_bias is not None
    plan = plan.on(q.device)
    out = row_blocks_buffer(plan, B, blk * D, cd, q.device)
    for b in _batch_slices(plan, B):
        Bs = b.stop - b.start
        ws = _Workspace(plan, Bs, D, cd, q.device, backward=False)
        kb, ab = _slice_bias(key_bias, b), _slice_bias(attn_bias, b)
        for ch in plan.chunks:
            R, C, G, tokens = ch.num_rows, ch.width, ch.num_rows // ch.group, ch.group * blk  # tokens: queries a group
            q_at, kv_at = (rows_of_batch(index, b, n) for index in (ch.q_index, ch.kv_index))
            s, _, _ = _scores(ch, plan, q2, k2, q_at, kv_at, Bs, scale, kb, ab, ws, D)
            p = _probabilities(s, masks_can_empty_rows)
            v_cols = torch.index_select(v2, 0, kv_at, out=ws.view(ws.v, Bs * G * C, blk * D))
            o = torch.bmm(p, v_cols.view(Bs * G, C * blk, D), out=ws.view(ws.o, Bs * G, tokens, D))
            out.index_copy_(0, q_at, o.view(Bs * R, blk * D))
    return out.view(B, H, S, D).to(q.dtype), torch.empty(B, H, 0, dtype=cd, device=q.device)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, plan: BlockPlan, scale: float, key_bias: Optional[torch.Tensor] = None,
             attn_bias: Optional[torch.Tensor] = None):
    """(dq, dk, dv) in the inputs' dtypes. The probabilities are recomputed as the softmax of the
    recomputed scores (a row's key blocks are all in its chunk), so `lse` is not read."""
    B, H, S, D = q.shape
    cd = compute_dtype(q.dtype)
    blk, n = plan.block, H * plan.num_blocks
    q2 = q.to(cd).reshape(B * n, blk * D)
    k2 = k.to(cd).reshape(B * n, blk * D)
    v2 = v.to(cd).reshape(B * n, blk * D)
    do2 = dout.to(cd).reshape(B * n, blk * D)
    masks_can_empty_rows = key_bias is not None or attn_bias is not None
    plan = plan.on(q.device)
    dq = row_blocks_buffer(plan, B, blk * D, cd, q.device)
    dk = torch.zeros(B * n, blk * D, dtype=cd, device=q.device)
    dv = torch.zeros_like(dk)
    for b in _batch_slices(plan, B):
        Bs = b.stop - b.start
        ws = _Workspace(plan, Bs, D, cd, q.device, backward=True)
        kb, ab = _slice_bias(key_bias, b), _slice_bias(attn_bias, b)
        for ch in plan.chunks:
            R, C, G, tokens = ch.num_rows, ch.width, ch.num_rows // ch.group, ch.group * blk  # tokens: queries a group
            q_at, kv_at = (rows_of_batch(index, b, n) for index in (ch.q_index, ch.kv_index))
            s, q_rows, k_cols = _scores(ch, plan, q2, k2, q_at, kv_at, Bs, scale, kb, ab, ws, D)
            p = _probabilities(s, masks_can_empty_rows)
            do_rows = torch.index_select(do2, 0, q_at, out=ws.view(ws.do, Bs * R, blk * D)).view(Bs * G, tokens, D)
            v_cols = torch.index_select(v2, 0, kv_at, out=ws.view(ws.v, Bs * G * C, blk * D))
            dkv = ws.view(ws.dkv, Bs * G, C * blk, D)
            torch.bmm(p.transpose(1, 2), do_rows, out=dkv)  # sums over the group's rows
            dv.index_add_(0, kv_at, dkv.view(Bs * G * C, blk * D))
            dp = torch.bmm(do_rows, v_cols.view(Bs * G, C * blk, D).transpose(1, 2),
                           out=ws.view(ws.dp, Bs * G, tokens, C * blk))
            # softmax's backward, p * (dp - rowsum(dp * p)), in place; the row sum is flash
            # attention's rowsum(dout * out) (every key block of a row is in this chunk)
            ds = torch._softmax_backward_data(dp, p, -1, cd, grad_input=dp)
            dq_rows = ws.view(ws.o, Bs * G, tokens, D)
            dq_rows.baddbmm_(ds, k_cols.view(Bs * G, C * blk, D), beta=0, alpha=scale)
            dq.index_copy_(0, q_at, dq_rows.view(Bs * R, blk * D))
            dkv.baddbmm_(ds.transpose(1, 2), q_rows.view(Bs * G, tokens, D), beta=0, alpha=scale)
            dk.index_add_(0, kv_at, dkv.view(Bs * G * C, blk * D))
    shape = (B, H, S, D)
    return (dq.view(shape).to(q.dtype), dk.view(shape).to(k.dtype), dv.view(shape).to(v.dtype))
