"""The autotuner's memory and cost models: pruning, the orderings they must get right, the profiling pass."""

from __future__ import annotations

import functools

import pytest
import torch

from fspeed.autotune.collectives import links_from_times
from fspeed.autotune.cost_model import CommCosts, LinkCost, predict_step, zero_comm_seconds
from fspeed.autotune.memory_model import (
    budget_choice, format_bytes, parse_bytes, predict_memory, prune,
)
from fspeed.autotune.profiling import LayerCost, Profile, build_job, linear_fit, profile_job
from fspeed.autotune.space import Candidate, ModelFacts, SearchSpace, enumerate_candidates
from fspeed.config.compose import compose_run_config
from fspeed.precision import fp32
from fspeed.remat_budget import CANDIDATES as BUDGET_ORDER

TINY = ("model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.seq_len=32", "data.max_bytes=40000",
        "train.train_batch_size=16", "train.micro_batch_size=4", "zero.param_persistence_threshold=0")


@functools.cache
def tiny():
    """(base run, job, profile) of a 2-layer GPT, profiled once (every remat the tests use, both sizes)."""
    base = compose_run_config(overrides=list(TINY))[0]
    job = build_job(base)
    profile = profile_job(job, base, (1, 8), [("none", 1), ("save_matmuls", 1), ("full", 1), ("full", 2)],
                          with_layers=True, repeats=1)
    return base, job, profile


