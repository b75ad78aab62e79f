"""The 1-bit family on gloo ranks: the compressed all-reduce against the one-process model bit for
bit (outputs, both error buffers, bytes), multi-rank training against a one-process model of the
algorithm, and a small GPT trained with 1-bit Adam against Adam."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed as fs
from fspeed.parallel.comm import CommLog
from fspeed.compressed_allreduce import CompressionPlan, compressed_allreduce, simulate_compressed_allreduce
from fspeed.flat import Flat
from fspeed.optim.base import per_tensor_norms
from fspeed.optim.onebit import ZeroOneAdamState, zero_one_counters, zero_one_full_allreduce
from fspeed.optim.onebit_lamb import frozen_factor, momentum_scaling, trust_ratios
from test_onebit_optim import SHAPES, batch_for, linear_loss, tree



# ---------------------------------------------------------------------------------- the collective


def collective_case(sizes, seed, steps):
    """On every rank: `steps` compressed all-reduces of rank-specific inputs; returns outputs and errors."""
    import torch.distributed as dist

    from fspeed.parallel.mesh import Mesh

    mesh = Mesh(data=-1, log=CommLog())
    comm = mesh.comm("data")
    rank, n = comm.rank, comm.size
    plan = CompressionPlan(tuple(sizes), n)
    we, se = torch.zeros(plan.total), torch.zeros(plan.server_numel)
    outs = []
    for step in range(steps):
        x = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(seed * 1000 + step * 10 + rank))
        outs.append(compressed_allreduce(plan.pad(x), we, se, plan, comm))
    bytes_by_op = dict(mesh.log.bytes_by_op)
    dist.barrier()
    return outs, we, se, bytes_by_op


def model_case(world, sizes, seed, steps):
    plan = CompressionPlan(tuple(sizes), world)
    we = [torch.zeros(plan.total) for _ in range(world)]
    se = [torch.zeros(plan.server_numel) for _ in range(world)]
    outs = []
    for step in range(steps):
        xs = [torch.randn(sum(sizes), generator=torch.Generator().manual_seed(seed * 1000 + step * 10 + r))
              for r in range(world)]
        outs.append(simulate_compressed_allreduce([plan.pad(x) for x in xs], we, se, plan))
    return outs, we, se


def check_against_model(results, world, sizes, seed, steps):
    outs, we, se = model_case(world, sizes, seed, steps)
    plan = CompressionPlan(tuple(sizes), world)
    for r, (r_outs, r_we, r_se, bytes_by_op) in enumerate(results):
        for step in range(steps):
            assert torch.equal(r_outs[step], outs[step][r]), f"rank {r} step {step}"
        assert torch.equal(r_we, we[r]) and torch.equal(r_se, se[r]), f"rank {r} error buffers"
        segs = len(sizes)
        assert bytes_by_op["all_to_all"] == steps * plan.total // 8
        assert bytes_by_op["all_gather"] == steps * (plan.server_numel // 8 + 2 * 4 * segs)


@settings(max_examples=6, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_gloo_2_ranks_equal_model_exactly(world2, sizes, seed):
    check_against_model(world2.run(collective_case, sizes, seed, 3), 2, sizes, seed, 3)


@settings(max_examples=4, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_gloo_4_ranks_equal_model_exactly(world4, sizes, seed):
    check_against_model(world4.run(collective_case, sizes, seed, 3), 4, sizes, seed, 3)


# ---------------------------------------------------------------------------------- training


def make_onebit(kind, world):
    if kind == "onebit_lamb":
        return fs.optim.onebit_lamb(1e-2, freeze_step=3, weight_decay=0.01, world_size=world)
    if kind == "onebit_adam":
        return fs.optim.onebit_adam(1e-2, freeze_step=3, weight_decay=0.01, world_size=world)
    return fs.optim.zero_one_adam(1e-2, weight_decay=0.01, var_freeze_step=6, var_update_scaler=2, local_step_scaler=2,
                                  local_step_clipper=4, world_size=world)


def train_ranks(kind, steps, rows):
    mesh = fs.Mesh(data=-1, log=fs.CommLog())
    n, rank = mesh.size("data"), mesh.coordinate("data")
    opt = make_onebit(kind, n)
    plan = fs.zero(0)
    state = fs.init_train_state(tree(0), opt, plan=plan, mesh=mesh)
    step = fs.make_train_step(linear_loss, opt, plan=plan, mesh=mesh)
    for i in range(steps):
        x = batch_for(i, rows * n)["x"]
        state, _ = step(state, {"x": x[rank * rows:(rank + 1) * rows]})
    return state.params.buffer.clone(), state.opt_state.worker_error.clone(), state.opt_state.server_error.clone()


def model_training(kind, world, steps, rows):
    """The algorithm for `world` ranks in one process, per tensor (DeepSpeed's per-parameter calls)."""
    opt_hp = make_onebit(kind, world).info.hparams
    lr, b1, b2, eps, wd = (opt_hp[k] for k in ("lr", "b1", "b2", "eps", "weight_decay"))
    sizes = [math.prod(SHAPES[k]) for k in sorted(SHAPES)]
    plans = [CompressionPlan((s,), world) for s in sizes]
    p = Flat.from_tree(tree(0)).buffer.clone()
    m, v = torch.zeros(62), torch.zeros(62)
    we = [[torch.zeros(pl.total) for _ in range(world)] for pl in plans]
    se = [[torch.zeros(pl.server_numel) for _ in range(world)] for pl in plans]
    state = ZeroOneAdamState(0, lr, None, None, None, 0.0, 1, 0, 1, 0, None, None)
    lrs, ps, ms, accs = 0.0, [], [], [torch.zeros(62) for _ in range(world)]

    def allreduce(per_rank):  # list over ranks of flat buffers -> the common result
        pieces = [x.split(sizes) for x in per_rank]
        out = [simulate_compressed_allreduce([pl.pad(pr[k]) for pr in pieces], we[k], se[k], pl)[0]
               for k, pl in enumerate(plans)]
        return torch.cat([pl.unpad(o) for pl, o in zip(plans, out)])

    def adamw(p, m, v):
        denom = v.sqrt().add_(eps)
        p.mul_(1 - lr * wd)
        p.addcdiv_(m, denom, value=-lr)

    for i in range(steps):
        t = i + 1
        x = batch_for(i, rows * world)["x"]
        local = [x[r * rows:(r + 1) * rows].mean(0) for r in range(world)]
        mean = sum(local) / world
        if kind == "onebit_adam":
            if t <= opt_hp["freeze_step"]:
                m.lerp_(mean, 1 - b1)
                v.mul_(b2).addcmul_(mean, mean, value=1 - b2)
            else:
                m = allreduce([m.clone().lerp_(g, 1 - b1) for g in local])
            adamw(p, m, v)
            continue
        vfs = opt_hp["var_freeze_step"]
        if t <= vfs + 1:
            ps = ps if t > 1 else [p.clone() for _ in local]
            if zero_one_full_allreduce(state, vfs):
                v.mul_(b2).addcmul_(mean, mean, value=1 - b2)
                m.lerp_(mean, 1 - b1)
            else:
                m.lerp_(allreduce(local), 1 - b1)
            for pr in ps:
                adamw(pr, m, v)
            ms = [m.clone() for _ in local]
        else:
            # every rank's local step, then the sync; (p + acc) - acc is not p bitwise, so ranks differ
            lrs += lr
            denom = v.sqrt().add_(eps)
            for r, g in enumerate(local):
                ms[r].lerp_(g, 1 - b1)
                u = ms[r] / denom
                u.add_(ps[r], alpha=wd)
                ps[r].add_(u, alpha=-lr)
                accs[r].add_(u, alpha=-lr)
            assert t % state.local_step_interval == 0, "the test's schedule syncs every phase-B step"
            for r in range(world):
                ps[r].sub_(accs[r])
                accs[r].mul_(denom)
            reduced = allreduce(accs)
            ms = [torch.div(reduced, -lrs) for _ in local]
            for pr in ps:
                pr.add_(reduced / denom)
            accs = [torch.zeros(62) for _ in local]
            lrs = 0.0
        state = state._replace(count=t, **zero_one_counters(state, t, vfs, opt_hp["var_update_scaler"],
                                                           opt_hp["local_step_scaler"], opt_hp["local_step_clipper"]))
        if t == vfs + 1:
            for errs in we + se:
                for e in errs:
                    e.zero_()
    if kind == "zero_one_adam":
        return ps, we, se
    return [p] * world, we, se


@pytest.mark.parametrize("kind", ["onebit_adam", "zero_one_adam"])
def test_two_ranks_match_the_one_process_model(world2, kind):
    steps = 8 if kind == "onebit_adam" else 9  # 0/1: phase A with 1-bit steps, then synced local steps
    results = world2.run(train_ranks, kind, steps, 4)
    p, we, se = model_training(kind, 2, steps, 4)
    sizes = [math.prod(SHAPES[k]) for k in sorted(SHAPES)]
    for r, (params, worker_error, server_error) in enumerate(results):
        assert torch.equal(params, p[r]), (kind, r)
        assert torch.equal(worker_error, torch.cat([we[k][r] for k in range(len(sizes))]))
        assert torch.equal(server_error, torch.cat([se[k][r] for k in range(len(sizes))]))


def test_four_ranks_match_the_one_process_model(world4):
    results = world4.run(train_ranks, "onebit_adam", 6, 2)
    p, we, se = model_training("onebit_adam", 4, 6, 2)
    for r, (params, worker_error, _) in enumerate(results):
        assert torch.equal(params, p[r]), r
        assert torch.equal(worker_error, torch.cat([we[k][r] for k in range(3)]))


def lamb_model_training(world, steps, rows):
    """1-bit LAMB for `world` ranks in one process: warmup on the mean gradient, then every rank's
    momentum (scaled per tensor) goes through one fused 1-bit all-reduce with a persistent padding tail."""
    hp = make_onebit("onebit_lamb", world).info.hparams
    lr, b1, b2, eps, wd, freeze = (hp[k] for k in ("lr", "b1", "b2", "eps", "weight_decay", "freeze_step"))
    sizes = [math.prod(SHAPES[k]) for k in sorted(SHAPES)]
    plan = CompressionPlan((62,), world)
    p = Flat.from_tree(tree(0)).buffer.clone()
    m, v, vf, tail = torch.zeros(62), torch.zeros(62), torch.zeros(62), torch.zeros(plan.total - 62)
    we = [torch.zeros(plan.total) for _ in range(world)]
    se = [torch.zeros(plan.server_numel) for _ in range(world)]
    coeff_freeze, last = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    counts = torch.tensor(sizes)

    def norms(x):
        return per_tensor_norms(list(x.split(sizes)))

    for i in range(steps):
        t = i + 1
        x = batch_for(i, rows * world)["x"]
        local = [x[r * rows:(r + 1) * rows].mean(0) for r in range(world)]
        if t <= freeze:
            mean = sum(local) / world
            m.lerp_(mean, 1 - b1)
            v.mul_(b2).addcmul_(mean, mean, value=1 - b2)
            if t == freeze:
                vf.copy_(v)
            u = (m / v.sqrt().add_(eps)).add_(p, alpha=wd)
            coeffs = trust_ratios(norms(p), norms(u), hp["min_coeff"], hp["max_coeff"])
            cb = hp["coeff_beta"]
            coeff_freeze = torch.where(coeffs != 1.0, cb * coeff_freeze + (1 - cb) * coeffs.double(), coeff_freeze)
            p.add_(u.mul_((coeffs * -lr).repeat_interleave(counts)))
            continue
        m_prev = m.clone()
        if t == freeze + 1:
            scale = momentum_scaling(norms(m_prev), sizes).float().repeat_interleave(counts)
        sent = [torch.cat([m.clone().lerp_(g, 1 - b1).mul_(scale), tail]) for g in local]
        out = simulate_compressed_allreduce(sent, we, se, plan)[0]
        m, tail = out[:62].div_(scale), out[62:]
        reconstructed = (m - m_prev * b1) / (1 - b1)
        vf.mul_(b2).addcmul_(reconstructed, reconstructed, value=1 - b2)
        denom = v.sqrt().add_(eps)
        prelim = m / denom
        u = prelim + wd * p
        ratio = torch.stack([d.max() for d in (denom / vf.sqrt().add_(eps)).split(sizes)]).double()
        update_ratio = torch.clamp(norms(prelim).double() / norms(u).double(), max=1.0)
        ratio = ratio * update_ratio + (1.0 - update_ratio)
        last = frozen_factor(ratio, last, hp["factor_min"], hp["factor_max"], hp["factor_threshold"])
        p.add_(u.mul_((coeff_freeze * last * -lr).float().repeat_interleave(counts)))
    return p, we, se


@pytest.mark.parametrize("world_name", ["world2", "world4"])
def test_onebit_lamb_ranks_match_the_one_process_model(world_name, request):
    world = request.getfixturevalue(world_name)
    n, steps, rows = int(world_name[-1]), 7, 2
    results = world.run(train_ranks, "onebit_lamb", steps, rows)
    p, we, se = lamb_model_training(n, steps, rows)
    for r, (params, worker_error, server_error) in enumerate(results):
        assert torch.equal(params, p), r
        assert torch.equal(worker_error, we[r]) and torch.equal(server_error, se[r]), r
    assert not torch.equal(we[0], we[1])  # the ranks' errors differ: a checkpoint must keep each


def masked_momentum_ranks(kind, masked, steps):
    """Train with the first 10 entries of tensor "c" always getting a zero gradient; returns the momentum."""
    mesh = fs.Mesh(data=-1)
    n, rank = mesh.size("data"), mesh.coordinate("data")
    mask = {"c": (torch.arange(40) >= 10).float()} if masked else None
    if kind == "zero_one_adam":  # phase A with 1-bit steps, then synced local steps
        opt = fs.optim.zero_one_adam(1e-2, weight_decay=0.01, var_freeze_step=4, var_update_scaler=2,
                                     local_step_scaler=2, local_step_clipper=2, world_size=n, exp_avg_mask=mask)
    else:
        make = fs.optim.onebit_adam if kind == "onebit_adam" else fs.optim.onebit_lamb
        opt = make(1e-2, freeze_step=2, weight_decay=0.01, world_size=n, exp_avg_mask=mask)
    plan = fs.zero(0)
    state = fs.init_train_state(tree(0), opt, plan=plan, mesh=mesh)
    step = fs.make_train_step(linear_loss, opt, plan=plan, mesh=mesh)
    for i in range(steps):
        x = batch_for(i, 2 * n)["x"]
        x[:, 22:32] = 0  # flat order a (15), b (7), c (40): c[:10]
        state, _ = step(state, {"x": x[rank * 2:(rank + 1) * 2]})
    return state.opt_state.mu.buffer.clone()


@pytest.mark.parametrize("kind", ["onebit_adam", "onebit_lamb", "zero_one_adam"])
def test_exp_avg_mask_keeps_zero_momentum_at_zero(world2, kind):
    """1-bit compression cannot send zeros: without the mask, entries whose gradient is always 0
    pick up momentum from the error feedback; with it they stay exactly 0 (DeepSpeed's exp_avg_mask)."""
    steps = 8 if kind == "zero_one_adam" else 6
    plain = world2.run(masked_momentum_ranks, kind, False, steps)
    masked = world2.run(masked_momentum_ranks, kind, True, steps)
    for mu in plain:
        assert mu[22:32].abs().max() > 0
    for mu in masked:
        assert torch.equal(mu[22:32], torch.zeros(10)) and mu[32:].abs().min() > 0


def test_exp_avg_mask_errors_name_the_problem():
    params = Flat.from_tree(tree(0))
    opt = fs.optim.onebit_adam(freeze_step=0, exp_avg_mask={"nope": torch.ones(3)})
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"exp_avg_mask names parameters that do not exist: \['nope'\]"):
        opt.apply(Flat(torch.zeros(62), params.layout), state, params)
    opt = fs.optim.onebit_lamb(freeze_step=0, exp_avg_mask={"c": torch.ones(3)})
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"exp_avg_mask\['c'\] has shape \[3\], which does not broadcast"):
        opt.apply(Flat(torch.zeros(62), params.layout), state, params)
    with pytest.raises(TypeError, match="exp_avg_mask must be a dict"):
        fs.optim.onebit_adam(exp_avg_mask=[torch.ones(3)])


