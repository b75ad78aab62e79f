"""Tensor slicing by Hugging Face's own tp_plan (`tp_plan="auto"`) computes what the module computes:
for families whose forwards do more than the sliced op (Gemma's scaled embedding, Qwen3's per-head
norms, Phi-3's and OLMo-2's whole-input row-parallel projections, Cohere's logit scale, Granite's
multipliers, MoE experts (Qwen3-MoE: its plan's dense-MLP entries match nothing and are
skipped), biases, fused QKV), the loss and every gradient on 2 tensor ranks equal
the module's own eager forward and backward. `benchmarks/tp_families.py` runs every family that
builds at tiny size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fspeed as fs
from tests.hf_families import eager_gradients, sliced_gradients, tiny_causal_lm

FAMILIES = ["gemma", "gemma2", "gemma3_text", "qwen3", "phi3", "olmo2", "glm", "cohere", "granite", "starcoder2",
            "gpt_neox", "codegen", "phi", "mixtral", "qwen3_moe"]


def assert_gradients_match(model_type: str, results, tensor: int) -> None:
    want_loss, want = eager_gradients(model_type)
    for loss, got, sliced in results:
        assert sliced, f"{model_type}: nothing was sliced over {tensor} ranks"
        assert loss == pytest.approx(want_loss, rel=1e-6), model_type
        for path, grad in want.items():
            torch.testing.assert_close(got[path], grad, rtol=1e-4, atol=1e-6, msg=f"{model_type}: {path}")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_family_sliced_by_its_own_plan_equals_its_eager_gradients(world2, model_type):
    assert_gradients_match(model_type, world2.run(sliced_gradients, model_type, 2), 2)


@pytest.mark.parametrize("model_type,stage", [("gemma", 1), ("qwen3", 3)])
def test_scaled_embeddings_and_per_head_norms_on_2_data_by_2_tensor_ranks(world4, model_type, stage):
    assert_gradients_match(model_type, world4.run(sliced_gradients, model_type, 2, stage=stage), 2)


class ScaledEmbedding(nn.Embedding):
    """An embedding whose forward scales its lookup (as Gemma's, BART's and M2M100's do)."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


class IndexedEmbedding(nn.Embedding):
    """An embedding that indexes its weight itself: nothing fspeed can slice."""

    def forward(self, ids):
        return self.weight[ids]


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * 0.5


class TinyLM(nn.Module):
    def __init__(self, embed: nn.Module, head: nn.Module):
        super().__init__()
        self.embed, self.up, self.down, self.head = embed, ScaledLinear(16, 32), nn.Linear(32, 16), head

    def forward(self, ids):
        return self.head(self.down(torch.relu(self.up(self.embed(ids)))))


def tiny_lm(indexed: bool = False) -> nn.Module:
    torch.manual_seed(0)
    embed = (IndexedEmbedding if indexed else ScaledEmbedding)(32, 16)
    return TinyLM(embed, nn.Linear(16, 32, bias=True))


PLAN = {"embed": "embedding_rowwise", "up": "colwise", "down": "rowwise", "head": "colwise_gather_output"}


def token_loss(logits, batch):
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def tiny_batch():
    ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(1))
    return ids, ids.roll(1, dims=1)


def sliced_tiny_lm(indexed: bool):
    module = tiny_lm(indexed)
    model = fs.functionalize(module, token_loss, tp_plan=PLAN)
    mesh = fs.Mesh(model=2)
    plan = fs.zero(0) | fs.tensor_slicing(fs.models.module_tp_rules)
    state = fs.init_train_state(model.init(), fs.optim.sgd(1.0), plan=plan, mesh=mesh, model=model)
    step = fs.make_train_step(model.loss, fs.optim.sgd(1.0), plan=plan, mesh=mesh)
    state, metrics = step(state, tiny_batch())
    return metrics["loss"]


def test_subclassed_modules_keep_their_own_computation_around_the_sliced_op(world2):
    """A scaled embedding and a scaled linear (subclasses whose forwards do more than the op) give
    the module's own loss under tensor slicing."""
    module = tiny_lm()
    with torch.no_grad():
        want = float(token_loss(module(tiny_batch()[0]), tiny_batch()))
    for loss in world2.run(sliced_tiny_lm, False):
        assert loss == pytest.approx(want, rel=1e-6)


def test_a_forward_that_uses_its_sliced_weight_otherwise_is_refused_by_name(world2):
    with pytest.raises(fs.testing.WorkerError, match=r"embed \(IndexedEmbedding\) uses its weight in"):
        world2.run(sliced_tiny_lm, True)


def test_the_fused_head_refuses_a_linear_subclass():
    class Head(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2.0

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.lm_head = nn.Embedding(8, 4), Head(4, 8, bias=False)

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids):
            return {"logits": self.lm_head(self.embed(input_ids))}

    with pytest.raises(ValueError, match="Head whose forward is not nn.Linear's own"):
        fs.functionalize(LM(), fs.causal_lm_loss)


def test_unsupported_styles_and_parameter_patterns_are_named():
    module = tiny_lm()
    with pytest.raises(ValueError, match="style 'mla_kv_a_proj' of 'up' is not supported; allowed: colwise"):
        fs.functionalize(module, token_loss, tp_plan={"up": "mla_kv_a_proj"})
    with pytest.raises(ValueError, match="names the parameter 'up.weight', not a submodule"):
        fs.functionalize(module, token_loss, tp_plan={"up.weight": "colwise"})
    with pytest.raises(ValueError, match="holds no parameters of its own"):
        fs.functionalize(nn.Sequential(nn.ReLU(), nn.Linear(2, 2)), token_loss,
                         tp_plan={"0": "replicated_with_grad_allreduce"})


def test_a_plan_that_leaves_a_per_head_norm_partial_is_refused_at_the_first_step(world2):
    """param2moe's own plan slices the heads but not the norms applied to each rank's heads: the
    first step names them and applies nothing; with them marked replicated_with_grad_allreduce,
    the gradients are the module's own."""
    with pytest.raises(fs.testing.WorkerError, match=r"q_norm.weight \(.*differ between the 2 tensor ranks.*"
                                                     r"'model.layers.\*.self_attn.q_norm': 'replicated_with_grad"):
        world2.run(sliced_gradients, "param2moe", 2)
    plan = {**fs.tp_plan_from(tiny_causal_lm("param2moe")),
            "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
            "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"}
    assert_gradients_match("param2moe", world2.run(sliced_gradients, "param2moe", 2, tp_plan=plan), 2)
