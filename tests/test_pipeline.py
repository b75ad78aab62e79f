"""Pipeline parallelism: stages from a model's layers, every schedule and partition against the
one-process reference (hypothesis), PP x DP x ZeRO, PP x TP, fp16 overflow on one stage, tied
parameters, in-flight micro-batches, evaluation, checkpoints, a Hugging Face model as layers."""

import math
import time

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed as fs
from fspeed.parallel.pipeline_transform import balanced_bounds, partition_layers, uniform_bounds
from fspeed.testing import assert_trains_like_one_process
from tests.fresh_process import in_fresh_process
from tests.hf_models import (hf_gpt2_layers, hf_gpt2_traced, hf_llama_layers, hf_llama_traced, lm_batch,
                              lm_dict_batch, lm_labels_batch)

VOCAB, SEQ = 64, 16


def gpt(n_layer: int = 4, tie: bool = True):
    """With dropout: each layer draws the same masks on any stage as in the one-process run."""
    return fs.models.gpt(fs.models.GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=n_layer, d_model=32, n_head=4,
                                             tie_embeddings=tie, dropout=0.1))


def gpt2_layers():
    return gpt(2)


def gpt3_layers():
    return gpt(3)


def gpt4_layers():
    return gpt(4)


def gpt6_layers():
    return gpt(6)


def gpt3_untied():
    return gpt(3, tie=False)


def batch(rows: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"inputs": torch.randint(0, VOCAB, (rows, SEQ), generator=g),
            "targets": torch.randint(0, VOCAB, (rows, SEQ), generator=g)}


def sgd():
    """Clipping (by the norm over every stage) then SGD with momentum: Adam would blow the rounding
    noise of near-zero gradients (summed in another order over stages and data ranks) up to its step size."""
    return fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.sgd(0.1, momentum=0.9))


BUILDERS = {2: gpt2_layers, 3: gpt3_layers, 4: gpt4_layers, 6: gpt6_layers}


