"""fspeed.parallel.grads: gradients leave backward as it produces them and are reduced in buckets.

Against the one-process run on real gloo worlds: stage 2 on 2 and 4 ranks with and without
gradient accumulation, overlap on and off; no tensor of the full gradient's size is allocated
during a stage-2 step; with overlap_comm the bucket collectives are issued during backward and
finished after it, without it each is waited for as it is launched.
"""

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fspeed as fs
from fspeed.parallel.grads import _aligned_ranges
from fspeed.train_step import split_micro_batches
from tests.parallel_cases import assert_matches_one_process, distributed_case, global_batch, gpt_setup


@pytest.mark.parametrize("grad_accum, overlap, bucket", [(1, False, 1000), (3, False, 97), (1, True, 97),
                                                         (3, True, 1000)])
def test_stage2_matches_one_process_on_2_ranks(world2, grad_accum, overlap, bucket):
    results = world2.run(distributed_case, 5, 3, grad_accum, 2, "sgd", 2, 1, "fp32", 0, bucket, overlap=overlap)
    assert_matches_one_process(results, 5, 3, grad_accum, 2, dp=2)


@pytest.mark.parametrize("grad_accum, overlap", [(1, True), (2, False)])
def test_stage2_matches_one_process_on_4_ranks(world4, grad_accum, overlap):
    results = world4.run(distributed_case, 6, 2, grad_accum, 1, "adamw", 2, 1, "fp32", 0, 300, overlap=overlap)
    assert_matches_one_process(results, 6, 2, grad_accum, 1, dp=4, opt_kind="adamw")


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 1000), stage=st.sampled_from([0, 1, 2, 3]), overlap=st.booleans(),
       grad_accum=st.sampled_from([1, 2]), bucket=st.sampled_from([50, 333, 10**6]), n_layer=st.integers(1, 3))
def test_property_overlap_and_buckets_do_not_change_the_numbers(world2, seed, stage, overlap, grad_accum, bucket,
                                                                n_layer):
    dims = dict(n_layer=n_layer, d_model=16, n_head=4, vocab=24)
    results = world2.run(distributed_case, seed, 2, grad_accum, 1, "sgd", stage, 1, "fp32", 200, bucket, dims,
                         overlap=overlap)
    assert_matches_one_process(results, seed, 2, grad_accum, 1, dp=2, dims=dims)


