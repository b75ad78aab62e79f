"""A model's loss composes with torch.func: grad, vmap, jvp, jacrev, Hessian-vector products
(jvp of grad, grad of grad) and hessian, each checked against central finite differences along random
directions, in float64, on the reference GPT, a functionalized Hugging Face GPT-2 and a plain
nn.Module (whose attention runs inside torch's own functions)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, jacrev, jvp, vmap
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

import fspeed as fs
from fspeed.models.gpt_module import GPTModule, load_params_into_module
from hf_models import hf_gpt2, lm_batch

EPS = 1e-5
TOL = dict(rtol=1e-6, atol=1e-9)


def _dot(a, b) -> torch.Tensor:
    return sum((x * y).sum() for x, y in zip(tree_leaves(a), tree_leaves(b)))


def _shifted(params, direction, eps: float):
    return tree_map(lambda p, d: p + eps * d, params, direction)


def _directional(fn, params, direction):
    """Central finite difference of `fn` (a tensor or a pytree of them) along `direction`."""
    plus, minus = fn(_shifted(params, direction, EPS)), fn(_shifted(params, direction, -EPS))
    return tree_map(lambda a, b: (a - b) / (2 * EPS), plus, minus)


def _random_like(params, seed: int):
    """A random direction of norm 1 (the difference step then stays EPS long whatever the size)."""
    g = torch.Generator().manual_seed(seed)
    direction = tree_map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params)
    norm = _dot(direction, direction).sqrt()
    return tree_map(lambda d: d / norm, direction)


def _gpt(fused_head: bool, attention: str = "dense"):
    sparse = fs.sparse.SparseAttentionConfig(mode="fixed", block=2, num_local_blocks=2) \
        if attention == "sparse" else None
    cfg = fs.models.GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=8, fused_head=fused_head,
                              attention=attention, sparse_attention=sparse)
    model = fs.models.gpt(cfg)
    params = tree_map(lambda p: (p + 0.3 * torch.randn_like(p)).double(), model.init(torch.Generator().manual_seed(0)))
    g = torch.Generator().manual_seed(1)
    batch = {"inputs": torch.randint(0, 32, (2, 8), generator=g), "targets": torch.randint(0, 32, (2, 8), generator=g)}
    return model, params, batch


class _Plain(nn.Module):
    """A plain module whose attention is torch's (`nn.TransformerEncoderLayer` calls SDPA inside
    `F.multi_head_attention_forward`)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.layer(self.inp(x), is_causal=True, src_mask=nn.Transformer.generate_square_subsequent_mask(
            x.shape[1], dtype=x.dtype)))


def _plain():
    torch.manual_seed(0)
    # (out - target)^2 written out: torch 2.13's F.mse_loss (mean) fails under jvp of grad (ZeroTensors are immutable)
    model = fs.functionalize(_Plain().double(), lambda out, batch: (out - batch[1]).pow(2).mean())
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(3, 5, 3, generator=g, dtype=torch.float64),
             torch.randn(3, 5, 2, generator=g, dtype=torch.float64))
    return model, model.init(), batch


def _hf_gpt2():
    module = hf_gpt2(layers=1).double()
    assert module.config._attn_implementation == "sdpa"  # the module calls F.scaled_dot_product_attention
    model = fs.functionalize(module, fs.causal_lm_loss)  # the output head fused with the loss
    return model, model.init(), lm_batch(3, seed=1)


CASES = {
    "gpt": functools.partial(_gpt, False),
    "gpt_fused_head": functools.partial(_gpt, True),
    "gpt_sparse": functools.partial(_gpt, False, "sparse"),
    "hf_gpt2": _hf_gpt2,
    "plain": _plain,
}


def _rows(batch, rows: slice):
    if isinstance(batch, dict):
        return {k: v[rows] for k, v in batch.items()}
    return tuple(v[rows] for v in batch)


@pytest.fixture(params=sorted(CASES))
def case(request):
    model, params, batch = CASES[request.param]()
    return request.param, model, params, batch


def test_grad_and_jvp_match_finite_differences(case):
    name, model, params, batch = case
    loss = functools.partial(model.loss, batch=batch)
    u = _random_like(params, 2)
    fd = _directional(loss, params, u)
    torch.testing.assert_close(_dot(grad(loss)(params), u), fd, **TOL)
    value, tangent = jvp(loss, (params,), (u,))
    torch.testing.assert_close(value, loss(params), rtol=1e-12, atol=0)
    torch.testing.assert_close(tangent, fd, **TOL)