# ---------------------------------------------------------------------------------- checkpoints


def resume_ranks(kind, directory, split, steps, rows):
    """Train `split` steps and save; then both continue the live state and resume a fresh one from the
    checkpoint to `steps`. Returns both runs' params and error buffers on this rank."""
    mesh = fs.Mesh(data=-1)
    n, rank = mesh.size("data"), mesh.coordinate("data")
    opt, plan = make_onebit(kind, n), fs.zero(0)
    step = fs.make_train_step(linear_loss, opt, plan=plan, mesh=mesh)

    def run(state, start):
        for i in range(start, steps):
            x = batch_for(i, rows * n)["x"]
            state, _ = step(state, {"x": x[rank * rows:(rank + 1) * rows]})
        return [t.clone() for t in (state.params.buffer, state.opt_state.worker_error, state.opt_state.server_error)]

    state = fs.init_train_state(tree(0), opt, plan=plan, mesh=mesh)
    for i in range(split):
        x = batch_for(i, rows * n)["x"]
        state, _ = step(state, {"x": x[rank * rows:(rank + 1) * rows]})
    fs.checkpoint.save_checkpoint(directory, state, mesh=mesh)
    saved_errors = state.opt_state.worker_error.clone()
    continued = run(state, split)
    template = fs.init_train_state(tree(1), opt, plan=plan, mesh=mesh)
    loaded, _ = fs.checkpoint.load_checkpoint(directory, template, mesh=mesh)
    assert loaded.step == split and torch.equal(loaded.opt_state.worker_error, saved_errors)
    return continued, run(loaded, split), saved_errors


