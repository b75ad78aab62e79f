"""fspeed.parallel.runtime: ZeRO 0-3 and tensor slicing on real gloo worlds, against the one-process
run; a dead or stuck rank fails with a clear error."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed as fs
from fspeed.parallel import zero
from fspeed.pytree import tree_flatten_with_paths
from fspeed.testing import GlooWorld, WorkerError
from tests.parallel_cases import assert_matches_one_process, distributed_case, global_batch, gpt_setup, train


@pytest.mark.parametrize("stage, grad_accum", [(stage, ga) for stage in (0, 1, 2, 3) for ga in (1, 3)])
def test_zero_stages_match_one_process_on_2_ranks(world2, stage, grad_accum):
    seed, steps, micro = 11 + stage, 3, 2
    results = world2.run(distributed_case, seed, steps, grad_accum, micro, "sgd", stage, 1, "fp32", 0, 1000)
    assert_matches_one_process(results, seed, steps, grad_accum, micro, dp=2)


@pytest.mark.parametrize("opt_kind, grad_accum", [("sgd", 3), ("adamw", 1)])
def test_zero3_at_the_default_persistence_threshold_matches_one_process_on_2_ranks(world2, opt_kind, grad_accum):
    """DeepSpeed's default param_persistence_threshold (100,000) keeps every parameter of the tiny
    GPT persistent: its compute copy whole on both ranks, its master and optimizer state a 1/2
    partition of all of them, its gradient reduced into that partition."""
    seed, steps, micro = 21, 3, 2
    results = world2.run(distributed_case, seed, steps, grad_accum, micro, opt_kind, 3, 1, "fp32", 100_000)
    psi = fs.Flat.from_tree(gpt_setup(seed)[2]).buffer.numel()
    part = -(-psi // 2)
    for _, _, _, sizes in results:
        # fp32: the masters are the compute buffer's leading part, the partition; the whole copies follow it
        assert sizes == {"params": part + 2 * part, "master": part}
    tolerance = {"opt_kind": "adamw", "rtol": 1e-4, "atol": 1e-4} if opt_kind == "adamw" else {}
    assert_matches_one_process(results, seed, steps, grad_accum, micro, dp=2, **tolerance)


def test_zero3_recompute_blocks_matches_one_process_on_2_ranks(world2):
    """zero.recompute_blocks: backward recomputes each block (same dropout stream) instead of replaying it."""
    seed, steps, micro, grad_accum = 13, 3, 2, 2
    dims = {"n_layer": 2, "d_model": 16}
    results = world2.run(distributed_case, seed, steps, grad_accum, micro, "sgd", 3, 1, "fp32", 0, 1000, dims, True)
    assert_matches_one_process(results, seed, steps, grad_accum, micro, dp=2, dims=dims)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_tensor_slicing_matches_one_process_on_2_ranks(world2, stage):
    seed, steps, micro, grad_accum = 5, 3, 2, 2
    results = world2.run(distributed_case, seed, steps, grad_accum, micro, "sgd", stage, 2)
    assert_matches_one_process(results, seed, steps, grad_accum, micro, dp=1)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_data_times_tensor_parallel_on_4_ranks(world4, stage):
    seed, steps, micro, grad_accum = 7, 3, 1, 2
    results = world4.run(distributed_case, seed, steps, grad_accum, micro, "sgd", stage, 2, "fp32", 0, 500)
    assert_matches_one_process(results, seed, steps, grad_accum, micro, dp=2)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_on_4_data_ranks_with_adamw(world4, stage):
    seed, steps, micro, grad_accum = 3, 3, 1, 1
    results = world4.run(distributed_case, seed, steps, grad_accum, micro, "adamw", stage, 1)
    # Adam divides by sqrt(v): reduction-order rounding on near-zero gradients is amplified
    assert_matches_one_process(results, seed, steps, grad_accum, micro, dp=4, opt_kind="adamw", rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_zero(world2, precision):
    seed, steps, micro, grad_accum = 9, 3, 2, 2
    results = world2.run(distributed_case, seed, steps, grad_accum, micro, "sgd", 2, 1, precision)
    for flat, *_ in results:
        assert torch.equal(flat, results[0][0])
    # against the one-process run in the same precision: equal up to low-precision rounding
    ref_flat, ref_losses, _, _ = train(seed, steps, grad_accum, micro * 2, "sgd", precision)
    torch.testing.assert_close(results[0][0], ref_flat, rtol=0, atol=1e-2)
    for got, want in zip(results[0][1], ref_losses):
        assert math.isclose(got, want, rel_tol=1e-2)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 1000), stage=st.sampled_from([0, 1, 2, 3]), grad_accum=st.sampled_from([1, 2, 3]),
       micro=st.integers(1, 2), persistence=st.sampled_from([0, 300, 10**6]), bucket=st.sampled_from([None, 97, 1000]),
       n_layer=st.integers(1, 3), d_model=st.sampled_from([8, 16, 24]), vocab=st.integers(5, 40),
       tp=st.sampled_from([1, 2]))
def test_property_any_layout_matches_one_process(world2, seed, stage, grad_accum, micro, persistence, bucket, n_layer,
                                                 d_model, vocab, tp):
    dims = dict(n_layer=n_layer, d_model=d_model, n_head=4, vocab=fs.models.pad_vocab(vocab, 2 * tp))
    results = world2.run(distributed_case, seed, 2, grad_accum, micro, "sgd", stage, tp, "fp32", persistence, bucket,
                         dims)
    assert_matches_one_process(results, seed, 2, grad_accum, micro, dp=2 // tp, dims=dims)


def norm_in_update_case(stage):
    """AdamW without clipping on 2 data ranks: the grad norm from the optimizer's pass (each rank's
    partition, summed over ranks; or the whole all-reduced gradient) and from a guard that reads it
    first; whether each run took it from the update."""
    cfg, model, params = gpt_setup(4)
    mesh = fs.Mesh(data=-1)
    runs = []
    for guard in (None, "skip"):
        opt, plan = fs.optim.adamw(3e-3, weight_decay=0.1), zero(stage, reduce_bucket_size=300)
        state = fs.init_train_state(params, opt, plan=plan, mesh=mesh, logical_axes=model.logical_axes)
        step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh, grad_accum=2, on_nonfinite=guard)
        norms = []
        for i in range(3):
            batch = global_batch(cfg, 8, 4, i)
            state, metrics = step(state, {k: v[4 * mesh.rank:4 * mesh.rank + 4] for k, v in batch.items()})
            norms.append(metrics["grad_norm"])
        runs.append((step.runtime_for(state).norm_in_update, norms, fs.parallel.gather_params(state, mesh)))
    return runs


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_grad_norm_from_the_update_pass_on_2_ranks(world2, stage):
    for (fused, norms, params), (guarded, ref_norms, ref_params) in world2.run(norm_in_update_case, stage):
        # every stage's pass sees the whole gradient or a partition of it (ZeRO-3: its shards and its
        # partition of the persistent parameters, whose gradients are partitioned as DeepSpeed's are)
        assert fused and not guarded
        assert norms == pytest.approx(ref_norms, rel=1e-6)
        assert torch.equal(fs.Flat.from_tree(params).buffer, fs.Flat.from_tree(ref_params).buffer)


def dying_rank_case():
    """Rank 1 exits in the middle of a step; rank 0 must fail with a clear error instead of hanging."""
    import os

    mesh = fs.Mesh(data=-1)
    if mesh.rank == 1:
        os._exit(3)
    cfg, model, params = gpt_setup(0)
    opt = fs.optim.sgd(0.1)
    plan = zero(2)
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh)
    fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)(state, global_batch(cfg, 2, 0, 0))


def rank_case():
    return fs.Mesh(data=-1).comm("data").all_reduce_(torch.ones(1)).item()


def test_a_dead_rank_makes_the_others_fail_with_a_clear_error_and_the_world_starts_afresh():
    with GlooWorld(2, timeout_s=60) as world:
        with pytest.raises(WorkerError) as err:
            world.run(dying_rank_case)
        assert world.run(rank_case) == [2.0, 2.0]  # the next call gets a new group, not the dead one
    text = str(err.value)
    assert "rank 1 died (exit code 3)" in text
    assert "CommError" in text and "over mesh axis 'data'" in text and "peer rank" in text


def sleeping_rank_case():
    import time

    if fs.Mesh(data=-1).rank == 1:
        time.sleep(30)
    return "done"


def test_a_rank_past_the_timeout_fails_the_call_with_its_stack_and_the_world_starts_afresh():
    with GlooWorld(2, timeout_s=60) as world:
        world.run(rank_case)  # started, so that the short timeout below times the function alone
        world.timeout_s = 3
        with pytest.raises(WorkerError) as err:
            world.run(sleeping_rank_case)
        world.timeout_s = 60
        assert world.run(rank_case) == [2.0, 2.0]
    text = str(err.value)
    assert "no answer within 3s from ranks [1]" in text
    assert "sleeping_rank_case" in text.split("--- rank 1:")[1]  # where rank 1 was stuck


def straggler_case():
    """Rank 1 never joins the all-reduce rank 0 issues: rank 0 must time out with a clear error."""
    import time

    mesh = fs.Mesh(data=-1)
    if mesh.rank == 1:
        time.sleep(5)
        return "slept"
    mesh.comm("data").all_reduce_(torch.ones(4))
    return "reduced"


def test_a_stuck_collective_times_out_with_a_clear_error():
    with GlooWorld(2, timeout_s=60, collective_timeout_s=2) as world:
        with pytest.raises(WorkerError) as err:
            world.run(straggler_case)
    text = str(err.value)
    assert "1 rank(s)" in text and "--- rank 0" in text
    assert "all_reduce over mesh axis 'data' (global ranks [0, 1]) failed after" in text


def unread_gather_case(stage):
    """ZeRO-1/2 steps of a Hugging Face GPT-2 whose last parameter all-gather nobody reads: the run
    simply ends (as a script does after its last step), with malloc set as fspeed-train sets it."""
    from tests.hf_models import hf_gpt2, lm_batch, lm_loss, split

    fs.retain_freed_host_memory()
    mesh = fs.Mesh(data=-1)
    model = fs.functionalize(hf_gpt2(0), lm_loss)
    opt, plan = fs.optim.adamw(1e-3), zero(stage, overlap_comm=True)
    state = fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    for i in range(2):
        state, _ = step(state, split(lm_batch(4, i), 2, mesh.rank))
    return state.donated  # the state is dropped here with its gather in flight


@pytest.mark.parametrize("stage", [1, 2])
def test_a_run_that_ends_with_its_parameter_gather_unread_exits_cleanly(stage):
    """Gloo aborts a process (std::terminate, exit code -6) that exits with a collective never waited
    for; fspeed waits what is left at exit, so both ranks exit with 0. Real processes: GlooWorld's
    ranks leave through os._exit, which skips the exit this is about."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fspeed.testing import free_port

    port = free_port()
    code = f"from tests.test_parallel_runtime import unread_gather_case as c; fs.init_distributed(); c({stage})"
    procs = [subprocess.Popen([sys.executable, "-c", "import fspeed as fs; " + code],
                              cwd=Path(__file__).resolve().parent.parent, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    errors = [p.communicate(timeout=120)[1][-2000:] for p in procs]  # read as they run: a full pipe blocks
    assert [p.returncode for p in procs] == [0, 0], errors


def params_in_flight_case(stage):
    """ZeRO-1/2 return a state whose parameter all-gather is still in flight; reading state.params
    completes it, and the parameters are then every rank's updated partition, in rank order."""
    cfg, model, params = gpt_setup(3)
    mesh = fs.Mesh(data=-1)
    plan = zero(stage, allgather_bucket_size=50)
    opt = fs.optim.adamw(1e-2)
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh, logical_axes=model.logical_axes)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    rows = slice(2 * mesh.rank, 2 * mesh.rank + 2)
    for i in range(2):
        state, _ = step(state, {k: v[rows] for k, v in global_batch(cfg, 4, 3, i).items()})
    gather = object.__getattribute__(state, "_in_flight")
    started = gather is not None and len(gather.chunks) > 1
    full = state.params.buffer.clone()  # waits for the gather
    settled = object.__getattribute__(state, "_in_flight") is None and gather.done
    assert state.master is not None  # ZeRO-1/2 keep the fp32 partition apart from the compute params
    masters = mesh.all_gather_objects(state.master.buffer.clone(), "the updated partitions")
    return started, settled, full, masters


@pytest.mark.parametrize("stage", [1, 2])
def test_a_state_read_waits_for_the_parameter_gather_in_flight(world2, stage):
    for started, settled, full, masters in world2.run(params_in_flight_case, stage):
        assert started and settled
        gathered = torch.cat(masters)
        assert torch.equal(full[: gathered.numel()], gathered)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 40), st.integers(1, 25), st.data())
