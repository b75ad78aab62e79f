"""fspeed.models.fused_ops: Hugging Face's Python tanh-GELUs compute as torch's fused kernel under
`functionalize` and `sequential` (the same function to about one ulp), the module left untouched;
`fused_ops=False` runs the module's own ops."""

import pytest
import torch
import torch.profiler as profiler
from torch import nn

import fspeed as fs
from fspeed.models.fused_ops import fused_forward
from tests.hf_models import hf_gpt2, lm_batch, lm_loss, quiet_transformers


def aten_ops(fn) -> set[str]:
    with profiler.profile(activities=[profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("name", ["NewGELUActivation", "FastGELUActivation", "AccurateGELUActivation", "BloomGelu"])
def test_each_fused_class_is_the_tanh_gelu(name):
    transformers = quiet_transformers()
    owner = transformers.models.bloom.modeling_bloom if name == "BloomGelu" else transformers.activations
    act = getattr(owner, name)()
    x = torch.linspace(-8, 8, 4001, dtype=torch.float64, requires_grad=True)
    assert fused_forward(act) is not None
    ours, theirs = torch.nn.functional.gelu(x, approximate="tanh"), act(x)
    torch.testing.assert_close(theirs, ours, rtol=1e-8, atol=1e-8)
    grads = [torch.autograd.grad(y.sum(), x)[0] for y in (theirs, ours)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-7, atol=1e-7)  # BLOOM writes its own backward


def test_functionalize_runs_the_fused_kernel_and_leaves_the_module_alone():
    module = hf_gpt2(layers=2)
    batch = lm_batch(2, 0)
    act = module.transformer.h[0].mlp.act
    fused, own = fs.functionalize(module, lm_loss), fs.functionalize(module, lm_loss, fused_ops=False)
    params = fused.init()
    ops = aten_ops(lambda: fused.loss(params, batch))
    assert "aten::gelu" in ops and "aten::tanh" not in ops
    assert "forward" not in act.__dict__  # set for the call only
    assert "aten::tanh" in aten_ops(lambda: own.loss(params, batch))
    assert "aten::tanh" in aten_ops(lambda: module(**batch))
    # the same function: loss and gradients agree to rounding
    grads = [torch.func.grad(model.loss)(params, batch) for model in (fused, own)]
    for a, b in zip(fs.pytree.tree_leaves(grads[0]), fs.pytree.tree_leaves(grads[1])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fused.loss(params, batch), own.loss(params, batch), rtol=1e-6, atol=0)


def test_sequential_layers_run_it_as_a_layer_or_inside_one():
    activations = quiet_transformers().activations
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), activations.NewGELUActivation())
    layers = [block, activations.FastGELUActivation(), nn.Linear(16, 4)]
    batch = {"inputs": torch.randn(3, 8), "targets": torch.randint(0, 4, (3,))}

    def loss_fn(y, b):
        return nn.functional.cross_entropy(y, b["targets"])
    fused = fs.models.sequential(layers, loss_fn=loss_fn)
    own = fs.models.sequential(layers, loss_fn=loss_fn, fused_ops=False)
    params = fused.init()
    ops = aten_ops(lambda: fused.loss(params, batch))
    assert "aten::gelu" in ops and "aten::tanh" not in ops
    assert "aten::gelu" not in aten_ops(lambda: own.loss(params, batch))
    torch.testing.assert_close(fused.loss(params, batch), own.loss(params, batch), rtol=1e-6, atol=0)


def test_a_subclass_or_an_instance_forward_keeps_its_own():
    activations = quiet_transformers().activations

    class Shifted(activations.NewGELUActivation):
        def forward(self, x):
            return super().forward(x) + 1

    assert fused_forward(Shifted()) is None
    hooked = activations.NewGELUActivation()
    hooked.forward = lambda x: x  # e.g. a hub kernel or a hook's wrapper, set on the instance
    assert fused_forward(hooked) is None
    assert fused_forward(nn.GELU()) is None


def test_a_class_whose_forward_was_patched_keeps_the_patch(monkeypatch):
    activations = quiet_transformers().activations
    assert fused_forward(activations.NewGELUActivation()) is not None
    monkeypatch.setattr(activations.NewGELUActivation, "forward", lambda self, x: x)  # e.g. a kernel library's
    assert fused_forward(activations.NewGELUActivation()) is None


def test_traced_layers_trace_the_fused_kernel():
    module = hf_gpt2(layers=2)
    batch = lm_batch(2, 0)
    fused = fs.models.traced_layers(module, batch)
    own = fs.models.traced_layers(module, batch, fused_ops=False)
    params = fused.init()
    fused.loss(params, batch)  # the first call traces the evaluation graph (the trace runs decompositions)
    ops = aten_ops(lambda: fused.loss(params, batch))
    assert "aten::gelu" in ops and "aten::tanh" not in ops
    own.loss(params, batch)
    assert "aten::tanh" in aten_ops(lambda: own.loss(params, batch))
    assert "forward" not in module.transformer.h[0].mlp.act.__dict__
    torch.testing.assert_close(fused.loss(params, batch), own.loss(params, batch), rtol=1e-6, atol=0)


def test_initialize_takes_fused_ops_for_a_module_and_refuses_it_for_a_model():
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    batch = lm_batch(2, 0)
    engines = {fused: fs.initialize(model=hf_gpt2(layers=2), config=config, fused_ops=fused)[0]
               for fused in (True, False)}
    ops = {fused: aten_ops(lambda e=engine: e.eval_batch(batch)) for fused, engine in engines.items()}
    assert "aten::gelu" in ops[True] and "aten::tanh" not in ops[True]
    assert "aten::tanh" in ops[False] and "aten::gelu" not in ops[False]
    with pytest.raises(ValueError, match="fused_ops=False is for nn.Modules"):
        fs.initialize(model=fs.functionalize(hf_gpt2(layers=2), lm_loss), config=config, fused_ops=False)