class _EmbedWithMask(torch.nn.Module):
    """ids -> (hidden, mask): a tuple crosses the stage boundaries (a bool mask, no gradient)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)

    def forward(self, ids):
        return self.emb(ids), ids % 3 != 0


class _MaskedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, inputs):  # one argument, the tuple (DeepSpeed's PipelineModule convention)
        h, mask = inputs
        return h + torch.tanh(self.lin(h)) * mask.unsqueeze(-1), mask


def tuple_layers(seed: int = 0):
    torch.manual_seed(seed)
    return fs.models.sequential([_EmbedWithMask(), *[_MaskedBlock() for _ in range(4)],
                                 lambda inputs: inputs[0], torch.nn.Dropout(0.2), torch.nn.Linear(16, VOCAB)],
                                loss_fn=lambda logits, b: F.cross_entropy(logits.flatten(0, 1), b["targets"].flatten()))

# -- partitions and the plan (one process) --------------------------------------------------------


class _L:
    def __init__(self, kind):
        self.kind = kind


def test_uniform_partition_is_deepspeeds():
    assert uniform_bounds(10, 4) == [0, 3, 6, 8, 10]  # the first n % p pieces one more
    assert uniform_bounds(4, 4) == [0, 1, 2, 3, 4]


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.integers(0, 50), min_size=1, max_size=9), data=st.data())
def test_balanced_partition_minimises_the_heaviest_piece(weights, data):
    pieces = data.draw(st.integers(1, len(weights)))
    bounds = balanced_bounds(weights, pieces)
    assert bounds[0] == 0 and bounds[-1] == len(weights) and all(a < b for a, b in zip(bounds, bounds[1:]))
    heaviest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
    best = math.inf
    import itertools
    for cuts in itertools.combinations(range(1, len(weights)), pieces - 1):
        edges = [0, *cuts, len(weights)]
        best = min(best, max(sum(weights[a:b]) for a, b in zip(edges, edges[1:])))
    assert heaviest == best


def test_partition_methods_and_their_errors():
    layers = [_L("Embedding"), _L("TransformerBlock"), _L("TransformerBlock"), _L("TransformerBlock"), _L("Head")]
    assert partition_layers("type:block", layers, [1] * 5, 2) in ([0, 2, 5], [0, 3, 5])
    assert partition_layers((2, 3), layers, [1] * 5, 2) == [0, 2, 5]
    with pytest.raises(ValueError, match="matches no layer kind"):
        partition_layers("type:conv", layers, [1] * 5, 2)
    with pytest.raises(ValueError, match="needs 2 layer counts"):
        partition_layers((2, 2), layers, [1] * 5, 2)
    with pytest.raises(ValueError, match="allowed: uniform, parameters"):
        fs.pipeline(4, partition="best")
    with pytest.raises(ValueError, match="schedule='gpipeline'"):
        fs.pipeline(4, schedule="gpipeline")
    with pytest.raises(ValueError, match="needs schedule='interleaved_1f1b'"):
        fs.pipeline(4, virtual_stages=2)
    with pytest.raises(ValueError, match="micro_batches=0"):
        fs.pipeline(0)


def test_stages_hold_their_layers_and_the_tied_embedding():
    model = gpt(4)
    params = model.init(torch.Generator().manual_seed(0))
    plan = fs.pipeline(4, partition="uniform")
    first = fs.parallel.resolve(plan, params, {"pipe": 2, "data": 1, "model": 1}, {"pipe": 0}, layers=model.layers)
    last = fs.parallel.resolve(plan, params, {"pipe": 2, "data": 1, "model": 1}, {"pipe": 1}, layers=model.layers)
    assert {"wte", "wpe", "blocks.1.ln1.weight"} <= set(first.local.paths)
    assert "blocks.2.ln1.weight" not in first.local.paths
    assert "wte" in last.local.paths and "blocks.3.mlp.w_in" in last.local.paths and "wpe" not in last.local.paths
    assert first.pipeline.tied == (("wte", (0, 1)),)
    assert "stage 0: embed..blocks.1 (3)" in first.pipeline.describe()
    with pytest.raises(ValueError, match="fewer than the 8 pipeline pieces"):
        fs.parallel.resolve(fs.pipeline(8), params, {"pipe": 8}, {"pipe": 0}, layers=model.layers)
    with pytest.raises(ValueError, match="needs the model's layer sequence"):
        fs.parallel.resolve(plan, params, {"pipe": 2}, {"pipe": 0})
    with pytest.raises(ValueError, match="micro_batches=3, stages=2; use 2 or 4"):  # when the state is built
        fs.parallel.resolve(fs.pipeline(3, schedule="interleaved_1f1b", virtual_stages=2), params, {"pipe": 2},
                            {"pipe": 0}, layers=model.layers)
    with pytest.raises(ValueError, match="ZeRO stage 3 with a pipeline"):
        fs.parallel.resolve(fs.zero(3) | plan, params, {"pipe": 2}, {"pipe": 0}, layers=model.layers)
    table = fs.explain(plan, params, fs.Mesh.single(), model.logical_axes, layers=model.layers)
    assert "stages" in table and "stage 0: embed..head (6)" in table


def test_layer_sequences_compute_the_models_loss():
    model = gpt(3)
    params = model.init(torch.Generator().manual_seed(0))
    b = batch(2, 0)
    assert torch.equal(model.layers.run(params, b), model.loss(params, b))
    # with dropout: layer i draws from generator i of fspeed.rng.layer_generators in both
    seeded = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    assert torch.equal(model.layers.run(params, b, rng=seeded()), model.loss(params, b, rng=seeded()))
    assert not torch.equal(model.loss(params, b, rng=seeded()), model.loss(params, b))
    seq = hf_gpt2_layers()
    p = seq.init()
    assert sorted(p) == ["1", "2", "3", "4", "tied"] and len(seq.layers.layers) == 6
    assert torch.isfinite(seq.loss(p, lm_dict_batch(2, 0)))


def test_a_step_needs_the_model_and_whole_steps():
    model = gpt(2)
    opt = fs.optim.adamw(1e-3)
    with pytest.raises(ValueError, match="pass the Model itself"):
        fs.make_train_step(model.loss, opt, plan=fs.pipeline(2), mesh=fs.Mesh.single())
    with pytest.raises(ValueError, match="grad_accum=3 but the pipeline runs micro_batches=2"):
        fs.make_train_step(model, opt, grad_accum=3, plan=fs.pipeline(2), mesh=fs.Mesh.single())


def test_one_stage_pipeline_matches_the_plain_step():
    """pipe=1: every piece on this process (interleaved chunks hand activations over locally)."""
    model = gpt(3)
    opt = fs.optim.sgd(0.1)  # Adam would blow up the rounding noise of the key bias (whose true gradient is 0)
    plan = fs.pipeline(2, schedule="interleaved_1f1b", virtual_stages=2, partition="uniform")
    mesh = fs.Mesh.single()
    params = model.init(torch.Generator().manual_seed(0))
    piped = fs.init_train_state(params, opt, plan=plan, mesh=mesh, model=model)
    plain = fs.init_train_state(params, opt, model=model)
    step_p = fs.make_train_step(model, opt, plan=plan, mesh=mesh)
    step_1 = fs.make_train_step(model.loss, opt, grad_accum=2)
    for i in range(2):
        piped, mp = step_p(piped, batch(4, i))
        plain, m1 = step_1(plain, batch(4, i))
        assert mp["loss"] == pytest.approx(m1["loss"], rel=1e-6)
    for path, t in zip(fs.tree_paths(plain.params.tree()), fs.pytree.tree_leaves(plain.params.tree())):
        torch.testing.assert_close(dict(piped.params.items())[path], t, rtol=1e-5, atol=1e-6)


# -- against the one-process reference on gloo worlds ---------------------------------------------

CASES = st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])


@settings(max_examples=8, deadline=None)
@given(schedule=CASES, partition=st.sampled_from(["uniform", "parameters", "type:block", "explicit"]),
       pipe=st.sampled_from([2, 4]), n_layer=st.integers(2, 4), micro=st.integers(1, 4), stage=st.sampled_from([0, 1, 2]),
       seed=st.integers(0, 3), interval=st.sampled_from([0, 0, 1, 2]), overlap=st.booleans(), first=st.booleans())
def test_every_schedule_and_partition_trains_like_one_process(world4, schedule, partition, pipe, n_layer, micro,
                                                              stage, seed, interval, overlap, first):
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    pieces = pipe * virtual
    layers = n_layer + 2
    if layers < pieces:
        n_layer, layers = 6, 8
    if schedule == "interleaved_1f1b":
        micro = pipe * max(1, micro // pipe)
    if partition == "explicit":
        partition = tuple(uniform_bounds(layers, pieces)[k + 1] - uniform_bounds(layers, pieces)[k]
                          for k in range(pieces))
    # overlap: small buckets, reduced over data as the stage's sums in them become final
    zero = fs.zero(stage, overlap_comm=True, reduce_bucket_size=1000) if overlap else fs.zero(stage)
    plan = zero | fs.pipeline(micro, schedule, partition, virtual, activation_checkpoint_interval=interval,
                              input_grad_first=first or schedule == "zero_bubble")
    assert_trains_like_one_process(BUILDERS[n_layer], plan,
                                   make_batch=batch, world_size=4, pipe=pipe, world=world4, steps=2, seed=seed,
                                   optimizer=sgd)


def test_pipe_times_tensor_slicing_trains_like_one_process(world4):
    plan = fs.zero(1) | fs.tensor_slicing(fs.models.gpt_rules) | fs.pipeline(2, "zero_bubble")
    assert_trains_like_one_process(gpt3_layers, plan, make_batch=batch, world_size=4, pipe=2, tensor=2,
                                   world=world4, steps=2, atol=1e-5)


def hf_llama_layers_tied():
    return hf_llama_layers(tied=True)


def hf_llama_layers_untied():
    return hf_llama_layers(tied=False)


def hf_llama_layers_unfused():
    return hf_llama_layers(tied=False, fused=False)


LLAMA_LAYERS = {"tied": hf_llama_layers_tied, "untied": hf_llama_layers_untied, "unfused": hf_llama_layers_unfused}


@settings(max_examples=6, deadline=None)
@given(llama=st.sampled_from(sorted(LLAMA_LAYERS)), schedule=st.sampled_from(["gpipe", "1f1b", "zero_bubble"]),
       micro=st.integers(1, 4), stage=st.sampled_from([0, 1]), seed=st.integers(0, 3))
def test_a_layer_list_sliced_by_its_tp_plan_pipelines_like_one_process(world4, llama, schedule, micro, stage, seed):
    """PP2 x TP2: a Hugging Face Llama as layers (`decoder_layers`) with its own tp_plan for the blocks;
    tied, the embedding (vocabulary-parallel) is also the head, fused with causal_lm_loss over its
    slices on the last stage; untied, the head colwise, fused; unfused, its logits gathered whole."""
    plan = fs.zero(stage) | fs.tensor_slicing(fs.models.module_tp_rules) | fs.pipeline(micro, schedule)
    assert_trains_like_one_process(LLAMA_LAYERS[llama], plan, make_batch=lm_batch, world_size=4, pipe=2,
                                   tensor=2, world=world4, steps=2, seed=seed, optimizer=sgd, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tied, attention", [(False, "sdpa"), (True, "eager")])
def test_decoder_layers_compute_the_module_itself(tied, attention):
    """The layers' loss and every gradient equal the Hugging Face module's own (causal attention by
    either implementation, rotary positions, a tied head); `decoder_layers_to_module` puts a tree
    of the layers' paths (here the gradients) into the module under its own names."""
    import copy

    from tests.hf_models import hf_llama

    module = hf_llama(1, layers=2, tied=tied, attention=attention)
    model = fs.models.decoder_layers(module)
    params = optree.tree_map(lambda t: t.detach().requires_grad_(True), model.init())
    batch = lm_batch(3, 4)
    loss = model.loss(params, batch)
    loss.backward()
    want = module(**batch).loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    holder = fs.models.decoder_layers_to_module(optree.tree_map(lambda t: t.grad, params), copy.deepcopy(module))
    for (name, got), (_, p) in zip(holder.named_parameters(), module.named_parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_decoder_layers_refuse_what_they_would_compute_otherwise():
    from tests.hf_models import quiet_transformers

    transformers = quiet_transformers()
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=VOCAB, max_position_embeddings=SEQ, head_dim=8)
    with pytest.raises(ValueError, match="model_type 'gemma2'.*traced_layers"):
        fs.models.decoder_layers(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**small)))
    mistral = fs.models.decoder_layers(transformers.MistralForCausalLM(transformers.MistralConfig(**small)))
    assert len(mistral.layers) == 5  # its window (4096) exceeds every sequence here
    with pytest.raises(ValueError, match="sliding window of 4 positions"):
        fs.models.decoder_layers(transformers.MistralForCausalLM(transformers.MistralConfig(**small, sliding_window=4)))


