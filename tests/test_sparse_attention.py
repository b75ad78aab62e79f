"""The block-sparse attention op against dense attention with the layout expanded into a mask.

Forward and gradients over random layouts, sequence lengths, heads, head dims, block sizes,
causal or not, key padding and additive masks; under plain autograd, torch.func.grad, vmap and
vmap(grad). fp64 makes the comparison tight; fp32/bf16/fp16 get tolerances for their precision.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, jacrev, vmap

import fspeed.sparse as sp

TORCH_BACKENDS = ["flash", "bmm"]


@st.composite
def problems(draw):
    block = draw(st.sampled_from([1, 2, 4, 8]))
    nb = draw(st.integers(1, 6))
    H = draw(st.integers(1, 3))
    B = draw(st.integers(1, 2))
    D = draw(st.sampled_from([1, 3, 8]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    density = draw(st.floats(0.0, 1.0))
    layout = (torch.rand(draw(st.sampled_from([1, H])), nb, nb, generator=g) < density).long()
    S = nb * block
    q, k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(3))
    kpm = None
    if draw(st.booleans()):
        kpm = torch.rand(draw(st.sampled_from([1, B])), S, generator=g) > 0.25
    am = None
    if draw(st.booleans()):
        am = torch.randn(*draw(st.sampled_from([(S, S), (H, S, S), (B, 1, S, S)])), generator=g, dtype=torch.float64)
    return dict(q=q, k=k, v=v, layout=layout, causal=draw(st.booleans()), key_padding_mask=kpm, attn_mask=am,
                scale=draw(st.sampled_from([None, 0.3])))


def _split(p):
    tensors = (p["q"], p["k"], p["v"])
    kwargs = {key: p[key] for key in ("causal", "key_padding_mask", "attn_mask", "scale")}
    return tensors, kwargs


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@given(p=problems())
def test_forward_and_grads_equal_dense_masked_attention(backend, p):
    (q, k, v), kwargs = _split(p)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = sp.attention(q, k, v, p["layout"], backend=backend, **kwargs)
    _assert_same_values_and_grads(out, sp.reference_attention(q, k, v, p["layout"], **kwargs), (q, k, v))


def _assert_same_values_and_grads(out, ref, inputs):
    """fp64 outputs equal, and so are the input gradients for one random cotangent."""
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    cotangent = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, inputs, cotangent), torch.autograd.grad(ref, inputs, cotangent)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


@st.composite
def grouped_problems(draw):
    """`problems` with runs of identical layout rows (row groups) and a random chunk budget."""
    p = draw(problems())
    nb = p["layout"].shape[-1]
    p["layout"] = p["layout"].repeat_interleave(draw(st.integers(2, 4)), dim=1)[:, :nb]
    p["chunk_blocks"] = draw(st.sampled_from([1, 3, 8, 256]))
    return p


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@given(p=grouped_problems())
def test_row_groups_equal_dense_masked_attention(backend, p):
    (q, k, v), kwargs = _split(p)
    B, H, S, D = q.shape
    nb = p["layout"].shape[-1]
    plan = sp.make_plan(p["layout"].expand(H, nb, nb), S // nb, causal=p["causal"], chunk_blocks=p["chunk_blocks"])
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = sp.attention(q, k, v, plan, backend=backend, **kwargs)
    _assert_same_values_and_grads(out, sp.reference_attention(q, k, v, p["layout"], **kwargs), (q, k, v))


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_fixed_layout_windows_run_as_row_groups(backend):
    """A bidirectional fixed layout's local windows become groups (keys gathered once per window),
    split to fit the chunk budget, mixed with padded groups; the result is unchanged."""
    H, block, S, B = 2, 4, 96, 2
    layout = sp.layout(sp.FixedConfig(num_heads=H, block=block, num_local_blocks=4, num_global_blocks=1,
                                      attention="bidirectional", different_layout_per_head=True), S)
    layout[1, 8:12, 3] = 0  # narrower windows: one is padded when chunked with a wider one
    layout[1, 20:24, 3] = 0
    layout[1, 5, 3] = 0  # one row leaves its window's group
    plan = sp.make_plan(layout, block, chunk_blocks=108)
    assert any(c.group > 1 and c.num_rows > c.group and c.pad is not None for c in plan.chunks)
    assert all(c.num_rows % c.group == 0 and c.kv_index.numel() * c.group == c.num_rows * c.width
               for c in plan.chunks)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kpm = torch.rand(B, S, generator=g) > 0.2
    out = sp.attention(q, k, v, plan, key_padding_mask=kpm, backend=backend)
    _assert_same_values_and_grads(out, sp.reference_attention(q, k, v, layout, key_padding_mask=kpm), (q, k, v))


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("block", [4, 64])
def test_causal_windows_run_as_groups_of_nested_rows(backend, block):
    """Under causal masking a window's rows hold nested key sets: below block 64 they run as one
    group over the union (each row masking the rest, its diagonal block not the last slot);
    from block 64 only equal rows would be grouped. Values and gradients are unchanged."""
    H, S = 2, 12 * block
    layout = sp.layout(sp.FixedConfig(num_heads=H, block=block, num_local_blocks=4, num_global_blocks=1,
                                      attention="unidirectional"), S)
    plan = sp.make_plan(layout, block, causal=True)
    nested = [c for c in plan.chunks if c.group > 1]
    if block < 64:
        assert nested and any(c.diag_slots is not None and not c.all_diag_last for c in nested)
    else:
        assert not nested
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, H, S, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kpm = torch.rand(2, S, generator=g) > 0.2
    out = sp.attention(q, k, v, plan, causal=True, key_padding_mask=kpm, backend=backend)
    ref = sp.reference_attention(q, k, v, layout, causal=True, key_padding_mask=kpm)
    _assert_same_values_and_grads(out, ref, (q, k, v))


def test_reference_is_dense_sdpa_when_every_block_is_present():
    q, k, v = (torch.randn(2, 3, 12, 4, dtype=torch.float64) for _ in range(3))
    dense = torch.ones(3, 4, 4, dtype=torch.long)
    for causal in (False, True):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(sp.reference_attention(q, k, v, dense, causal=causal), want)
        torch.testing.assert_close(sp.attention(q, k, v, dense, causal=causal), want)
    mask = torch.rand(12, 12) > 0.3
    mask.fill_diagonal_(True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(sp.attention(q, k, v, dense, attn_mask=mask), want)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_torch_func_grad_vmap_and_jacrev(backend):
    g = torch.Generator().manual_seed(0)
    B, H, S, D = 2, 2, 16, 4
    q, k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(3))
    layout = sp.layout(sp.BigBirdConfig(num_heads=H, block=4, num_random_blocks=1, different_layout_per_head=True), S)
    kpm = torch.rand(B, S, generator=g) > 0.2

    def loss(fn, q, k, v):
        return (fn(q, k, v, layout, causal=True, key_padding_mask=kpm) ** 2).sum()

    def ours_fn(*a, **kw):
        return sp.attention(*a, backend=backend, **kw)

    ours = grad(lambda *x: loss(ours_fn, *x), argnums=(0, 1, 2))(q, k, v)
    want = grad(lambda *x: loss(sp.reference_attention, *x), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, want):
        torch.testing.assert_close(a, b)

    # vmap over an extra leading dim of q, and over a batch of key padding masks
    qs = torch.randn(3, B, H, S, D, generator=g, dtype=torch.float64)
    got = vmap(lambda x: sp.attention(x, k, v, layout, backend=backend))(qs)
    torch.testing.assert_close(got, torch.stack([sp.reference_attention(x, k, v, layout) for x in qs]))
    masks = torch.rand(3, B, S, generator=g) > 0.3
    got = vmap(lambda m: sp.attention(q, k, v, layout, key_padding_mask=m, backend=backend))(masks)
    torch.testing.assert_close(got, torch.stack([sp.reference_attention(q, k, v, layout, key_padding_mask=m)
                                                 for m in masks]))

    # per-example gradients: vmap(grad) runs the backward Function under vmap
    def one(q1, k1, v1):
        return sp.attention(q1[None], k1[None], v1[None], layout, causal=True, backend=backend).sum()

    per_example = vmap(grad(one, argnums=(0, 1, 2)))(q, k, v)
    for i in range(B):
        want = grad(lambda a, b, c: sp.reference_attention(a[None], b[None], c[None], layout, causal=True).sum(),
                    argnums=(0, 1, 2))(q[i], k[i], v[i])
        for a, b in zip(per_example, want):
            torch.testing.assert_close(a[i], b)

    small = q[:1, :1, :8]
    jac = jacrev(lambda x: sp.attention(x, k[:1, :1, :8], v[:1, :1, :8], layout[:1, :2, :2], backend=backend))(small)
    want = jacrev(lambda x: sp.reference_attention(x, k[:1, :1, :8], v[:1, :1, :8], layout[:1, :2, :2]))(small)
    torch.testing.assert_close(jac, want)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_low_precision_inputs_accumulate_in_fp32(dtype, tol, backend):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    layout = sp.layout(sp.FixedConfig(num_heads=2, block=8, num_local_blocks=2), 32)
    out = sp.attention(q, k, v, layout, causal=True, backend=backend)
    assert out.dtype == dtype
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = sp.reference_attention(q32, k32, v32, layout, causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    cot = torch.randn(out.shape, generator=g).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), cot)
    want = torch.autograd.grad(ref, (q32, k32, v32), cot.float())
    for a, b in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, rtol=4 * tol, atol=4 * tol)


@pytest.mark.parametrize("backend", TORCH_BACKENDS + ["numba"])
def test_softmax_is_stable_for_huge_scores(backend):
    """Scores near 1e4 overflow a naive exp in fp32; the log-sum-exp softmax must not."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g) for _ in range(3))
    layout = sp.layout(sp.BigBirdConfig(num_heads=2, block=8, num_random_blocks=1), 32)
    out = sp.attention(q, k, v, layout, scale=2000.0, backend=backend)
    ref = sp.reference_attention(q.double(), k.double(), v.double(), layout, scale=2000.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_bmm_backend_keeps_everything_on_the_inputs_device():
    """The plan's index tables live on the CPU; on another device (here "meta", which checks
    devices and shapes without data) every index and mask must follow the inputs there, copied
    once per device (`BlockPlan.on`) rather than on every call."""
    H, S = 2, 64
    layouts = [sp.layout(sp.BigBirdConfig(num_heads=H, block=8, num_random_blocks=1), S),
               sp.layout(sp.FixedConfig(num_heads=H, block=8, num_local_blocks=4, attention="unidirectional"), S)]
    for layout in layouts:
        plan = sp.make_plan(layout, 8, causal=True)
        q, k, v = (torch.randn(2, H, S, 8, device="meta", requires_grad=True) for _ in range(3))
        kpm = torch.ones(2, S, dtype=torch.bool, device="meta")
        am = torch.zeros(H, S, S, device="meta")
        for _ in range(2):
            out = sp.attention(q, k, v, plan, causal=True, key_padding_mask=kpm, attn_mask=am, backend="bmm")
            out.sum().backward()
        assert out.device.type == q.grad.device.type == k.grad.device.type == "meta" and q.grad.shape == q.shape
        on_meta = plan.on("meta")
        assert plan.on(torch.device("meta")) is on_meta and plan.on("cpu") is plan
        assert list(plan._copies) == ["meta"]
        tables = [t for ch in on_meta.chunks for t in vars(ch).values() if isinstance(t, torch.Tensor)]
        assert all(t.device.type == "meta" for t in tables + [on_meta.layout, on_meta.empty_rows])
        csr = plan.device_tables("meta")  # the CUDA kernels' tables: also copied once per device
        assert plan.device_tables("meta") is csr and all(t.device.type == "meta" for t in csr.values())
    assert any(ch.diag_offsets is not None for ch in plan.chunks)  # the fixed layout's nested causal groups


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_fully_masked_rows_give_zero_output_and_finite_grads(backend):
    q, k, v = (torch.randn(2, 1, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    layout = torch.tensor([[[1, 0], [0, 0]]])  # query block 1 sees nothing
    kpm = torch.ones(2, 8, dtype=torch.bool)
    kpm[1, :4] = False  # batch 1: block 0's keys are all padding too
    out = sp.attention(q, k, v, layout, key_padding_mask=kpm, backend=backend)
    assert (out[:, :, 4:] == 0).all() and (out[1] == 0).all()
    torch.testing.assert_close(out, sp.reference_attention(q, k, v, layout, key_padding_mask=kpm))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(x).all() for x in grads)


def test_plan_reuse_and_mask_modes():
    q, k, v = (torch.randn(1, 2, 16, 4, dtype=torch.float64) for _ in range(3))
    layout = sp.layout(sp.VariableConfig(num_heads=2, block=4, local_window_blocks=[1, 2]), 16)
    plan = sp.make_plan(layout, 4, causal=True)
    assert plan.nnz == int(torch.tril(layout[0]).sum() * 2) and plan.seq_len == 16
    torch.testing.assert_close(sp.attention(q, k, v, plan, causal=True), sp.attention(q, k, v, layout, causal=True))
    keep = torch.tensor([[1.0] * 14 + [0.0] * 2])
    by_mul = sp.attention(q, k, v, layout, key_padding_mask=keep, key_padding_mask_mode="mul")
    by_bool = sp.attention(q, k, v, layout, key_padding_mask=keep.bool())
    torch.testing.assert_close(by_mul, by_bool)


def test_errors_name_the_problem():
    q = torch.randn(1, 2, 16, 4)
    layout = torch.ones(2, 4, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="one shape"):
        sp.attention(q, q[:, :, :8], q, layout)
    with pytest.raises(ValueError, match=r"layout has 3 heads but q has 2"):
        sp.attention(q, q, q, torch.ones(3, 4, 4))
    with pytest.raises(ValueError, match="not a multiple of the layout's 3 blocks"):
        sp.attention(q, q, q, torch.ones(2, 3, 3))
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        sp.attention(q, q, q, layout, key_padding_mask=torch.ones(1, 15, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must be"):
        sp.attention(q, q, q, layout, attn_mask=torch.ones(2, 2, 16, 16))
    with pytest.raises(ValueError, match="backend='nope' is not a block-sparse attention backend; choose one of "
                                         r"'auto' \(flex on CUDA, bmm otherwise\), 'flex'"):
        sp.attention(q, q, q, layout, backend="nope")
    with pytest.raises(ValueError, match="backend='Flex' is not a block-sparse"):
        sp.SparseSelfAttention(sp.FixedConfig(num_heads=2, block=4), max_seq_length=16, backend="Flex")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        sp.attention(q, q, q, layout, backend="cuda")
    with pytest.raises(ValueError, match="causal=True disagrees"):
        sp.attention(q, q, q, sp.make_plan(layout, 4), causal=True)
    with pytest.raises(ValueError, match="chunk_blocks=0 must be a positive integer"):
        sp.make_plan(layout, 4, chunk_blocks=0)
    bias = torch.zeros(16, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="does not differentiate through"):
        sp.attention(q, q, q, layout, attn_mask=bias)


# --------------------------------------------------------------------------- self-attention helpers


def test_sparse_self_attention_pads_slices_and_masks_like_deepspeed():
    cfg = sp.FixedConfig(num_heads=2, block=4, num_local_blocks=2, attention="unidirectional")
    attn = sp.SparseSelfAttention(cfg, max_seq_length=32, key_padding_mask_mode="mul")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 13, 8, generator=g, dtype=torch.float64) for _ in range(3))
    keep = torch.ones(2, 13)
    keep[0, 10:] = 0
    out = attn(q, k, v, key_padding_mask=keep)
    assert out.shape == q.shape
    # DeepSpeed uses the master layout's corner, padded to 16 tokens with the pad keys masked
    corner = attn.master_layout[:, :4, :4]
    assert torch.equal(corner, sp.layout(cfg, 32)[:, :4, :4])
    padded = [F.pad(x, (0, 0, 0, 3)) for x in (q, k, v)]
    kpm = F.pad(keep, (0, 3)).bool()
    torch.testing.assert_close(out, sp.reference_attention(*padded, corner, key_padding_mask=kpm)[:, :, :13])
    with pytest.raises(ValueError, match="exceeds max_seq_length=32"):
        attn(*(torch.randn(1, 2, 33, 8) for _ in range(3)))


def test_bert_sparse_self_attention_and_padding_utils():
    g = torch.Generator().manual_seed(4)
    hidden, H, L = 8, 2, 10
    params = {n: {"weight": torch.randn(hidden, hidden, generator=g), "bias": torch.randn(hidden, generator=g)}
              for n in ("query", "key", "value")}
    x = torch.randn(3, L, hidden, generator=g)
    mask = torch.ones(3, L)
    attn = sp.SparseSelfAttention(sp.DenseConfig(num_heads=H, block=4), max_seq_length=16, key_padding_mask_mode="mul")
    got = sp.bert_sparse_self_attention(params, x, mask, attn)
    heads = [F.linear(x, params[n]["weight"], params[n]["bias"]).view(3, L, H, 4).transpose(1, 2)
             for n in ("query", "key", "value")]
    want = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(3, L, hidden)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    ids = torch.arange(10).view(2, 5)
    pad_len, ids2, mask2, types2, pos2, emb2 = sp.pad_to_block_size(
        4, input_ids=ids, attention_mask=torch.ones(2, 5), token_type_ids=torch.ones(2, 5, dtype=torch.long),
        position_ids=torch.arange(5).expand(2, 5), pad_token_id=7)
    assert pad_len == 3 and ids2.shape == (2, 8) and (ids2[:, 5:] == 7).all()
    assert (mask2[:, 5:] == 0).all() and (types2[:, 5:] == 0).all() and (pos2[:, 5:] == 7).all() and emb2 is None
    embeds = torch.randn(2, 5, 3)
    pad_len, *_, emb = sp.pad_to_block_size(4, inputs_embeds=embeds, embed=lambda i: torch.ones(*i.shape, 3))
    assert emb.shape == (2, 8, 3) and (emb[:, 5:] == 1).all()
    assert sp.unpad_sequence_output(3, torch.zeros(2, 8, 3)).shape == (2, 5, 3)
    assert sp.unpad_sequence_output(0, emb) is emb


# --------------------------------------------------------------------------- through the CLI


def test_gpt_with_sparse_attention_trains_through_fspeed_train(tmp_path):
    """model.attention=sparse with a bigbird layout: the run finishes and the loss falls."""
    import csv
    import os
    import shutil
    import subprocess
    import sys

    exe = shutil.which("fspeed-train")
    cmd = [exe] if exe else [sys.executable, "-m", "fspeed.cli.train"]
    run_dir = tmp_path / "run"
    args = ["model.attention=sparse", "sparse_attention.mode=bigbird", "sparse_attention.block=8",
            "sparse_attention.num_random_blocks=1", "model.seq_len=64", "model.n_layer=2", "model.d_model=64",
            "train.steps=30", "train.eval_every=0", "train.micro_batch_size=8", "data.max_bytes=200000",
            "optimizer.lr=3e-3", "scheduler.warmup_num_steps=5", "monitor.progress_bar=false",
            f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd + args, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HYDRA_FULL_ERROR="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "metrics.csv") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f) if r.get("loss")]
    assert len(losses) >= 20
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5, losses


def test_config_section_builds_the_model_and_deepspeed_block_translates():
    from hydra import compose, initialize_config_module

    from fspeed.config import ConfigError, to_run_config
    from fspeed.config.build import build_model_config
    from fspeed.config.deepspeed import translate_deepspeed_config

    ckpt = "checkpoint.dir=/tmp/fspeed-test-ckpt"
    with initialize_config_module("fspeed.conf", version_base=None):
        run = to_run_config(compose("train", overrides=[ckpt, "model.attention=sparse", "sparse_attention.mode=bigbird",
                                                        "sparse_attention.block=64", "model.seq_len=8192",
                                                        "sparse_attention.local_window_blocks=[2,3]"]))
        model_cfg = build_model_config(run, vocab_size=100)
        assert model_cfg.attention == "sparse"
        assert model_cfg.sparse_attention.to_sparsity_config(model_cfg.n_head) == sp.BigBirdConfig(
            num_heads=model_cfg.n_head, block=64, num_random_blocks=0)
        assert run.sparse_attention.local_window_blocks == (2, 3)
        assert build_model_config(to_run_config(compose("train", overrides=[ckpt])), 100).attention == "dense"
        with pytest.raises(ConfigError, match="num_local_blocks=3 must be divisible by num_global_blocks=2"):
            to_run_config(compose("train", overrides=[ckpt, "sparse_attention.num_local_blocks=3",
                                                      "sparse_attention.num_global_blocks=2"]))
        with pytest.raises(ConfigError, match="sparse_attention.mode"):
            to_run_config(compose("train", overrides=[ckpt, "sparse_attention.mode=strided"]))

    block = {"mode": "bslongformer", "block": 32, "global_block_indices": [0, 5], "attention": "unidirectional",
             "num_random_blocks": 3}
    done = translate_deepspeed_config({"sparse_attention": block})
    assert "model.attention=sparse" in done.overrides and "sparse_attention.mode=bslongformer" in done.overrides
    assert "sparse_attention.block=32" in done.overrides
    assert "sparse_attention.global_block_indices=[0,5]" in [o.replace(" ", "") for o in done.overrides]
    ignored = " ".join(done.no_effect)
    assert "sparse_attention.attention" in ignored and "sparse_attention.num_random_blocks" in ignored
