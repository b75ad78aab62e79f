"""`attention(q, k, v, layout, ...)`: differentiable block-sparse attention that composes with torch.func.

The op is a `torch.autograd.Function` with a separate `setup_context` and a `vmap` rule, so
`torch.func.grad`, `vjp`, `vmap` (and `vmap(grad(...))`) work; under forward mode (`jvp`, `jacfwd`,
`hessian`) or a `grad` of a `grad` it computes `reference_attention` instead. The forward pass computes only the
blocks in the layout and saves the output (and, for the backends that read it, the per-row
log-sum-exp); the backward pass recomputes the probabilities (flash attention's trade: no
O(nnz x block^2) tensor is kept between the passes). Masks follow DeepSpeed's softmax:
`scores * scale + key_padding_mask + attn_mask`, then a softmax over the row's present blocks; a
row with nothing left gives 0 (not NaN).

Backends (`backend=`), all computing only the layout's blocks, O(S x D + chunk) memory:
"flex" (PyTorch's FlexAttention, compiled, over one BlockMask built from the layout's block
table, `flex_backend`; on CUDA its fused Triton forward and backward, on the CPU its compiled
forward with the "bmm" backward), "bmm" (gather + bmm + in-place softmax + bmm in torch ops, any
device, `torch_blocks`), "flash" (CPU: row chunks through torch's fused CPU flash-attention
kernel, `flash_blocks`), "numba" (fused flash-style Numba CPU kernels) and "cuda" (Numba CUDA
kernels, CUDA tensors). "auto" is "flex" on CUDA tensors (fp32/fp16/bf16, where Triton is
installed) and "bmm" otherwise. On an H200 (torch 2.11, bf16, S=8192, bigbird at ~10%,
forward+backward) bmm took 17-23 ms and the Numba kernels (no tensor cores) 280-310 ms, against
2.6 ms for compiled FlexAttention over the same layout (and 1.2 ms for dense flash SDPA, which
computes every score), so CUDA goes to FlexAttention. On 2 CPU threads at S=4096,
forward+backward, bmm takes 80 ms against flash's 106 and numba's 345 (bigbird, 9% dense) and 133
against 259 and 927 (fixed, 23% dense; benchmarks/sparse_attention.py), because its bmms run at
dense flash attention's FLOP rate; flex on the CPU compiles for seconds per new shape, and its
eager path (fp64 on the CPU, or past Dynamo's recompile limit) holds O(S^2) scores, so the CPU
default stays bmm.
The plain O(S^2) definition is `reference_attention`.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from ..torch_internals import decomposed_ops_needed
from . import flash_blocks, flex_backend, torch_blocks
from .plan import BlockPlan, layout_array, make_plan

BACKENDS = ("auto", "flex", "bmm", "flash", "numba", "cuda")
_BACKEND_HELP = ("'auto' (flex on CUDA, bmm otherwise), 'flex' (FlexAttention), 'bmm' (gather + bmm, any device), "
                 "'flash' (CPU flash kernel per chunk), 'numba' (Numba CPU kernels), 'cuda' (Numba CUDA kernels)")


def check_backend(name) -> None:
    """A clear error for a backend name that is not one of BACKENDS."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not a block-sparse attention backend; choose one of {_BACKEND_HELP}")


def resolve_backend(name: str, device, dtype: torch.dtype) -> str:
    """The backend `name` runs as for tensors of `dtype` on `device`: "auto" becomes "flex" on CUDA
    (fp32/fp16/bf16, FlexAttention and Triton present) and "bmm" everywhere else."""
    check_backend(name)
    if name != "auto":
        return name
    device = torch.device(device)
    if device.type == "cuda" and flex_backend.supports(dtype) and flex_backend.available(device):
        return "flex"
    return "bmm"