def test_the_parameter_gather_pieces_come_in_the_forwards_order(parts, part, bucket, data):
    """ZeRO-1/2's gather pieces cover the buffer once, each within one rank's part and at most a
    bucket long, and the pieces a unit needs come before those of every unit the forward takes later."""
    from fspeed.parallel.param_gather import gather_pieces

    end = parts * part
    cuts = sorted(data.draw(st.sets(st.integers(1, end - 1), max_size=8)) if end > 1 else [])
    bounds = [0, *cuts, data.draw(st.integers(max(cuts, default=0) + 1, end))]
    ranges = dict(enumerate(zip(bounds, bounds[1:])))  # units over the start of the buffer; the padding after
    order = data.draw(st.permutations(list(ranges)))[:data.draw(st.integers(0, len(ranges)))]
    pieces = gather_pieces(parts, part, bucket, ranges, order)
    covered = sorted(pieces)
    assert covered[0][0] == 0 and covered[-1][1] == end
    assert all(b == c for (_, b), (c, _) in zip(covered, covered[1:]))
    assert all(0 < b - a <= bucket and a // part == (b - 1) // part for a, b in pieces)

    def first_use(a, b):
        return min((order.index(u) if u in order else len(order) for u, (lo, hi) in ranges.items() if lo < b and a < hi),
                   default=len(order) + 1)

    keys = [first_use(a, b) for a, b in pieces]
    assert keys == sorted(keys)


def forward_first_gather_case():
    """A Hugging Face GPT-2 under ZeRO-1: its flat buffer sorts `transformer.wte` after the blocks, but the
    gather after the step sends the embedding first, which is what the next forward takes first."""
    from tests.hf_models import hf_gpt2, lm_batch, lm_loss, split

    mesh = fs.Mesh(data=-1)
    model = fs.functionalize(hf_gpt2(0, layers=3), lm_loss)
    opt, plan = fs.optim.adamw(1e-3), zero(1, allgather_bucket_size=1000)
    state = fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    state, _ = step(state, split(lm_batch(4, 0), 2, mesh.rank))
    first = step.runtime_for(state).gather.pieces[0]
    offsets = dict(zip(state.layout.local.paths, state.layout.local.offsets))
    wte, last_block = offsets["transformer.wte.weight"], offsets["transformer.h.2.ln_1.weight"]
    return first, wte, last_block


def test_the_zero1_gather_sends_what_the_forward_takes_first(world2):
    for (a, _), wte, last_block in world2.run(forward_first_gather_case):
        assert wte > last_block  # the buffer's order is not the forward's
        assert a == wte


def _piece_optimizer(name):
    return {"adamw": lambda: fs.optim.adamw(1e-3, weight_decay=0.1),
            "torch_adamw": lambda: fs.optim.from_torch(torch.optim.AdamW, lr=1e-3, weight_decay=0.1),
            "torch_sgd": lambda: fs.optim.from_torch(torch.optim.SGD, lr=1e-2, momentum=0.9)}[name]()


def update_by_piece_case(stage, precision, by_piece, optimizer="adamw"):
    """A Hugging Face GPT-2 under ZeRO-1/2: the update run piece by piece with the parameter gather
    (`update_and_gather`), or whole (then `write_back`): the parameters after 3 steps and how often
    the piecewise path ran."""
    from fspeed.parallel.runtime import ParallelRuntime
    from tests.hf_models import hf_gpt2, lm_batch, lm_loss, split

    calls, real = [0], (ParallelRuntime.update_and_gather, ParallelRuntime.updates_by_piece)

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return real[0](self, *args, **kwargs)

    ParallelRuntime.update_and_gather = counted
    ParallelRuntime.updates_by_piece = real[1] if by_piece else (lambda *args: False)
    try:
        mesh = fs.Mesh(data=-1)
        model = fs.functionalize(hf_gpt2(0, layers=3), lm_loss)
        opt, plan = _piece_optimizer(optimizer), zero(stage, allgather_bucket_size=5000)
        state = fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model,
                                    precision=getattr(fs.precision, precision)())
        step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
        for i in range(3):
            state, metrics = step(state, split(lm_batch(4, i), 2, mesh.rank))
        return calls[0], fs.gather_params(state, mesh), metrics["grad_norm"]
    finally:
        ParallelRuntime.update_and_gather, ParallelRuntime.updates_by_piece = real


