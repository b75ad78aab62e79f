"""`fs.models.traced_layers`: a Hugging Face model's own forward, traced and cut before each block, as
pipeline layers (no hand-written layer list): equal to the module in one process (any batch size,
tied weights, its own loss), dropout by the step's generator and off in evaluation, under the
pipeline schedules on gloo ranks, and the errors for what it cannot carry."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed as fs
from fspeed.pytree import tree_leaves, tree_map
from fspeed.testing import assert_trains_like_one_process
from tests.hf_models import hf_gpt2, hf_gpt2_traced, hf_llama, hf_llama_traced, lm_batch, small_cnn, with_fused_gelu

BUILD = {"gpt2": hf_gpt2, "llama": hf_llama}


def _grads(model, module, batch):
    params = tree_map(lambda t: t.detach().requires_grad_(), model.init())
    loss = model.loss(params, batch, rng=torch.Generator().manual_seed(0))
    loss.backward()
    module.zero_grad()
    want = module(**batch)
    want.loss.backward()
    named = dict(module.named_parameters())
    got = dict(zip(fs.tree_paths(params), tree_leaves(params)))
    return loss, want.loss, {path: (got[path].grad, named[path].grad) for path in named}


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def traced(request):
    module = BUILD[request.param](layers=3)
    return module, fs.models.traced_layers(module, lm_batch(2, 0))


def test_cut_before_each_block_with_the_modules_names_and_ties(traced):
    module, model = traced
    seq = model.layers
    assert len(seq) == 4 and seq.layers[0].name == "input"
    assert [layer.kind for layer in seq.layers[1:]] == [type(module.get_submodule(seq.layers[1].name)).__name__] * 3
    assert set(fs.tree_paths(model.init())) == {n for n, _ in module.named_parameters()}
    if type(module).__name__.startswith("GPT2"):  # the tied embedding: used by the first and the last layer
        assert "transformer.wte.weight" in seq.layers[0].uses and "transformer.wte.weight" in seq.layers[-1].uses
    assert all("forward" not in m.__dict__ for m in module.modules())  # the splitter's wrapping undone


@settings(max_examples=4, deadline=None)
@given(rows=st.integers(1, 5), seed=st.integers(0, 2**16), mask=st.booleans())
def test_equals_the_module_at_any_batch_size(traced, rows, seed, mask):
    """Traced on 2 rows, run on any number (a dynamic batch dimension); labels that differ from the
    inputs (the example had them aliased) and -100 positions."""
    module, model = traced
    batch = lm_batch(rows, seed)
    if mask:
        batch["labels"] = torch.roll(batch["labels"], 1, 1)
        batch["labels"][:, :3] = -100
    loss, want, grads = _grads(model, module, batch)
    assert torch.equal(loss, want)
    for path, (got, ref) in grads.items():
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6, msg=path)


def test_dropout_draws_from_the_generator_and_is_off_in_evaluation():
    module = hf_gpt2(dropout=0.2, layers=2)
    model = fs.models.traced_layers(module, lm_batch(2, 0))
    params, batch = model.init(), lm_batch(2, 5)
    with torch.no_grad():
        a, b = (model.loss(params, batch, rng=torch.Generator().manual_seed(s)) for s in (1, 1))
        c = model.loss(params, batch, rng=torch.Generator().manual_seed(2))
        evaluated = model.loss(params, batch)  # no generator: the evaluation graph
        module.eval()
        want = module(**batch).loss
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.testing.assert_close(evaluated, want, rtol=0, atol=1e-6)


def test_what_it_cannot_trace_is_a_clear_error():
    module = hf_gpt2(layers=2)
    with pytest.raises(ValueError, match="matches no submodule"):
        fs.models.traced_layers(module, lm_batch(2, 0), split_before="transformer.blocks.*")
    with pytest.raises(ValueError, match="inside other matches"):
        fs.models.traced_layers(module, lm_batch(2, 0), split_before=["transformer.h.*", "transformer.h.0.attn"])
    checkpointed = hf_gpt2(layers=2)
    checkpointed.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="activation_checkpoint_interval=1"):
        fs.models.traced_layers(checkpointed, lm_batch(2, 0))
    with pytest.raises(ValueError, match="persistent buffers"):
        fs.models.traced_layers(small_cnn(), (torch.zeros(2, 3, 6, 6), torch.zeros(2, dtype=torch.long)))
    model = fs.models.traced_layers(module, lm_batch(2, 0))
    short = {k: v[:, :8] for k, v in lm_batch(2, 0).items()}
    with pytest.raises(ValueError, match="specialised to the traced example"):
        model.loss(model.init(), short)
    with pytest.raises(ValueError, match="lacks 'labels'"):
        model.loss(model.init(), {"input_ids": lm_batch(2, 0)["input_ids"]})
    with pytest.raises(ValueError, match="traced on cpu and runs on meta"):
        model.loss(tree_map(lambda t: t.to("meta"), model.init()), lm_batch(2, 0))


def test_a_traced_llama_trains_like_one_process_under_zero_bubble_with_zero1_in_bf16(world2):
    """2 stages with ZeRO-1 in bf16 (a graph traced for bf16 parameters on the first step); the weight
    passes take the traced graph's linears (see test_pipeline's deferral test). Pipelines over data
    ranks: test_pipeline (the same stage code); GPT-2 under 1F1B in fp32: fspeed-train's test
    (test_cli_targets)."""
    plan = fs.zero(1) | fs.pipeline(2, "zero_bubble")
    assert_trains_like_one_process(hf_llama_traced, plan, make_batch=lm_batch, world_size=2, pipe=2, world=world2,
                                   steps=2, precision="bf16", rtol=1e-3, atol=1e-4)


def test_a_bf16_run_traces_a_bf16_graph_equal_to_the_module_in_bf16():
    module = hf_gpt2(layers=2)
    model = fs.models.traced_layers(module, lm_batch(2, 0))
    params = tree_map(lambda t: t.to(torch.bfloat16), model.init())
    batch = lm_batch(3, 4)
    with torch.no_grad():
        got = model.loss(params, batch, rng=torch.Generator().manual_seed(0))
        want = with_fused_gelu(module).to(torch.bfloat16)(**batch).loss  # its GELU traced fused (fused_ops)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert next(module.parameters()).dtype == torch.float32  # the module's own parameters untouched


def test_a_traced_model_with_dropout_and_checkpointed_layers_in_interleaved_chunks(world2):
    """The tied GPT-2 embedding kept equal on the first and last piece; dropout masks per layer."""
    plan = fs.pipeline(4, "interleaved_1f1b", virtual_stages=2, activation_checkpoint_interval=1)
    assert_trains_like_one_process(traced_gpt2_with_dropout, plan, make_batch=lm_batch, world_size=2, pipe=2,
                                   world=world2, steps=2, rtol=1e-4, atol=1e-5)


def traced_gpt2_with_dropout():
    return hf_gpt2_traced(dropout=0.1, layers=4)


def _pipeline_eval(build, make_batch) -> float:
    model = build()
    mesh, plan = fs.Mesh(pipe=2), fs.pipeline(2, "1f1b")
    state = fs.init_train_state(model.init(), fs.optim.sgd(0.1), plan=plan, mesh=mesh, model=model)
    return fs.make_eval_step(model, plan=plan, mesh=mesh)(state, make_batch(6, 3))


def hf_gpt2_layers_with_dropout():
    from tests.hf_models import hf_gpt2_layers
    return hf_gpt2_layers(dropout=0.3)


def test_evaluation_through_the_stages_runs_the_modules_in_eval_mode(world2):
    """The whole batch (6 rows; traced on 2) as one micro-batch through 2 stages, dropout off: the
    module's own eval-mode loss on every rank, for a traced model and for a hand-written layer list."""
    from tests.hf_models import lm_dict_batch
    got = world2.run(_pipeline_eval, traced_gpt2_with_dropout, lm_batch)
    module = traced_gpt2_with_dropout_module()
    module.eval()
    with torch.no_grad():
        want = float(module(**lm_batch(6, 3)).loss)
    assert got == pytest.approx([want] * 2, rel=1e-6)
    got = world2.run(_pipeline_eval, hf_gpt2_layers_with_dropout, lm_dict_batch)
    model = hf_gpt2_layers_with_dropout()
    with torch.no_grad():
        want = [float(model.loss(model.init(), lm_dict_batch(6, 3))) for _ in range(2)]
    assert want[0] == want[1] and got == pytest.approx(want, rel=1e-6)


