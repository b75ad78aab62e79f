"""fspeed.parallel.memory: the estimate equals the bytes the buffers really hold, follows the ZeRO
paper's formulas, and reports the peak within a step."""

import importlib

import pytest
import torch

import fspeed as fs
from fspeed.parallel import zero
from fspeed.parallel.memory import layout_memory
from fspeed.pytree import tensor_leaves
from tests.parallel_cases import global_batch, gpt_setup, offload_plan, tiny_gpt


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
            persistent = layout.persistent_numel
            assert persistent == sum(layout.params[i].local_numel for u in layout.units for i in u.resident_params)
            # masters, moments and the gradient accumulator: the shards and the persistent partition, 1/N of
            # everything (plus padding); the compute params also hold the persistent parameters whole, and the
            # gradients one packed bucket for them
            whole = n * layout.persistent_part
            expected = {"params": 2 * (local + whole), "grads": 2 * (local + persistent), "master": 4 * local,
                        "optimizer": 8 * local}
            assert local < psi / n + n * (len(layout.units) + 1)
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


def default_persistence_case(precision):
    """ZeRO-3 at DeepSpeed's default param_persistence_threshold on this world's ranks, a GPT whose
    every parameter is persistent: the bytes each model-state buffer holds after a step, the
    model's element count, and the estimate (what the memory line prints)."""
    mesh = fs.Mesh(data=-1)
    cfg, model, params = gpt_setup(0, n_layer=2, d_model=64)
    opt, plan = fs.optim.adamw(1e-3), zero(3)
    prec = getattr(fs.precision, precision)()
    state = fs.init_train_state(params, opt, precision=prec, plan=plan, mesh=mesh)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh, grad_accum=2)
    state, _ = step(state, global_batch(cfg, 4, 0, 0))
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    shares = state.master.buffer.untyped_storage().data_ptr() == state.params.buffer.untyped_storage().data_ptr()
    held = {"params": nbytes(state.params.buffer), "grads": step.persistent_grad_bytes(),
            "master": 0 if shares else nbytes(state.master.buffer),  # fp32: the compute buffer's leading part
            "optimizer": nbytes(state.opt_state.mu.buffer) + nbytes(state.opt_state.nu.buffer)}
    psi = fs.Flat.from_tree(params).buffer.numel()
    return held, state.master.buffer.numel(), psi, fs.estimate_memory(params, plan, mesh.sizes, prec)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_persistent_parameters_keep_only_their_compute_copy_whole(world2, precision):
    """As DeepSpeed's stage 3 (a `ds_persist` parameter stays gathered, but its `ds_tensor`
    partition is what the fp32 partition and the optimizer state are built from, and its gradient
    is reduce-scattered): masters, optimizer state and gradients are 1/2 of the model on each of
    2 ranks (plus padding), the compute parameters whole (plus their partition's copy), and the
    memory line is what the buffers hold."""
    for held, master_numel, psi, est in world2.run(default_persistence_case, precision):
        part = -(-psi // 2)
        assert est.persistent == psi  # every parameter is persistent at the default threshold
        assert master_numel == part and held["optimizer"] == 8 * part  # Adam's two fp32 moments, 1/2 each
        assert held["master"] == (4 * part if precision == "bf16" else 0)
        pb = 2 if precision == "bf16" else 4
        assert held["params"] == pb * (part + 2 * part)  # the partition's compute copy, then every parameter whole
        # the fp32 accumulator of the partition, and one fp32 bucket packing the persistent gradients
        assert held["grads"] == 4 * part + 4 * psi
        assert held == est.device and sum(held.values()) == est.device_total
        line = str(est)
        assert f"{est.device_total / 2**20:.2f} MiB per rank" in line and f"{psi:,} persistent elements" in line


def measured_memory_case(stage, precision, offload, offload_param):
    """Bytes of every model-state buffer after two steps, split by where ZeRO-Offload puts them,
    with the estimate for the same params, plan, mesh and precision."""
    zero_mod = importlib.import_module("fspeed.parallel.runtime")

    host_allocations = []
    real = zero_mod.host_buffer

    def recording(numel, dtype, pin_memory):
        host_allocations.append(numel * torch.empty(0, dtype=dtype).element_size())
        return real(numel, dtype, pin_memory)

    zero_mod.host_buffer = recording  # the runtime's host gradient and staging buffers
    try:
        mesh = fs.Mesh(data=-1)
        cfg, model, params = tiny_gpt(0, n_layer=3, d_model=32)
        opt, plan = fs.optim.adamw(1e-3), offload_plan(stage, offload, offload_param, persistence=300)
        prec = fs.precision.bf16(grad_accum_dtype="bf16") if precision == "bf16" else fs.precision.fp32()
        state = fs.init_train_state(params, opt, precision=prec, plan=plan, mesh=mesh)
        step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
        for i in range(2):
            x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(i))
            state, _ = step(state, {"inputs": x[:, :-1], "targets": x[:, 1:]})
    finally:
        zero_mod.host_buffer = real
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    params_b = nbytes(state.params.buffer)
    grads_device, grads_host = step.persistent_grad_bytes("device"), step.persistent_grad_bytes("host")
    shares = lambda a, b: a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # noqa: E731
    # fp32 ZeRO-1/2 update the params' own slice in place: those masters hold no bytes of their own
    master_b = nbytes(state.master.buffer) if state.master is not None and \
        not shares(state.master.buffer, state.params.buffer) else 0
    opt_b = nbytes(state.opt_state.mu.buffer) + nbytes(state.opt_state.nu.buffer)
    on_device = {"params": 0 if offload_param else params_b, "grads": grads_device,
                 "master": 0 if offload else master_b, "optimizer": 0 if offload else opt_b}
    on_host = (params_b if offload_param else 0) + grads_host + (master_b + opt_b if offload else 0) \
        + sum(host_allocations)
    estimate = fs.estimate_memory(params, plan, mesh.sizes, prec)
    return on_device, on_host, estimate


