"""Block-sparse attention on CPU: fused flash-style Numba kernels over a CSR/CSC block layout.

Arrays only (no fspeed imports). Shapes: q, k, v, out, dout [B, H, S, D] (float32 or float64,
C-contiguous); the layout as int32 CSR `row_ptr [H, nb + 1]`, `col_idx [nnz]` (key blocks of each
query block, ascending, global offsets) and CSC `col_ptr`, `row_idx` (query blocks of each key
block); `key_bias [Bk, S]` with Bk in {0, 1, B} (0 = none) and `attn_bias [Bm, Hm, S, S]` with
Bm in {0, 1, B}, Hm in {1, H}, both additive; `lse [B, H, S]`.

Scores are `q . k * scale + key_bias + attn_bias`, with keys after the query masked inside the
diagonal block when `causal` (blocks above the diagonal must already be absent from the layout).

* `forward`: one task per (batch, head, query block), run in parallel (`prange`): an online
  softmax over the row's key blocks (running max and sum, rescaled accumulator), so only one
  block x block score tile exists per task. Writes out and the log-sum-exp (+inf for a row with
  no key: its output is 0).
* `backward_dq`: per query block, recomputes the probabilities from lse, dS = P * (dP - delta),
  dQ += dS K scale.
* `backward_dkdv`: per key block (CSC), the same recomputation, dV += P^T dO, dK += dS^T Q scale.
  Splitting dQ from dK/dV means no two tasks write the same memory: no atomics, no locks.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

# fastmath without "nnan"/"ninf": masked scores are -inf and must stay so.
_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}


@njit(inline="always", fastmath=_FAST)
def _score_tile(q, k, key_bias, attn_bias, causal, scale, b, h, r, c, blk, s, kT):
    """s[i, j] = scaled, masked score of query r*blk+i against key c*blk+j."""
    D = q.shape[3]
    q0, k0 = r * blk, c * blk
    for d in range(D):
        for j in range(blk):
            kT[d, j] = k[b, h, k0 + j, d]
    for i in range(blk):
        for j in range(blk):
            s[i, j] = 0.0
        for d in range(D):
            qv = q[b, h, q0 + i, d] * scale
            for j in range(blk):
                s[i, j] += qv * kT[d, j]
    if key_bias.shape[0] > 0:
        bb = b if key_bias.shape[0] > 1 else 0
        for i in range(blk):
            for j in range(blk):
                s[i, j] += key_bias[bb, k0 + j]
    if attn_bias.shape[0] > 0:
        bb = b if attn_bias.shape[0] > 1 else 0
        hh = h if attn_bias.shape[1] > 1 else 0
        for i in range(blk):
            for j in range(blk):
                s[i, j] += attn_bias[bb, hh, q0 + i, k0 + j]
    if causal and c == r:
        for i in range(blk):
            for j in range(i + 1, blk):
                s[i, j] = -np.inf


@njit(parallel=True, fastmath=_FAST, cache=True)
def forward(q, k, v, row_ptr, col_idx, key_bias, attn_bias, causal, scale, out, lse):
    B, H, S, D = q.shape
    nb = row_ptr.shape[1] - 1
    blk = S // nb
    for task in prange(B * H * nb):
        b = task // (H * nb)
        h = (task // nb) % H
        r = task % nb
        s = np.empty((blk, blk), dtype=q.dtype)
        kT = np.empty((D, blk), dtype=q.dtype)
        acc = np.zeros((blk, D), dtype=q.dtype)
        m = np.full(blk, -np.inf, dtype=q.dtype)
        l = np.zeros(blk, dtype=q.dtype)
        for n in range(row_ptr[h, r], row_ptr[h, r + 1]):
            c = col_idx[n]
            _score_tile(q, k, key_bias, attn_bias, causal, scale, b, h, r, c, blk, s, kT)
            for i in range(blk):
                row_max = m[i]
                for j in range(blk):
                    row_max = max(row_max, s[i, j])
                if row_max == -np.inf:
                    continue  # nothing visible yet in this row
                corr = math.exp(m[i] - row_max)
                m[i] = row_max
                total = 0.0
                for j in range(blk):
                    p = math.exp(s[i, j] - row_max)
                    s[i, j] = p
                    total += p
                l[i] = l[i] * corr + total
                for d in range(D):
                    acc[i, d] *= corr
                for j in range(blk):
                    p = s[i, j]
                    for d in range(D):
                        acc[i, d] += p * v[b, h, c * blk + j, d]
        for i in range(blk):
            if l[i] > 0:
                inv = 1.0 / l[i]
                for d in range(D):
                    out[b, h, r * blk + i, d] = acc[i, d] * inv
                lse[b, h, r * blk + i] = m[i] + math.log(l[i])
            else:
                for d in range(D):
                    out[b, h, r * blk + i, d] = 0.0
                lse[b, h, r * blk + i] = np.inf


@njit(inline="always", fastmath=_FAST)
def _probs_and_dscores(q, k, v, dout, lse, delta, key_bias, attn_bias, causal, scale, b, h, r, c, blk, s, kT, dp):
    """s <- P (recomputed from lse), dp <- dS = P * (dO . v - delta) for the (r, c) block."""
    D = q.shape[3]
    _score_tile(q, k, key_bias, attn_bias, causal, scale, b, h, r, c, blk, s, kT)
    q0, k0 = r * blk, c * blk
    for i in range(blk):
        row_lse = lse[b, h, q0 + i]
        for j in range(blk):
            s[i, j] = math.exp(s[i, j] - row_lse)
    for i in range(blk):
        for j in range(blk):
            acc = 0.0
            for d in range(D):
                acc += dout[b, h, q0 + i, d] * v[b, h, k0 + j, d]
            dp[i, j] = s[i, j] * (acc - delta[b, h, q0 + i])


@njit(parallel=True, fastmath=_FAST, cache=True)
def backward_dq(q, k, v, dout, lse, delta, row_ptr, col_idx, key_bias, attn_bias, causal, scale, dq):
    B, H, S, D = q.shape
    nb = row_ptr.shape[1] - 1
    blk = S // nb
    for task in prange(B * H * nb):
        b = task // (H * nb)
        h = (task // nb) % H
        r = task % nb
        s = np.empty((blk, blk), dtype=q.dtype)
        dp = np.empty((blk, blk), dtype=q.dtype)
        kT = np.empty((D, blk), dtype=q.dtype)
        acc = np.zeros((blk, D), dtype=q.dtype)
        for n in range(row_ptr[h, r], row_ptr[h, r + 1]):
            c = col_idx[n]
            _probs_and_dscores(q, k, v, dout, lse, delta, key_bias, attn_bias, causal, scale, b, h, r, c, blk,
                               s, kT, dp)
            for i in range(blk):
                for j in range(blk):
                    g = dp[i, j]
                    for d in range(D):
                        acc[i, d] += g * k[b, h, c * blk + j, d]
        for i in range(blk):
            for d in range(D):
                dq[b, h, r * blk + i, d] = acc[i, d] * scale


@njit(parallel=True, fastmath=_FAST, cache=True)
def backward_dkdv(q, k, v, dout, lse, delta, col_ptr, row_idx, key_bias, attn_bias, causal, scale, dk, dv):
    B, H, S, D = q.shape
    nb = col_ptr.shape[1] - 1
    blk = S // nb
    for task in prange(B * H * nb):
        b = task // (H * nb)
        h = (task // nb) % H
        c = task % nb
        s = np.empty((blk, blk), dtype=q.dtype)
        dp = np.empty((blk, blk), dtype=q.dtype)
        kT = np.empty((D, blk), dtype=q.dtype)
        acc_k = np.zeros((blk, D), dtype=q.dtype)
        acc_v = np.zeros((blk, D), dtype=q.dtype)
        for n in range(col_ptr[h, c], col_ptr[h, c + 1]):
            r = row_idx[n]
            _probs_and_dscores(q, k, v, dout, lse, delta, key_bias, attn_bias, causal, scale, b, h, r, c, blk,
                               s, kT, dp)
            for i in range(blk):
                for j in range(blk):
                    p = s[i, j]
                    g = dp[i, j]
                    for d in range(D):
                        acc_v[j, d] += p * dout[b, h, r * blk + i, d]
                        acc_k[j, d] += g * q[b, h, r * blk + i, d]
        for j in range(blk):
            for d in range(D):
                dk[b, h, c * blk + j, d] = acc_k[j, d] * scale
                dv[b, h, c * blk + j, d] = acc_v[j, d]
