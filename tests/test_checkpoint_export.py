"""Full weights out of a checkpoint (`export_weights`, `fspeed-export`) and into a fresh state
(`init_from_weights`, `checkpoint.init_from`): `load_state_dict` of the exported file gives the
trained module; a sharded checkpoint exports the same weights as its live `gather_params`."""

import json

import pytest
import torch
from safetensors.torch import load_file

import fspeed as fs
import fspeed.checkpoint as ck
from fspeed.cli.export import main as export_main
from fspeed.parallel import gather_params, zero
from tests.hf_models import MODELS, call
from tests.parallel_cases import global_batch, gpt_setup, make_opt
from tests.test_checkpoint_universal import ROWS, SEED


@pytest.mark.parametrize("name", ["gpt2", "cnn"])
def test_exported_weights_load_into_the_module_and_give_its_outputs(tmp_path, name):
    """A functionalized module (GPT-2: tied embeddings; CNN: BatchNorm buffers) trained in bf16, saved,
    exported in fp32: a fresh module's strict load_state_dict of the file gives the trained outputs."""
    build, loss_fn, make_batch = MODELS[name]
    module = build(0)
    model = fs.functionalize(module, loss_fn=loss_fn)
    opt = fs.optim.adamw(1e-2)
    state = fs.init_train_state(model.init(), opt, precision=fs.precision.bf16(), model=model)
    step = fs.make_train_step(model.loss, opt)
    for i in range(2):
        state, _ = step(state, make_batch(4, i))
    ck.save_checkpoint(tmp_path / "ck", state)
    aliases = model.loss.aliases if name == "gpt2" else None
    ck.export_weights(tmp_path / "ck", tmp_path / "model.safetensors", aliases=aliases)
    trained = fs.to_module(state, build(0)).eval()
    fresh = build(1)
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    fresh.eval()
    batch = make_batch(3, 9)
    with torch.no_grad():
        a, b = call(trained, batch), call(fresh, batch)
    a, b = (a.logits, b.logits) if name == "gpt2" else (a, b)
    assert torch.equal(a, b)


def sharded_save(directory):
    """ZeRO-3 on this world, 2 steps, saved; the live full weights."""
    cfg, model, params = gpt_setup(SEED)
    opt = make_opt("adamw")
    mesh = fs.Mesh(data=-1)
    plan = zero(3, param_persistence_threshold=20)
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh, logical_axes=model.logical_axes)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    dp, rank = mesh.size("data"), mesh.coordinate("data")
    for i in range(2):
        batch = global_batch(cfg, ROWS, SEED, i)
        state, _ = step(state, {k: v[rank * ROWS // dp:(rank + 1) * ROWS // dp] for k, v in batch.items()})
    ck.save_checkpoint(directory, state, mesh=mesh)
    return {k: v.clone() for k, v in fs.Flat.from_tree(gather_params(state, mesh)).items()}


def init_sharded(source):
    """A fresh ZeRO-1 state on this world initialised from `source`: its full weights, step, moments."""
    _, model, params = gpt_setup(SEED + 1)
    mesh = fs.Mesh(data=-1)
    plan = zero(1)
    state = fs.init_train_state(params, make_opt("adamw"), plan=plan, mesh=mesh, logical_axes=model.logical_axes)
    state = ck.init_from_weights(state, source)
    return ({k: v.clone() for k, v in fs.Flat.from_tree(gather_params(state, mesh)).items()}, state.step,
            float(state.opt_state[1].mu.buffer.abs().sum()))


def test_a_sharded_checkpoint_exports_its_full_weights_and_they_initialise_any_layout(world2, tmp_path):
    live = world2.run(sharded_save, str(tmp_path / "ck"))[0]
    assert export_main([str(tmp_path / "ck" / "latest"), str(tmp_path / "model.safetensors")]) == 0
    exported = load_file(tmp_path / "model.safetensors")
    assert exported.keys() == live.keys()
    for k in live:
        assert torch.equal(exported[k], live[k]), k
    # bf16, sharded like Hugging Face's save_pretrained
    assert export_main([str(tmp_path / "ck"), str(tmp_path / "shards"), "--dtype", "bf16",
                        "--max-shard-size", "8KB"]) == 0
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and index["weight_map"].keys() == live.keys()
    for file in files:
        for k, v in load_file(tmp_path / "shards" / file).items():
            assert v.dtype == torch.bfloat16 and torch.equal(v, live[k].bfloat16()), k
    # init_from: another layout, weights only (a fresh optimizer and counters)
    for params, step, moments in world2.run(init_sharded, str(tmp_path / "model.safetensors")):
        assert step == 0 and moments == 0.0
        for k in live:
            assert torch.equal(params[k], live[k]), k
    _, model, params = gpt_setup(SEED + 1)
    one = ck.init_from_weights(fs.init_train_state(params, make_opt("adamw")), tmp_path / "shards")
    for k, v in one.params.items():
        assert torch.equal(v, live[k].bfloat16().float()), k


def test_init_from_weights_that_do_not_fit_lists_every_problem(tmp_path):
    from safetensors.torch import save_file

    _, model, params = gpt_setup(SEED)
    full = fs.Flat.from_tree(params)
    tensors = {k: v.clone() for k, v in full.items()}
    first, second = list(tensors)[:2]
    del tensors[first]
    tensors[second] = torch.zeros(3, 3)
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "bad.safetensors")
    state = fs.init_train_state(params, make_opt("adamw"))
    with pytest.raises(ck.CheckpointError) as e:
        ck.init_from_weights(state, tmp_path / "bad.safetensors")
    text = str(e.value)
    assert f"1 missing key(s): ['{first}']" in text and "1 unexpected key(s): ['extra.weight']" in text
    assert f"1 mis-shaped: {second} is [3, 3], the model's is [3, 16]" in text
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.init_from_weights(state, tmp_path / "nothing.safetensors")
    assert export_main([str(tmp_path), str(tmp_path / "x.safetensors")]) == 1


def test_init_from_a_torch_distributed_checkpoint_of_the_same_module(tmp_path):
    """DCP interop: `dcp.save(module.state_dict())` (keys under `model.` too) initialises a state."""
    import torch.distributed.checkpoint as dcp

    build, loss_fn, _ = MODELS["cnn"]
    trained = build(3)
    for k, v in trained.state_dict().items():  # distinct buffers too
        if v.is_floating_point():
            v.add_(0.5)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({f"model.{k}": v for k, v in trained.state_dict().items()}, checkpoint_id=str(tmp_path / "dcp"),
                 no_dist=True)
    model = fs.functionalize(build(0), loss_fn=loss_fn)
    state = ck.init_from_weights(fs.init_train_state(model.init(), fs.optim.adamw(1e-3), model=model), tmp_path / "dcp")
    out = fs.to_module(state, build(0))
    for k, v in trained.state_dict().items():
        assert torch.equal(out.state_dict()[k], v), k


def _padded_gpt_checkpoint(directory, tie_embeddings=True):
    """A GPT whose 21-token vocabulary is padded to 24 rows, trained 2 steps and saved as fspeed-train saves it."""
    cfg = fs.models.GPTConfig(vocab_size=24, seq_len=8, n_layer=1, n_head=2, d_model=16, tie_embeddings=tie_embeddings)
    model = fs.models.gpt(cfg)
    opt = make_opt("adamw")
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(SEED)), opt)
    step = fs.make_train_step(model.loss, opt)
    for i in range(2):
        state, _ = step(state, global_batch(fs.models.GPTConfig(vocab_size=21, seq_len=8), 4, SEED, i))
    tensors = ["wte"] if tie_embeddings else ["wte", "head"]
    ck.save_checkpoint(directory, state, client_state={ck.VOCAB_KEY: {"size": 21, "padded_size": 24,
                                                                       "tensors": tensors}})
    return model, {k: v.clone() for k, v in fs.Flat.from_tree(state.params.tree()).items()}