@pytest.mark.parametrize("stage, offload, offload_param", [(1, True, False), (2, False, False), (2, True, False),
                                                           (3, True, False), (3, True, True)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_estimator_matches_the_bytes_really_held(world2, stage, offload, offload_param, precision):
    for on_device, on_host, est in world2.run(measured_memory_case, stage, precision, offload, offload_param):
        assert {k: est.device[k] for k in on_device} == on_device
        assert est.cpu_total == on_host
        assert (est.cpu_total > 0) == offload


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_estimator_follows_the_zero_paper_formulas(stage):
    psi, n = 8 * 3 * 1000, 8
    precision = fs.precision.bf16(grad_accum_dtype="bf16")  # the paper's 2 + 2 + 12 bytes per parameter
    plain = fs.estimate_memory(psi, offload_plan(stage, False), {"data": n}, precision)
    off = fs.estimate_memory(psi, offload_plan(stage, True), {"data": n}, precision)
    both = fs.estimate_memory(psi, offload_plan(3, True, True), {"data": n}, precision)
    k_part = 12 * psi // n
    assert plain.paper_device == {1: 4 * psi + k_part, 2: 2 * psi + 14 * psi // n, 3: 16 * psi // n}[stage]
    assert off.paper_device == plain.paper_device - k_part and off.paper_cpu == 16 * psi // n  # 12 + fp32 grads
    assert both.paper_device == 0 and both.paper_cpu == 20 * psi // n
    # stage 2 also keeps its reduce bucket (DeepSpeed's IPG buffer: reduce_bucket_size elements, here
    # capped at the model's size); stage 1's partition is a view of its accumulation buffer
    bucket = 2 * psi if stage == 2 else 0
    assert plain.device_total == plain.paper_device + bucket
    assert off.device_total == off.paper_device + bucket
    # on CPU: 12 bytes of masters and moments + the 16-bit gradient and 16-bit staging = the paper's 16
    assert off.cpu_total == off.paper_cpu and off.device["master"] == off.device["optimizer"] == 0
    # parameters offloaded too: the 16-bit host gradient is read as it is, no 4-byte copy
    assert both.cpu_total == both.paper_cpu - 4 * psi // n and both.device_total == 0
    assert both.peak["gathered"] == 2 * psi  # the one unit, gathered for its forward
    assert "ZeRO paper formula" in str(off) and "CPU" in str(off)


def test_estimator_rejects_bad_input():
    with pytest.raises(ValueError, match="positive element count"):
        fs.estimate_memory(0, zero(2), {"data": 2})
    with pytest.raises(ValueError, match="allowed: 'fp32', 'bf16', 'fp16'"):
        fs.estimate_memory(10, zero(2), {"data": 2}, "int8")




def test_estimator_reports_the_peak_within_a_step():
    cfg = fs.models.GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=4, d_model=64)
    params = fs.models.gpt(cfg).init(torch.Generator())
    n, bucket = 4, 5000
    est = fs.estimate_memory(params, zero(2, reduce_bucket_size=bucket, overlap_comm=True), {"data": n}, "bf16")
    block = sum(t.numel() for t in tensor_leaves(params["blocks"][0]))
    psi = sum(t.numel() for t in tensor_leaves(params))
    part = -(-psi // n)
    assert est.device["grads"] == 4 * (part + 2 * bucket)  # fp32 partition accumulator and two buckets
    assert est.peak["unit grads"] == 2 * max(block, params["wte"].numel())  # bf16 gradients of the largest unit
    assert est.peak_grad_bytes == est.device["grads"] + est.peak["unit grads"]
    assert est.device_peak == est.device_total + sum(est.peak.values())
    stage3 = fs.estimate_memory(params, zero(3, param_persistence_threshold=0), {"data": n}, "bf16")
    assert stage3.peak["gathered"] == 2 * 2 * block  # the unit computing and the one prefetched
    assert "peak" in str(stage3)
    assert stage1_holds_its_full_buffer(params, n)


def stage1_holds_its_full_buffer(params, n):
    est = fs.estimate_memory(params, zero(1), {"data": n}, "bf16")
    psi = sum(t.numel() for t in tensor_leaves(params))
    return est.device["grads"] == 4 * n * -(-psi // n)
