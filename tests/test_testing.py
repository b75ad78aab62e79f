"""fspeed.testing: the equivalence harness users prove their own models with, and its strategies."""

import pytest
import torch
from hypothesis import given, settings

import fspeed as fs
from fspeed.testing import assert_trains_like_one_process, meshes, plans
from tests.hf_models import cnn_batch, cnn_loss, hf_gpt2, lm_batch, lm_loss, small_cnn


@settings(max_examples=4, deadline=None)
@given(plan=plans())
def test_a_hugging_face_gpt2_trains_like_one_process_under_any_zero_plan(world2, plan):
    trained = assert_trains_like_one_process(hf_gpt2, plan, make_batch=lm_batch, loss_fn=lm_loss, world=world2,
                                             grad_accum=2, rtol=2e-4, atol=2e-4)
    assert len(trained.losses) == 3 and "transformer.h.0.attn.c_attn.weight" in trained.params


def test_a_batchnorm_cnn_with_accumulation_trains_like_one_process(world2):
    assert_trains_like_one_process(small_cnn, fs.zero(3, param_persistence_threshold=0), make_batch=cnn_batch,
                                   loss_fn=cnn_loss, world=world2, grad_accum=2)


def seeded_by_rank():
    """A model whose initial weights differ on every rank (a bug the harness must catch)."""
    torch.manual_seed(torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
    return torch.nn.Linear(4, 2)


def linear_batch(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)


def mse(out, batch):
    return torch.nn.functional.mse_loss(out, batch[1])


def test_an_unpicklable_task_is_named_at_once(world2):
    with pytest.raises(TypeError, match="'<lambda>' or its arguments cannot be sent"):
        world2.run(lambda: 1)
    assert world2.run(sum, [1, 2]) == [3, 3]  # the world still works


def test_the_harness_catches_ranks_that_disagree(world2):
    with pytest.raises(AssertionError, match="differs from the one-process run|disagree"):
        assert_trains_like_one_process(seeded_by_rank, fs.zero(0), make_batch=linear_batch, loss_fn=mse,
                                       world=world2)


@given(data_only=meshes(4), any_mesh=meshes(4, tensor=True), plan=plans(stages=(3,)))
def test_strategies_draw_valid_meshes_and_plans(data_only, any_mesh, plan):
    assert data_only == (4, 1) and any_mesh in {(4, 1), (2, 2), (1, 4)}
    assert plan.find("zero").config.stage == 3