@pytest.mark.parametrize("tie", [True, False])
def test_a_padded_vocabulary_is_exported_at_its_true_size_and_loads_back_into_the_models_tree(tmp_path, tie, capsys):
    model, trained = _padded_gpt_checkpoint(tmp_path / "ck", tie)
    assert export_main([str(tmp_path / "ck"), str(tmp_path / "model.safetensors")]) == 0
    rows = ["wte"] if tie else ["wte", "head"]
    assert f"vocabulary 21: {', '.join(rows)} written with 21 rows, the model's 24 less its padding" \
        in capsys.readouterr().err
    exported = load_file(tmp_path / "model.safetensors")
    for name, value in trained.items():
        assert torch.equal(exported[name], value[:21] if name in rows else value), name
    from safetensors import safe_open
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["fspeed_vocab"]) == {"size": 21, "padded_size": 24, "tensors": rows,
                                                          "padding": "dropped"}
    params = ck.load_exported(tmp_path / "model.safetensors", model)  # the model's own (nested) tree
    assert isinstance(params["blocks"], type(model.init(torch.Generator())["blocks"]))
    for name, value in fs.Flat.from_tree(params).items():
        expected = torch.cat([trained[name][:21], torch.zeros(3, 16)]) if name in rows else trained[name]
        assert torch.equal(value, expected), name
    state = ck.init_from_weights(fs.init_train_state(model.init(torch.Generator()), make_opt("adamw")),
                                 tmp_path / "model.safetensors")  # a fine-tuning start: the same
    assert all(torch.equal(v, fs.Flat.from_tree(params)[k]) for k, v in state.params.items())
    # kept: the model's tensors exactly
    assert export_main([str(tmp_path / "ck"), str(tmp_path / "kept.safetensors"), "--keep-vocab-padding"]) == 0
    kept = ck.load_exported(tmp_path / "kept.safetensors", model)
    assert all(torch.equal(v, trained[k]) for k, v in fs.Flat.from_tree(kept).items())


def test_load_exported_names_what_does_not_fit(tmp_path):
    model, _ = _padded_gpt_checkpoint(tmp_path / "ck")
    ck.export_weights(tmp_path / "ck", tmp_path / "model.safetensors")
    other = fs.models.gpt(fs.models.GPTConfig(vocab_size=24, seq_len=8, n_layer=2, n_head=2, d_model=16))
    with pytest.raises(ck.CheckpointError, match=r"does not fit gpt: \d+ missing key\(s\): \['blocks.1"):
        ck.load_exported(tmp_path / "model.safetensors", other)
    with pytest.raises(ck.CheckpointError, match="is an fspeed checkpoint, not exported weights: export it first"):
        ck.load_exported(tmp_path / "ck", model)
