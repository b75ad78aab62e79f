"""The autotuner's search space: candidates, what is left out and why, and overrides that reproduce a layout."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from fspeed.autotune.space import (
    Candidate, ModelFacts, SearchSpace, Skipped, enumerate_candidates, parse_remat,
)
from fspeed.config.compose import compose_run_config

BASE = ("model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.seq_len=32", "train.train_batch_size=16",
        "train.micro_batch_size=4",
        # values a candidate must override, whatever the base says
        "zero.overlap_comm=true", "zero.reduce_bucket_size=1000", "activation_checkpointing.policy=full",
        "activation_checkpointing.every=2", "zero.offload_optimizer.pin_memory=false")
CUTTABLE = ModelFacts(layers=4, tensor_rules=True, heads=2)

# the keys a candidate sets; everything else must stay as the base has it
CANDIDATE_KEYS = {
    "zero.stage", "zero.offload_optimizer.device", "zero.offload_param.device", "zero.overlap_comm",
    "zero.reduce_bucket_size", "zero.allgather_bucket_size", "train.train_batch_size", "train.micro_batch_size",
    "train.grad_accum", "parallel.data", "parallel.tensor", "parallel.pipe", "activation_checkpointing.policy",
    "activation_checkpointing.every", "activation_checkpointing.budget_mib", "pipeline.micro_batches",
    "pipeline.schedule", "pipeline.virtual_stages", "pipeline.activation_checkpoint_interval", "dp_world_size",
    "batch",
}


@functools.cache
def base_run():
    return compose_run_config(overrides=list(BASE))[0]


def flat(config, prefix=""):
    """{dotted key: value} of a config's leaves (sections recursed)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and f.name != "batch":
            out.update(flat(value, key + "."))
        else:
            out[key] = value
    return out


def varied_candidates():
    """A spread of valid layouts: every stage, remat form, offload, tensor, pipeline schedule and slow knob."""
    space = SearchSpace(remat=("none", "save_matmuls:2", "full", "budget:64"), micro_batch=(2, 4), slow=True,
                        overlap_comm=(None, True), reduce_bucket_size=(1000,), allgather_bucket_size=(2000,),
                        schedule=("1f1b", "gpipe", "zero_bubble", "interleaved_1f1b"))
    found = enumerate_candidates(space, base_run(), 2, CUTTABLE)
    picked, seen = [], set()
    for c in found.candidates:
        key = (c.zero_stage, c.remat, c.offload_optimizer, c.offload_param, c.tensor, c.pipe, c.schedule)
        if key not in seen:
            seen.add(key)
            picked.append(c)
    return picked


def test_overrides_composed_by_fspeed_reproduce_every_field_of_the_layout():
    base = base_run()
    candidates = varied_candidates()
    assert {c.pipe for c in candidates} == {1, 2} and {c.tensor for c in candidates} == {1, 2}
    assert {c.remat for c in candidates} == {"none", "save_matmuls", "full", "budget"}
    assert any(c.offload_param for c in candidates) and any(c.schedule == "interleaved_1f1b" for c in candidates)
    for c in candidates[::4]:  # each composition costs ~0.15 s
        composed, _ = compose_run_config(overrides=[*BASE, *c.to_overrides()], dp_world_size=c.data)
        assert composed == c.apply_to(base), c.label()
        assert Candidate.from_run_config(composed) == c
        changed = {k for k, v in flat(composed).items() if flat(base)[k] != v}
        assert changed <= CANDIDATE_KEYS, f"{c.label()} changed {sorted(changed - CANDIDATE_KEYS)}"


def test_apply_to_changes_only_the_layout_keys_and_reads_back():
    base = base_run()
    for c in varied_candidates():
        run = c.apply_to(base)
        assert Candidate.from_run_config(run) == c
        assert run.batch.train_batch_size == 16 == c.global_batch
        changed = {k for k, v in flat(run).items() if flat(base)[k] != v}
        assert changed <= CANDIDATE_KEYS


def test_every_candidate_keeps_the_global_batch_and_divides_the_world():
    found = enumerate_candidates(SearchSpace(), base_run(), 2, CUTTABLE)
    assert found.candidates
    for c in found.candidates:
        assert c.global_batch == 16 and c.world == 2 and c.micro_batch * c.grad_accum * c.data == 16
    micro = {c.micro_batch for c in found.candidates if c.data == 2}
    assert micro == {1, 2, 4, 8}
    assert len(set(found.candidates)) == len(found.candidates)
    assert not set(found.candidates) & {s.candidate for s in found.skipped}


def test_values_fspeed_refuses_are_skipped_with_the_reason_never_tried():
    found = enumerate_candidates(SearchSpace(), base_run(), 2, CUTTABLE)
    reasons = {s.candidate: s.reason for s in found.skipped}
    zero3_pipe = [c for c in reasons if c.zero_stage == 3 and c.pipe == 2 and c.tensor == 1 and not c.offload_param]
    assert zero3_pipe and all("pipeline stages" in reasons[c] for c in zero3_pipe)
    stage0_offload = [c for c in reasons if c.zero_stage == 0 and c.offload_optimizer and not c.offload_param
                      and c.tensor == 1 and c.pipe == 1]
    assert stage0_offload and all("offload_optimizer" in reasons[c] for c in stage0_offload)
    assert not any(c.zero_stage == 3 and c.pipe > 1 for c in found.candidates)
    assert not any(c.zero_stage == 0 and c.offload_optimizer for c in found.candidates)


