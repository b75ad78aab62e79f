"""Scaled dot-product attention that composes with every `torch.func` transform.

torch's fused attention kernels (flash, memory-efficient, the CPU flash kernel) have no
forward-mode rule and no double backward. `scaled_dot_product_attention` calls them in training
(plain autograd, `torch.func.grad`, `vmap`) and SDPA's math backend (the same function in
differentiable ops) while `jvp`, `jacfwd`, `hessian` or a `grad` of a `grad` is active;
`decomposed_attention()` does the same for a third-party module's own SDPA calls. Under `vmap` the
fused kernel stays: torch runs it once per example, which at 256 positions was faster than the
decomposition (80 against 102 ms for per-example gradients of 8 sequences, a 2-layer GPT).

Plain autograd's double backward (`torch.autograd.grad(..., create_graph=True)`) cannot be seen
coming when the forward runs: run that forward under `sdpa_kernel(SDPBackend.MATH)`, or use
`torch.func` (`grad` of `grad`, `jvp` of `grad`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..torch_internals import decomposed_ops_needed, sdpa_math


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, *, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, decomposed where the active transforms need it (module docstring)."""
    fn = sdpa_math if decomposed_ops_needed() else F.scaled_dot_product_attention
    return fn(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def decomposed_attention() -> contextlib.AbstractContextManager:
    """A context in which a module's own SDPA calls, direct or inside torch's functions
    (`nn.MultiheadAttention`, Hugging Face's attention), compose with the active transforms: SDPA's
    math backend only (`sdpa_kernel`, which sets torch's process-wide backend switches for the
    context); nothing is changed when no transform needs it."""
    return sdpa_kernel(SDPBackend.MATH) if decomposed_ops_needed() else contextlib.nullcontext()


__all__ = ["decomposed_attention", "scaled_dot_product_attention"]
