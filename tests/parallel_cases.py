"""Shared cases for the parallel tests: a tiny reference GPT trained on one process or on a gloo
world, each data rank taking its share of every global batch (workers import these by module path)."""

import math

import torch

import fspeed as fs
from fspeed.parallel import gather_params, tensor_slicing, zero


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


def tiny_gpt(seed, n_layer=2, d_model=16, vocab=24, seq=8):
    cfg = fs.models.GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=n_layer, n_head=4, d_model=d_model)
    model = fs.models.gpt(cfg)
    return cfg, model, model.init(torch.Generator().manual_seed(seed))


def offload_plan(stage, offload, offload_param=False, persistence=0):
    return zero(stage, param_persistence_threshold=persistence, offload_optimizer="cpu" if offload else "none",
                offload_param="cpu" if offload_param else "none")
