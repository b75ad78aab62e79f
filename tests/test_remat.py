"""Activation checkpointing (remat): the no-remat gradients, less kept memory, on any model and plan."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed as fs
from fspeed.remat_budget import bytes_kept_for_backward
from fspeed.host_memory import live_host_bytes
from tests.fresh_process import in_fresh_process
from tests.hf_models import SEQ, VOCAB, hf_gpt2, hf_llama


def lm_loss(outputs, batch):
    return outputs.loss


def gradient(model, params, batch, precision="fp32", seed=0):
    """One micro-batch's gradient (flat, fp32) and loss through make_train_step."""
    opt = fs.optim.sgd(0.0)
    state = fs.init_train_state(params, opt, precision=getattr(fs.precision, precision)(), seed=seed,
                                model=model if model.init_buffers is not None else None)
    step = fs.make_train_step(model.loss, opt)
    s = step.begin(state)
    step.micro(s, state, batch)
    return s.runtime.finish().buffer.float().clone(), float(s.losses[0])


def gpt(n_layer, dropout=0.1):
    cfg = fs.models.GPTConfig(vocab_size=VOCAB, n_layer=n_layer, n_head=2, d_model=16, seq_len=SEQ, dropout=dropout)
    return fs.models.gpt(cfg)


def gpt_batch(rows, seq, seed):
    x = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"inputs": x, "targets": x.roll(-1, 1)}


def hf_batch(rows, seed, **extra):
    """use_cache=False: remat turns the cache off (a recompute would append to it), and the
    cached path rounds differently, so the reference runs without it too."""
    x = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": x, "labels": x, "use_cache": False, **extra}


@settings(max_examples=8, deadline=None)
@given(n_layer=st.integers(1, 4), every=st.integers(1, 3), policy=st.sampled_from(["full", "save_matmuls"]),
       rows=st.integers(1, 3), seq=st.integers(2, SEQ), seed=st.integers(0, 100))
def test_gpt_remat_gradients_equal_no_remat_exactly(n_layer, every, policy, rows, seq, seed):
    model = gpt(n_layer)
    params = model.init(torch.Generator().manual_seed(seed))
    batch = gpt_batch(rows, seq, seed)
    want, want_loss = gradient(model, params, batch, seed=seed)
    got, loss = gradient(fs.remat(model, policy, every), params, batch, seed=seed)
    assert loss == want_loss
    assert torch.equal(got, want)  # the same ops in the same order, the same dropout masks


@pytest.mark.parametrize("policy", ["full", "save_matmuls", fs.remat_policies.save_named("nothing-tagged")])
def test_hf_gpt2_with_dropout_remat_equals_no_remat(policy):
    module = hf_gpt2(dropout=0.1, layers=3)
    model = fs.functionalize(module, lm_loss)
    batch = hf_batch(2, 1)
    want, want_loss = gradient(model, model.init(), batch, seed=3)
    got, loss = gradient(fs.remat(model, policy, every=2), model.init(), batch, seed=3)
    assert loss == want_loss and torch.equal(got, want)


def test_remat_turns_the_cache_off_so_the_recompute_matches():
    module = hf_gpt2(dropout=0.1, layers=2)
    model = fs.functionalize(module, lm_loss)
    batch = hf_batch(2, 5)
    want, _ = gradient(model, model.init(), batch, seed=2)
    del batch["use_cache"]  # the model's default (True) would grow the cache in the recompute
    got, _ = gradient(fs.remat(model, "save_matmuls"), model.init(), batch, seed=2)
    assert torch.equal(got, want)


def test_bf16_remat_within_bf16_tolerance():
    module = hf_llama(layers=2)
    model = fs.functionalize(module, lm_loss)
    batch = hf_batch(2, 2)
    want, _ = gradient(model, model.init(), batch, "bf16")
    got, _ = gradient(fs.remat(model, "save_matmuls"), model.init(), batch, "bf16")
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_hugging_face_gradient_checkpointing_gets_fspeed_remat():
    """A layer's own torch.utils.checkpoint would recompute on the module's own (stale) weights
    after functional_call has put them back: fspeed's remat takes its place, exactly."""
    module = hf_gpt2(dropout=0.1, layers=2)
    model = fs.functionalize(module, lm_loss)
    batch = hf_batch(2, 4)
    params = {k: v for k, v in model.init().items()}
    want, _ = gradient(model, params, batch, seed=1)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(0.5)  # the module's own weights differ from the state's from here on
    module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    got, _ = gradient(model, params, batch, seed=1)
    assert torch.equal(got, want)
    assert all(m.gradient_checkpointing for m in module.transformer.h)  # the user's switch is left on