def test_hessian_vector_products_match_finite_differences(case):
    name, model, params, batch = case
    loss = functools.partial(model.loss, batch=batch)
    u, v = _random_like(params, 3), _random_like(params, 4)
    fd = _dot(_directional(grad(loss), params, u), v)  # v . (H u) from the gradient's differences
    _, forward_over_reverse = jvp(grad(loss), (params,), (u,))
    reverse_over_reverse = grad(lambda p: _dot(grad(loss)(p), u))(params)
    torch.testing.assert_close(_dot(forward_over_reverse, v), fd, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(_dot(reverse_over_reverse, v), fd, rtol=1e-5, atol=1e-8)


def test_hessian_of_one_parameter_matches_finite_differences(case):
    """The full Hessian (jacfwd of jacrev) over the last parameter leaf, the others held."""
    name, model, params, batch = case
    leaves, spec = tree_flatten(params)

    def loss_of_last(w):
        return model.loss(tree_unflatten(leaves[:-1] + [w], spec), batch)

    w = leaves[-1]
    hessian = torch.func.hessian(loss_of_last)(w).reshape(w.numel(), w.numel())
    d = _random_like(w, 8)
    fd = _directional(grad(loss_of_last), w, d).reshape(-1)
    torch.testing.assert_close(hessian @ d.reshape(-1), fd, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(hessian, hessian.T, rtol=1e-7, atol=1e-10)


def test_vmap_per_example_gradients_match_finite_differences(case):
    name, model, params, batch = case

    def example_loss(p, example):
        return model.loss(p, tree_map(lambda t: t.unsqueeze(0), example))

    per_example = vmap(grad(example_loss), in_dims=(None, 0))(params, batch)
    u = _random_like(params, 5)
    for i in range(2):
        example = _rows(batch, slice(i, i + 1))
        fd = _directional(lambda p: model.loss(p, example), params, u)
        torch.testing.assert_close(_dot(tree_map(lambda g: g[i], per_example), u), fd, **TOL)


def test_jacrev_of_outputs_matches_finite_differences(case):
    name, model, params, batch = case
    inputs = {"input_ids": batch["input_ids"]} if name == "hf_gpt2" else batch[0] if name == "plain" \
        else batch["inputs"]

    def outputs(p):
        out = model.apply(p, inputs)
        out = out.logits if hasattr(out, "logits") else out
        return out[..., :3].sum(-1)  # a few outputs per position, to keep the Jacobian small

    jac = jacrev(outputs)(params)
    u = _random_like(params, 6)
    along = sum((j * d).flatten(-d.dim()).sum(-1) if d.dim() else j * d
                for j, d in zip(tree_leaves(jac), tree_leaves(u)))
    torch.testing.assert_close(along, _directional(outputs, params, u), **TOL)


def test_jvp_of_gpt_logits_equals_the_module_twin():
    """The GPT's nn.Module twin calls the same attention and agrees with it under jvp."""
    model, params, batch = _gpt(False)
    cfg = fs.models.GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=8)
    module, direction = GPTModule(cfg).double(), GPTModule(cfg).double()
    u = _random_like(params, 7)
    load_params_into_module(module, params)
    load_params_into_module(direction, u)
    _, expected = jvp(lambda p: model.apply(p, batch["inputs"]), (params,), (u,))
    _, got = jvp(lambda p: torch.func.functional_call(module, p, (batch["inputs"],)),
                 (dict(module.named_parameters()),), (dict(direction.named_parameters()),))
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_a_rematerialized_model_composes_too():
    """Under torch.func a remat model's blocks run whole (its checkpoint's saved-tensor hooks are
    refused there): the same gradient and Hessian-vector product as the model without remat."""
    model, params, batch = _gpt(False)
    plain, remat = (functools.partial(m.loss, batch=batch) for m in (model, fs.remat(model)))
    u = _random_like(params, 9)
    for fn in (grad, lambda f: lambda p: jvp(grad(f), (p,), (u,))[1]):
        for got, expected in zip(tree_leaves(fn(remat)(params)), tree_leaves(fn(plain)(params))):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_training_path_keeps_the_fused_kernels(monkeypatch):
    """Outside forward mode and nested gradients the fused SDPA kernel runs (the decomposition is
    only for the transforms that need it)."""
    model, params, batch = _gpt(False)
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    grad(functools.partial(model.loss, batch=batch))(params)
    assert len(calls) == 1  # the one block's attention
    jvp(functools.partial(model.loss, batch=batch), (params,), (params,))
    assert len(calls) == 1


def test_vocab_sliced_head_loss_refuses_forward_mode():
    from fspeed.models.head_loss import head_loss

    class _Comm:
        size, rank = 2, 0

    x, w, t = torch.randn(4, 8), torch.randn(5, 8), torch.randint(0, 5, (4,))
    with pytest.raises(NotImplementedError, match="vocabulary-sliced"):
        jvp(lambda x: head_loss(x, w, t, comm=_Comm()), (x,), (x,))
