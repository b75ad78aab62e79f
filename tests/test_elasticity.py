"""The elastic batch (fspeed.elasticity) against a transcription of DeepSpeed's compute_elastic_config,
and the `elasticity` block's translation into fspeed's config."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fspeed.config import ConfigError
from fspeed.config.deepspeed import DeepSpeedConfigError, translate_deepspeed_config
from fspeed.elasticity import ElasticConfig, ElasticityError, elastic_batch

# ------------------------------------------------------------------ the oracle: DeepSpeed's computation, transcribed

HCN = [1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120, 20160,
       25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400, 665280, 720720]


class Refused(Exception):
    """DeepSpeed raises (ElasticityError, ValueError, an assertion, or a TypeError on a None list)."""


def ds_candidates(bases, cap):
    out = []
    for base in bases:
        if base > cap:
            continue
        if base == cap:
            out.append(base)
        else:
            value = cap // base
            first_above = [h > value for h in HCN]
            index = first_above.index(True) if True in first_above else 0  # numpy argmax of all-False is 0
            out.append(HCN[index - 1] * base)
    return list(set(out))


def ds_valid_gpus(batch, micro_batches, lo, hi):
    valid = []
    for micro in micro_batches:
        if batch % micro == 0:
            most = batch // micro
            if lo <= most <= hi:
                valid.append(most)
            for i in range(1, most // 2 + 1):
                if i > hi:
                    break
                if i < lo:
                    continue
                if most % i == 0:
                    valid.append(i)
    return sorted(set(valid))


def ds_v01(micro_batches, cap, min_gpus, max_gpus, prefer_larger):
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or cap // min(micro_batches)
    if not all(m <= cap for m in micro_batches):
        raise Refused("micro batch above the maximum")
    bases = list(micro_batches) + [math.lcm(*micro_batches)]
    best_count, valid, final = 0, None, int(min(micro_batches))
    for batch in ds_candidates(bases, cap):
        current = ds_valid_gpus(batch, micro_batches, min_gpus, max_gpus)
        if len(current) > best_count or (len(current) == best_count and (
                (prefer_larger and batch > final) or (not prefer_larger and batch < final))):
            best_count, valid, final = len(current), current, batch
    return final, valid


def ds_v02(micro_batches, cap, gpus, min_gpus, max_gpus, prefer_larger, per_node, mp):
    if per_node % mp:
        raise Refused("num_gpus_per_node % model_parallel_size")
    dp_per_node = per_node // mp
    final, valid_nodes = ds_v01(micro_batches, int(cap / dp_per_node), int(min_gpus / per_node),
                                int(max_gpus / per_node), prefer_larger)
    final = int(final) * dp_per_node
    if valid_nodes is None:
        raise Refused("membership test on None")
    valid = [i * dp_per_node for i in valid_nodes]
    if gpus // mp in valid:
        return final, valid
    current = (gpus / per_node) * dp_per_node
    candidates = [math.floor(cap / float(m * current)) * (m * current) for m in micro_batches]
    chosen = max(candidates) if prefer_larger else min(candidates)
    return chosen, [int(current)]


def ds_compute(block, world_size):
    """(final batch, valid world sizes, micro-batch or None) as DeepSpeed's compute_elastic_config returns."""
    version = float(block["version"])
    if block["model_parallel_size"] > 1 and version != 0.2:
        raise Refused("model parallelism needs 0.2")
    args = (block["micro_batch_sizes"], block["max_train_batch_size"])
    if version == 0.1:
        final, valid = ds_v01(*args, block["min_gpus"], block["max_gpus"], block["prefer_larger_batch"])
    else:
        final, valid = ds_v02(*args, world_size, block["min_gpus"], block["max_gpus"], block["prefer_larger_batch"],
                              block["num_gpus_per_node"], block["model_parallel_size"])
    final = int(final)
    if world_size <= 0:
        return final, tuple(valid or ()), None
    if valid is None or world_size not in valid:
        raise Refused("world size not valid")
    for micro in sorted(set(block["micro_batch_sizes"]), reverse=True):
        if final // world_size % micro == 0:
            return final, tuple(valid), micro
    raise Refused("no micro batch divides")