def test_remat_patterns_must_name_units():
    model = fs.functionalize(hf_gpt2(), lm_loss)
    with pytest.raises(ValueError, match=r"match no unit.*transformer\.h\.0"):
        fs.remat(model, where=["transformer.h.*.attn"])
    with pytest.raises(ValueError, match="policy 'everything' is not one of"):
        fs.remat(model, "everything")
    with pytest.raises(ValueError, match="every=0"):
        fs.remat(model, every=0)
    with pytest.raises(ValueError, match="path patterns apply to functionalize"):
        fs.remat(gpt(2), where=["blocks.*"])


def forward_kept_bytes(model, params, batch):
    return fs.measure_activations(model, params, batch)[0]


def policies_kept():
    """(kept bytes without remat, with save_matmuls, with full) of a 4-layer GPT; run in a fresh process
    (`tests.fresh_process`), so malloc's count is not moved by what ran before in the test process."""
    cfg = fs.models.GPTConfig(vocab_size=VOCAB, n_layer=4, n_head=2, d_model=64, seq_len=128)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    batch = gpt_batch(8, 128, 0)
    return tuple(forward_kept_bytes(m, params, batch)
                 for m in (model, fs.remat(model, "save_matmuls"), fs.remat(model, "full")))


@pytest.mark.skipif(live_host_bytes() is None, reason="counts malloc's bytes (glibc)")
def test_policies_keep_what_they_promise():
    """full keeps block inputs only; save_matmuls keeps the matmul outputs too; no remat keeps all."""
    none, matmuls, full = in_fresh_process(policies_kept)
    block_input = 8 * 128 * 64 * 4
    logits = 8 * 128 * VOCAB * 4
    assert full < none / 4, (full, none)
    assert full < 4 * block_input + 4 * logits + 12 * block_input + (1 << 20)  # inputs + head + one block's
    assert full < matmuls < none, (full, matmuls, none)


FULL_REMAT = dict(layers=4, rows=16, seq=128, width=64)


def full_remat_kept():
    """Bytes a fully rematerialized GPT (FULL_REMAT's sizes, vocabulary VOCAB) keeps for backward with
    its head and loss fused, then as separate ops; run in a fresh process."""
    layers, rows, seq, width = FULL_REMAT.values()
    kept = []
    for fused_head in (True, False):
        cfg = fs.models.GPTConfig(vocab_size=VOCAB, n_layer=layers, n_head=2, d_model=width, seq_len=seq,
                                  fused_head=fused_head)
        model = fs.models.gpt(cfg)
        kept.append(forward_kept_bytes(fs.remat(model, "full"), model.init(torch.Generator().manual_seed(0)),
                                       gpt_batch(rows, seq, 0)))
    return tuple(kept)


@pytest.mark.skipif(live_host_bytes() is None, reason="counts malloc's bytes (glibc)")
def test_full_remat_keeps_one_input_per_block_and_the_fused_heads_gradients():
    """The theory of benchmarks/activation_memory.py: each block's input, and what the fused head and
    loss took in forward (the gradients of the last block's output, of the tied head weight and of
    ln_f's weight and bias), plus each checkpointed block's bookkeeping (the autograd nodes of its
    forward, checkpoint's saved RNG state): under 64 KiB a block here. With the separate head ops
    (fused_head=False, what the default takes below GPTConfig's FUSED_HEAD_MIN_LOGITS) ln_f's input
    and output and the log-probabilities stay instead of the one gradient."""
    layers, rows, seq, width = FULL_REMAT.values()
    block_input = rows * seq * width * 4
    theory = layers * block_input + block_input + (VOCAB + 2) * width * 4
    fused, separate = in_fresh_process(full_remat_kept)
    assert theory < fused < theory + layers * (64 << 10), (fused, theory)
    log_probs = rows * seq * VOCAB * 4
    held = layers * block_input + 2 * block_input + log_probs  # the block inputs, ln_f's input and output
    assert held < separate < held + layers * (64 << 10) + (64 << 10), (separate, held)


