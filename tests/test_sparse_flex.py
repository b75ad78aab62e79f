"""The FlexAttention backend (`backend="flex"`) against fspeed's dense-masked reference attention.

On this CPU, torch 2.13's FlexAttention runs forward only (compiled through Inductor's CPU template, or
its eager path); the backend's CPU backward is fspeed's bmm backward, so forward and gradients are
both checked. What is checked:

* the BlockMask exactly: its block tables (full and partial tiles) and its mask_mod against the layout
  expanded to tokens, at fspeed's block and at the coarser CUDA tile (random layouts, blocks, tiles);
* compiled flex forward + gradients over random layouts, sequence lengths, heads, blocks, masks
  (few examples: each new shape compiles for seconds), each checked to have run compiled;
* the same through FlexAttention's eager path over many more examples (same mask_mod semantics);
* fully masked rows, torch.func (grad, vmap), the CUDA-tile mask run on the CPU, backend selection.
"""

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch.func import grad, vmap

import fspeed.sparse as sp
from fspeed.sparse import flex_backend
from fspeed.sparse.attention import resolve_backend

flex_attention = pytest.importorskip("torch.nn.attention.flex_attention")


def _layout(g, heads: int, nb: int, density: float) -> torch.Tensor:
    return (torch.rand(heads, nb, nb, generator=g) < density).long()


def _token_mask(layout: torch.Tensor, block: int, causal: bool) -> torch.Tensor:
    """[H, S, S] bool: the layout expanded to tokens, causal cut included."""
    allowed = layout.bool().repeat_interleave(block, -2).repeat_interleave(block, -1)
    if causal:
        allowed = allowed & torch.ones(allowed.shape[-2:], dtype=torch.bool).tril()
    return allowed


@st.composite
def layouts(draw):
    block = draw(st.sampled_from([1, 2, 4, 8, 16]))
    nb = draw(st.integers(1, 9))
    H = draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    layout = _layout(g, H, nb, draw(st.floats(0.0, 1.0)))
    return layout, block, draw(st.booleans()), block * draw(st.sampled_from([1, 2, 3, 4]))