def _backend_module(name: str, device: torch.device):
    if name in ("auto", "bmm"):
        return torch_blocks
    if name == "flex":
        if not flex_backend.available(device):
            raise ValueError(f"backend='flex' needs torch.nn.attention.flex_attention (torch >= 2.5) and, on CUDA, "
                             f"Triton; not available for tensors on {device}")
        return flex_backend
    if name == "flash":
        if device.type != "cpu" or not flash_blocks.available():
            raise ValueError(f"backend='flash' needs CPU tensors and torch's CPU flash-attention op "
                             f"(torch >= 2.3); got tensors on {device}")
        return flash_blocks
    if name == "numba":
        if device.type != "cpu":
            raise ValueError(f"backend='numba' runs on CPU tensors; got tensors on {device}")
        from . import numba_backend
        return numba_backend
    if name == "cuda":
        if device.type != "cuda":
            raise ValueError(f"backend='cuda' needs CUDA tensors; got tensors on {device}")
        from . import cuda_backend
        cuda_backend.require()
        return cuda_backend
    check_backend(name)
    raise ValueError(f"backend={name!r} is not a block-sparse attention backend")


def _fold_batch(n: int, in_dims, tensors, masks):
    """Fold a vmapped dim (size n) into the batch dim (dim 0) of every tensor.

    Tensors flagged in `masks` may be None or have a broadcast batch of 1; an unbatched one of
    those stays as it is, the others are widened to the full batch.
    """
    first = next(i for i, (t, d) in enumerate(zip(tensors, in_dims)) if t is not None and not masks[i])
    B = tensors[first].shape[1] if in_dims[first] is not None else tensors[first].shape[0]
    folded = []
    for x, dim, is_mask in zip(tensors, in_dims, masks):
        if x is None or (is_mask and dim is None and x.shape[0] == 1):
            folded.append(x)
            continue
        x = x.movedim(dim, 0) if dim is not None else x.expand(n, *x.shape)
        folded.append(x.expand(n, B, *x.shape[2:]).reshape(n * B, *x.shape[2:]))
    return folded, B


class BlockSparseAttention(torch.autograd.Function):
    """(q, k, v, key_bias, attn_bias) -> (out, lse); plan, scale and backend are constants."""

    @staticmethod
    def forward(q, k, v, key_bias, attn_bias, plan: BlockPlan, scale: float, backend: str):
        impl = _backend_module(backend, q.device)
        return impl.forward(q, k, v, plan, scale, key_bias, attn_bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, key_bias, attn_bias, plan, scale, backend = inputs
        out, lse = output
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
            raise NotImplementedError(
                "fspeed.sparse.attention does not differentiate through key_padding_mask or attn_mask; "
                "pass masks that do not require grad (detach them)"
            )
        ctx.save_for_backward(q, k, v, key_bias, attn_bias, out, lse)
        ctx.plan, ctx.scale, ctx.backend = plan, scale, backend
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, key_bias, attn_bias, out, lse = ctx.saved_tensors
        dq, dk, dv = BlockSparseAttentionBackward.apply(dout, q, k, v, out, lse, key_bias, attn_bias,
                                                        ctx.plan, ctx.scale, ctx.backend)
        return dq, dk, dv, None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, q, k, v, key_bias, attn_bias, plan, scale, backend):
        """Fold the vmapped dim into the batch dim: one call over N * B sequences."""
        n = info.batch_size
        (q, k, v, key_bias, attn_bias), B = _fold_batch(
            n, in_dims, (q, k, v, key_bias, attn_bias), (False, False, False, True, True))
        out, lse = BlockSparseAttention.apply(q, k, v, key_bias, attn_bias, plan, scale, backend)
        return (out.view(n, B, *out.shape[1:]), lse.view(n, B, *lse.shape[1:])), (0, 0)


