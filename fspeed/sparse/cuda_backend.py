"""Block-sparse attention on CUDA tensors through the Numba CUDA kernels (`fspeed.kernels.sparse_attention_cuda`).

Tensors reach the kernels zero-copy through `__cuda_array_interface__` (bf16 as its int16 bit
pattern, since numba has no bf16 array type); outputs are fp32 buffers cast back by torch.
Kernels launch on the default CUDA stream, which orders with torch's default stream (not with
other torch streams). Needs numba-cuda; `require()` names the packages when it is missing.
Opt-in (`backend="cuda"`): `backend="auto"` takes FlexAttention on CUDA tensors ("flex"). On an
H200 (torch 2.11, bf16, S=8192, bigbird ~10%, forward+backward) these kernels, scalar FMAs without
tensor cores, took 280-310 ms against 2.6 ms for compiled FlexAttention over the same layout.
"""

from __future__ import annotations

from typing import Optional

import torch

from .plan import BlockPlan

INSTALL_HINT = ('pip install "numba-cuda==0.30.4" "nvidia-cuda-nvrtc==13.0.88" '
                "(the NVRTC wheel must match the machine's CUDA 13.0 toolkit and driver)")


def available() -> bool:
    """numba-cuda importable and a GPU visible to it."""
    try:
        from numba import cuda
    except ImportError:
        return False
    try:
        return bool(cuda.is_available())
    except Exception:  # numba-cuda raises various driver errors when no driver is present
        return False


def require() -> None:
    try:
        from numba import cuda  # noqa: F401
    except ImportError as error:
        raise RuntimeError(f"backend='cuda' needs numba-cuda: {INSTALL_HINT}") from error
    if not available():
        raise RuntimeError("backend='cuda': numba-cuda cannot see a CUDA GPU (driver missing or no device)")


def _kernels():
    from fspeed.kernels import sparse_attention_cuda
    return sparse_attention_cuda


def _arr(x: Optional[torch.Tensor], ndim: int, device):
    from numba import cuda
    if x is None:
        return cuda.as_cuda_array(torch.zeros((0,) * ndim, dtype=torch.float32, device=device))
    x = x.detach()  # autograd's inputs: the kernels only read their values
    if x.dtype == torch.bfloat16:
        x = x.view(torch.int16)
    return cuda.as_cuda_array(x.contiguous())


def _tables(plan: BlockPlan, device):
    return {name: _arr(t, 1, device) for name, t in plan.device_tables(device).items()}


def _inputs(*xs: torch.Tensor):
    if xs[0].dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"backend='cuda' takes fp32, fp16 or bf16 tensors, got {xs[0].dtype}")
    return [_arr(x, 4, x.device) for x in xs]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float,
            key_bias: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None):
    kern = _kernels()
    kern.check_shapes(plan.block, q.shape[-1])
    dev = q.device
    out = torch.empty(q.shape, dtype=torch.float32, device=dev)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=dev)
    t = _tables(plan, dev)
    kern.forward(*_inputs(q, k, v), t["row_ptr"], t["col_idx"], _arr(_f32(key_bias), 2, dev),
                 _arr(_f32(attn_bias), 4, dev), plan.causal, scale, _arr(out, 4, dev), _arr(lse, 3, dev))
    return out.to(q.dtype), lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, plan: BlockPlan, scale: float, key_bias: Optional[torch.Tensor] = None,
             attn_bias: Optional[torch.Tensor] = None):
    kern = _kernels()
    dev = q.device
    delta = (dout.float() * out.float()).sum(-1)
    grads = [torch.empty(q.shape, dtype=torch.float32, device=dev) for _ in range(3)]
    t = _tables(plan, dev)
    kern.backward(*_inputs(q, k, v, dout.to(q.dtype)), _arr(lse.float(), 3, dev), _arr(delta, 3, dev),
                  t["row_ptr"], t["col_idx"], t["col_ptr"], t["row_idx"], _arr(_f32(key_bias), 2, dev),
                  _arr(_f32(attn_bias), 4, dev), plan.causal, scale, *[_arr(g, 4, dev) for g in grads])
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


def _f32(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.float()