def test_fspeed_train_with_activation_checkpointing_trains_the_same_run(tmp_path):
    """activation_checkpointing.policy=full (with dropout) gives the no-remat run's losses exactly."""
    import csv

    from tests.test_cli import fspeed_train

    losses = {}
    for policy in ("none", "full"):
        run_dir = tmp_path / policy
        extra = ["activation_checkpointing.profile=true", "train.log_every=2"] if policy == "full" else \
            ["activation_checkpointing.budget_mib=1000"]  # roomy: measured, and no remat chosen
        proc = fspeed_train("train.steps=4", "train.eval_every=0", "data.max_bytes=100000", "model.n_layer=2",
                            "model.dropout=0.1", f"activation_checkpointing.policy={policy}", f"hydra.run.dir={run_dir}",
                            "monitor.progress_bar=false", *extra, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(run_dir / "metrics.csv") as f:
            losses[policy] = [r["loss"] for r in csv.DictReader(f)]
        logs = proc.stdout + proc.stderr
        if policy == "full":
            assert "activation checkpointing, ms per step" in logs and "blocks.1" in logs
            with open(run_dir / "metrics.csv") as f:
                rows = list(csv.DictReader(f))[1:]
            assert all(float(r["remat_recompute_ms"]) > 0 and float(r["remat_backward_ms"]) > 0 for r in rows)
        else:
            assert "none               1" in logs and "<- chosen" in logs and "activations" in logs
    assert losses["full"] == losses["none"] and len(losses["none"]) == 5
    proc = fspeed_train("activation_checkpointing.policy=full", "activation_checkpointing.partition_activations=true",
                        f"hydra.run.dir={tmp_path / 'bad'}",
                        cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "activation_checkpointing.partition_activations" in proc.stderr
    assert "parallel.tensor is 1" in proc.stderr


def remat_llama():
    return fs.remat(fs.functionalize(hf_llama(layers=2), lm_loss), "save_matmuls")


def remat_llama_sliced():
    """With its own tp_plan: the layers the tensor=2 case slices (the plain one's have no logical axes)."""
    return fs.remat(fs.functionalize(hf_llama(layers=2), lm_loss, tp_plan="auto"), "save_matmuls")


def remat_llama_host_inputs():
    return fs.remat(fs.functionalize(hf_llama(layers=2), lm_loss), "full", offload=True)  # cpu_checkpointing


def remat_gpt2():
    module = hf_gpt2(dropout=0.1, layers=2)  # a data rank's micro-batch draws the masks one process draws for it
    module.activation_checkpointing_enable()  # Hugging Face's switch: fspeed's remat takes its place
    return fs.functionalize(module, lm_loss)


def sgd():
    return fs.optim.sgd(0.1)  # Adam would amplify the rounding noise of the key biases (true gradient 0)


def llama_batch(rows, seed):
    batch = hf_batch(rows, seed)
    del batch["use_cache"]  # both sides remat, so both run without the cache
    return batch


@pytest.mark.parametrize("build, stage, tensor, offload", [
    (remat_llama, 3, 1, None), (remat_gpt2, 3, 1, None), (remat_llama_sliced, 1, 2, None),
    (remat_llama_host_inputs, 2, 1, "cpu")])
def test_remat_under_zero_and_tensor_slicing_matches_one_process(world2, build, stage, tensor, offload):
    """The recompute runs inside ZeRO-3's second gather, on tensor-sliced layers, beside ZeRO-Offload."""
    from fspeed.testing import assert_trains_like_one_process

    zero = fs.zero(stage, offload_optimizer=offload) if offload else fs.zero(stage)
    plan = zero | (fs.tensor_slicing(fs.models.module_tp_rules) if tensor > 1 else fs.Plan(()))
    assert_trains_like_one_process(build, plan, make_batch=llama_batch, world_size=2, tensor=tensor, steps=2,
                                   grad_accum=2, world=world2,
                                   optimizer=sgd)


def partitioned_case(partition):
    """On a tensor=2 world: the bytes a fully rematerialized GPT keeps for backward, and its gradient."""
    cfg = fs.models.GPTConfig(vocab_size=VOCAB, n_layer=4, n_head=2, d_model=64, seq_len=128, fused_head=True)
    model = fs.remat(fs.models.gpt(cfg), "full", partition=partition)
    mesh = fs.Mesh(data=1, model=2)
    plan = fs.tensor_slicing(fs.models.gpt_rules)
    params = model.init(torch.Generator().manual_seed(0))
    batch = gpt_batch(8, 128, 0)
    opt = fs.optim.sgd(0.0)
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh, model=model)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    state, _ = step(state, batch)  # warm up
    kept = []
    for _ in range(3):  # the fewest of three: gloo's own threads allocate now and then, and malloc counts them
        s = step.begin(state)
        kept.append(bytes_kept_for_backward(lambda: step.micro(s, state, batch))[0])
        grad = s.runtime.finish().buffer.clone()
    return min(kept), grad


@pytest.mark.skipif(live_host_bytes() is None, reason="counts malloc's bytes (glibc)")
def test_partitioned_activations_keep_half_the_block_inputs_on_tensor_2():
    """On a world of its own: ranks that ran other tests would count their malloc history too."""
    from fspeed.testing import GlooWorld

    with GlooWorld(2) as world:
        whole = world.run(partitioned_case, False)
        parts = world.run(partitioned_case, True)
    one_input = 8 * 128 * 64 * 4
    partitioned = 4 * one_input + one_input  # the 4 block inputs and the fused head's x gradient (the same size)
    for (kept_whole, grad_whole), (kept_part, grad_part) in zip(whole, parts):
        assert torch.equal(grad_part, grad_whole)  # the recompute sees the gathered input, bit for bit
        saved = kept_whole - kept_part
        assert 0.4 * partitioned < saved < 0.6 * partitioned, (saved, partitioned)


def test_partition_needs_tensor_slicing():
    model = fs.remat(gpt(2), "full", partition=True)
    with pytest.raises(ValueError, match="no tensor slicing"):
        gradient(model, model.init(torch.Generator().manual_seed(0)), gpt_batch(2, 8, 0))


def test_contiguous_inputs_and_profile_keep_the_numbers():
    """contiguous: every kept input in one buffer, allocated once after the first step; profile:
    forward, recompute and backward time per block; the gradient is unchanged by either."""
    model = gpt(3)
    params = model.init(torch.Generator().manual_seed(0))
    batch = gpt_batch(2, 12, 0)
    want, _ = gradient(model, params, batch)
    profile = fs.RematProfile()
    remat_model = fs.remat(model, "full", profile=profile, contiguous=True)
    for _ in range(3):
        got, _ = gradient(remat_model, params, batch)
        assert torch.equal(got, want)
    sums = profile.take()
    assert sorted(sums) == ["blocks.0", "blocks.1", "blocks.2"]
    for row in sums.values():
        assert row["forward"] > 0 and row["recompute"] > 0 and row["backward"] > 0
    assert "total" in profile.table(sums) and profile.take() == {}


@pytest.mark.parametrize("with_profile", [False, True])
def test_synchronize_checkpoint_boundary_syncs_each_blocks_forward_and_backward(monkeypatch, with_profile):
    """DeepSpeed's synchronize_checkpoint_boundary: a device synchronize at the start and end of each
    checkpointed block's forward and backward (4 per block per step), the gradient unchanged."""
    model = gpt(3)
    params = model.init(torch.Generator().manual_seed(0))
    batch = gpt_batch(2, 12, 0)
    want, _ = gradient(model, params, batch)
    calls = []
    monkeypatch.setattr(torch.cpu, "synchronize", lambda device=None: calls.append(device))
    profile = fs.RematProfile() if with_profile else None
    got, _ = gradient(fs.remat(model, "full", every=2, synchronize=True, profile=profile), params, batch)
    assert torch.equal(got, want)
    assert len(calls) == 4 * 2  # blocks 0 and 2 are checkpointed (every=2)
    calls.clear()
    gradient(fs.remat(model, "full", profile=profile), params, batch)
    assert calls == []


def test_contiguous_arena_reuses_one_buffer():
    from fspeed.rematerialization import ContiguousArena

    arena = ContiguousArena()
    for _ in range(3):
        views = [arena.take(torch.full((5, 7), float(i))) for i in range(4)]
        assert all(torch.equal(v, torch.full((5, 7), float(i))) for i, v in enumerate(views))
        for _ in views:
            arena.release()
    assert arena.allocations <= 3  # grows while the first forward asks, then reuses
    allocations = arena.allocations
    for _ in range(4):
        arena.take(torch.ones(5, 7))
    assert arena.allocations == allocations


def budget_case():
    """The budget choices of a 4-layer GPT, in a fresh process: (kept bytes without remat, with full,
    the choice for half of none's, whether its gradient equals none's, the choice for twice none's and
    whether that returned the model itself, the refusal for a quarter of full's)."""
    cfg = fs.models.GPTConfig(vocab_size=VOCAB, n_layer=4, n_head=2, d_model=64, seq_len=128)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    batch = gpt_batch(8, 128, 0)
    none, _ = fs.measure_activations(model, params, batch)
    full, _ = fs.measure_activations(fs.remat(model, "full"), params, batch)
    chosen, half = fs.remat_within_budget(model, params, batch, budget_bytes=none // 2)
    same = torch.equal(gradient(chosen, params, batch)[0], gradient(model, params, batch)[0])
    roomy, twice = fs.remat_within_budget(model, params, batch, budget_bytes=2 * none)
    try:
        fs.remat_within_budget(model, params, batch, budget_bytes=full // 4)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return none, full, half, same, twice, roomy is model, refusal


@pytest.mark.skipif(live_host_bytes() is None, reason="counts malloc's bytes (glibc)")
def test_budget_picks_the_cheapest_policy_that_fits():
    none, full, choice, same_gradient, roomy_choice, roomy_is_model, refusal = in_fresh_process(budget_case)
    assert full < none / 4
    policy, every = choice.chosen
    assert policy is not None and choice.tried[-1][2] <= none // 2 and all(t[2] > none // 2 for t in choice.tried[:-1])
    assert "<- chosen" in str(choice)
    assert same_gradient
    assert roomy_choice.chosen == (None, 1) and roomy_is_model
    assert refusal is not None and "no activation checkpointing fits" in refusal


def test_host_copies_give_the_values_back_in_backward_order():
    """The CPU path of cpu_checkpointing's copies (inline; CUDA's side streams are checked on a GPU by
    benchmarks/sparse_attention_gpu.py): each block input comes back as it was, also to a second
    recompute, and the chain of inputs ends with the backward that consumed it."""
    from fspeed.host_copies import HostCopies

    copies = HostCopies()
    inputs = [torch.randn(3, 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    held = [copies.offload(x) for x in inputs]
    assert copies.bytes_to_host == 3 * 15 * 4
    for h, x in reversed(list(zip(held, inputs))):  # backward: the last block's input first
        got = copies.fetch(h)
        assert torch.equal(got, x) and got.data_ptr() != x.data_ptr()
    assert torch.equal(copies.fetch(held[1]), inputs[1])  # a second recompute of a block
    assert copies.last is None and all(h.before is None for h in held)
    assert copies.bytes_to_device == 4 * 15 * 4


@pytest.mark.parametrize("every", [1, 2])
def test_cpu_checkpointing_gradients_equal_no_remat_exactly(every):
    """Offloaded inputs come back bit for bit; dropout replays (the GPT's dropout is 0.1)."""
    model = gpt(3)
    params = model.init(torch.Generator().manual_seed(3))
    batch = gpt_batch(2, SEQ, 3)
    want, want_loss = gradient(model, params, batch, seed=3)
    got, loss = gradient(fs.remat(model, "full", every, offload=True), params, batch, seed=3)
    assert loss == want_loss
    assert torch.equal(got, want)
