"""Block-sparse attention through the fused Numba CPU kernels (`fspeed.kernels.sparse_attention_cpu`).

fp16/bf16 inputs are computed in fp32 (numpy has no bf16); fp64 stays fp64. Tensors reach the
kernels as zero-copy numpy views. The first call of a process compiles the kernels (seconds).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fspeed.kernels import sparse_attention_cpu as kernels

from .plan import BlockPlan


def _compute(x: torch.Tensor) -> np.ndarray:
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.detach().to(dtype).contiguous().numpy()


def _bias(bias: Optional[torch.Tensor], ndim: int, dtype) -> np.ndarray:
    if bias is None:
        return np.zeros((0,) * ndim, dtype=dtype)
    return bias.detach().to(torch.float64 if dtype == np.float64 else torch.float32).contiguous().numpy()


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float,
            key_bias: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None):
    qn, kn, vn = _compute(q), _compute(k), _compute(v)
    out = np.empty_like(qn)
    lse = np.empty(qn.shape[:3], dtype=qn.dtype)
    kernels.forward(qn, kn, vn, plan.row_ptr, plan.col_idx, _bias(key_bias, 2, qn.dtype),
                    _bias(attn_bias, 4, qn.dtype), plan.causal, qn.dtype.type(scale), out, lse)
    return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, plan: BlockPlan, scale: float, key_bias: Optional[torch.Tensor] = None,
             attn_bias: Optional[torch.Tensor] = None):
    qn, kn, vn, don = _compute(q), _compute(k), _compute(v), _compute(dout)
    delta = (don * _compute(out)).sum(-1)
    lse_n = lse.detach().to(torch.float64 if qn.dtype == np.float64 else torch.float32).contiguous().numpy()
    kb, ab = _bias(key_bias, 2, qn.dtype), _bias(attn_bias, 4, qn.dtype)
    sc = qn.dtype.type(scale)
    dq, dk, dv = np.empty_like(qn), np.empty_like(qn), np.empty_like(qn)
    kernels.backward_dq(qn, kn, vn, don, lse_n, delta, plan.row_ptr, plan.col_idx, kb, ab, plan.causal, sc, dq)
    kernels.backward_dkdv(qn, kn, vn, don, lse_n, delta, plan.col_ptr, plan.row_idx, kb, ab, plan.causal, sc, dk, dv)
    return (torch.from_numpy(dq).to(q.dtype), torch.from_numpy(dk).to(k.dtype), torch.from_numpy(dv).to(v.dtype))
