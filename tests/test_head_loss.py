"""The fused norm + head + cross-entropy (`ops.head_loss`): loss and gradients against the separate
torch ops (hypothesis over shapes, chunking, ignored targets, dtypes), what it keeps for backward,
the vocab-sliced version on 2 gloo ranks, and the GPT that uses it."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed as fs
from fspeed.remat_budget import bytes_kept_for_backward
from fspeed.models.head_loss import head_loss
from tests.fresh_process import in_fresh_process


def layer_norm(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)


def separate(x, w, targets, weight, bias):
    logits = F.linear(layer_norm(x, weight, bias), w)
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def case(rows, seq, d, vocab, seed, dtype, ignored):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, seq, d, generator=g).to(dtype)
    w = (torch.randn(vocab, d, generator=g) * 0.5).to(dtype)
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    bias = (0.1 * torch.randn(d, generator=g)).to(dtype)
    targets = torch.randint(0, vocab, (rows, seq), generator=g)
    targets[torch.rand(rows, seq, generator=g) < ignored] = -100
    targets.view(-1)[0] = 0  # at least one counted position
    return [t.requires_grad_() for t in (x, w, weight, bias)], targets


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 3), seq=st.integers(1, 9), d=st.integers(4, 12), vocab=st.integers(2, 40),
       chunk=st.integers(1, 30), seed=st.integers(0, 99), ignored=st.sampled_from([0.0, 0.3]),
       scale=st.sampled_from([1.0, 0.375, 1024.0]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_head_loss_equals_the_separate_ops(rows, seq, d, vocab, chunk, seed, ignored, scale, dtype):
    """Any chunking (one position per chunk up to all in one), targets ignored (-100), a loss scale."""
    (x, w, weight, bias), targets = case(rows, seq, d, vocab, seed, dtype, ignored)
    fused = head_loss(x, w, targets, norm=layer_norm, norm_params=(weight, bias), chunk_rows=chunk)
    want = separate(x, w, targets, weight, bias)
    got_grads = torch.autograd.grad(fused * scale, (x, w, weight, bias))
    want_grads = torch.autograd.grad(want * scale, (x, w, weight, bias))
    tol = dict(rtol=1e-5, atol=1e-6 * max(1.0, scale)) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2 * scale)
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-6)
    for got, ref, name in zip(got_grads, want_grads, ("x", "w", "norm weight", "norm bias")):
        assert got.dtype == ref.dtype, name
        torch.testing.assert_close(got, ref, **tol, msg=lambda m: f"{name}: {m}")


def test_head_loss_without_gradients():
    (x, w, weight, bias), targets = case(2, 5, 8, 16, 0, torch.float32, 0.0)
    x, w = x.detach(), w.detach()
    with torch.no_grad():
        loss = head_loss(x, w, targets, norm=layer_norm, norm_params=(weight, bias), chunk_rows=3)
    assert float(loss) == pytest.approx(float(separate(x, w, targets, weight, bias).detach()), rel=1e-6)
    out = head_loss(x, w, targets)  # no norm, no parameter requiring a gradient
    assert float(out) == pytest.approx(float(F.cross_entropy(F.linear(x, w).flatten(0, 1), targets.flatten())), rel=1e-6)
    assert out.grad_fn is None  # nothing required a gradient: no graph, no gradients taken


def _fused(x, w, targets, weight, bias):
    return head_loss(x, w, targets, norm=layer_norm, norm_params=(weight, bias))


def _kept_by_fused_and_separate() -> tuple[int, int]:
    """Vocabulary 8192, width 64, 256 positions: (bytes the fused op keeps for backward, bytes the
    separate ops keep); run in a fresh process, whose malloc count no other test has moved."""
    (x, w, weight, bias), targets = case(4, 64, 64, 8192, 0, torch.float32, 0.0)
    x = x.detach()

    def run(fn):
        xi = x.clone().requires_grad_()
        return bytes_kept_for_backward(lambda: fn(xi, w, targets, weight, bias).backward())[0]
    run(_fused), run(separate)  # the first calls' one-time allocations
    return run(_fused), run(separate)


def test_head_loss_keeps_a_fraction_of_what_the_separate_ops_keep():
    """Vocabulary 8192, width 64, 256 positions: the separate ops keep the log-softmax (positions x
    vocabulary); the fused op keeps the gradients of x and of the weight (vocabulary x width)."""
    fused, whole = in_fresh_process(_kept_by_fused_and_separate)
    logits_bytes, grads_bytes = 256 * 8192 * 4, (8192 * 64 + 256 * 64) * 4
    assert whole > logits_bytes
    assert fused < grads_bytes * 1.1 < whole / 3, (fused, whole)


def _sliced_head_loss(vocab: int, chunk: int, partition: bool = False):
    """On a model=2 world: the loss and gradients with this rank's half of the vocabulary."""
    from fspeed.parallel.comm import AxisComm  # noqa: F401 (the mesh builds it)

    mesh = fs.Mesh(data=1, model=2)
    comm = mesh.comm("model")
    (x, w, weight, bias), targets = case(2, 7, 8, vocab, 3, torch.float32, 0.2)
    half = vocab // 2
    local = w.detach()[comm.rank * half:(comm.rank + 1) * half].clone().requires_grad_()
    loss = head_loss(x, local, targets, norm=layer_norm, norm_params=(weight, bias), comm=comm, chunk_rows=chunk,
                     partition=partition)
    grads = torch.autograd.grad(loss * 2.0, (x, local, weight, bias))
    return float(loss), [g.detach() for g in grads]


