"""The reference GPT and functionalize(nn.Module) against plain PyTorch."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fspeed as fs
from fspeed.models.gpt_module import GPTModule, load_params_into_module, params_from_module


def test_gpt_matches_its_nn_module_twin_both_ways():
    torch.manual_seed(0)
    cfg = fs.models.GPTConfig(vocab_size=37, seq_len=10, n_layer=2, n_head=4, d_model=16, tie_embeddings=False)
    module = GPTModule(cfg)
    params = params_from_module(module)
    tokens = torch.randint(0, 37, (3, 10))
    torch.testing.assert_close(fs.models.gpt(cfg).apply(params, tokens), module(tokens), rtol=1e-5, atol=1e-5)
    other = fs.models.gpt(cfg).init(torch.Generator().manual_seed(1))
    load_params_into_module(module, other)
    torch.testing.assert_close(fs.models.gpt(cfg).apply(other, tokens), module(tokens), rtol=1e-5, atol=1e-5)
    batch = {"inputs": tokens, "targets": tokens.roll(1, 1)}
    assert module.loss(batch).item() == pytest.approx(float(fs.models.gpt(cfg).loss(other, batch)), rel=1e-6)


@given(n_layer=st.integers(1, 3), n_head=st.sampled_from([1, 2, 4]), tie=st.booleans(), seed=st.integers(0, 99))
def test_gpt_init_shapes_axes_and_loss(n_layer, n_head, tie, seed):
    cfg = fs.models.GPTConfig(vocab_size=29, seq_len=8, n_layer=n_layer, n_head=n_head, d_model=8, tie_embeddings=tie)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(seed))
    paths, leaves, _ = fs.tree_flatten_with_paths(params)
    assert set(paths) == set(model.logical_axes)
    for path, leaf in zip(paths, leaves):
        assert len(model.logical_axes[path]) == leaf.dim(), path
    assert ("head" in params) == (not tie)
    tokens = torch.randint(0, 29, (2, 9), generator=torch.Generator().manual_seed(seed))
    loss = model.loss(params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    assert abs(float(loss) - torch.log(torch.tensor(29.0)).item()) < 0.5  # near-uniform at init
    assert "parameters" in model.describe(params)


def test_gpt_config_errors():
    with pytest.raises(ValueError, match="divisible by n_head"):
        fs.models.GPTConfig(vocab_size=10, d_model=10, n_head=3)
    with pytest.raises(ValueError, match="vocab_size"):
        fs.models.GPTConfig(vocab_size=0)
    with pytest.raises(ValueError, match="dropout"):
        fs.models.GPTConfig(vocab_size=10, dropout=1.0)
    model = fs.models.gpt(fs.models.GPTConfig(vocab_size=10, seq_len=4, d_model=8, n_head=2, n_layer=1))
    with pytest.raises(ValueError, match="exceeds the model's seq_len=4"):
        model.apply(model.init(torch.Generator()), torch.zeros(1, 5, dtype=torch.long))


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        self.enc = nn.TransformerEncoderLayer(d_model=3, nhead=1, dim_feedforward=8, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.enc(self.net(x).unsqueeze(1)).squeeze(1)


def mse(outputs, batch):
    return F.mse_loss(outputs, batch[1])


def test_functionalize_matches_module_outputs_and_grads():
    torch.manual_seed(0)
    module = SmallNet()
    model = fs.functionalize(module, mse)
    params = model.init(torch.Generator())
    assert set(fs.tree_paths(params)) == {n for n, _ in module.named_parameters()}
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    module.eval()
    torch.testing.assert_close(model.apply(params, x, train=False), module(x))
    module.train()
    buffers = model.init_buffers()
    loss = mse(module(x), (x, y))
    loss.backward()
    # module state enters the transformed function as an input (as train_step passes the state's)
    grads = torch.func.grad(lambda p, b: model.loss(p, (x, y), buffers=b))(params, buffers)
    grads = dict(zip(fs.tree_paths(grads), fs.pytree.tree_leaves(grads)))
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(buffers["net"]["1"]["running_mean"], module.net[1].running_mean)  # updated in place


def test_functionalized_batchnorm_statistics_update_through_train_step():
    torch.manual_seed(0)
    module = SmallNet().train()
    model = fs.functionalize(module, mse)
    opt = fs.optim.sgd(0.1)
    state = fs.init_train_state(model.init(torch.Generator()), opt, model=model)
    before = module.net[1].running_mean.clone()
    state, _ = fs.make_train_step(model.loss, opt, grad_accum=2)(state, (torch.randn(8, 6), torch.randn(8, 3)))
    bn = state.buffers["net"]["1"]
    assert int(bn["num_batches_tracked"]) == 2 and not torch.equal(bn["running_mean"], before)


def test_functionalized_module_trains_like_a_plain_torch_loop():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 2))
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = [(torch.randn(16, 5), torch.randn(16, 2)) for _ in range(5)]

    model = fs.functionalize(module, mse)
    opt = fs.optim.adamw(1e-2, weight_decay=0.05)
    state = fs.init_train_state(model.init(torch.Generator()), opt)
    step = fs.make_train_step(model.loss, opt)
    for batch in data:
        state, _ = step(state, batch)

    torch_opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(initial[n])
    for x, y in data:
        torch_opt.zero_grad()
        mse(module(x), (x, y)).backward()
        torch_opt.step()
    for name, p in module.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_functionalize_errors():
    with pytest.raises(ValueError, match="no parameters"):
        fs.functionalize(nn.ReLU())
    model = fs.functionalize(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="loss_fn"):
        model.loss(model.init(torch.Generator()), (torch.zeros(1, 2), torch.zeros(1, 2)))