def test_pipe_times_data_times_tensor_trains_like_one_process():
    """PP2 x DP2 x TP2 on 8 gloo ranks (a world of its own): a Hugging Face Llama's layers with its
    tp_plan, ZeRO-1 over the data ranks, 1F1B."""
    plan = fs.zero(1) | fs.tensor_slicing(fs.models.module_tp_rules) | fs.pipeline(2, "1f1b")
    assert_trains_like_one_process(hf_llama_layers_untied, plan, make_batch=lm_batch, world_size=8, pipe=2, tensor=2,
                                   steps=2, optimizer=sgd, rtol=1e-4, atol=1e-5)


def _units_gathered_per_call():
    """ZeRO-3 on 2 data ranks, a layer list: the units one step gathered for a call of their own."""
    import fspeed.parallel.ops as unit_ops

    calls, real = [], unit_ops._UnitCall.__init__

    def init(self, *args):
        real(self, *args)
        calls.append(self.unit.name)
    unit_ops._UnitCall.__init__ = init
    try:
        model = hf_llama_layers_untied()
        mesh, plan, opt = fs.Mesh(data=2, pipe=1), fs.zero(3, param_persistence_threshold=0), fs.optim.sgd(0.1)
        state = fs.init_train_state(model.init(), opt, plan=plan, mesh=mesh, model=model)
        fs.make_train_step(model, opt, plan=plan, mesh=mesh)(state, lm_batch(2, 0))
    finally:
        unit_ops._UnitCall.__init__ = real
    return calls


def test_zero3_gathers_each_layer_of_a_layer_list_for_its_own_call(world2):
    """The embedding, the 3 blocks and the norm; the head, fused with the loss, is taken for the
    micro-batch (`ops.param`)."""
    assert world2.run(_units_gathered_per_call) == [["0", "1", "2", "3", "4"]] * 2


@pytest.mark.parametrize("tied, precision", [(False, "fp32"), (True, "fp32"), (True, "fp16")])
def test_a_layer_list_with_a_tp_plan_trains_like_one_process_without_a_pipeline(world4, tied, precision):
    """TP2 x data 2 with ZeRO-3: each layer is a unit, gathered for its own call; in fp16 the tied
    head is not fused: its vocabulary slices' logits are gathered for the loss."""
    plan = fs.zero(3) | fs.tensor_slicing(fs.models.module_tp_rules)
    tolerance = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
    assert_trains_like_one_process(hf_llama_layers_tied if tied else hf_llama_layers_untied, plan,
                                   make_batch=lm_batch, world_size=4, tensor=2, world=world4, steps=2,
                                   precision=precision, optimizer=sgd, **tolerance)


def test_a_tp_plan_that_a_layer_list_cannot_honour_is_refused():
    embed = torch.nn.Embedding(VOCAB, 16)
    head = fs.models.TiedLayer("embed", embed, forward=lambda m, x: x @ m.weight.t())
    with pytest.raises(ValueError, match="its own forward.*Leave those modules out"):
        fs.models.sequential([fs.models.TiedLayer("embed", embed), head], loss_fn=lambda y, b: y.sum(),
                             tp_plan={"tied.embed": "embedding_rowwise"})
    lin = torch.nn.Linear(16, 16)
    with pytest.raises(ValueError, match="appears as two different layers"):
        fs.models.sequential([embed, lin, lin], loss_fn=lambda y, b: y.sum(), tp_plan={"1": "colwise"})
    with pytest.raises(ValueError, match="matches no submodule"):
        fs.models.sequential([embed, lin], loss_fn=lambda y, b: y.sum(), tp_plan={"*.q_proj": "colwise"})


def test_a_hugging_face_gpt2_as_layers_trains_like_one_process(world4):
    """Zero bubble's deferring mode on a module's layers, entered again by the checkpointed groups'
    recompute (activation_checkpoint_interval)."""
    plan = fs.zero(1) | fs.pipeline(2, "zero_bubble", activation_checkpoint_interval=1)
    assert_trains_like_one_process(hf_gpt2_layers_with_dropout, plan,
                                   make_batch=lm_dict_batch, world_size=4, pipe=2, world=world4, steps=2,
                                   rtol=1e-4, atol=1e-5)


def hf_gpt2_layers_with_dropout():
    return hf_gpt2_layers(dropout=0.1)