class _Allocations(TorchDispatchMode):
    """The size (elements) and op of every tensor storage an op allocates (not views, not in place)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append((t.untyped_storage().nbytes() // t.element_size(), str(func)))
        return out


def allocations_case(stage, grad_accum):
    """The largest allocation of a ZeRO step (after a warm-up step), the full gradient's size,
    and the gradient bytes the runtime holds between steps."""
    mesh = fs.Mesh(data=-1)
    cfg, model, params = gpt_setup(0, n_layer=4, d_model=64, vocab=32)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(1e-3))
    plan = fs.zero(stage, reduce_bucket_size=8192, overlap_comm=True)
    state = fs.init_train_state(params, opt, precision=fs.precision.bf16(), plan=plan, mesh=mesh)
    step = fs.make_train_step(model.loss, opt, grad_accum=grad_accum, plan=plan, mesh=mesh)
    state, _ = step(state, global_batch(cfg, 2 * grad_accum, 0, 0))
    mode = _Allocations()
    with mode:
        state, _ = step(state, global_batch(cfg, 2 * grad_accum, 0, 1))
    return max(mode.sizes), state.layout.local.numel, step.persistent_grad_bytes(), state.layout.partition_numel


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_stage2_never_allocates_a_tensor_of_the_full_gradients_size(world2, grad_accum):
    for (largest, op), psi, held, part in world2.run(allocations_case, 2, grad_accum):
        assert largest < psi / 2, f"{op} allocated {largest} elements; the full gradient has {psi}"
        assert held == 4 * (part + 2 * 8192)  # the fp32 partition accumulator and two reduce buckets
    for (largest, op), psi, held, _ in world2.run(allocations_case, 1, 1):
        assert held >= 4 * psi  # stage 1 keeps the full accumulation buffer, as DeepSpeed's stage 1


def overlap_case(stage, overlap):
    """Comm events of one step, and when each micro-batch's backward ended."""
    mesh = fs.Mesh(data=-1, log=fs.CommLog())
    cfg, model, params = gpt_setup(1, n_layer=4, d_model=32)
    opt = fs.optim.sgd(0.1)
    plan = fs.zero(stage, reduce_bucket_size=2000, overlap_comm=overlap, param_persistence_threshold=1000)
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh)
    step = fs.make_train_step(model.loss, opt, grad_accum=2, plan=plan, mesh=mesh)
    state, _ = step(state, global_batch(cfg, 4, 1, 0))
    runtime = step.runtime_for(state)
    ends, real_end = [], runtime.end_micro

    def end_micro():
        ends.append(time.perf_counter())
        real_end()

    runtime.end_micro = end_micro
    mesh.log.reset()
    state, _ = step(state, global_batch(cfg, 4, 1, 1))
    gradient_ops = ("all_reduce", "reduce", "reduce_scatter")
    return [e for e in mesh.log.events if e.op in gradient_ops and e.nbytes > 8], ends


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_comm_issues_bucket_collectives_during_backward(world2, stage):
    for events, ends in world2.run(overlap_case, stage, True):
        backward_end = ends[-1]
        during = [e for e in events if e.issued < backward_end]
        assert during, "no gradient collective was issued before backward finished"
        # issued during backward, finished (waited for) after it: the collective ran beside backward
        assert any(e.waited > backward_end and e.blocked < e.waited - e.issued for e in during)
    for events, ends in world2.run(overlap_case, stage, False):
        backward_end = ends[-1]
        during = [e for e in events if e.issued < backward_end]
        assert during and all(e.waited <= backward_end for e in during)  # each waited for as launched


def test_buckets_cover_the_parameters_in_aligned_ranges():
    ranges, members = _aligned_ranges([0, 10, 30, 35], [10, 20, 5, 100], 25)
    assert ranges == [(0, 10), (10, 35), (35, 60), (60, 85), (85, 110), (110, 135)]
    assert members == [[0], [1, 2], [3], [3], [3], [3]]
    ranges, _ = _aligned_ranges([0, 10, 30, 35], [10, 20, 5, 100], 1000, cuts=[40, 70])
    assert ranges == [(0, 40), (40, 70), (70, 135)]  # never across a partition boundary


@given(sizes=st.lists(st.integers(0, 50), min_size=1, max_size=12), bucket=st.integers(1, 60),
       parts=st.integers(1, 4))