def test_a_model_that_cannot_be_cut_or_sliced_gets_no_pipeline_or_tensor_candidate():
    facts = ModelFacts(layers=None, cut_reason="its forward cannot be traced", tensor_rules=False,
                       tensor_reason="no tp_plan")
    found = enumerate_candidates(SearchSpace(), base_run(), 2, facts)
    assert all(c.pipe == 1 and c.tensor == 1 for c in found.candidates)
    pipes = [s for s in found.skipped if s.candidate.pipe == 2 and s.candidate.tensor == 1]
    tensors = [s for s in found.skipped if s.candidate.tensor == 2 and s.candidate.pipe == 1]
    assert pipes and all("cannot be traced" in s.reason for s in pipes)
    assert tensors and all("no tp_plan" in s.reason for s in tensors)
    odd_heads = enumerate_candidates(SearchSpace(tensor=(2,), pipe=(1,)), base_run(), 2,
                                     ModelFacts(layers=4, tensor_rules=True, heads=3))
    assert not odd_heads.candidates and all("3 attention heads" in s.reason for s in odd_heads.skipped)
    too_few_layers = enumerate_candidates(SearchSpace(pipe=(2,), tensor=(1,), zero_stage=(0,)), base_run(), 2,
                                          ModelFacts(layers=1))
    assert not too_few_layers.candidates and "1 layers" in too_few_layers.skipped[0].reason


def test_a_micro_batch_that_does_not_divide_the_global_batch_is_skipped():
    found = enumerate_candidates(SearchSpace(micro_batch=(3, 4), zero_stage=(0,), remat=("none",),
                                             tensor=(1,), pipe=(1,), offload_optimizer=(False,),
                                             offload_param=(False,)), base_run(), 2, CUTTABLE)
    assert [c.micro_batch for c in found.candidates] == [4]
    assert [s.candidate.micro_batch for s in found.skipped] == [3]
    assert "does not divide the global batch 16" in found.skipped[0].reason


def test_interleaved_needs_micro_batches_a_multiple_of_the_stages():
    found = enumerate_candidates(SearchSpace(pipe=(2,), tensor=(1,), zero_stage=(0,), remat=("none",),
                                             schedule=("interleaved_1f1b",), micro_batch=(16,)),
                                 base_run(), 2, CUTTABLE)
    assert not found.candidates  # 16 per micro-batch on 1 data rank: 1 micro-batch for 2 stages
    assert "multiple of stages" in found.skipped[0].reason


def test_restricted_and_fixed_axes():
    space = SearchSpace(zero_stage=(1, 2), remat=("full:2",), offload_optimizer=(False,), offload_param=(False,),
                        tensor=(1,), pipe=(1,))
    found = enumerate_candidates(space, base_run(), 2, CUTTABLE)
    assert {c.zero_stage for c in found.candidates} == {1, 2}
    assert {(c.remat, c.remat_every) for c in found.candidates} == {("full", 2)}
    fixed = enumerate_candidates(dataclasses.replace(space, zero_stage=2, micro_batch=[2]), base_run(), 2, CUTTABLE)
    assert [c.label() for c in fixed.candidates] == ["z2 mb2x4 dp2 remat=full:2 overlap=on"]  # the base's overlap_comm


def test_without_a_global_batch_micro_batch_and_accumulation_vary_freely():
    base = compose_run_config(overrides=["train.micro_batch_size=2"])[0]
    found = enumerate_candidates(SearchSpace(zero_stage=(0,), remat=("none",), tensor=(1,), pipe=(1,),
                                             grad_accum=(1, 2)), base, 2, CUTTABLE)
    assert {(c.micro_batch, c.grad_accum) for c in found.candidates} == {(m, a) for m in (1, 2, 4, 8) for a in (1, 2)}


@pytest.mark.parametrize("space, message", [
    (dict(zero_stage=(4,)), "autotune.space.zero_stage: 4"),
    (dict(micro_batch=(0,)), "autotune.space.micro_batch: 0"),
    (dict(remat=("sometimes",)), "autotune.space.remat: 'sometimes'"),
    (dict(schedule=("pipedream",)), "autotune.space.schedule"),
    (dict(zero_stage=()), "autotune.space.zero_stage: an empty list"),
    (dict(offload_optimizer=("yes",)), "autotune.space.offload_optimizer"),
    (dict(overlap_comm=(True,)), "autotune.space.overlap_comm is searched in the slow mode only"),
    (dict(reduce_bucket_size=(1000,)), "autotune.space.reduce_bucket_size is searched in the slow mode only"),
    (dict(virtual_stages=(2,)), "autotune.space.virtual_stages applies to the schedule interleaved_1f1b"),
])
def test_bad_space_values_are_one_clear_error(space, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SearchSpace(**space)


def test_accumulation_steps_are_not_an_axis_at_a_fixed_global_batch():
    with pytest.raises(ValueError, match="autotune.space.grad_accum: the global batch is fixed"):
        enumerate_candidates(SearchSpace(grad_accum=(2,)), base_run(), 2, CUTTABLE)


def test_remat_axis_spelling():
    assert parse_remat("none") == ("none", 1, None)
    assert parse_remat("full:3") == ("full", 3, None)
    assert parse_remat("budget:512") == ("budget", 1, 512.0)
    for bad in ("none:2", "full:0", "budget", "budget:-1", "full:x"):
        with pytest.raises(ValueError, match="allowed: none, save_matmuls, full"):
            parse_remat(bad)
    c = Candidate(2, 4, 2, data=2, remat="budget", remat_budget_mib=64.0, offload_optimizer=True)
    assert c.remat_label() == "budget:64" and c.label() == "z2 mb4x2 dp2 remat=budget:64 offload=opt"
    assert {c: 1}[Candidate(2, 4, 2, data=2, remat="budget", remat_budget_mib=64.0, offload_optimizer=True)] == 1
    assert isinstance(Skipped(c, "why"), Skipped)