def test_a_layer_list_fuses_its_output_head_with_causal_lm_loss():
    """sequential(loss_fn=fs.causal_lm_loss) with the tied head as head_of(...): the same loss and
    gradients as the head's logits fed to the loss, without keeping those logits for backward."""
    fused, plain = hf_gpt2_layers(fused=True), hf_gpt2_layers(fused=False)
    assert fused.layers.last_with_loss is not None and plain.layers.last_with_loss is None
    params = fused.init()
    batch = lm_labels_batch(4, 0)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0, :5] = -100  # ignored positions
    results = []
    for model in (fused, plain):
        leaves = optree.tree_map(lambda t: t.detach().requires_grad_(True), params)
        loss = model.loss(leaves, batch)
        loss.backward()
        results.append((loss.detach(), [t.grad for t in optree.tree_leaves(leaves)]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="fuses the last layer.*head_of"):
        fs.models.sequential([torch.nn.Linear(4, 4), torch.nn.Linear(4, 8, bias=True)], loss_fn=fs.causal_lm_loss)


def test_a_fused_head_layer_list_pipelines_like_one_process(world4):
    plan = fs.zero(1) | fs.pipeline(2, "1f1b")
    assert_trains_like_one_process(hf_gpt2_layers_fused, plan, make_batch=lm_labels_batch, world_size=4, pipe=2,
                                   world=world4, steps=2, rtol=1e-4, atol=1e-5)


def hf_gpt2_layers_fused():
    return hf_gpt2_layers(fused=True)


def _tuple_eval_loss(pipe: int) -> float:
    model = tuple_layers()
    mesh, plan = fs.Mesh(data=4 // pipe, pipe=pipe), fs.pipeline(4, "interleaved_1f1b", "uniform", 2)
    state = fs.init_train_state(model.init(), fs.optim.sgd(0.1), plan=plan, mesh=mesh, model=model)
    return fs.make_eval_step(model, plan=plan, mesh=mesh)(state, batch(2, 9))


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "interleaved_1f1b"])
def test_a_tuple_of_tensors_crosses_the_stages(world4, schedule):
    """(hidden, bool mask) between every layer: one message per tensor, gradients for the floating
    one; on 4 stages, with checkpointed groups (their tuple input kept on the host) under zero
    bubble, on 2 stages x 2 chunks; and evaluation through the stages."""
    from fspeed.rematerialization import Remat
    pipe, virtual = (2, 2) if schedule == "interleaved_1f1b" else (4, 1)
    remat = Remat("full", offload=True) if schedule == "zero_bubble" else None  # the tuple's hidden on the host
    plan = fs.zero(1) | fs.pipeline(4, schedule, "uniform", virtual, remat=remat,
                                    activation_checkpoint_interval=2 if schedule == "zero_bubble" else 0)
    assert_trains_like_one_process(tuple_layers, plan, make_batch=batch, world_size=4, pipe=pipe, world=world4,
                                   steps=2, optimizer=sgd)
    if schedule == "interleaved_1f1b":
        model = tuple_layers()
        want = fs.make_eval_step(model.loss)(fs.init_train_state(model.init(), fs.optim.sgd(0.1)), batch(2, 9))
        assert world4.run(_tuple_eval_loss, 2) == [pytest.approx(want, rel=1e-6)] * 4


def test_untied_gpt_with_checkpointed_layer_groups_trains_like_one_process(world4):
    plan = fs.pipeline(2, "1f1b", activation_checkpoint_interval=2)
    assert_trains_like_one_process(gpt3_untied, plan, make_batch=batch, world_size=4, pipe=4, world=world4, steps=2)


def _overflow_on_stage_0(steps: int = 3):
    """fp16 on 2 stages; stage 0's gradient is poisoned (inf) at step 2 only. Returns per rank: the
    skipped flags, the loss scales, whether the weights moved at step 2, and this stage's wte copy."""
    from fspeed.parallel import pipeline_runtime

    model = gpt(2)
    mesh = fs.Mesh(data=1, pipe=2)
    plan = fs.pipeline(2)
    opt = fs.optim.adamw(1e-3)
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt, plan=plan, mesh=mesh, model=model,
                                precision=fs.precision.fp16(initial_scale_power=8))
    step = fs.make_train_step(model, opt, plan=plan, mesh=mesh)
    original = pipeline_runtime.PipelineExecutor.step
    calls = []

    def poisoned(self, *args, **kwargs):
        losses, grads = original(self, *args, **kwargs)
        calls.append(1)
        if self.stage == 0 and len(calls) == 2:
            grads.buffer[0] = float("inf")
        return losses, grads
    pipeline_runtime.PipelineExecutor.step = poisoned
    out = {"skipped": [], "scale": [], "moved": []}
    try:
        for i in range(steps):
            before = state.master.buffer.clone()
            state, metrics = step(state, batch(4, i))
            out["skipped"].append(metrics["skipped"])
            out["scale"].append(metrics["loss_scale"])
            out["moved"].append(not torch.equal(before, state.master.buffer))
    finally:
        pipeline_runtime.PipelineExecutor.step = original
    out["wte"] = dict(state.master.items())["wte"].clone()
    return out


def test_fp16_overflow_on_one_stage_skips_the_step_on_all_and_ties_stay_equal(world2):
    first, last = world2.run(_overflow_on_stage_0)
    for rank in (first, last):
        assert rank["skipped"] == [False, True, False]
        assert rank["moved"] == [True, False, True]
    assert first["scale"] == last["scale"]  # one loss scale (DeepSpeed's hysteresis 2: the first overflow keeps it)
    assert torch.equal(first["wte"], last["wte"])  # the tied embedding's two copies are one value


def _in_flight(schedule: str, micro: int):
    """(this rank's stage, the most micro-batches its executor held at once in one step)."""
    from fspeed.parallel import pipeline_runtime

    model = gpt(2)
    mesh = fs.Mesh(data=1, pipe=4)
    plan = fs.pipeline(micro, schedule)
    opt = fs.optim.sgd(1e-2)
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt, plan=plan, mesh=mesh, model=model)
    step = fs.make_train_step(model, opt, plan=plan, mesh=mesh)
    original, seen = pipeline_runtime.PipelineExecutor.step, []

    def watched(self, *args, **kwargs):
        seen.append(self)
        return original(self, *args, **kwargs)
    pipeline_runtime.PipelineExecutor.step = watched
    try:
        step(state, batch(micro, 0))
    finally:
        pipeline_runtime.PipelineExecutor.step = original
    return mesh.coordinate("pipe"), seen[0].peak_in_flight


def _reductions_during_the_schedule(stage: int, schedule: str, overlap: bool = True, precision: str = "fp32"):
    """(this rank's stage, the data-axis reductions issued before its schedule ended, all of them,
    the elements whose reduction was issued then) in a step of PP2 x DP2."""
    from fspeed.parallel import pipeline_runtime

    model = gpt(4)
    mesh = fs.Mesh(data=2, pipe=2, log=fs.CommLog())
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    plan = fs.zero(stage, reduce_bucket_size=4096, overlap_comm=overlap) | fs.pipeline(4, schedule,
                                                                                       virtual_stages=virtual)
    opt = fs.optim.sgd(1e-2)
    precision_kw = {"precision": getattr(fs.precision, precision)()}
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), opt, plan=plan, mesh=mesh, model=model,
                                **precision_kw)
    step = fs.make_train_step(model, opt, plan=plan, mesh=mesh)
    state, _ = step(state, batch(8, 0))
    original, ended = pipeline_runtime.PipelineExecutor.step, []

    def watched(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        ended.append(time.perf_counter())
        return out
    pipeline_runtime.PipelineExecutor.step = watched
    mesh.log.reset()
    try:
        state, _ = step(state, batch(8, 1))
        reductions = [e for e in mesh.log.events if e.axis == "data" and e.op in ("all_reduce", "reduce")]
        early = [e for e in reductions if e.issued < ended[0]]
        state, _ = step(state, batch(8, 2))
    finally:
        pipeline_runtime.PipelineExecutor.step = original
    return (mesh.coordinate("pipe"), len(early), len(reductions), sum(e.nbytes for e in early) // 4,
            state.params.buffer.clone())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero2_in_a_pipeline_reduces_the_stage_sums_in_place_like_one_process(world4, precision):
    """PP2 x DP2, ZeRO-2 with overlap_comm and small buckets: a stage sums its gradient in the
    buffer the sink lends, whose partition-aligned buckets are reduced onto their owners (in bf16
    the sums are not the parameters' .grad, so they all go after the schedule)."""
    plan = fs.zero(2, overlap_comm=True, reduce_bucket_size=1000) | fs.pipeline(4, "1f1b")
    tolerance = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
    assert_trains_like_one_process(gpt3_layers, plan, make_batch=batch, world_size=4, pipe=2, world=world4,
                                   steps=2, optimizer=sgd, precision=precision, **tolerance)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "interleaved_1f1b"])
