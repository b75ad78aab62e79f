"""Batch triad: DeepSpeed's resolution table, the invariant, and errors instead of truncation."""

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from fspeed.batch_triad import BatchTriad, BatchTriadError, resolve_batch_triad, suggest_consistent_triples

sizes = st.integers(min_value=1, max_value=96)
maybe_sizes = st.none() | sizes
dps = st.integers(min_value=1, max_value=8)


# (given tbs, mbs, gas, dp) -> (tbs, mbs, gas), DeepSpeed's table (reference 4.1)
DEEPSPEED_TABLE = [
    ((64, 8, 2, 4), (64, 8, 2)),  # all three: only checked
    ((64, 8, None, 2), (64, 8, 4)),  # tbs + mbs: gas = tbs / (mbs * dp)
    ((64, None, 4, 2), (64, 8, 4)),  # tbs + gas: mbs = tbs / (gas * dp)
    ((None, 8, 4, 2), (64, 8, 4)),  # mbs + gas: tbs = mbs * gas * dp
    ((64, None, None, 4), (64, 16, 1)),  # tbs only: gas = 1, mbs = tbs / dp
    ((None, 8, None, 3), (24, 8, 1)),  # mbs only: gas = 1, tbs = mbs * dp
    ((32, 32, None, 1), (32, 32, 1)),
]


@pytest.mark.parametrize("given_values, expected", DEEPSPEED_TABLE)
def test_deepspeed_resolution_table(given_values, expected):
    triad = resolve_batch_triad(*given_values)
    assert (triad.train_batch_size, triad.micro_batch_size, triad.grad_accum) == expected
    assert triad.dp_world_size == given_values[3]
    assert isinstance(triad, BatchTriad)
    assert triad.derivation  # says how it was resolved


def test_derivation_names_the_rule_used():
    assert resolve_batch_triad(64, 8, None, 2).derivation.startswith("grad_accum = train_batch_size / (micro_batch_size x dp)")
    assert resolve_batch_triad(None, 8, 4, 2).derivation.endswith("= 64")


@given(maybe_sizes, maybe_sizes, maybe_sizes, dps)
def test_every_resolution_satisfies_the_invariant_and_keeps_given_values(tbs, mbs, gas, dp):
    try:
        triad = resolve_batch_triad(tbs, mbs, gas, dp)
    except BatchTriadError:
        return
    assert triad.train_batch_size == triad.micro_batch_size * triad.grad_accum * triad.dp_world_size
    for given_value, resolved in ((tbs, triad.train_batch_size), (mbs, triad.micro_batch_size), (gas, triad.grad_accum)):
        assert given_value is None or given_value == resolved  # nothing truncated or replaced


@given(sizes, sizes, dps, st.sets(st.sampled_from(["tbs", "mbs", "gas"]), min_size=1))
def test_any_subset_of_a_consistent_triple_resolves(mbs, gas, dp, keep):
    assume(keep != {"gas"})  # gas alone is not enough, as in DeepSpeed
    tbs = mbs * gas * dp
    triad = resolve_batch_triad(tbs if "tbs" in keep else None, mbs if "mbs" in keep else None,
                                gas if "gas" in keep else None, dp)
    assert triad.train_batch_size == triad.micro_batch_size * triad.grad_accum * dp
    if len(keep) >= 2:  # two of the three determine the third
        assert triad[:3] == (tbs, mbs, gas)


@given(sizes, sizes, sizes, dps)
def test_inconsistent_triple_is_an_error_with_dp_derivation_and_suggestions(tbs, mbs, gas, dp):
    assume(tbs != mbs * gas * dp)
    with pytest.raises(BatchTriadError) as info:
        resolve_batch_triad(tbs, mbs, gas, dp)
    message = str(info.value)
    assert f"dp={dp}" in message and "world" not in message
    assert "derivation:" in message
    assert "consistent choices" in message


def test_non_divisible_derivation_is_refused_not_truncated():
    # DeepSpeed would silently derive gas = 64 // 6 // 1 = 10 and then fail its own assertion.
    with pytest.raises(BatchTriadError, match=r"64 is not divisible by 6 x 1 = 6") as info:
        resolve_batch_triad(64, 6, None, 1)
    assert "train_batch_size=64, micro_batch_size=8, grad_accum=8" in str(info.value)
    with pytest.raises(BatchTriadError, match="not divisible by 3 x 2"):
        resolve_batch_triad(64, None, 3, 2)
    with pytest.raises(BatchTriadError, match="not divisible by dp=4"):
        resolve_batch_triad(10, None, None, 4)


@pytest.mark.parametrize("gas", [None, 4])
def test_missing_sizes_are_an_error(gas):
    with pytest.raises(BatchTriadError, match="either train_batch_size or micro_batch_size"):
        resolve_batch_triad(None, None, gas, 1)


@pytest.mark.parametrize("args, error", [
    ((0, None, None, 1), BatchTriadError),
    ((None, -4, None, 1), BatchTriadError),
    ((None, 4, 0, 1), BatchTriadError),
    ((None, 4, None, 0), BatchTriadError),
    ((None, 4.0, None, 1), TypeError),
    ((True, None, None, 1), TypeError),
    ((None, 4, None, None), TypeError),
])
def test_bad_values_name_the_argument(args, error):
    with pytest.raises(error, match="train_batch_size|micro_batch_size|grad_accum|dp_world_size"):
        resolve_batch_triad(*args)


@given(maybe_sizes, maybe_sizes, maybe_sizes, dps)
def test_suggestions_are_consistent(tbs, mbs, gas, dp):
    for t, m, g in suggest_consistent_triples(tbs, mbs, gas, dp):
        assert t == m * g * dp
        assert resolve_batch_triad(t, m, g, dp)[:3] == (t, m, g)
