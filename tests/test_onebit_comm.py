"""The error-feedback 1-bit all-reduce in one process: packing, padding, and the one-process model
against a per-tensor transcription of DeepSpeed's algorithm (the gloo collective: test_onebit_distributed)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fspeed.parallel.comm import AxisComm, CommLog
from fspeed.compressed_allreduce import (
    CompressionPlan, compressed_allreduce, divider, pack_signs, padded_numel, simulate_compressed_allreduce,
    unpack_signs,
)


def _sign(x):
    return torch.where(x < 0, -1.0, 1.0)


def deepspeed_transcription(xs, worker_errors, server_errors):
    """DeepSpeed's compressed_allreduce for one tensor on n ranks, written plainly (numpy packbits
    order is irrelevant here: signs are used unpacked)."""
    n = len(xs)
    size = xs[0].numel()
    corrected = padded_numel(size, n)
    chunk = corrected // n
    bufs, scales = [], []
    for r in range(n):
        x = torch.cat([xs[r], torch.zeros(corrected - size)]) + worker_errors[r]
        s = torch.linalg.vector_norm(x) / math.sqrt(x.numel())
        worker_errors[r].copy_(x - s * _sign(x))
        bufs.append(_sign(x))
        scales.append(s)
    server_signs, server_scales = [], []
    for i in range(n):
        y = sum(bufs[j][i * chunk:(i + 1) * chunk] * (scales[j] / n) for j in range(n)) + server_errors[i]
        s = torch.linalg.vector_norm(y) / math.sqrt(chunk)
        server_errors[i].copy_(y - s * _sign(y))
        server_signs.append(_sign(y))
        server_scales.append(s)
    out = torch.cat([server_signs[i] * server_scales[i] for i in range(n)])[:size]
    return [out.clone() for _ in range(n)]


def test_divider_and_padding_follow_deepspeed():
    assert [divider(n) for n in (1, 2, 3, 4, 6, 8, 16)] == [8, 8, 24, 8, 24, 8, 16]
    assert padded_numel(1, 2) == 16 and padded_numel(16, 2) == 16 and padded_numel(17, 2) == 32
    assert padded_numel(100, 3) == 144  # multiple of 3 * 24


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 80), seed=st.integers(0, 2**16))
def test_pack_round_trip(n, seed):
    x = torch.randn(n * 8, generator=torch.Generator().manual_seed(seed))
    x[::5] = 0.0  # zeros count as +1, as DeepSpeed's sign().add_(1).bool()
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == n
    assert torch.equal(unpack_signs(packed), _sign(x))


def test_packing_is_msb_first_like_numpy_packbits():
    x = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 1, -1, -1, -1, -1, -1, -1, -1, -1])
    assert pack_signs(x).tolist() == [0b10000001, 0]


def test_pack_rejects_partial_bytes():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(12))


@settings(max_examples=25, deadline=None)
@given(world=st.sampled_from([1, 2, 3, 4]), sizes=st.lists(st.integers(1, 70), min_size=1, max_size=4),
       seed=st.integers(0, 2**16), steps=st.integers(1, 3))
def test_segmented_model_equals_per_tensor_transcription(world, sizes, seed, steps):
    """One fused call over all segments = DeepSpeed's per-tensor calls (outputs and both errors)."""
    gen = torch.Generator().manual_seed(seed)
    plan = CompressionPlan(tuple(sizes), world)
    we = [torch.zeros(plan.total) for _ in range(world)]
    se = [torch.zeros(plan.server_numel) for _ in range(world)]
    ref_we = [[torch.zeros(padded_numel(s, world)) for _ in range(world)] for s in sizes]
    ref_se = [[torch.zeros(padded_numel(s, world) // world) for _ in range(world)] for s in sizes]
    for _ in range(steps):
        xs = [torch.randn(sum(sizes), generator=gen) for _ in range(world)]
        out = simulate_compressed_allreduce([plan.pad(x) for x in xs], we, se, plan)
        pieces = [x.split(sizes) for x in xs]
        ref = [deepspeed_transcription([p[k] for p in pieces], ref_we[k], ref_se[k]) for k in range(len(sizes))]
        for r in range(world):
            torch.testing.assert_close(plan.unpad(out[r]), torch.cat([ref[k][r] for k in range(len(sizes))]),
                                       rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(we[r], torch.cat([ref_we[k][r] for k in range(len(sizes))]), rtol=1e-5, atol=1e-6)
    # server errors: rank i serves chunk i of every segment
    for i in range(world):
        torch.testing.assert_close(se[i], torch.cat([ref_se[k][i] for k in range(len(sizes))]), rtol=1e-5, atol=1e-6)


def test_world_of_one_is_local_error_feedback():
    plan = CompressionPlan((13,), 1)
    x = plan.pad(torch.randn(13, generator=torch.Generator().manual_seed(0)))
    we, se = torch.zeros(plan.total), torch.zeros(plan.server_numel)
    comm = AxisComm("data", None, [0], CommLog())
    out = compressed_allreduce(x, we, se, plan, comm)
    (ref,) = simulate_compressed_allreduce([x], [torch.zeros(plan.total)], [torch.zeros(plan.server_numel)], plan)
    assert torch.equal(out, ref)


def test_plan_mismatch_is_a_clear_error():
    plan = CompressionPlan((8,), 2)
    comm = AxisComm("data", None, [0], CommLog())
    with pytest.raises(ValueError, match="plan is for 2 ranks"):
        compressed_allreduce(torch.zeros(plan.total), torch.zeros(plan.total), torch.zeros(plan.server_numel), plan, comm)
