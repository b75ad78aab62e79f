"""ZeRO 0-3 and tensor slicing on real gloo worlds, against the one-process run."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed as fs
from fspeed.parallel import resolve, tensor_slicing, zero
from fspeed.testing import GlooWorld, WorkerError
from fspeed.parallel import gather_params
from fspeed.parallel.memory import layout_memory



def gpt_setup(seed, n_layer=2, d_model=16, n_head=4, vocab=24, seq=8):
    cfg = fs.models.GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=n_layer, n_head=n_head, d_model=d_model)
    model = fs.models.gpt(cfg)
    return cfg, model, model.init(torch.Generator().manual_seed(seed))


def make_opt(kind):
    if kind == "sgd":
        return fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.sgd(0.3, momentum=0.9, weight_decay=0.01))
    return fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.adamw(3e-3, weight_decay=0.1))


def global_batch(cfg, rows, seed, step):
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=torch.Generator().manual_seed(seed * 1000 + step))
    return {"inputs": x[:, :-1], "targets": x[:, 1:]}


def train(seed, steps, grad_accum, micro, opt_kind, precision="fp32", stage=None, tp=1, persistence=0, bucket=None,
          mesh=None, dims=None, recompute=False, overlap=None):
    """Train the tiny GPT; with a plan, each data rank takes its share of every global batch."""
    cfg, model, params = gpt_setup(seed, **(dims or {}))
    opt = make_opt(opt_kind)
    prec = getattr(fs.precision, precision)()
    plan = None
    if stage is not None:
        options = {"param_persistence_threshold": persistence, "recompute_blocks": recompute, "overlap_comm": overlap}
        if bucket:
            options.update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
        plan = zero(stage, **options)
        if tp > 1:
            plan = plan | tensor_slicing(fs.models.gpt_rules)
    dp = mesh.size("data") if mesh else 1
    rank = mesh.coordinate("data") if mesh else 0
    state = fs.init_train_state(params, opt, precision=prec, plan=plan, mesh=mesh, logical_axes=model.logical_axes)
    step = fs.make_train_step(model.loss, opt, grad_accum=grad_accum, plan=plan, mesh=mesh)
    losses, norms = [], []
    rows = micro * grad_accum * dp
    for i in range(steps):
        batch = global_batch(cfg, rows, seed, i)
        share = {k: v[rank * rows // dp:(rank + 1) * rows // dp] for k, v in batch.items()}
        state, metrics = step(state, share)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    full = gather_params(state, mesh) if mesh else state.master_params.tree()
    return fs.Flat.from_tree(full).buffer, losses, norms, state


def distributed_case(seed, steps, grad_accum, micro, opt_kind, stage, tp, precision="fp32", persistence=0, bucket=None,
                     dims=None, recompute=False, overlap=None):
    mesh = fs.Mesh(data=-1, model=tp)
    flat, losses, norms, state = train(seed, steps, grad_accum, micro, opt_kind, precision, stage, tp, persistence,
                                       bucket, mesh, dims, recompute, overlap)
    sizes = {"params": state.params.buffer.numel(),
             "master": state.master.buffer.numel() if state.master is not None else 0}
    return flat, losses, norms, sizes


def assert_matches_one_process(results, seed, steps, grad_accum, micro, dp, opt_kind="sgd", precision="fp32",
                               rtol=1e-5, atol=1e-6, dims=None):
    """Every rank gathered the same parameters, equal to the one-process run on the global batches."""
    for flat, *_ in results:
        assert torch.equal(flat, results[0][0])
    ref_flat, ref_losses, ref_norms, _ = train(seed, steps, grad_accum, micro * dp, opt_kind, precision, dims=dims)
    torch.testing.assert_close(results[0][0], ref_flat, rtol=rtol, atol=atol)
    for got, want in zip(results[0][1], ref_losses):
        assert math.isclose(got, want, rel_tol=max(rtol, 1e-5), abs_tol=atol)
    for got, want in zip(results[0][2], ref_norms):
        assert math.isclose(got, want, rel_tol=max(rtol, 1e-4), abs_tol=atol)


@pytest.mark.parametrize("stage, grad_accum", [(stage, ga) for stage in (0, 1, 2, 3) for ga in (1, 3)])
def test_zero_stages_match_one_process_on_2_ranks(world2, stage, grad_accum):
    seed, steps, micro = 11 + stage, 3, 2
    results = world2.run(distributed_case, seed, steps, grad_accum, micro, "sgd", stage, 1, "fp32", 0, 1000)
    assert_matches_one_process(results, seed, steps, grad_accum, micro, dp=2)


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


def memory_case(stage):
    """Per-rank bytes of every model-state buffer after a step (bf16 params and gradients, AdamW)."""
    mesh = fs.Mesh(data=-1)
    cfg, model, params = gpt_setup(0, n_layer=3, d_model=32)
    opt = fs.optim.adamw(1e-3)
    plan = zero(stage, param_persistence_threshold=300)
    precision = fs.precision.bf16(grad_accum_dtype="bf16")
    state = fs.init_train_state(params, opt, precision=precision, plan=plan, mesh=mesh)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    state, _ = step(state, global_batch(cfg, 2, 0, 0))
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    return {
        "params": nbytes(state.params.buffer),
        "grads": step.persistent_grad_bytes(),
        "master": nbytes(state.master.buffer),
        "optimizer": nbytes(state.opt_state.mu.buffer) + nbytes(state.opt_state.nu.buffer),
        "layout": state.layout,
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_rank_model_state_bytes_follow_the_zero_formulas(world4, stage):
    results = world4.run(memory_case, stage)
    for got in results:
        layout = got["layout"]
        psi, n, p = layout.local.numel, layout.data_size, layout.partition_numel
        if stage == 3:
            local = layout.storage.numel
            assert any(u.sharded for u in layout.units) and any(not u.sharded for u in layout.units)
            resident = sum(layout.params[i].local_numel for u in layout.units for i in u.resident_params)
            # the shard accumulator and one packed bucket holding all persistent parameters
            expected = {"params": 2 * local, "grads": 2 * (local + resident), "master": 4 * local,
                        "optimizer": 8 * local}
            assert local < psi / n + resident + n * len(layout.units)
        else:
            padded = n * p if stage else psi
            # stage 0-1 keep one full accumulation buffer; stage 2 only its partition and one bucket
            # (overlap_comm is off by default below stage 3)
            expected = {"params": 2 * padded, "grads": 2 * {0: padded, 1: padded, 2: p + psi}[stage],
                        "master": 4 * (p if stage else psi), "optimizer": 8 * (p if stage else psi)}
        assert {k: got[k] for k in expected} == expected
    # the layout's own accounting (what explain() and estimate_memory print) is what the buffers hold
    mem = layout_memory(results[0]["layout"], fs.precision.bf16(grad_accum_dtype="bf16"))
    assert (results[0]["params"], results[0]["grads"], results[0]["master"], results[0]["optimizer"]) == \
        (mem.device["params"], mem.device["grads"], mem.device["master"], mem.device["optimizer"])


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


def test_a_dead_rank_makes_the_others_fail_with_a_clear_error():
    with GlooWorld(2, timeout_s=60) as world:
        with pytest.raises(WorkerError) as err:
            world.run(dying_rank_case)
    text = str(err.value)
    assert "rank 1 died (exit code 3)" in text
    assert "CommError" in text and "over mesh axis 'data'" in text and "peer rank" in text


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


# ----------------------------------------------------------------- sharded checkpoints


def run_steps(state, step, cfg, seed, rows, dp, rank, start, stop):
    for i in range(start, stop):
        batch = global_batch(cfg, rows, seed, i)
        state, _ = step(state, {k: v[rank * rows // dp:(rank + 1) * rows // dp] for k, v in batch.items()})
    return state


def checkpoint_case(directory, stage, tp, precision, fail_rank=None):
    """Train 4 steps straight; and 2 steps, save, load into a fresh state, 2 more: equal bits."""
    import fspeed.checkpoint as ck
    mesh = fs.Mesh(data=-1, model=tp)
    seed, dp, rank = 3, mesh.size("data"), mesh.coordinate("data")
    rows = 2 * dp
    cfg, model, params = gpt_setup(seed)
    opt = make_opt("adamw")
    plan = zero(stage, param_persistence_threshold=0) | (tensor_slicing(fs.models.gpt_rules) if tp > 1 else fs.Plan())

    def fresh():
        return fs.init_train_state(params, opt, precision=getattr(fs.precision, precision)(), plan=plan, mesh=mesh,
                                   logical_axes=model.logical_axes)
    step = fs.make_train_step(model.loss, opt, grad_accum=2, plan=plan, mesh=mesh)
    straight = run_steps(fresh(), step, cfg, seed, rows, dp, rank, 0, 4)
    state = run_steps(fresh(), step, cfg, seed, rows, dp, rank, 0, 2)
    path = ck.save_checkpoint(directory, state, mesh=mesh, client_state={"note": "x", "t": torch.arange(3)})
    failure = None
    if fail_rank is not None:  # a later save that fails on one rank must leave this one in place
        real = ck._write_safetensors
        if mesh.rank == fail_rank:
            ck._write_safetensors = lambda *a: (_ for _ in ()).throw(OSError("disk full"))
        try:
            ck.save_checkpoint(directory, run_steps(state, step, cfg, seed, rows, dp, rank, 2, 3), mesh=mesh,
                               tag="global_step2")
        except ck.CheckpointError as e:
            failure = str(e)
        finally:
            ck._write_safetensors = real
        return failure, sorted(p.name for p in path.iterdir()), ck.latest_tag(directory)
    resumed, client = ck.load_checkpoint(directory, fresh(), mesh=mesh)
    resumed = run_steps(resumed, step, cfg, seed, rows, dp, rank, 2, 4)
    same = all(torch.equal(a, b) for a, b in zip(ck.state_entries(straight)[0].values(),
                                                   ck.state_entries(resumed)[0].values()))
    scalars = ck.state_entries(straight)[1] == ck.state_entries(resumed)[1]
    # another layout is refused on every rank, naming both
    other = zero(1 if stage != 1 else 2) | (tensor_slicing(fs.models.gpt_rules) if tp > 1 else fs.Plan())
    try:
        ck.load_checkpoint(directory, fs.init_train_state(params, opt, plan=other, mesh=mesh,
                                                          logical_axes=model.logical_axes), mesh=mesh)
        refused = None
    except ck.CheckpointError as e:
        refused = str(e)
    return same, scalars, client["note"], client["t"].tolist(), sorted(p.name for p in path.iterdir()), refused


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "bf16"), (2, "fp16"), (3, "bf16")])
def test_sharded_checkpoint_resumes_bit_exact_on_2_ranks(world2, tmp_path, stage, precision):
    results = world2.run(checkpoint_case, str(tmp_path), stage, 1, precision)
    for same, scalars, note, t, files, refused in results:
        assert same and scalars and note == "x" and t == [0, 1, 2]
        assert files == ["meta.json", "rank_00000.safetensors", "rank_00001.safetensors"]
        assert "another layout" in refused and "stage" in refused


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_checkpoint_with_tensor_slicing_on_4_ranks(world4, tmp_path, stage):
    for same, scalars, *_ in world4.run(checkpoint_case, str(tmp_path), stage, 2, "fp32"):
        assert same and scalars


def test_a_save_failing_on_one_rank_keeps_the_last_checkpoint(world2, tmp_path):
    results = world2.run(checkpoint_case, str(tmp_path), 2, 1, "fp32", 1)
    for failure, files, latest in results:
        assert "rank 1: OSError: disk full" in failure and "previous checkpoint is untouched" in failure
        assert latest == "global_step2" and "rank_00001.safetensors" in files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def gathered_bytes_case(recompute):
    """Bytes of gathered ZeRO-3 weights still held when each unit's backward starts."""
    import fspeed.parallel.ops as so
    calls, held = [], []
    real_init, real_backward = so._BlockCall.__init__, so._GatheredUnit.backward

    def init(self, *args):
        real_init(self, *args)
        calls.append(self)

    def backward(ctx, grad):
        held.append(sum(c.full.untyped_storage().nbytes() for c in calls if c.full is not None))
        return real_backward(ctx, grad)
    so._BlockCall.__init__, so._GatheredUnit.backward = init, staticmethod(backward)
    try:
        flat, *_ = distributed_case(1, 1, 1, 2, "sgd", 3, 1, dims={"n_layer": 3, "d_model": 32}, recompute=recompute)
    finally:
        so._BlockCall.__init__, so._GatheredUnit.backward = real_init, staticmethod(real_backward)
    return len(calls), held


@pytest.mark.parametrize("recompute", [False, True])
def test_zero3_frees_gathered_layers_between_forward_and_backward(world2, recompute):
    for n_calls, held in world2.run(gathered_bytes_case, recompute):
        assert n_calls == 3 and len(held) == 3
        assert held == [0, 0, 0]  # every gathered layer was freed after its forward