class BlockSparseAttentionBackward(torch.autograd.Function):
    """The backward pass as its own Function, so kernels see plain tensors under torch.func.

    (Inside `torch.func.grad`, a Function's backward receives wrapped tensors, which Numba cannot
    read; a Function's forward always receives plain ones.) Not differentiable again.
    """

    @staticmethod
    def forward(dout, q, k, v, out, lse, key_bias, attn_bias, plan: BlockPlan, scale: float, backend: str):
        impl = _backend_module(backend, q.device)
        return impl.backward(dout.contiguous(), q, k, v, out, lse, plan, scale, key_bias, attn_bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("fspeed.sparse.attention supports first-order gradients only")

    @staticmethod
    def vmap(info, in_dims, dout, q, k, v, out, lse, key_bias, attn_bias, plan, scale, backend):
        n = info.batch_size
        tensors, B = _fold_batch(n, in_dims[:8], (dout, q, k, v, out, lse, key_bias, attn_bias),
                                 (False,) * 6 + (True, True))
        grads = BlockSparseAttentionBackward.apply(*tensors, plan, scale, backend)
        return tuple(g.view(n, B, *g.shape[1:]) for g in grads), (0, 0, 0)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype, mode: str = "add", *, name: str = "mask") -> torch.Tensor:
    """A mask as an additive bias: bool True = attend (0) / False = masked (-inf); float masks are
    added as they are (`mode="add"`) or, DeepSpeed's `"mul"` mode, 0 -> -inf and anything else -> 0."""
    if mode not in ("add", "mul"):
        raise ValueError(f"{name} mode={mode!r} must be 'add' or 'mul'")
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    if not mask.is_floating_point():
        if mode == "add":
            raise ValueError(f"{name} has dtype {mask.dtype}: an additive mask must be floating point or bool "
                             "(use mode='mul' for 0/1 integer masks)")
        mask = mask.to(dtype)
    if mode == "mul":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask == 0, float("-inf"))
    return mask.to(dtype)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a [batch, heads, seq, head_dim] tensor, got {shape}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k and v must have one shape (self-attention), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
                         f"{q.device}/{k.device}/{v.device}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Union[torch.Tensor, BlockPlan], *,
              block: Optional[int] = None, causal: bool = False, key_padding_mask: Optional[torch.Tensor] = None,
              attn_mask: Optional[torch.Tensor] = None, key_padding_mask_mode: str = "add",
              attn_mask_mode: str = "add", scale: Optional[float] = None, backend: str = "auto") -> torch.Tensor:
    """Block-sparse softmax(q k^T * scale + masks) v over the blocks of `layout`.

    backend: one of BACKENDS (see the module docstring); "auto" is "flex" on CUDA, "bmm" elsewhere.

    q, k, v: [batch, heads, seq, head_dim] (fp32, fp64, fp16 or bf16; the softmax and
    accumulation run in fp32, or fp64 for fp64). layout: [heads or 1, blocks, blocks] 0/1
    (row = query block), or a `BlockPlan` from `make_plan` to skip rebuilding the index tables each
    call. The block size is seq // blocks unless `block` is given. causal: also mask keys after
    the query (blocks above the diagonal are skipped). key_padding_mask: [batch or 1, seq], bool
    (True = a real token) or float (added; `key_padding_mask_mode="mul"` turns 0 into -inf).
    attn_mask: [seq, seq], [heads, seq, seq] or [batch, heads or 1, seq, seq], same conventions;
    only its entries inside present blocks are read. scale defaults to head_dim ** -0.5.
    """
    _check_qkv(q, k, v)
    B, H, S, D = q.shape
    plan = layout if isinstance(layout, BlockPlan) else _plan_for(layout, S, block, causal, H)
    if isinstance(layout, BlockPlan):
        if block is not None and block != plan.block:
            raise ValueError(f"block={block} disagrees with the plan's block={plan.block}")
        if causal != plan.causal:
            raise ValueError(f"causal={causal} disagrees with the plan, built with causal={plan.causal}")
    if plan.seq_len != S:
        raise ValueError(f"seq={S} but the layout covers {plan.num_blocks} blocks of {plan.block} = "
                         f"{plan.seq_len} tokens")
    if plan.num_heads != H:
        raise ValueError(f"the plan has {plan.num_heads} heads but q has {H}")
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    key_bias = attn_bias = None
    if key_padding_mask is not None:
        if key_padding_mask.dim() != 2 or key_padding_mask.shape[1] != S or key_padding_mask.shape[0] not in (1, B):
            raise ValueError(f"key_padding_mask must be [batch={B} or 1, seq={S}], got {tuple(key_padding_mask.shape)}")
        key_bias = additive_mask(key_padding_mask.to(q.device), cd, key_padding_mask_mode, name="key_padding_mask")
    if attn_mask is not None:
        attn_bias = _canonical_attn_mask(attn_mask.to(q.device), B, H, S, cd, attn_mask_mode)
    check_backend(backend)
    if decomposed_ops_needed():  # the Function has no forward-mode rule and one backward
        return reference_attention(q, k, v, plan.layout, block=plan.block, causal=plan.causal,
                                   key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                   key_padding_mask_mode=key_padding_mask_mode, attn_mask_mode=attn_mask_mode,
                                   scale=scale)
    scale = float(D ** -0.5 if scale is None else scale)
    backend = resolve_backend(backend, q.device, q.dtype)
    if backend == "flex" and flex_backend.direct(q):
        # FlexAttention's own autograd: its fused backward, nothing recomputed
        _backend_module(backend, q.device)
        if any(m is not None and m.requires_grad for m in (key_bias, attn_bias)):
            raise NotImplementedError(
                "fspeed.sparse.attention does not differentiate through key_padding_mask or attn_mask; "
                "pass masks that do not require grad (detach them)")
        return flex_backend.flex(q, k, v, flex_backend.block_mask(plan, q.device), scale, key_bias, attn_bias)
    out, _ = BlockSparseAttention.apply(q, k, v, key_bias, attn_bias, plan, scale, backend)
    return out