@pytest.mark.parametrize("optimizer, pieces", [("torch_sgd", True), ("torch_adamw", False)])
def test_a_torch_optimizer_updates_by_piece_only_without_state_per_parameter(world2, optimizer, pieces):
    """`from_torch` SGD keeps per-element momentum only: it runs piece by piece. Torch's AdamW keeps a
    0-d `step` per parameter, which a piece of the partition cannot slice: it keeps the whole update.
    Either way the parameters are those of the whole update."""
    by_piece = world2.run(update_by_piece_case, 1, "fp32", True, optimizer)
    whole = world2.run(update_by_piece_case, 1, "fp32", False, optimizer)
    for (calls, params, _), (_, expected, _) in zip(by_piece, whole):
        assert calls == (3 if pieces else 0)
        for value, reference in zip(tree_flatten_with_paths(params)[1], tree_flatten_with_paths(expected)[1]):
            assert torch.equal(value, reference)


@pytest.mark.parametrize("stage, precision", [(1, "fp32"), (2, "bf16"), (1, "fp16")])
def test_an_update_piece_by_piece_with_the_gather_equals_the_whole_update(world2, stage, precision):
    """The optimizer's update split into the gather's pieces (their broadcasts started as they are
    updated) leaves exactly the parameters of the whole update; the grad norm from the update pass
    sums the same squares in another order."""
    by_piece, whole = world2.run(update_by_piece_case, stage, precision, True), \
        world2.run(update_by_piece_case, stage, precision, False)
    for (calls, params, norm), (no_calls, expected, expected_norm) in zip(by_piece, whole):
        assert calls == 3 and no_calls == 0
        paths, leaves, _ = tree_flatten_with_paths(params)
        assert paths == tree_flatten_with_paths(expected)[0]
        for path, value, reference in zip(paths, leaves, tree_flatten_with_paths(expected)[1]):
            assert torch.equal(value, reference), path
        assert norm == pytest.approx(expected_norm, rel=1e-6)