def traced_gpt2_with_dropout_module():
    return hf_gpt2(0, 0.1, layers=4)


def test_tensor_slicing_a_layer_list_is_a_clear_error_not_replicated_work():
    """Layer lists have no logical axes: model=2 would have computed every layer twice, silently."""
    from fspeed.parallel.layout import resolve
    model = hf_gpt2_traced(layers=2)
    plan = fs.zero(1) | fs.tensor_slicing(fs.models.gpt_rules) | fs.pipeline(2)
    with pytest.raises(ValueError, match="slices none of the model's parameters"):
        resolve(plan, model.init(), {"data": 1, "model": 2, "pipe": 2}, {"data": 0, "model": 0, "pipe": 0},
                model.logical_axes, model.units, model.layers)


def _zoo(name: str):
    from tests.hf_models import VOCAB, SEQ, quiet_transformers
    tf = quiet_transformers()
    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, num_attention_heads=4)
    if name == "bert":  # an encoder, masked-LM head, takes extra arguments through **kwargs
        return tf.BertForMaskedLM(tf.BertConfig(**small, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                                max_position_embeddings=SEQ))
    if name == "gpt_neox":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**small, hidden_size=32, num_hidden_layers=2,
                                                      intermediate_size=64, max_position_embeddings=SEQ))
    if name == "opt":
        return tf.OPTForCausalLM(tf.OPTConfig(**small, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                              max_position_embeddings=SEQ, word_embed_proj_dim=32))
    # an encoder-decoder: the decoder's cuts carry the encoder's output
    return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=VOCAB, d_model=32, num_layers=2, num_decoder_layers=2,
                                                     num_heads=4, d_ff=64, d_kv=8, decoder_start_token_id=0,
                                                     pad_token_id=0))