def test_the_data_reduction_starts_during_the_last_backward(world4, stage, schedule):
    """PP2 x DP2, ZeRO 0-2 with overlap_comm: the buckets of the parameters whose sums are final
    are reduced over `data` while the schedule goes on (the first stage's during its last backward
    or weight pass), not all after it; the tied embedding's waits for the other stage's sum.
    Without overlap_comm all go after the schedule. (Equality with one process: the property test
    above.)"""
    overlapped = world4.run(_reductions_during_the_schedule, stage, schedule)
    for pipe_rank, early, total, elements, _ in overlapped:
        assert total > 1 and 0 < early < total, (pipe_rank, early, total)
        # at least the stage's last block (d_model 32: 12 * 32 * 32 weights) went before the schedule ended
        assert elements >= 12 * 32 * 32, (pipe_rank, elements)
    after = world4.run(_reductions_during_the_schedule, stage, schedule, False)
    for (pipe_rank, early, total, _, params), (*_, want) in zip(after, overlapped):
        assert total > 1 and early == 0, (pipe_rank, early, total)
        torch.testing.assert_close(params, want, rtol=0, atol=0)  # the same sums, reduced earlier


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "interleaved_1f1b"])
def test_with_16_bit_parameters_the_data_reduction_also_starts_in_the_schedule(world4, precision, schedule):
    """bf16 / fp16 parameters, fp32 sums (not the parameters' .grad: backward's gradients are
    added after each action): each chunk's buckets go once its last backward's are added."""
    overlapped = world4.run(_reductions_during_the_schedule, 1, schedule, True, precision)
    for pipe_rank, early, total, elements, _ in overlapped:
        assert total > 1 and 0 < early < total and elements >= 12 * 32 * 32, (pipe_rank, early, total, elements)
    after = world4.run(_reductions_during_the_schedule, 1, schedule, False, precision)
    for (pipe_rank, early, total, _, params), (*_, want) in zip(after, overlapped):
        assert early == 0, (pipe_rank, early, total)
        torch.testing.assert_close(params, want, rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_1f1b_holds_at_most_stages_minus_index_micro_batches(world4, schedule):
    held = dict(world4.run(_in_flight, schedule, 8))
    for stage, peak in held.items():
        assert peak == (min(4 - stage, 8) if schedule == "1f1b" else 8), (stage, peak)


def _resume(directory: str):
    model = gpt(2)
    mesh = fs.Mesh(data=2, pipe=2)
    plan = fs.zero(1) | fs.pipeline(2)
    opt = fs.optim.adamw(1e-3)

    def fresh(seed):
        return fs.init_train_state(model.init(torch.Generator().manual_seed(seed)), opt, plan=plan, mesh=mesh,
                                   model=model)
    step = fs.make_train_step(model, opt, plan=plan, mesh=mesh)
    evaluate = fs.make_eval_step(model, plan=plan, mesh=mesh)
    state, straight = fresh(0), []
    for i in range(4):
        if i == 2:
            fs.checkpoint.save_checkpoint(directory, state, mesh=mesh)
        state, metrics = step(state, batch(2, i))
        straight.append(metrics["loss"])
    resumed, _ = fs.checkpoint.load_checkpoint(directory, fresh(1), mesh=mesh)
    again = []
    for i in range(2, 4):
        resumed, metrics = step(resumed, batch(2, i))
        again.append(metrics["loss"])
    full = fs.gather_params(state, mesh)
    return straight, again, evaluate(state, batch(2, 9)), {p: t for p, t in zip(fs.tree_paths(full),
                                                                                 fs.pytree.tree_leaves(full))}


def test_a_pipeline_run_resumes_exactly_and_loads_into_one_process(world4, tmp_path):
    results = world4.run(_resume, str(tmp_path / "ck"))
    straight, again, eval_loss, full = results[0]
    assert again == straight[2:]
    assert all(r[2] == eval_loss for r in results)  # every stage reports the last stage's loss
    model = gpt(2)
    assert sorted(full) == sorted(fs.tree_paths(model.init(torch.Generator().manual_seed(0))))
    opt = fs.optim.adamw(1e-3)
    local, _ = fs.checkpoint.load_checkpoint(tmp_path / "ck", fs.init_train_state(model.init(torch.Generator().manual_seed(1)),
                                                                        opt, model=model))
    # each data rank trained on the same batch(2, i) as 2 micro-batches: here the 4 of the global batch
    step = fs.make_train_step(model.loss, opt, grad_accum=4)
    losses = []
    for i in range(2, 4):
        local, metrics = step(local, {k: torch.cat([v, v]) for k, v in batch(2, i).items()})
        losses.append(metrics["loss"])
    assert losses == pytest.approx(straight[2:], rel=1e-6)
    assert fs.make_eval_step(model.loss)(local, batch(2, 9)) == pytest.approx(eval_loss, rel=1e-5)


def test_show_schedule_of_a_plan_on_a_mesh():
    plan = fs.zero(1) | fs.pipeline(micro_batches=4, schedule="zero_bubble")
    text = fs.parallel.show_schedule(plan, {"pipe": 2, "data": 1})
    assert text.splitlines()[1] == "stage 0 | F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3" and "theory 0.0769" in text
    with pytest.raises(ValueError, match="has no pipeline"):
        fs.parallel.show_schedule(fs.zero(1), {"pipe": 2})
    with pytest.raises(ValueError, match="a 'pipe' entry"):
        fs.parallel.show_schedule(plan, 2)


def zero_bubble_live_tensors() -> tuple[int, int, int]:
    """(tensors alive after two zero-bubble steps, after five more, the linears the weight passes did);
    run in a fresh process: gc.get_objects counts the whole process's tensors, which other tests'
    objects (and their garbage going meanwhile) would move."""
    import gc

    from fspeed.parallel.pipeline_runtime import PipelineExecutor
    from fspeed.train_step import split_micro_batches
    model = gpt(2)
    plan = fs.pipeline(4, schedule="zero_bubble")
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), fs.optim.adamw(1e-3), plan=plan,
                                mesh=fs.Mesh.single(), model=model)
    executor = PipelineExecutor(state.layout, fs.Mesh.single(), model.layers, torch.float32)
    micro = split_micro_batches(batch(8, 0), 4)

    def live_tensors() -> int:
        gc.collect()
        return sum(type(o) is torch.Tensor or type(o) is torch.nn.Parameter for o in gc.get_objects())
    for _ in range(2):
        executor.step(state.params, micro, 0.25, lambda m, i: None)
    before = live_tensors()
    for _ in range(5):
        executor.step(state.params, micro, 0.25, lambda m, i: None)
    return before, live_tensors(), executor.deferred_linears


