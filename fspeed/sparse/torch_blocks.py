"""Block-sparse attention in batched torch ops: gather the listed key blocks, bmm, softmax, bmm.

For each row chunk of a `BlockPlan`, the query blocks and their key/value blocks are gathered
with `index_select` into reused workspace buffers, scores are one `bmm` over the chunk, the
softmax runs over each query row's concatenated key blocks (so it is exact, and numerically
stable: max-subtracted, log-sum-exp kept for the backward pass), and the output is a second
`bmm`. Memory beyond inputs and outputs is the workspace: O(chunk x block^2), never O(seq^2).

The backward pass recomputes the probabilities from the saved log-sum-exp (flash attention's
trick) and scatters key/value gradients with `index_add_`. Works on any device torch supports.
Rows with no key left (everything masked) give 0 and a log-sum-exp of +inf.
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


def _batch_slices(plan: BlockPlan, batch: int) -> list[slice]:
    step = max(1, WORKSPACE_SLOTS // max(plan.max_slots, 1))
    return [slice(b, min(b + step, batch)) for b in range(0, batch, step)]


def _scores(ch: RowChunk, plan: BlockPlan, qs3: torch.Tensor, k3: torch.Tensor, key_bias: Optional[torch.Tensor],
            attn_bias: Optional[torch.Tensor], ws: _Workspace, D: int):
    """Scaled, masked scores [B*R, blk, C*blk] of one chunk, plus the gathered Q rows and K blocks."""
    B, blk, R, C = qs3.shape[0], plan.block, ch.num_rows, ch.width
    q_rows = torch.index_select(qs3, 1, ch.q_index, out=ws.view(ws.q, B, R, blk * D))
    k_cols = torch.index_select(k3, 1, ch.kv_index, out=ws.view(ws.k, B, R * C, blk * D))
    s = ws.view(ws.s, B * R, blk, C * blk)
    torch.bmm(q_rows.view(B * R, blk, D), k_cols.view(B * R, C * blk, D).transpose(1, 2), out=s)
    s4 = s.view(B, R, blk, C * blk)
    if ch.pad is not None:
        s4.masked_fill_(ch.pad.to(s.device).repeat_interleave(blk, dim=1)[None, :, None, :], float("-inf"))
    if plan.causal and ch.diag_rows is not None:
        upper = torch.ones(blk, blk, dtype=torch.bool, device=s.device).triu_(1)
        if ch.all_diag:
            s4[..., -blk:].masked_fill_(upper, float("-inf"))
        else:
            sel = ch.diag_rows.to(s.device).nonzero().squeeze(1)
            s4[:, sel, :, -blk:] = s4[:, sel, :, -blk:].masked_fill(upper, float("-inf"))
    if key_bias is not None:
        kb = key_bias.view(key_bias.shape[0], plan.num_blocks, blk).index_select(1, ch.col_index.to(s.device))
        s4.add_(kb.view(key_bias.shape[0], R, 1, C * blk))
    if attn_bias is not None:
        Bm, Hm = attn_bias.shape[:2]
        a6 = attn_bias.view(Bm, Hm, plan.num_blocks, blk, plan.num_blocks, blk).permute(0, 1, 2, 4, 3, 5)
        heads = ch.heads if Hm > 1 else torch.zeros_like(ch.heads)
        dev = s.device
        g = a6[:, heads.to(dev)[:, None], ch.rows.to(dev)[:, None], ch.cols.to(dev)]  # [Bm, R, C, blk, blk]
        s4.add_(g.permute(0, 1, 3, 2, 4).reshape(Bm, R, blk, C * blk))
    return s, q_rows, k_cols


def _slice_bias(bias: Optional[torch.Tensor], b: slice) -> Optional[torch.Tensor]:
    if bias is None or bias.shape[0] == 1:
        return bias
    return bias[b]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float,
            key_bias: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None):
    """(out [B,H,S,D] in q's dtype, lse [B,H,S] in the compute dtype) for q, k, v [B,H,S,D]."""
    B, H, S, D = q.shape
    cd = compute_dtype(q.dtype)
    blk, nb = plan.block, plan.num_blocks
    qs3 = (q.to(cd) * scale).reshape(B, H * nb, blk * D)
    k3 = k.to(cd).reshape(B, H * nb, blk * D)
    v3 = v.to(cd).reshape(B, H * nb, blk * D)
    out = torch.zeros(B, H * nb, blk * D, dtype=cd, device=q.device)
    lse = torch.full((B, H * nb, blk), float("inf"), dtype=cd, device=q.device)
    for b in _batch_slices(plan, B):
        Bs = b.stop - b.start
        ws = _Workspace(plan, Bs, D, cd, q.device, backward=False)
        kb, ab = _slice_bias(key_bias, b), _slice_bias(attn_bias, b)
        for ch in plan.chunks:
            R, C = ch.num_rows, ch.width
            s, _, _ = _scores(ch, plan, qs3[b], k3[b], kb, ab, ws, D)
            m = s.amax(-1, keepdim=True)
            m.masked_fill_(m == float("-inf"), 0.0)
            s.sub_(m).exp_()
            denom = s.sum(-1, keepdim=True)
            v_cols = torch.index_select(v3[b], 1, ch.kv_index, out=ws.view(ws.v, Bs, R * C, blk * D))
            o = torch.bmm(s, v_cols.view(Bs * R, C * blk, D), out=ws.view(ws.o, Bs * R, blk, D))
            empty = denom == 0
            o.div_(denom.masked_fill(empty, 1.0))
            row_lse = (m + denom.log()).masked_fill_(empty, float("inf"))
            out[b].index_copy_(1, ch.q_index, o.view(Bs, R, blk * D))
            lse[b].index_copy_(1, ch.q_index, row_lse.view(Bs, R, blk))
    return out.view(B, H, S, D).to(q.dtype), lse.view(B, H, S)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, plan: BlockPlan, scale: float, key_bias: Optional[torch.Tensor] = None,
             attn_bias: Optional[torch.Tensor] = None):
    """(dq, dk, dv) in the inputs' dtypes, recomputing the probabilities from `lse`."""
    B, H, S, D = q.shape
    cd = compute_dtype(q.dtype)
    blk, nb = plan.block, plan.num_blocks
    qs3 = (q.to(cd) * scale).reshape(B, H * nb, blk * D)
    k3 = k.to(cd).reshape(B, H * nb, blk * D)
    v3 = v.to(cd).reshape(B, H * nb, blk * D)
    do3 = dout.to(cd).reshape(B, H * nb, blk * D)
    delta = (dout.to(cd) * out.to(cd)).sum(-1).view(B, H * nb, blk)
    lse3 = lse.to(cd).view(B, H * nb, blk)
    dq = torch.zeros(B, H * nb, blk * D, dtype=cd, device=q.device)
    dk = torch.zeros_like(dq)
    dv = torch.zeros_like(dq)
    for b in _batch_slices(plan, B):
        Bs = b.stop - b.start
        ws = _Workspace(plan, Bs, D, cd, q.device, backward=True)
        kb, ab = _slice_bias(key_bias, b), _slice_bias(attn_bias, b)
        for ch in plan.chunks:
            R, C = ch.num_rows, ch.width
            s, q_rows, k_cols = _scores(ch, plan, qs3[b], k3[b], kb, ab, ws, D)
            p = s.sub_(lse3[b].index_select(1, ch.q_index).view(Bs * R, blk, 1)).exp_()
            do_rows = torch.index_select(do3[b], 1, ch.q_index, out=ws.view(ws.do, Bs, R, blk * D))
            do_rows = do_rows.view(Bs * R, blk, D)
            v_cols = torch.index_select(v3[b], 1, ch.kv_index, out=ws.view(ws.v, Bs, R * C, blk * D))
            dkv = ws.view(ws.dkv, Bs * R, C * blk, D)
            torch.bmm(p.transpose(1, 2), do_rows, out=dkv)
            dv[b].index_add_(1, ch.kv_index, dkv.view(Bs, R * C, blk * D))
            ds = torch.bmm(do_rows, v_cols.view(Bs * R, C * blk, D).transpose(1, 2),
                           out=ws.view(ws.dp, Bs * R, blk, C * blk))
            ds.sub_(delta[b].index_select(1, ch.q_index).view(Bs * R, blk, 1)).mul_(p)
            dq_rows = torch.bmm(ds, k_cols.view(Bs * R, C * blk, D), out=ws.view(ws.o, Bs * R, blk, D))
            dq[b].index_copy_(1, ch.q_index, dq_rows.view(Bs, R, blk * D))
            torch.bmm(ds.transpose(1, 2), q_rows.view(Bs * R, blk, D), out=dkv)
            dk[b].index_add_(1, ch.kv_index, dkv.view(Bs, R * C, blk * D))
    shape = (B, H, S, D)
    return (dq.mul_(scale).view(shape).to(q.dtype), dk.view(shape).to(k.dtype), dv.view(shape).to(v.dtype))