def test_property_buckets_partition_the_buffer(sizes, bucket, parts):
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    part = -(-total // parts) if total else 1
    cuts = [k * part for k in range(1, parts)]
    ranges, members = _aligned_ranges(offsets, sizes, bucket, cuts)
    covered = [x for a, b in ranges for x in range(a, b)]
    assert covered == list(range(total))  # every element once, in order
    for (a, b), inside in zip(ranges, members):
        assert b - a <= bucket and not any(a < c < b for c in cuts)
        assert inside == [i for i, (o, s) in enumerate(zip(offsets, sizes)) if s and o < b and o + s > a]


def reductions_by_micro_batch_case(stage, grad_accum):
    """The gradient-reduction collectives (op, bytes) of a step's second run, by window: each
    micro-batch (forward, backward and its end), then the boundary (update and the rest); and
    what the counts are checked against: the local element count, the elements of the sharded
    units and of the persistent parameters, and the number of sharded units."""
    log = fs.CommLog()
    mesh = fs.Mesh(data=-1, log=log)
    cfg, model, params = gpt_setup(2, n_layer=2, d_model=32)
    opt = fs.optim.sgd(0.1)
    # small buckets (several per step) and, under ZeRO-3, layers with sharded and persistent parameters
    plan = fs.zero(stage, reduce_bucket_size=3000, param_persistence_threshold=1000)
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh)
    step = fs.make_train_step(model.loss, opt, grad_accum=grad_accum, plan=plan, mesh=mesh)
    rows = 2 * grad_accum
    windows = []
    for i in range(2):
        batch = global_batch(cfg, 2 * rows, 2, i)
        share = {k: v[mesh.rank * rows:(mesh.rank + 1) * rows] for k, v in batch.items()}
        micro_batches = split_micro_batches(share, grad_accum)
        log.reset()
        windows = []
        running = step.begin(state)
        for micro_batch in micro_batches:
            step.micro(running, state, micro_batch)
            windows.append([(e.op, e.nbytes) for e in log.events])
            log.reset()
        state, _ = step.boundary(running, state)
        windows.append([(e.op, e.nbytes) for e in log.events])
    layout = state.layout
    reductions = [[(op, nbytes) for op, nbytes in w if op in ("all_reduce", "reduce", "reduce_scatter")]
                  for w in windows]
    return reductions, layout.local.numel, layout.persistent_start, layout.persistent_numel, \
        len(layout.sharded_units)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_reductions_per_micro_batch(world2, stage):
    """Counted in the communication log, micro-batch by micro-batch (grad_accum=4, 2 ranks, fp32,
    DeepSpeed's defaults otherwise):

    * stages 0 and 1 accumulate locally and communicate nothing until the last micro-batch, whose
      backward reduces every bucket once (stage 0 all-reduces, stage 1 reduces onto the owning
      rank): each gradient element exactly once a step. DeepSpeed's "smart gradient
      accumulation" (reference 4.2).
    * stages 2 and 3 reduce every micro-batch into the partitions, as DeepSpeed does (reference
      4.2: "stage >= 2 reduces every micro-step into partitions"; stage3.py's partition_grads
      copies the first micro-step's reduced partition and adds the later ones): each micro-batch
      sends every gradient element once, so only a partition is ever accumulated. Stage 3
      reduce-scatters each sharded unit's gradient (one per unit) and reduces the persistent
      parameters' gradients in packed buckets onto the owners of their partition.

    The boundary reduces no gradient: only scalars (the grad norm's sums of squares, the loss)."""
    grad_accum = 4
    for reductions, psi, sharded, persistent, units in world2.run(reductions_by_micro_batch_case, stage, grad_accum):
        micro, boundary = reductions[:grad_accum], reductions[grad_accum]
        assert all(nbytes <= 16 for _, nbytes in boundary), boundary  # the norm (2 fp64) and the loss
        if stage <= 1:
            assert micro[:-1] == [[]] * (grad_accum - 1), "a gradient was reduced before the last micro-batch"
            op = "all_reduce" if stage == 0 else "reduce"
            assert {o for o, _ in micro[-1]} == {op}
            assert len(micro[-1]) >= -(-psi // 3000)  # at least one per bucket of 3000 elements
            assert sum(nbytes for _, nbytes in micro[-1]) == 4 * psi  # every fp32 gradient element once
        else:
            assert all(window == micro[0] for window in micro), "the micro-batches reduced differently"
            if stage == 2:
                assert {o for o, _ in micro[0]} == {"reduce"}
                assert sum(nbytes for _, nbytes in micro[0]) == 4 * psi
            else:
                scattered = [nbytes for op, nbytes in micro[0] if op == "reduce_scatter"]
                assert units and len(scattered) == units  # one per sharded unit: its padded shard received
                assert sum(scattered) == 4 * sharded
                assert persistent and sum(nbytes for op, nbytes in micro[0] if op == "reduce") == 4 * persistent
                assert {o for o, _ in micro[0]} == {"reduce_scatter", "reduce"}