def test_zero_bubble_steps_keep_no_tensor_alive():
    """The weight pass's records must not outlive the step (they once formed a cycle with the graph:
    ~90 MB leaked per step of the benchmark's GPT)."""
    before, after, deferred_linears = in_fresh_process(zero_bubble_live_tensors)
    assert after <= before, (before, after)  # the leak kept 2 tensors per linear per micro-batch: +320 here
    # the weight passes did the linears' weight gradients (2 blocks x 4, and the head's: at this size
    # the head and the loss are separate ops), per micro-batch and step
    assert deferred_linears == 7 * 4 * 9


@pytest.mark.parametrize("kind", ["modules", "gpt", "hf_gpt2_layers", "traced_gpt2", "traced_llama"])
def test_zero_bubble_defers_the_linears_also_in_checkpointed_groups(kind):
    """Layers that call F.linear themselves (nn.Linear) go through the torch-function mode, fspeed's
    own through ops: both defer their weight gradients to W, also when a checkpointed group's
    recompute runs them again in B (activation_checkpoint_interval, policies full and save_matmuls),
    and the gradients stay those of 1F1B. So do Hugging Face's Conv1D (`torch.addmm`, eager in a
    layer list or `aten.addmm` in a traced graph) and a traced graph's `aten.linear`."""
    from fspeed.rematerialization import Remat
    from fspeed.parallel.pipeline_runtime import PipelineExecutor
    from fspeed.train_step import split_micro_batches
    if kind == "modules":
        model = fs.models.sequential([torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8)],
                                     loss_fn=lambda y, b: F.mse_loss(y, b["targets"]), inputs=lambda b: b["inputs"])
        micro = split_micro_batches({"inputs": torch.randn(4, 8), "targets": torch.randn(4, 8)}, 2)
        linears = 2
    elif kind == "gpt":
        # 4 linears per block, and the head (at this size the head and loss are separate ops)
        model, micro, linears = gpt(2), split_micro_batches(batch(4, 0), 2), 2 * 4 + 1
    elif kind == "hf_gpt2_layers":  # 4 Conv1D per block; the tied head is a matmul with wte's transpose
        model, micro, linears = hf_gpt2_layers(layers=2), split_micro_batches(lm_dict_batch(4, 0), 2), 2 * 4
    else:  # Conv1D's 4 or Llama's 7 projections per block, and the head
        model = (hf_gpt2_traced if kind == "traced_gpt2" else hf_llama_traced)(layers=2)
        micro, linears = split_micro_batches(lm_batch(4, 0), 2), 2 * (4 if kind == "traced_gpt2" else 7) + 1

    def grads_and_deferred(schedule: str, interval: int = 0, policy: str = "full"):
        remat = Remat(policy) if interval else None
        plan = fs.pipeline(2, schedule=schedule, activation_checkpoint_interval=interval, remat=remat)
        state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), fs.optim.adamw(1e-3), plan=plan,
                                    mesh=fs.Mesh.single(), model=model)
        executor = PipelineExecutor(state.layout, fs.Mesh.single(), model.layers, torch.float32)
        _, grads = executor.step(state.params, micro, 0.5, lambda m, i: None)
        return grads.buffer, executor.deferred_linears
    want, none = grads_and_deferred("1f1b")
    assert none == 0 and bool(want.abs().sum() > 0)
    for interval, policy in ((0, "full"), (1, "full"), (2, "save_matmuls")):
        got, deferred = grads_and_deferred("zero_bubble", interval, policy)
        assert deferred == linears * 2, (interval, policy)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def _zero_bubble_replanned():
    """A tied GPT on pipe=2, zero bubble: the first step's schedule and gradient, the schedule it
    re-planned to, and the gradient of a step with another placement of the W's."""
    from fspeed.parallel.pipeline_runtime import PipelineExecutor
    from fspeed.parallel.schedules import zero_bubble_for_costs
    from fspeed.train_step import split_micro_batches
    mesh, model = fs.Mesh(pipe=2), gpt(4)
    plan = fs.pipeline(4, schedule="zero_bubble")
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), fs.optim.sgd(0.1), plan=plan, mesh=mesh,
                                model=model)
    executor = PipelineExecutor(state.layout, mesh, model.layers, torch.float32)
    micro = split_micro_batches(batch(8, 0), 4)
    first = executor.schedule
    _, g1 = executor.step(state.params, micro, 0.25, lambda m, i: None)
    replanned, pending = executor.schedule, executor.replan
    executor.schedule = zero_bubble_for_costs(2, 4, [62.0, 67.0], 73.0, 45.0)  # W's fill the waits, ZB-H1's don't
    _, g2 = executor.step(state.params, micro, 0.25, lambda m, i: None)
    return first, replanned, pending, executor.schedule, g1.buffer, g2.buffer


def test_zero_bubble_replans_once_the_same_on_every_stage_and_the_bits_stay(world2):
    """After its first step zero bubble re-plans where the W's go from the stages' measured times,
    once, to one schedule on every rank; moving the W's changes no bit of the gradient (they stay in
    micro-batch order)."""
    from fspeed.parallel.schedules import build_schedule, check_schedule
    runs = world2.run(_zero_bubble_replanned)
    assert runs[0][1] == runs[1][1]  # every rank builds the same schedule from the same times
    for first, replanned, pending, moved, g1, g2 in runs:
        assert first == build_schedule("zero_bubble", 2, 4) and not pending
        check_schedule(replanned)
        assert moved.actions != first.actions
        assert torch.equal(g1, g2)