@settings(max_examples=200, deadline=None)
@given(case=layouts())
def test_block_mask_is_the_layout_exactly(case):
    """Full tiles are exactly the tiles whose every score the layout keeps (so skipping the mask_mod
    there is exact), partial tiles are the other tiles holding any kept score, and the mask_mod is the
    layout itself at token level; together they are the layout, at any tile that is a multiple of
    the block (the CUDA tile included)."""
    layout, block, causal, tile = case
    H, nb, _ = layout.shape
    S = nb * block
    plan = sp.make_plan(layout, block, causal=causal)
    bm = flex_backend.block_mask(plan, "cpu", tile=tile)
    assert bm.BLOCK_SIZE == (tile, tile) and bm.seq_lengths == (S, S)
    want = _token_mask(layout, block, causal)  # [H, S, S]
    nt = -(-S // tile)
    padded = torch.zeros(H, nt * tile, nt * tile, dtype=torch.bool)
    padded[:, :S, :S] = want
    per_tile = padded.view(H, nt, tile, nt, tile)
    want_full = per_tile.all(4).all(2)
    want_any = per_tile.any(4).any(2)

    def dense(num, idx):
        out = torch.zeros(H, nt, nt, dtype=torch.bool)
        for h in range(H):
            for r in range(nt):
                cols = idx[0, h, r, : num[0, h, r]].long()
                assert len(set(cols.tolist())) == len(cols)  # no tile listed twice
                out[h, r, cols] = True
        return out

    full = dense(bm.full_kv_num_blocks, bm.full_kv_indices)
    partial = dense(bm.kv_num_blocks, bm.kv_indices)
    assert torch.equal(full, want_full)
    assert torch.equal(partial, want_any & ~want_full)
    # the q-major tables FlexAttention's backward walks are the transposes
    assert torch.equal(dense(bm.full_q_num_blocks, bm.full_q_indices), want_full.transpose(1, 2))
    assert torch.equal(dense(bm.q_num_blocks, bm.q_indices), (want_any & ~want_full).transpose(1, 2))
    mask = flex_attention.create_mask(bm.mask_mod, 1, H, S, S, device="cpu")[0]
    assert torch.equal(mask, want)
    if causal and tile > 1:
        assert not full.diagonal(dim1=1, dim2=2).any()  # the diagonal tiles always go through the mask_mod


def test_cuda_tile_is_a_multiple_of_flex_kernel_tiles():
    assert flex_backend.tile_for(64, "cpu") == 64 and flex_backend.tile_for(16, "cpu") == 16
    assert flex_backend.tile_for(64, "cuda") == 128 and flex_backend.tile_for(16, "cuda") == 128
    assert flex_backend.tile_for(128, "cuda") == 128 and flex_backend.tile_for(256, "cuda") == 256
    assert flex_backend.tile_for(96, "cuda") == 384
    with pytest.raises(ValueError, match="tile=24 must be a multiple of the layout's block=16"):
        flex_backend.build_block_mask(np.ones((1, 2, 2), dtype=bool), 16, False, "cpu", tile=24)


def test_block_mask_is_cached_per_layout_seq_len_device_and_tile():
    layout = torch.ones(2, 4, 4)
    layout[1, 0, 3] = 0
    plan = sp.make_plan(layout, 8, causal=False)
    a = flex_backend.block_mask(plan, "cpu")
    assert flex_backend.block_mask(plan, torch.device("cpu")) is a
    assert flex_backend.block_mask(sp.make_plan(layout.clone(), 8), "cpu") is a  # same layout, another plan
    assert flex_backend.block_mask(plan, "cpu", tile=16) is not a
    assert flex_backend.block_mask(plan, "cpu", tile=16) is flex_backend.block_mask(plan, "cpu", tile=16)
    assert flex_backend.block_mask(sp.make_plan(layout, 8, causal=True), "cpu") is not a
    assert flex_backend.block_mask(sp.make_plan(layout, 4), "cpu") is not a  # another block: another seq len
    other = layout.clone()
    other[0, 2, 1] = 0
    assert flex_backend.block_mask(sp.make_plan(other, 8), "cpu") is not a


# ---------------------------------------------------------------------------------------- numbers


@st.composite
def problems(draw, blocks=(1, 2, 4, 8), max_blocks=6, dtype=torch.float64):
    block = draw(st.sampled_from(list(blocks)))
    nb = draw(st.integers(1, max_blocks))
    H = draw(st.integers(1, 3))
    B = draw(st.integers(1, 2))
    D = draw(st.sampled_from([1, 3, 8]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    layout = _layout(g, draw(st.sampled_from([1, H])), nb, draw(st.floats(0.0, 1.0)))
    S = nb * block
    q, k, v = (torch.randn(B, H, S, D, generator=g, dtype=dtype) for _ in range(3))
    kpm = None
    if draw(st.booleans()):
        kpm = torch.rand(draw(st.sampled_from([1, B])), S, generator=g) > 0.25
    am = None
    if draw(st.booleans()):
        am = torch.randn(*draw(st.sampled_from([(S, S), (H, S, S), (B, 1, S, S)])), generator=g, dtype=dtype)
    kwargs = dict(causal=draw(st.booleans()), key_padding_mask=kpm, attn_mask=am,
                  scale=draw(st.sampled_from([None, 0.3])))
    return (q, k, v), layout, kwargs


def _check_against_reference(inputs, layout, kwargs, tol):
    q, k, v = (x.clone().requires_grad_() for x in inputs)
    out = sp.attention(q, k, v, layout, backend="flex", **kwargs)
    ref = sp.reference_attention(q, k, v, layout, **kwargs)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    cot = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), cot)
    want = torch.autograd.grad(ref, (q, k, v), cot)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert torch.isfinite(out).all()


@contextlib.contextmanager
def eager_flex():
    saved, flex_backend.COMPILE = flex_backend.COMPILE, False
    try:
        yield
    finally:
        flex_backend.COMPILE = saved


@settings(max_examples=40, deadline=None)
@given(case=problems())
def test_eager_flex_forward_and_grads_equal_reference(case):
    """FlexAttention's eager path (the mask_mod over all scores), fp64: tight."""
    inputs, layout, kwargs = case
    with eager_flex():
        _check_against_reference(inputs, layout, kwargs, 1e-9)


@settings(max_examples=6, deadline=None)
@given(case=problems(blocks=(4, 8, 16), max_blocks=5, dtype=torch.float32))
def test_compiled_flex_forward_and_grads_equal_reference(case):
    """Compiled flex (Inductor's CPU template walks the block tables), fp32. Dynamo is reset first so
    each example compiles rather than falling back to eager past the recompile limit."""
    torch._dynamo.reset()
    compiled_before = counters["stats"]["unique_graphs"]
    inputs, layout, kwargs = case
    _check_against_reference(inputs, layout, kwargs, 2e-5)
    assert counters["stats"]["unique_graphs"] > compiled_before, "flex did not run compiled"


def test_cuda_tile_mask_computes_the_layout_on_the_cpu():
    """The BlockMask built at the CUDA tile (128, four 32-blocks a side, partial tiles resolved by the
    mask_mod), run by compiled flex on the CPU: the same attention as the layout (S not a multiple of 128)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    H, block, nb = 2, 32, 10
    layout = _layout(g, H, nb, 0.4)
    layout[:, :8, :4] = 1  # tiles (0, 0) and (1, 0) whole: the second is full even under the causal cut
    q, k, v = (torch.randn(1, H, nb * block, 16, generator=g) for _ in range(3))
    for causal in (False, True):
        plan = sp.make_plan(layout, block, causal=causal)
        mask = flex_backend.block_mask(plan, "cpu", tile=128)
        assert mask.BLOCK_SIZE == (128, 128) and int(mask.full_kv_num_blocks.sum()) > 0
        out = flex_backend.flex(q, k, v, mask, 16 ** -0.5)
        torch.testing.assert_close(out, sp.reference_attention(q, k, v, layout, causal=causal), rtol=2e-5, atol=2e-5)


def test_fully_masked_rows_give_zero_output_and_finite_grads():
    g = torch.Generator().manual_seed(1)
    layout = torch.ones(2, 4, 4, dtype=torch.long)
    layout[1, 2] = 0  # head 1, query block 2: no key block at all
    q, k, v = (torch.randn(2, 2, 32, 8, generator=g, requires_grad=True) for _ in range(3))
    kpm = torch.ones(2, 32, dtype=torch.bool)
    kpm[1] = False  # batch element 1: every key padded
    out = sp.attention(q, k, v, layout, key_padding_mask=kpm, backend="flex")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0, 1, 16:24], torch.zeros(8, 8))
    torch.testing.assert_close(out, sp.reference_attention(q, k, v, layout, key_padding_mask=kpm))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(x).all() for x in grads)


def test_torch_func_grad_and_vmap():
    g = torch.Generator().manual_seed(0)
    B, H, S, D = 2, 2, 32, 8
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    layout = sp.layout(sp.BigBirdConfig(num_heads=H, block=8, num_random_blocks=1, different_layout_per_head=True), S)
    kpm = torch.rand(B, S, generator=g) > 0.2

    def loss(fn, q, k, v):
        return (fn(q, k, v, layout, causal=True, key_padding_mask=kpm) ** 2).sum()

    def flex(*a, **kw):
        return sp.attention(*a, backend="flex", **kw)

    ours = grad(lambda *x: loss(flex, *x), argnums=(0, 1, 2))(q, k, v)
    want = grad(lambda *x: loss(sp.reference_attention, *x), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    qs = torch.randn(3, B, H, S, D, generator=g)
    got = vmap(lambda x: sp.attention(x, k, v, layout, backend="flex"))(qs)
    torch.testing.assert_close(got, torch.stack([sp.reference_attention(x, k, v, layout) for x in qs]),
                               rtol=2e-5, atol=2e-5)


def test_direct_path_hands_autograd_to_flex(monkeypatch):
    """Where flex has its own backward (CUDA), `attention` calls it directly; on the CPU that path is
    exercised forward-only (inputs without grad) by pretending it applies."""
    monkeypatch.setattr(flex_backend, "direct", lambda q: True)
    g = torch.Generator().manual_seed(5)
    layout = sp.layout(sp.FixedConfig(num_heads=2, block=8, num_local_blocks=2, attention="unidirectional"), 32)
    q, k, v = (torch.randn(2, 2, 32, 8, generator=g) for _ in range(3))
    am = torch.randn(32, 32, generator=g)
    kpm = torch.rand(2, 32, generator=g) > 0.3
    out = sp.attention(q, k, v, layout, causal=True, key_padding_mask=kpm, attn_mask=am, backend="flex")
    want = sp.reference_attention(q, k, v, layout, causal=True, key_padding_mask=kpm, attn_mask=am)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    with pytest.raises(NotImplementedError, match="does not differentiate through"):
        sp.attention(q, k, v, layout, attn_mask=am.requires_grad_(), backend="flex")


def test_auto_is_flex_on_cuda_and_bmm_on_cpu(monkeypatch):
    assert resolve_backend("auto", "cpu", torch.float32) == "bmm"
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "bmm"
    monkeypatch.setattr(flex_backend, "available", lambda device: True)
    assert resolve_backend("auto", "cuda", torch.bfloat16) == "flex"
    assert resolve_backend("auto", "cuda", torch.float32) == "flex"
    assert resolve_backend("auto", "cuda", torch.float64) == "bmm"
    monkeypatch.setattr(flex_backend, "available", lambda device: False)  # no Triton
    assert resolve_backend("auto", "cuda", torch.bfloat16) == "bmm"
    for name in ("flex", "bmm", "flash", "numba", "cuda"):
        assert resolve_backend(name, "cuda", torch.bfloat16) == name
    with pytest.raises(ValueError, match=r"backend='triton' is not a block-sparse attention backend; choose one of "
                                         r"'auto' .*'flex' .*'bmm' .*'flash' .*'numba' .*'cuda'"):
        resolve_backend("triton", "cuda", torch.bfloat16)


def test_flex_backend_errors_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(flex_backend, "available", lambda device: False)
    q = torch.randn(1, 1, 16, 4)
    with pytest.raises(ValueError, match="backend='flex' needs torch.nn.attention.flex_attention"):
        sp.attention(q, q, q, torch.ones(1, 2, 2), backend="flex")