@pytest.mark.parametrize("name", ["bert", "gpt_neox", "opt", "t5"])
def test_other_architectures_trace_into_layers_equal_to_their_module(name):
    """Evaluation graph (dropout off) against the module in eval mode: loss and every gradient."""
    from tests.hf_models import VOCAB, SEQ
    module = _zoo(name)
    g = torch.Generator().manual_seed(1)
    make = lambda rows: {"input_ids": torch.randint(1, VOCAB, (rows, SEQ), generator=g),  # noqa: E731
                         "labels": torch.randint(1, VOCAB, (rows, SEQ), generator=g)}
    model = fs.models.traced_layers(module, make(2))
    assert len(model.layers) == 1 + len([p for p in fs.models.module.repeated_blocks(module)])
    params = tree_map(lambda t: t.detach().requires_grad_(), model.init())
    batch = make(3)
    loss = model.loss(params, batch)  # no generator: the evaluation graph
    loss.backward()
    module.eval()
    want = module(**batch).loss
    want.backward()
    assert torch.equal(loss, want)
    named = dict(module.named_parameters())
    for path, t in zip(fs.tree_paths(params), tree_leaves(params)):
        torch.testing.assert_close(t.grad, named[path].grad, rtol=0, atol=1e-6, msg=path)


@pytest.mark.parametrize("build", [hf_gpt2, hf_llama])
def test_causal_lm_loss_makes_the_last_layer_a_fused_head(build):
    """With fs.causal_lm_loss the cut before the output head makes it the last layer, run with the loss
    as ops.head_loss (no logits kept): the module's own loss and gradients (GPT-2's tied head too)."""
    module = build(layers=2)
    model = fs.models.traced_layers(module, lm_batch(2, 0), fs.causal_lm_loss)
    seq = model.layers
    assert seq.layers[-1].name == "lm_head" and seq.last_with_loss is not None
    batch = lm_batch(3, 7)
    batch["labels"] = torch.roll(batch["labels"], 2, 1)
    batch["labels"][:, :2] = -100
    loss, want, grads = _grads(model, module, batch)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    for path, (got, ref) in grads.items():
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=path)