@pytest.mark.parametrize("build", ["gpt", "traced_llama"])
def test_zero_bubble_weight_pass_in_bf16_equals_1f1b_bit_for_bit(build):
    """bf16 activations: W makes each weight gradient in bf16, as backward does, and adds it to the
    fp32 sum (it once fed bf16 operands to the fp32 sum's addmm_ and failed)."""
    from fspeed.parallel.pipeline_runtime import PipelineExecutor
    from fspeed.train_step import split_micro_batches
    # untied: a tied head on this one stage would take the weight's gradient in W and the embedding's
    # in B, another order of the sum than 1F1B's backward
    model = gpt(2, tie=False) if build == "gpt" else hf_llama_traced(layers=2)
    micro = split_micro_batches(batch(4, 0) if build == "gpt" else lm_batch(4, 0), 2)

    def grads(schedule: str):
        plan = fs.pipeline(2, schedule=schedule)
        state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), fs.optim.adamw(1e-3), plan=plan,
                                    mesh=fs.Mesh.single(), model=model, precision=fs.precision.bf16())
        executor = PipelineExecutor(state.layout, fs.Mesh.single(), model.layers, torch.float32)
        _, g = executor.step(state.params, micro, 0.5, lambda m, i: None)
        return g.buffer, executor.deferred_linears
    want, _ = grads("1f1b")
    got, deferred = grads("zero_bubble")
    assert deferred > 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _norm_in_update(data: int, stage: int):
    """A tied GPT on pipe=2 (x data): AdamW without clipping, the grad norm from the optimizer's own
    pass and from a guard that reads it before the update; whether each took it from the update."""
    mesh = fs.Mesh(data=data, pipe=2)
    model = fs.models.gpt(fs.models.GPTConfig(vocab_size=64, seq_len=8, n_layer=3, n_head=2, d_model=16))
    params = model.init(torch.Generator().manual_seed(0))
    runs = []
    for guard in (None, "skip"):
        opt, plan = fs.optim.adamw(3e-3, weight_decay=0.1), fs.zero(stage) | fs.pipeline(4, schedule="1f1b")
        state = fs.init_train_state(params, opt, plan=plan, mesh=mesh, model=model)
        step = fs.make_train_step(model, opt, plan=plan, mesh=mesh, on_nonfinite=guard)
        norms = []
        for i in range(3):
            tokens = torch.randint(0, 64, (8, 9), generator=torch.Generator().manual_seed(10 + i))
            rows = slice(8 // data * mesh.coords["data"], 8 // data * (mesh.coords["data"] + 1))
            state, metrics = step(state, {"inputs": tokens[rows, :-1], "targets": tokens[rows, 1:]})
            norms.append(metrics["grad_norm"])
        runs.append((step.runtime_for(state).norm_in_update, norms, fs.parallel.gather_params(state, mesh)))
    return runs


@pytest.mark.parametrize("data,stage", [(1, 0), (2, 0), (2, 1)])
def test_a_pipelines_grad_norm_from_the_update_pass_counts_a_tied_copy_once(request, data, stage):
    world = request.getfixturevalue("world4" if data == 2 else "world2")
    for (fused, norms, params), (guarded, ref_norms, ref_params) in world.run(_norm_in_update, data, stage):
        assert fused == (stage == 0) and not guarded  # ZeRO-1 on 2 data ranks sees a partition: read first
        assert norms == pytest.approx(ref_norms, rel=1e-6)  # fp32 norms per tensor against fp64 sums
        assert torch.equal(fs.Flat.from_tree(params).buffer, fs.Flat.from_tree(ref_params).buffer)


def _input_grad_first(schedule: str, first: bool, layers: str):
    """One step on pipe=2: (stage, the deferred linears, the order of this stage's gradient sends and
    weight passes as ("send", micro) / ("W", linears), the early B's, the stage's gradient sum)."""
    from fspeed.parallel.pipeline_runtime import PipelineExecutor
    from fspeed.parallel.schedules import early_input_grads
    from fspeed.train_step import split_micro_batches
    mesh = fs.Mesh(pipe=2)
    if layers == "gpt":
        model, micro = gpt(4, tie=False), split_micro_batches(batch(8, 0), 4)
    else:  # nn.Linear's own F.linear, through the torch-function mode
        model = hf_llama_layers(layers=4)
        micro = split_micro_batches(lm_batch(8, 0), 4)
    plan = fs.pipeline(4, schedule=schedule, input_grad_first=first)
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), fs.optim.sgd(0.1), plan=plan, mesh=mesh,
                                model=model)
    executor = PipelineExecutor(state.layout, mesh, model.layers, torch.float32)
    events, send, weight_pass = [], executor._send, executor._weight_pass

    def sending(kind, m, *args):
        if kind == "grad":
            events.append(("send", m))
        return send(kind, m, *args)

    def weights(store, acc_of):
        events.append(("W", len(store)))
        return weight_pass(store, acc_of)
    executor._send, executor._weight_pass = sending, weights
    _, grads = executor.step(state.params, micro, 0.25, lambda m, i: None)
    stage = mesh.coordinate("pipe")
    return stage, executor.deferred_linears, events, early_input_grads(executor.schedule, stage), grads.buffer


@pytest.mark.parametrize("schedule, layers", [("1f1b", "gpt"), ("gpipe", "gpt"), ("1f1b", "llama")])
def test_the_cooldowns_backwards_send_the_input_gradient_before_the_weights(world2, schedule, layers):
    """With input_grad_first (the default), the last stage's B's after its last forward (1F1B: the
    last one; gpipe: all) send the input's gradient, then add the linears' weight gradients; the
    other B's, and every B with input_grad_first=False, run whole. The gradients are the same."""
    on, off = world2.run(_input_grad_first, schedule, True, layers), world2.run(_input_grad_first, schedule, False,
                                                                                 layers)
    for (stage, deferred, events, early, g_on), (_, none, whole, late, g_off) in zip(on, off):
        assert none == 0 and not late and all(kind == "send" for kind, _ in whole)
        torch.testing.assert_close(g_on, g_off, rtol=1e-5, atol=1e-6)
        if stage == 0:  # the first piece sends nothing back
            assert deferred == 0 and not events and not early
            continue
        assert sorted(early) == [(m, 0) for m in ([3] if schedule == "1f1b" else range(4))]
        passes = [i for i, (kind, _) in enumerate(events) if kind == "W"]
        assert len(passes) == len(early) and deferred > 0
        linears = 4 * (4 if layers == "gpt" else 7) // 2 + (layers == "gpt")  # blocks 2-3 (and the GPT's head)
        assert deferred == linears * len(early), (deferred, linears)
        for i in passes:   # each right after its own micro-batch's send
            assert events[i - 1][0] == "send" and (events[i - 1][1], 0) in early