def synthetic_profile(parameters: int = 1_000_000, dispatch_s: float = 0.005, per_sample_s: float = 0.002) -> Profile:
    """A profile with known costs: a micro-batch of m rows takes dispatch + m x per_sample seconds."""
    rows = [(m, 1000 * m, dispatch_s + per_sample_s * m) for m in (1, 8)]
    layers = tuple(LayerCost(f"blocks.{i}", 0.001, 0.002, 100, 4096, parameters // 4) for i in range(4))
    return Profile(ModelFacts(layers=4, tensor_rules=True), {"w": torch.zeros(parameters)}, {}, None, fp32(), 8,
                   1e-9, remat={("none", 1): rows}, layer_costs=layers, layer_micro_batch=1)


LINKS = CommCosts({axis: {op: LinkCost(1e-4, 1e-9) for op in ("all_reduce", "all_gather", "reduce_scatter", "send")}
                   for axis in ("data", "model", "pipe")})


def test_more_accumulation_steps_of_a_smaller_micro_batch_cost_more_dispatch():
    profile = synthetic_profile(dispatch_s=0.005, per_sample_s=0.002)
    steps = {a: predict_step(Candidate(0, 16 // a, a, data=1), profile, LINKS) for a in (1, 2, 4, 16)}
    ordered = [steps[a].seconds for a in (1, 2, 4, 16)]
    assert ordered == sorted(ordered) and ordered[0] < ordered[-1]
    # the same rows every step: the difference is the dispatch paid once more per extra micro-batch
    assert steps[16].parts["compute"] - steps[1].parts["compute"] == pytest.approx(15 * 0.005)


def test_zero3_moves_more_than_zero1_at_the_same_bandwidth_and_overlap_hides_some():
    profile = synthetic_profile()
    z1, z3 = (zero_comm_seconds(Candidate(s, 4, 2, data=2, overlap_comm=False), profile, LINKS, 0.0) for s in (1, 3))
    z0 = zero_comm_seconds(Candidate(0, 4, 2, data=2), profile, LINKS, 0.0)
    assert z3 > z1 > 0 and z0 > 0
    alone = zero_comm_seconds(Candidate(3, 4, 2, data=1), profile, LINKS, 0.0)
    assert alone == 0.0  # one data rank: nothing to communicate
    hidden = zero_comm_seconds(Candidate(3, 4, 2, data=2, overlap_comm=True), profile, LINKS, backward_s=z3 / 2)
    assert hidden == pytest.approx(z3 / 2)
    slow = CommCosts({"data": {op: LinkCost(1e-4, 1e-8) for op in ("all_reduce", "all_gather", "reduce_scatter")}})
    assert zero_comm_seconds(Candidate(3, 4, 2, data=2, overlap_comm=False), profile, slow, 0.0) > z3


def test_smaller_buckets_pay_more_latency_and_offload_adds_copies():
    profile = synthetic_profile()
    profile.host_copy_s_per_byte = 1e-10
    big = predict_step(Candidate(2, 4, 2, data=2, reduce_bucket_size=10**9), profile, LINKS)
    small = predict_step(Candidate(2, 4, 2, data=2, reduce_bucket_size=1000), profile, LINKS)
    assert small.parts["zero comm"] > big.parts["zero comm"]
    offloaded = predict_step(Candidate(2, 4, 2, data=2, reduce_bucket_size=10**9, offload_optimizer=True), profile,
                             LINKS)
    assert offloaded.parts["optimizer"] > big.parts["optimizer"]


def test_zero_bubble_beats_1f1b_in_the_schedule_simulator():
    profile = synthetic_profile()
    one_f_one_b, zero_bubble = (predict_step(Candidate(0, 1, 8, data=1, pipe=2, schedule=s), profile, LINKS)
                                for s in ("1f1b", "zero_bubble"))
    assert zero_bubble.parts["compute"] < one_f_one_b.parts["compute"]


def test_linear_fit_never_shrinks_or_goes_negative():
    assert linear_fit([(1, 3.0), (3, 7.0)], 5) == pytest.approx(11.0)
    assert linear_fit([(2, 4.0)], 6) == pytest.approx(12.0)
    assert linear_fit([(1, 5.0), (8, 1.0)], 16) >= 0 and linear_fit([(1, 5.0), (8, 1.0)], 16) >= linear_fit(
        [(1, 5.0), (8, 1.0)], 1)
    assert linear_fit([(1, 0.1), (8, 8.0)], 0) >= 0


def test_collective_links_from_two_message_sizes():
    links = links_from_times({"all_reduce": [(1000, 0.0011), (1_001_000, 0.0021)]})
    assert links["all_reduce"].latency_s == pytest.approx(0.0011 - 1e-9 * 1000)
    assert links["all_reduce"].s_per_byte == pytest.approx(1e-9)


def test_profile_measures_activations_that_grow_with_the_micro_batch_and_shrink_with_remat():
    _, job, profile = tiny()
    assert job.facts.layers == 4 and job.facts.tensor_rules and job.facts.heads == 2
    for key in profile.remat:
        assert profile.activation_bytes(*key, 8) > profile.activation_bytes(*key, 1) > 0
    assert profile.activation_bytes("full", 1, 8) < profile.activation_bytes("none", 1, 8)
    assert [c.name for c in profile.layer_costs] == ["embed", "blocks.0", "blocks.1", "head"]
    assert sum(c.params for c in profile.layer_costs) >= profile.parameters  # a tied embedding counts twice
    assert profile.optimizer_state_bytes == 8 and profile.optimizer_s_per_element > 0


def test_memory_predictions_follow_zero_offload_and_micro_batch():
    base, job, profile = tiny()

    def peak(c):
        return predict_memory(c, profile, base)

    z0, z3 = peak(Candidate(0, 4, 2, data=2)), peak(Candidate(3, 4, 2, data=2))
    assert z3.estimate.device_total < z0.estimate.device_total
    on_device = peak(Candidate(2, 4, 2, data=2))
    offloaded = peak(Candidate(2, 4, 2, data=2, offload_optimizer=True))
    assert offloaded.device_bytes < on_device.device_bytes and offloaded.host_bytes > on_device.host_bytes == 0
    assert peak(Candidate(0, 8, 1, data=2)).activations > peak(Candidate(0, 2, 4, data=2)).activations
    piped = peak(Candidate(0, 2, 8, data=1, pipe=2))
    assert 0 < piped.activations and piped.estimate.parameters < profile.parameters  # the heaviest stage's
    baseline = predict_memory(Candidate(0, 4, 2, data=2), profile, base, baseline=100 << 20)
    assert baseline.peak_bytes == z0.peak_bytes + (100 << 20)


def test_pruning_with_a_synthetic_budget_keeps_exactly_those_that_fit():
    base, job, profile = tiny()
    found = enumerate_candidates(SearchSpace(remat=("none", "full"), pipe=(1,), tensor=(1,)), base, 2, job.facts)
    predictions = [predict_memory(c, profile, base) for c in found.candidates]
    budget = sorted(p.peak_bytes for p in predictions)[len(predictions) // 2]
    fits, over = prune(predictions, budget)
    assert fits and over and len(fits) + len(over) == len(predictions)
    assert all(p.peak_bytes <= budget for p in fits)
    by_candidate = {p.candidate: p for p in predictions}
    for skipped in over:
        assert by_candidate[skipped.candidate].peak_bytes > budget
        assert f"over autotune.memory_per_rank={format_bytes(budget)}" in skipped.reason


def test_the_budget_remat_picks_the_first_policy_that_fits_or_is_pruned():
    base, _, profile = tiny()
    roomy = profile.activation_bytes("none", 1, 4) / 2**20 + 1
    assert budget_choice(profile, roomy, 4)[0] == ("none", 1)
    order = [(policy or "none", every) for policy, every in BUDGET_ORDER if (policy or "none", every) in profile.remat]
    for budget in sorted(profile.activation_bytes(*key, 4) + 1 for key in order):
        picked = budget_choice(profile, budget / 2**20, 4)[0]
        assert profile.activation_bytes(*picked, 4) <= budget  # it fits, and nothing before it in the order does
        assert all(profile.activation_bytes(*key, 4) > budget for key in order[:order.index(picked)])
    hopeless = predict_memory(Candidate(1, 4, 2, data=2, remat="budget", remat_budget_mib=1e-6), profile, base)
    fits, over = prune([hopeless], 1 << 40)
    assert not fits and "even full remat keeps" in over[0].reason


def test_sizes_parse_with_units_and_refuse_anything_else():
    assert parse_bytes("70GiB") == 70 * 2**30 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(4096) == 4096
    for bad in ("lots", "12 parsecs", "0", -5):
        with pytest.raises(ValueError, match="autotune.memory_per_rank"):
            parse_bytes(bad)