def test_causal_lm_loss_refuses_a_head_whose_logits_are_changed():
    class Scaled(torch.nn.Module):  # logits scaled after the head, as some models do
        def __init__(self):
            super().__init__()
            self.inner = hf_gpt2(layers=2)

        def get_output_embeddings(self):
            return self.inner.lm_head

        def forward(self, input_ids, labels=None):
            return {"logits": self.inner(input_ids=input_ids, use_cache=False).logits * 0.5}
    with pytest.raises(ValueError, match="changes its logits after the output head"):
        fs.models.traced_layers(Scaled(), lm_batch(2, 0), fs.causal_lm_loss)


def test_a_fused_head_pipeline_trains_like_one_process(world2):
    plan = fs.pipeline(2, "1f1b")
    assert_trains_like_one_process(traced_llama_fused, plan, make_batch=lm_batch, world_size=2, pipe=2, world=world2,
                                   steps=2, rtol=1e-4, atol=1e-5)


def traced_llama_fused():
    return fs.models.traced_layers(hf_llama(layers=2), lm_batch(2, 0), fs.causal_lm_loss)


def test_explain_plans_a_traced_pipeline_from_one_process():
    """fs.explain with mesh sizes (no process group): the stages of the traced layers and the tied
    embedding held by both."""
    model = hf_gpt2_traced(layers=3)
    plan = fs.zero(1) | fs.pipeline(4, "1f1b", partition="parameters")
    table = fs.explain(plan, model.init(), {"data": 2, "pipe": 2}, model.logical_axes, layers=model.layers)
    assert "stage 0: input" in table and "stage 1:" in table
    assert [line.split()[-1] for line in table.splitlines() if line.startswith("transformer.wte.weight")] == ["0,1"]


def test_balanced_partition_gives_a_heavy_last_layer_its_own_stage():
    """A layer list whose last layer costs far more than the others: layer counts balanced by measured
    time, not uniform; with the reference GPT (its fused tail) the counts cover every layer."""
    heavy = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])
    model = fs.models.sequential([torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16),
                                  torch.nn.Linear(16, 512), heavy],
                                 loss_fn=lambda y, b: y.square().mean(), inputs=lambda b: b["x"])
    example = {"x": torch.randn(64, 16)}
    costs = fs.parallel.layer_costs(model, example)
    assert len(costs) == 5 and all(c > 0 for c in costs) and costs[-1] > 5 * max(costs[:3])
    assert fs.parallel.balanced_partition(model, example, 2) == [4, 1]
    gpt = fs.models.gpt(fs.models.GPTConfig(vocab_size=64, seq_len=16, n_layer=3, d_model=32, n_head=4))
    counts = fs.parallel.balanced_partition(gpt, {"inputs": torch.randint(0, 64, (2, 16)),
                                                  "targets": torch.randint(0, 64, (2, 16))}, 2)
    assert sum(counts) == len(gpt.layers) and len(counts) == 2
    with pytest.raises(ValueError, match="pieces"):
        fs.parallel.balanced_partition(model, example, 9)

    # the same through the plan: partition="profile" resolved on an example micro-batch
    plan = fs.zero(1) | fs.pipeline(4, partition="profile")
    asked = []
    profiled = fs.parallel.profiled_partition(plan, model, lambda: asked.append(1) or example, stages=2)
    assert profiled.find("pipeline").partition == (4, 1) and profiled.find("zero") == plan.find("zero") and asked
    explicit = fs.zero(1) | fs.pipeline(4, partition=(3, 2))
    assert fs.parallel.profiled_partition(explicit, model, lambda: asked.append(2), stages=2) is explicit
    assert asked == [1]  # an example is taken only for a plan that profiles
    with pytest.raises(ValueError, match="partition 'profile' times each layer.*profiled_partition"):
        fs.init_train_state(model.init(torch.Generator().manual_seed(0)), fs.optim.sgd(0.1), plan=plan,
                            mesh=fs.Mesh(pipe=1), model=model)