def _receives_posted(schedule: str):
    """Per receive of a step after the first (this stage): how many of the stage's actions had
    finished when it was posted, and the index of the action that takes it."""
    from fspeed.parallel.pipeline_runtime import PipelineExecutor
    from fspeed.train_step import split_micro_batches
    mesh, model = fs.Mesh(pipe=2), gpt(4, tie=False)
    plan = fs.pipeline(4, schedule=schedule)
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), fs.optim.sgd(0.1), plan=plan, mesh=mesh,
                                model=model)
    executor = PipelineExecutor(state.layout, mesh, model.layers, torch.float32)
    micro = split_micro_batches(batch(8, 0), 4)
    executor.step(state.params, micro, 0.25, lambda m, i: None)  # learns the transfers' shapes
    posted, start_recv = [], executor.comm.start_recv

    def recording(out, peer):
        posted.append(len(executor.timeline))
        return start_recv(out, peer)
    executor.comm.start_recv, executor.timeline = recording, []
    executor.step(state.params, micro, 0.25, lambda m, i: None)
    stage = mesh.coordinate("pipe")
    takers = [i for i, a in enumerate(executor.schedule.actions[stage]) if (a.kind == "F") == (stage == 1)
              and a.kind in "FB"]
    return posted, takers


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_receives_are_posted_two_actions_ahead(world2, schedule):
    """A transfer is posted before the action ahead of its taker starts, so it lands while the stage
    computes (posted only one action ahead, a transfer that had arrived was read from the socket by
    the posting call, in the critical path's gap)."""
    for posted, takers in world2.run(_receives_posted, schedule):
        assert len(posted) == len(takers)
        for done, taker in zip(posted, takers):
            assert done <= max(0, taker - 2), (posted, takers)


def cnn_layers(seed: int = 0):
    """The test CNN (its blocks with BatchNorm statistics) as layers: stem, blocks, pooling, head."""
    from tests.hf_models import small_cnn

    cnn = small_cnn(seed)
    return fs.models.sequential([cnn.stem, *cnn.blocks, lambda x: x.mean((2, 3)), cnn.head],
                                loss_fn=lambda y, b: F.cross_entropy(y, b[1]), inputs=lambda b: b[0], name="cnn-layers")


def _stateful_layers_case(schedule: str, virtual: int, precision: str, steps: int = 2):
    """2 stages against one process: parameters, the BatchNorm statistics (every rank's), the
    losses and an evaluation (statistics read, not updated)."""
    from tests.hf_models import cnn_batch

    model, reference = cnn_layers(), cnn_layers()
    mesh, plan = fs.Mesh(data=1, pipe=2), fs.pipeline(4, schedule, "uniform", virtual)
    policy = getattr(fs.precision, precision)()
    state = fs.init_train_state(model.init(), sgd(), plan=plan, mesh=mesh, model=model, precision=policy)
    step = fs.make_train_step(model, sgd(), plan=plan, mesh=mesh)
    ref = fs.init_train_state(reference.init(), sgd(), model=reference, precision=policy)
    ref_step = fs.make_train_step(reference.loss, sgd(), grad_accum=4)
    losses = []
    for s in range(steps):
        state, metrics = step(state, cnn_batch(8, s))
        ref, ref_metrics = ref_step(ref, cnn_batch(8, s))
        losses.append((metrics["loss"], ref_metrics["loss"]))
    evals = (fs.make_eval_step(model, plan=plan, mesh=mesh)(state, cnn_batch(4, 9)),
             fs.make_eval_step(reference.loss)(ref, cnn_batch(4, 9)))
    return (fs.gather_params(state, mesh), ref.master_params.tree(), state.buffers, ref.buffers, losses, evals,
            state.buffers is not None and fs.tree_paths(state.buffers))


@pytest.mark.parametrize("schedule, virtual, precision", [("1f1b", 1, "fp32"), ("zero_bubble", 1, "fp32"),
                                                         ("interleaved_1f1b", 2, "fp32"), ("1f1b", 1, "bf16")])
def test_layers_with_batchnorm_statistics_pipeline_like_one_process(world2, schedule, virtual, precision):
    """In bf16 the BatchNorms compute in fp32 with fp32 statistics (`fp32_modules`)."""
    for params, ref_params, buffers, ref_buffers, losses, evals, paths in world2.run(_stateful_layers_case, schedule,
                                                                                      virtual, precision):
        assert sorted(paths) == ["1.bn.num_batches_tracked", "1.bn.running_mean", "1.bn.running_var",
                                 "2.bn.num_batches_tracked", "2.bn.running_mean", "2.bn.running_var"]
        for a, b in zip(optree.tree_leaves(params), optree.tree_leaves(ref_params)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(optree.tree_leaves(buffers), optree.tree_leaves(ref_buffers)):  # on every stage
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert int(buffers["1"]["bn"]["num_batches_tracked"]) == 8  # 4 micro-batches x 2 steps
        for got, want in losses:
            assert got == pytest.approx(want, rel=1e-5)
        assert evals[0] == pytest.approx(evals[1], rel=1e-5)


def test_a_tied_layer_with_statistics_is_refused_and_a_missing_state_is_named():
    bn = torch.nn.BatchNorm1d(4)
    with pytest.raises(ValueError, match="TiedLayer 'bn' has persistent buffers"):
        fs.models.sequential([fs.models.TiedLayer("bn", bn), fs.models.TiedLayer("bn", bn)], loss_fn=lambda y, b: y.sum())
    model = cnn_layers()
    with pytest.raises(ValueError, match="state buffers.*running_mean.*buffers=model.init_buffers"):
        model.loss(model.init(), (torch.zeros(2, 3, 6, 6), torch.zeros(2, dtype=torch.long)))


def _stateful_resume(directory: str):
    """2 stages of the CNN's layers: 3 steps straight, and from a checkpoint after the first."""
    from tests.hf_models import cnn_batch

    model = cnn_layers()
    mesh, plan = fs.Mesh(data=1, pipe=2), fs.pipeline(2, "1f1b")
    step = fs.make_train_step(model, sgd(), plan=plan, mesh=mesh)
    state = fs.init_train_state(model.init(), sgd(), plan=plan, mesh=mesh, model=model)
    losses = []
    for s in range(3):
        if s == 1:
            fs.checkpoint.save_checkpoint(directory, state, mesh=mesh)
        state, metrics = step(state, cnn_batch(4, s))
        losses.append(metrics["loss"])
    resumed, _ = fs.checkpoint.load_checkpoint(directory, fs.init_train_state(model.init(), sgd(), plan=plan, mesh=mesh,
                                                                   model=model), mesh=mesh)
    again = []
    for s in range(1, 3):
        resumed, metrics = step(resumed, cnn_batch(4, s))
        again.append(metrics["loss"])
    return losses[1:], again, [torch.equal(a, b) for a, b in zip(optree.tree_leaves(state.buffers),
                                                                 optree.tree_leaves(resumed.buffers))]


def test_layers_with_statistics_resume_exactly_from_a_pipeline_checkpoint(world2, tmp_path):
    for straight, again, same in world2.run(_stateful_resume, str(tmp_path / "ck")):
        assert again == straight and all(same) and len(same) == 6