# ----------------------------------------------------------------------------------------------- properties

@st.composite
def elastic_blocks(draw):
    version = draw(st.sampled_from([0.1, 0.2]))
    per_node = draw(st.sampled_from([1, 2, 4, 8])) if version == 0.2 else 1
    mp = draw(st.sampled_from([d for d in (1, 2, 4, 8) if per_node % d == 0])) if version == 0.2 else 1
    min_gpus = draw(st.integers(1, 16))
    return {
        "max_train_batch_size": draw(st.integers(1, 5000)),
        "micro_batch_sizes": draw(st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 8, 12, 16, 32]), min_size=1,
                                           max_size=4, unique=True)),
        "min_gpus": min_gpus, "max_gpus": draw(st.integers(min_gpus, 256)),
        "prefer_larger_batch": draw(st.booleans()), "model_parallel_size": mp, "num_gpus_per_node": per_node,
        "version": version,
    }


def _both(block, world_size):
    try:
        expected = ds_compute(block, world_size)
    except Refused:
        expected = "refused"
    try:
        got = elastic_batch(ElasticConfig(**block), world_size)
    except ElasticityError:
        return expected, "refused", None
    return expected, (got.train_batch_size, got.valid_world_sizes, got.micro_batch_size), got


@settings(max_examples=400, deadline=None)
@given(block=elastic_blocks(), world=st.integers(1, 64), pick_valid=st.booleans())
def test_the_elastic_batch_is_deepspeeds(block, world, pick_valid):
    """The batch, the valid world sizes and the micro-batch DeepSpeed computes, or a refusal where it refuses."""
    if pick_valid:  # most random world sizes are invalid: draw one of the valid ones half the time
        try:
            valid = ds_compute(block, 0)[1] if block["version"] == 0.1 else ()
        except Refused:
            valid = ()
        world = valid[world % len(valid)] if valid else block["num_gpus_per_node"] * (world % 8 + 1)
    expected, got, batch = _both(block, world)
    assert got == expected
    if batch is not None:  # the triad holds
        assert batch.micro_batch_size * batch.grad_accum * world == batch.train_batch_size


@settings(max_examples=200, deadline=None)
@given(block=elastic_blocks().filter(lambda b: b["version"] == 0.1))
def test_version_01_without_a_world_size_gives_the_batch_and_the_valid_sizes(block):
    expected, got, _ = _both(block, 0)
    assert got == expected


