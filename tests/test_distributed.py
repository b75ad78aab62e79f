"""ZeRO 0-3 and tensor slicing on real gloo worlds, against the one-process run."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed as fs
from fspeed.plan import model_state_bytes, resolve, tensor_slicing, zero
from fspeed.testing import GlooWorld, WorkerError
from fspeed.zero import gather_params


@pytest.fixture(scope="module")
def world2():
    with GlooWorld(2) as world:
        yield world


@pytest.fixture(scope="module")
def world4():
    with GlooWorld(4) as world:
        yield world


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
          mesh=None):
    """Train the tiny GPT; with a plan, each data rank takes its share of every global batch."""
    cfg, model, params = gpt_setup(seed)
    opt = make_opt(opt_kind)
    prec = getattr(fs.precision, precision)()
    plan = None
    if stage is not None:
        options = {"param_persistence_threshold": persistence}
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


def distributed_case(seed, steps, grad_accum, micro, opt_kind, stage, tp, precision="fp32", persistence=0, bucket=None):
    mesh = fs.Mesh(data=-1, model=tp)
    flat, losses, norms, state = train(seed, steps, grad_accum, micro, opt_kind, precision, stage, tp, persistence,
                                       bucket, mesh)
    sizes = {"params": state.params.buffer.numel(),
             "master": state.master.buffer.numel() if state.master is not None else 0}
    return flat, losses, norms, sizes


CASES = [(stage, ga) for stage in (0, 1, 2, 3) for ga in (1, 3)]


@pytest.mark.parametrize("stage, grad_accum", CASES)
def test_zero_stages_match_one_process_on_2_ranks(world2, stage, grad_accum):
    seed, steps, micro = 11 + stage, 3, 2
    results = world2.run(distributed_case, seed, steps, grad_accum, micro, "sgd", stage, 1, "fp32", 0, 1000)
    ref_flat, ref_losses, ref_norms, _ = train(seed, steps, grad_accum, micro * 2, "sgd")
    for flat, *_ in results:
        assert torch.equal(flat, results[0][0])
    torch.testing.assert_close(results[0][0], ref_flat, rtol=1e-5, atol=1e-6)
    for got, want in zip(results[0][1], ref_losses):
        assert math.isclose(got, want, rel_tol=1e-5)
    for got, want in zip(results[0][2], ref_norms):
        assert math.isclose(got, want, rel_tol=1e-4)
