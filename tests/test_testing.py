"""fspeed.testing: the equivalence harness users prove their own models with, and its strategies."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from torch import nn

import fspeed as fs
from fspeed.testing import assert_trains_like_one_process, meshes, plans
from tests.hf_families import tiny_causal_lm
from tests.hf_models import cnn_batch, cnn_loss, hf_gpt2, hf_llama_layers, lm_batch, lm_loss, small_cnn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@settings(max_examples=4, deadline=None)
@given(plan=plans())
def test_a_hugging_face_gpt2_trains_like_one_process_under_any_zero_plan(world2, plan):
    trained = assert_trains_like_one_process(hf_gpt2, plan, make_batch=lm_batch, loss_fn=lm_loss, world=world2,
                                             grad_accum=2, rtol=2e-4, atol=2e-4)
    assert len(trained.losses) == 3 and "transformer.h.0.attn.c_attn.weight" in trained.params


def test_a_batchnorm_cnn_with_accumulation_trains_like_one_process(world2):
    assert_trains_like_one_process(small_cnn, fs.zero(3, param_persistence_threshold=0), make_batch=cnn_batch,
                                   loss_fn=cnn_loss, world=world2, grad_accum=2)


# -- Hugging Face families under tensor slicing, a pipeline and ZeRO-3, with the default checks -----

def qwen2():
    return tiny_causal_lm("qwen2")


def gemma():
    return tiny_causal_lm("gemma")


def llama_layers():
    return hf_llama_layers(tied=False)


def test_qwen2_under_zero1_and_tensor_slicing_trains_like_one_process(world2):
    """Adam turns the rounding of a sliced reduction into lr-sized moves of the entries whose gradient
    is near zero (the key biases'): the default comparison passes the correct plan all the same, and
    its gradients are the one process's."""
    plan = fs.zero(1) | fs.tensor_slicing(fs.models.module_tp_rules)
    trained = assert_trains_like_one_process(qwen2, plan, make_batch=lm_batch, loss_fn=lm_loss, tp_plan="auto",
                                             world=world2, tensor=2)
    assert len(trained.losses) == 3 and len(trained.sgd_losses) == 4
    assert float(trained.gradients["model.layers.0.mlp.down_proj.weight"].abs().max()) > 0


def test_gemma_under_tensor_slicing_trains_like_one_process(world2):
    plan = fs.zero(0) | fs.tensor_slicing(fs.models.module_tp_rules)
    assert_trains_like_one_process(gemma, plan, make_batch=lm_batch, loss_fn=lm_loss, tp_plan="auto", world=world2,
                                   tensor=2)


def test_a_llama_pipelined_over_2_stages_trains_like_one_process(world2):
    assert_trains_like_one_process(llama_layers, fs.zero(1) | fs.pipeline(2, "1f1b"), make_batch=lm_batch,
                                   world=world2, pipe=2)


def test_a_gpt2_under_zero3_trains_like_one_process(world2):
    assert_trains_like_one_process(hf_gpt2, fs.zero(3, param_persistence_threshold=0), make_batch=lm_batch,
                                   loss_fn=lm_loss, world=world2)


# -- what the harness must catch ------------------------------------------------------------------

def seeded_by_rank():
    """A model whose initial weights differ on every rank (a bug the harness must catch)."""
    torch.manual_seed(torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
    return torch.nn.Linear(4, 2)


def linear_batch(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)


def mse(out, batch):
    return torch.nn.functional.mse_loss(out, batch[1])


class NormedMLP(nn.Module):
    """up - layer norm (no weight) - down: slicing `up` by columns leaves each tensor rank
    normalizing its own half of the features, a different function (a wrong tp_plan fspeed cannot
    see: no parameter it keeps whole gets different gradients on the ranks)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 16), nn.Linear(16, 2)

    def forward(self, x):
        h = self.up(x)
        return self.down(torch.relu(nn.functional.layer_norm(h, h.shape[-1:])))


def normed_mlp():
    torch.manual_seed(0)
    return NormedMLP()


def mse_scaled_on_rank_1(out, batch):
    """A loss 0.1% larger on rank 1 (a bug the harness must catch)."""
    scale = 1.001 if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1 else 1.0
    return scale * mse(out, batch)


def normalized_by_its_slice():
    """A step of 1e-2 along the gradient divided by the norm of the gradient it is given, declared
    elementwise: on a ZeRO partition that norm is the partition's (an optimizer bug the harness
    must catch, with the gradients right)."""
    def update(grads, state, params=None):
        norm = fs.optim.global_norm(grads)
        return fs.pytree.tree_map(lambda g: g * (-1e-2 / norm), grads), state

    return fs.optim.GradientTransformation(lambda params: fs.optim.EmptyState(), update,
                                           info=fs.optim.TransformInfo("normalized", {}),
                                           capabilities=fs.optim.ELEMENTWISE)


def test_the_harness_catches_ranks_that_disagree(world2):
    with pytest.raises(AssertionError, match="differs from the one-process run|disagree"):
        assert_trains_like_one_process(seeded_by_rank, fs.zero(0), make_batch=linear_batch, loss_fn=mse,
                                       world=world2)


def test_the_harness_catches_a_tp_plan_that_changes_the_function(world2):
    plan = fs.zero(1) | fs.tensor_slicing(fs.models.module_tp_rules)
    with pytest.raises(AssertionError) as caught:
        assert_trains_like_one_process(normed_mlp, plan, make_batch=linear_batch, loss_fn=mse, world=world2, tensor=2,
                                       tp_plan={"up": "colwise", "down": "rowwise"}, steps=2)
    message = str(caught.value)
    assert "gradients: 'up." in message and "at the first step" in message and "loss: step 1 of the SGD run" in message


def test_the_harness_catches_a_loss_scaled_on_one_rank(world2):
    with pytest.raises(AssertionError, match=r"(?s)gradients: .* differs at the first step by .*loss: step 1"):
        assert_trains_like_one_process(normed_mlp, fs.zero(2), make_batch=linear_batch, loss_fn=mse_scaled_on_rank_1,
                                       world=world2, steps=2)


def test_the_harness_catches_an_optimizer_wrong_on_a_partition(world2):
    """The gradients and the SGD trajectory agree; the optimizer's trajectory is named."""
    with pytest.raises(AssertionError) as caught:
        assert_trains_like_one_process(normed_mlp, fs.zero(1), make_batch=linear_batch, loss_fn=mse, world=world2,
                                       optimizer=normalized_by_its_slice, steps=2)
    message = str(caught.value)
    assert "optimizer trajectory (normalized" in message and "after step 1" in message
    assert "gradients:" not in message and "SGD trajectory" not in message


# -- the world ------------------------------------------------------------------------------------

def test_an_unpicklable_task_is_named_at_once(world2):
    with pytest.raises(TypeError, match="'<lambda>' or its arguments cannot be sent"):
        world2.run(lambda: 1)
    assert world2.run(sum, [1, 2]) == [3, 3]  # the world still works


def test_a_script_without_a_main_guard_gets_one_clear_error(tmp_path):
    """The spawn start method imports the main script again in every rank: each rank stops quietly
    and the script's own process says what to do, once (not a bootstrapping traceback per rank)."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        from fspeed.testing import GlooWorld

        world = GlooWorld(2)
        print(world.run(sum, [1, 2]))
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert output.count('if __name__ == "__main__":') == 1 and "spawn" in output and str(script) in output
    assert "bootstrapping phase" not in output and "Traceback" in output


@given(data_only=meshes(4), any_mesh=meshes(4, tensor=True), plan=plans(stages=(3,)))
def test_strategies_draw_valid_meshes_and_plans(data_only, any_mesh, plan):
    assert data_only == (4, 1) and any_mesh in {(4, 1), (2, 2), (1, 4)}
    assert plan.find("zero").config.stage == 3