@pytest.mark.parametrize("block, world, expected", [
    # DeepSpeed's documented example: max 2000, micro 2/4/6 -> 1680 on 1..840 GPUs (v0.1)
    ({"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1}, 8, (1680, 6, 35)),
    ({"max_train_batch_size": 64, "micro_batch_sizes": [2, 4], "max_gpus": 8, "version": 0.1}, 3, (48, 4, 4)),
])
def test_known_cases(block, world, expected):
    b = elastic_batch(ElasticConfig(**block), world)
    assert (b.train_batch_size, b.micro_batch_size, b.grad_accum) == expected
    assert world in b.valid_world_sizes


@pytest.mark.parametrize("fields, key", [
    ({"min_gpus": 4, "max_gpus": 2}, "min_gpus"),
    ({"micro_batch_sizes": ()}, "micro_batch_sizes"),
    ({"version": 0.3}, "version"),
    ({"model_parallel_size": 2, "version": 0.1}, "model_parallel_size"),
    ({"model_parallel_size": 3, "num_gpus_per_node": 4}, "num_gpus_per_node"),
    ({"max_train_batch_size": 0}, "max_train_batch_size"),
])
def test_bad_configs_name_the_key(fields, key):
    with pytest.raises(ElasticityError) as err:
        ElasticConfig(**fields)
    assert err.value.key == key and key in str(err.value)


def test_a_world_size_outside_the_valid_ones_lists_them():
    with pytest.raises(ElasticityError) as err:
        elastic_batch(ElasticConfig(max_train_batch_size=64, micro_batch_sizes=(2, 4), max_gpus=8, version=0.1), 5)
    assert err.value.key == "world_size" and "valid: 1, 2, 3, 4, 6, 8" in str(err.value)


# ------------------------------------------------------------------------------------------------ translation

ELASTIC = {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4], "max_gpus": 8, "version": 0.1}


def _run(ds, dp, *overrides):
    from fspeed.config.compose import compose_run_config
    return compose_run_config(ds, ["checkpoint.dir=unused", *overrides], dp_world_size=dp)[0]


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 6, 8])
def test_an_enabled_block_sets_the_batch_for_the_data_parallel_world(dp):
    run = _run({"elasticity": ELASTIC}, dp)
    b = elastic_batch(ElasticConfig(**{k: v for k, v in ELASTIC.items() if k != "enabled"}), dp)
    assert run.batch[:4] == (b.train_batch_size, b.micro_batch_size, b.grad_accum, dp)
    assert run.batch.train_batch_size == 48  # the same global batch on every valid world size


def test_an_invalid_world_is_a_config_error_naming_the_valid_sizes():
    with pytest.raises(ConfigError) as err:
        _run({"elasticity": ELASTIC}, 5)
    assert "parallel.data" in str(err.value) and "valid: 1, 2, 3, 4, 6, 8" in str(err.value)


def test_batch_keys_beside_an_enabled_block_are_refused_unless_ignored():
    with pytest.raises(DeepSpeedConfigError) as err:
        translate_deepspeed_config({"train_batch_size": 32, "elasticity": ELASTIC})
    assert "train_batch_size" in str(err.value) and "ignore_non_elastic_batch_info" in str(err.value)
    ds = {"train_batch_size": 32, "gradient_accumulation_steps": 2,
          "elasticity": {**ELASTIC, "ignore_non_elastic_batch_info": True, "min_time": 20}}
    t = translate_deepspeed_config(ds)
    assert not any(o.startswith("train.train_batch_size") for o in t.overrides)
    assert any(n.startswith("train_batch_size = 32") for n in t.no_effect)
    assert any(n.startswith("elasticity.min_time = 20") for n in t.no_effect)
    assert _run(ds, 2).batch.train_batch_size == 48


@pytest.mark.parametrize("block, key", [
    ({"enabled": True, "micro_batch_sizes": [2]}, "elasticity.max_train_batch_size"),
    ({**ELASTIC, "min_time": -1}, "elasticity.min_time"),
    ({**ELASTIC, "versoin": 0.1}, "elasticity.versoin"),
])
def test_translation_errors_name_the_key(block, key):
    with pytest.raises(DeepSpeedConfigError) as err:
        translate_deepspeed_config({"elasticity": block})
    assert key in str(err.value)


def test_a_disabled_block_has_no_effect_and_fspeeds_own_keys_conflict_clearly():
    t = translate_deepspeed_config({"train_batch_size": 8, "elasticity": {"enabled": False, "max_gpus": 4}})
    assert any(n.startswith("elasticity = ") for n in t.no_effect)
    assert "train.train_batch_size=8" in t.overrides
    with pytest.raises(ConfigError) as err:
        _run({"elasticity": ELASTIC}, 2, "train.grad_accum=2")
    assert "elasticity.enabled" in str(err.value) and "train.grad_accum=2" in str(err.value)
    with pytest.raises(ConfigError) as err:
        _run({"elasticity": {**ELASTIC, "version": 0.2, "model_parallel_size": 2, "num_gpus_per_node": 2}}, 2)
    assert "elasticity.model_parallel_size" in str(err.value)