@pytest.mark.parametrize("chunk, partition", [(4, False), (1000, False), (4, True), (1000, True)])
def test_vocab_sliced_head_loss_equals_the_whole_one(world2, chunk, partition):
    """Also with `partition` (each rank keeps half of the x gradient: 2 x 7 x 8 = 112 values, 56 each)."""
    results = world2.run(_sliced_head_loss, 10, chunk, partition)
    (x, w, weight, bias), targets = case(2, 7, 8, 10, 3, torch.float32, 0.2)
    want = separate(x, w, targets, weight, bias)
    dx, dw, dweight, dbias = torch.autograd.grad(want * 2.0, (x, w, weight, bias))
    for rank, (loss, (gx, gw, gweight, gbias)) in enumerate(results):
        assert loss == pytest.approx(float(want.detach()), rel=1e-6)
        torch.testing.assert_close(gx, dx, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gw, dw[rank * 5:(rank + 1) * 5], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gweight, dweight, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gbias, dbias, rtol=1e-5, atol=1e-6)


def _kept_by_sliced_head(partition: bool) -> int:
    mesh = fs.Mesh(data=1, model=2)
    comm = mesh.comm("model")
    (x, w, weight, bias), targets = case(4, 256, 64, 512, 0, torch.float32, 0.0)
    local = w.detach()[comm.rank * 256:(comm.rank + 1) * 256].clone().requires_grad_()
    x = x.detach().requires_grad_()

    def run():
        loss = head_loss(x, local, targets, norm=layer_norm, norm_params=(weight, bias), comm=comm, partition=partition)
        loss.backward()
    run()
    # the fewest of three: gloo's own threads allocate now and then, and malloc's count is the process's
    return min(bytes_kept_for_backward(run)[0] for _ in range(3))


def test_a_partitioned_sliced_head_keeps_half_the_x_gradient():
    """4 x 256 x 64 fp32 x gradient (256 KiB): whole on each rank, or half of it with partition. On a
    world of its own: ranks that ran other tests would count their malloc history too."""
    from fspeed.testing import GlooWorld

    with GlooWorld(2) as world:
        whole, parts = world.run(_kept_by_sliced_head, False), world.run(_kept_by_sliced_head, True)
    dx_bytes = 4 * 256 * 64 * 4
    for w_, p_ in zip(whole, parts):
        assert w_ - p_ == pytest.approx(dx_bytes / 2, rel=0.2), (whole, parts)


def test_partition_needs_a_sliced_head():
    (x, w, weight, bias), targets = case(2, 7, 8, 10, 3, torch.float32, 0.2)
    with pytest.raises(ValueError, match="vocab-sliced head"):
        head_loss(x, w, targets, partition=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_gpt_loss_equals_the_separate_head_and_loss(precision):
    """fused_head=True: fp32 and bf16 take the fused op, fp16 the separate ops (a gradient taken at
    scale 1 would underflow there): the loss and gradients are the separate ops' either way."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model = fs.models.gpt(fs.models.GPTConfig(vocab_size=96, seq_len=12, n_layer=2, d_model=32, n_head=4,
                                              fused_head=True))
    params = fs.pytree.tree_map(lambda t: t.to(dtype).requires_grad_(),
                                model.init(torch.Generator().manual_seed(0)))
    ids = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(1))
    batch = {"inputs": ids, "targets": ids.roll(-1, 1)}
    leaves = fs.pytree.tree_leaves(params)
    got = torch.autograd.grad(model.loss(params, batch) * 8.0, leaves)
    logits = model.apply(params, ids)
    want = torch.autograd.grad(F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten()) * 8.0, leaves)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_the_gpt_fuses_its_head_with_the_loss_from_a_size_up(monkeypatch):
    """fused_head=None: the fused op from FUSED_HEAD_MIN_LOGITS logits of a micro-batch up, the separate
    ops below (faster there); True and False force it."""
    import importlib
    gpt_module = importlib.import_module("fspeed.models.gpt")
    calls = []
    monkeypatch.setattr(fs.models.ops.DenseOps, "head_loss",
                        lambda self, *a, **k: calls.append(1) or head_loss(*a, norm=k["norm"], norm_params=k["norm_params"]))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"inputs": ids, "targets": ids.roll(-1, 1)}
    for fused, threshold, expected in ((None, 2 * 12 * 96, 1), (None, 2 * 12 * 96 + 1, 0), (True, 1 << 40, 1),
                                       (False, 1, 0)):
        monkeypatch.setattr(gpt_module, "FUSED_HEAD_MIN_LOGITS", threshold)
        model = fs.models.gpt(fs.models.GPTConfig(vocab_size=96, seq_len=12, n_layer=1, d_model=16, n_head=2,
                                                  fused_head=fused))
        calls.clear()
        model.loss(model.init(torch.Generator().manual_seed(0)), batch)
        assert len(calls) == expected, (fused, threshold)


def test_head_loss_without_a_norm_takes_the_gradients_of_x_and_w():
    (x, w, _, _), targets = case(3, 5, 8, 11, 4, torch.float32, 0.2)
    got = torch.autograd.grad(head_loss(x, w, targets, chunk_rows=4) * 3.0, (x, w))
    want = torch.autograd.grad(F.cross_entropy(F.linear(x, w).flatten(0, 1), targets.flatten()) * 3.0, (x, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