def _plan_for(layout: torch.Tensor, S: int, block: Optional[int], causal: bool, H: int) -> BlockPlan:
    if not isinstance(layout, torch.Tensor) or layout.dim() not in (2, 3):
        raise ValueError("layout must be a [heads, blocks, blocks] (or [blocks, blocks]) tensor or a BlockPlan")
    layout = layout_array(layout)
    if layout.ndim == 2:
        layout = layout[None]
    nb = layout.shape[-1]
    if layout.shape[0] not in (1, H):
        raise ValueError(f"layout has {layout.shape[0]} heads but q has {H}")
    if block is None:
        if S % nb:
            raise ValueError(f"seq={S} is not a multiple of the layout's {nb} blocks")
        block = S // nb
    return make_plan(np.broadcast_to(layout, (H, nb, nb)), block, causal=causal)


def _canonical_attn_mask(mask: torch.Tensor, B: int, H: int, S: int, dtype, mode: str) -> torch.Tensor:
    if mask.dim() == 2:
        mask = mask[None, None]
    elif mask.dim() == 3:
        mask = mask[None]
    if mask.dim() != 4 or mask.shape[-2:] != (S, S) or mask.shape[0] not in (1, B) or mask.shape[1] not in (1, H):
        raise ValueError(f"attn_mask must be [seq, seq], [heads, seq, seq] or [batch, heads or 1, seq, seq] with "
                         f"batch={B}, heads={H}, seq={S}; got {tuple(mask.shape)}")
    return additive_mask(mask, dtype, mode, name="attn_mask").contiguous()


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor, *,
                        block: Optional[int] = None, causal: bool = False,
                        key_padding_mask: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                        key_padding_mask_mode: str = "add", attn_mask_mode: str = "add",
                        scale: Optional[float] = None) -> torch.Tensor:
    """The plain O(seq^2) definition, in plain autograd ops: the layout expanded to a dense mask.

    Same conventions as `attention` (fully masked rows give 0). For tests and small inputs.
    """
    _check_qkv(q, k, v)
    B, H, S, D = q.shape
    if layout.dim() == 2:
        layout = layout.unsqueeze(0)
    nb = layout.shape[-1]
    block = S // nb if block is None else block
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    allowed = layout.bool().repeat_interleave(block, -2).repeat_interleave(block, -1).to(q.device)[None]
    if causal:
        allowed = allowed & torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    scores = torch.einsum("bhqd,bhkd->bhqk", q.to(cd), k.to(cd)) * (D ** -0.5 if scale is None else scale)
    if key_padding_mask is not None:
        scores = scores + additive_mask(key_padding_mask.to(q.device), cd, key_padding_mask_mode)[:, None, None, :]
    if attn_mask is not None:
        scores = scores + _canonical_attn_mask(attn_mask.to(q.device), B, H, S, cd, attn_mask_mode)
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).detach()
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(-1, keepdim=True)
    probs = weights / torch.where(denom == 0, torch.ones_like(denom), denom)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v.to(cd)).to(q.dtype)