@pytest.mark.parametrize("kind", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_resume_keeps_every_ranks_error_buffers(world2, tmp_path, kind):
    """After compressed steps each rank has its own error buffers (and, for 0/1 Adam's local steps,
    its own params): every rank saves and restores its own, and the resumed run equals the live one."""
    results = world2.run(resume_ranks, kind, str(tmp_path), 5, 9, 2)
    for r, (continued, resumed, _) in enumerate(results):
        for a, b in zip(continued, resumed):
            assert torch.equal(a, b), (kind, r)
    assert not torch.equal(results[0][2], results[1][2])


# ---------------------------------------------------------------------------------- a GPT


def noisy_counting(cfg, rows, seed):
    """Sequences that count up mod vocab, with 20% random tokens: learnable, with a loss floor."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, cfg.vocab_size, (rows, 1), generator=gen)
    x = (start + torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    noise = torch.rand(x.shape, generator=gen) < 0.2
    x = torch.where(noise, torch.randint(0, cfg.vocab_size, x.shape, generator=gen), x)
    return {"inputs": x[:, :-1], "targets": x[:, 1:]}


def train_gpt(kind, steps):
    mesh = fs.Mesh(data=-1)
    n, rank = mesh.size("data"), mesh.coordinate("data")
    cfg = fs.models.GPTConfig(vocab_size=16, seq_len=12, n_layer=1, n_head=2, d_model=32)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    opt = (fs.optim.onebit_adam(3e-3, freeze_step=steps // 4, world_size=n) if kind == "onebit_adam"
           else fs.optim.adam(3e-3))
    plan = fs.zero(0)
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    rows = 16
    for i in range(steps):
        batch = noisy_counting(cfg, rows * n, 1 + i)
        state, _ = step(state, {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()})
    val = noisy_counting(cfg, 64, 10**6)
    return fs.make_eval_step(model.loss, plan=plan, mesh=mesh)(state, val)


def test_gpt_trains_with_onebit_adam_like_adam(world2):
    steps = 60
    adam = world2.run(train_gpt, "adam", steps)[0]
    onebit = world2.run(train_gpt, "onebit_adam", steps)[0]
    initial = math.log(16)
    assert adam < 0.75 * initial  # it learned something
    assert abs(onebit - adam) <= 0.05 * adam, (onebit, adam)


# ---------------------------------------------------------------------------------- the CLI


def test_fspeed_train_launch_with_onebit_adam_then_resume(tmp_path):
    """fspeed-train --launch with 1-bit Adam on 2 ranks at a small size: compressed steps after
    freeze_step, a per-rank checkpoint, and a resume from it."""
    import csv

    from tests.test_cli import fspeed_train

    common = ("--launch", "optimizer=onebit_adam", "optimizer.freeze_step=2", "parallel.data=2",
              "train.eval_every=0", "train.eval_batches=1", "data.max_bytes=100000", "model.n_layer=1",
              "model.d_model=32", "model.seq_len=32", "train.micro_batch_size=4", "monitor.progress_bar=false")
    proc = fspeed_train(*common, "train.steps=4", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "onebit_adam(" in proc.stdout + proc.stderr and "freeze_step=2" in proc.stdout + proc.stderr
    ckpt = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in (ckpt / "global_step4").iterdir()) == [
        "meta.json", "rank_00000.safetensors", "rank_00001.safetensors"]
    proc = fspeed_train(*common, "train.steps=6", "checkpoint.resume=true", f"checkpoint.dir={ckpt}",
                        f"hydra.run.dir={tmp_path / 'resumed'}", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 4" in proc.stdout + proc.stderr
    with open(tmp_path / "resumed" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows][-2:] == ["5", "6"] and all(float(r["loss"]) > 0 for r in rows if r["loss"])
