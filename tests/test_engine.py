"""fspeed.engine: `fs.initialize` and a DeepSpeed-style loop over any nn.Module and a ds_config,
against the same config run through the functional API."""

import json

import pytest
import torch

import fspeed as fs
from tests.hf_models import cnn_batch, cnn_loss, hf_gpt2, lm_batch, lm_loss, small_cnn, split


def ds_config(stage, micro=2, accum=2):
    return {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                     "warmup_num_steps": 3, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000},
    }


def engine_case(stage, steps=3):
    """The DeepSpeed-style loop and the functional API on the same config, model and data; both
    gathered parameter sets, and the losses."""
    from fspeed.config.build import build_optimizer, build_precision, build_zero_config
    from fspeed.config.compose import compose_run_config

    config = ds_config(stage)
    engine, optimizer, _, schedule = fs.initialize(model=hf_gpt2(), config=config)  # loss: outputs.loss
    mesh = engine.mesh
    data, rank = mesh.size("data"), mesh.coordinate("data")
    losses = []
    for s in range(steps):
        share = split(lm_batch(8, s), data, rank)
        for i in range(2):
            loss = engine(split(share, 2, i))
            engine.backward(loss)
            engine.step()
        losses.append(engine.metrics["loss"])
    lr = engine.get_lr()
    # the functional API with the same config
    run, _ = compose_run_config(config, dp_world_size=data)
    model = fs.functionalize(hf_gpt2(), lm_loss)
    plan = fs.zero(build_zero_config(run))
    opt = build_optimizer(run)
    state = fs.init_train_state(model.init(), opt, precision=build_precision(run), seed=run.train.seed, plan=plan,
                                mesh=mesh, model=model)
    step = fs.make_train_step(model.loss, opt, grad_accum=2, plan=plan, mesh=mesh)
    reference = []
    for s in range(steps):
        state, metrics = step(state, split(lm_batch(8, s), data, rank))
        reference.append(metrics["loss"])
    a, b = fs.gather_params(engine.state, mesh), fs.gather_params(state, mesh)
    module = engine.module  # the module with the trained weights (a collective)
    with torch.no_grad():
        in_module = float(module.transformer.wte.weight.sum())
    return fs.Flat.from_tree(a).buffer, fs.Flat.from_tree(b).buffer, losses, reference, lr, schedule(steps), \
        in_module, float(fs.Flat.from_tree(a)["transformer.wte.weight"].sum())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_deepspeed_style_loop_equals_the_functional_api_on_2_ranks(world2, stage):
    for engine_params, functional_params, losses, reference, lr, scheduled, in_module, in_state in \
            world2.run(engine_case, stage):
        assert torch.equal(engine_params, functional_params)
        assert losses == reference
        assert lr == [pytest.approx(scheduled)] and 0 < scheduled < 1e-3  # the config's WarmupLR, still warming up
        assert in_module == pytest.approx(in_state)


def test_initialize_on_one_process_with_a_dataset_and_a_checkpoint(tmp_path):
    from torch.utils.data import TensorDataset

    x, y = cnn_batch(32, 0)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}
    engine, _, loader, _ = fs.initialize(model=small_cnn(), config=config, loss_fn=cnn_loss,
                                         training_data=TensorDataset(x, y))
    batches = list(loader)
    assert len(batches) == 8 and batches[0][0].shape == (4, 3, 6, 6)
    for i, batch in enumerate(batches[:4]):
        engine.backward(engine(tuple(batch)))
        engine.step()
        assert engine.is_gradient_accumulation_boundary() is False
    assert engine.global_steps == 2 and engine.gradient_accumulation_steps() == 2
    path = engine.save_checkpoint(tmp_path, client_state={"epoch": 0})
    assert path.name == "global_step2"
    # buffers (BatchNorm statistics) travel with the checkpoint
    again, _, _, _ = fs.initialize(model=small_cnn(), config=config, loss_fn=cnn_loss)
    _, client = again.load_checkpoint(tmp_path)
    assert client == {"epoch": 0} and again.global_steps == 2
    stats = "blocks.0.bn.running_mean"
    assert torch.equal(dict(again.module.named_buffers())[stats], dict(engine.module.named_buffers())[stats])
    assert engine.eval_batch(tuple(batches[5])) == pytest.approx(again.eval_batch(tuple(batches[5])))


def test_the_loop_order_and_unsupported_arguments_are_clear_errors(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}
    module = small_cnn()
    engine, _, _, _ = fs.initialize(model=module, config=config, loss_fn=cnn_loss)
    batch = cnn_batch(2, 0)
    loss = engine(batch)
    with pytest.raises(RuntimeError, match="twice without engine.backward"):
        engine(batch)
    with pytest.raises(RuntimeError, match="the loss the last engine"):
        engine.backward(loss.clone())
    engine.backward(loss)
    engine.step()
    no_loss, *_ = fs.initialize(model=module, config=config)  # the CNN returns logits: no loss to take
    with pytest.raises(ValueError, match=r"returned Tensor without a scalar loss.*pass loss_fn\(outputs, batch\)"):
        no_loss(batch)
    with pytest.raises(ValueError, match=r"model_parameters\[0\] holds a tensor of shape \[3\] that is not a parameter"):
        fs.initialize(model=module, config=config, loss_fn=cnn_loss, model_parameters=[{"params": [torch.zeros(3)]}])
    with pytest.raises(ValueError, match="is in no param group"):
        fs.initialize(model=module, config=config, loss_fn=cnn_loss,
                      model_parameters=[{"params": [module.head.weight]}])
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    engine, *_ = fs.initialize(model=module, config=str(path), loss_fn=cnn_loss, model_parameters=module.parameters())
    assert engine.train_micro_batch_size_per_gpu() == 2


def test_deepspeed_parameter_groups_equal_torch_groups():
    """DeepSpeed users pass torch-style groups as model_parameters: no decay for biases and norms,
    a lower lr for the head (no scheduler: the group's lr is its lr)."""
    import copy

    module = small_cnn()
    decay = [p for n, p in module.named_parameters() if n.endswith("weight") and ".bn." not in n and n != "head.weight"]
    no_decay = [p for n, p in module.named_parameters() if n.endswith("bias") or ".bn." in n]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0},
              {"params": [module.head.weight], "weight_decay": 0.1, "lr": 1e-4}]
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
    reference = copy.deepcopy(module)
    engine, *_ = fs.initialize(model=module, config=config, loss_fn=cnn_loss, model_parameters=groups)
    ref_params = dict(reference.named_parameters())
    names = {id(p): n for n, p in module.named_parameters()}
    torch_opt = torch.optim.AdamW([{**g, "params": [ref_params[names[id(p)]] for p in g["params"]]} for g in groups],
                                  lr=1e-3, foreach=False)
    for seed in range(3):
        batch = cnn_batch(4, seed)
        engine.backward(engine(batch))
        engine.step()
        torch_opt.zero_grad()
        cnn_loss(reference(batch[0]), batch).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
        torch_opt.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(engine.state.master_params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_engine_breakdown():
    """wall_clock_breakdown: the step's phases in engine.metrics (the monitors: test_engine_monitor)."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "wall_clock_breakdown": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}
    engine, *_ = fs.initialize(model=small_cnn(), config=config, loss_fn=cnn_loss)
    engine.train_batch(batch=cnn_batch(4, 0))
    assert engine.metrics["fwd_ms"] > 0 and engine.metrics["step_ms"] > 0


def engine_pipeline_case(steps=2):
    """fs.initialize with a DeepSpeed config's pipeline block and a layer list (DeepSpeed's
    PipelineModule), trained by train_batch(data_iter), against the functional API's pipeline."""
    from tests.hf_models import hf_gpt2_layers, lm_dict_batch
    config = {**ds_config(1, micro=2, accum=4), "pipeline": {"stages": 2, "partition": "uniform"}}
    engine, _, _, _ = fs.initialize(model=hf_gpt2_layers(), config=config)
    mesh = engine.mesh
    losses = []
    for s in range(steps):
        micro = fs.train_step.split_micro_batches(lm_dict_batch(8, s), 4)
        losses.append(engine.train_batch(data_iter=iter(micro)))
    eval_loss = engine.eval_batch(lm_dict_batch(4, 99))
    plan = engine.plan
    model = hf_gpt2_layers()
    from fspeed.config.build import build_optimizer
    from fspeed.config.compose import compose_run_config
    run, _ = compose_run_config(config, dp_world_size=1)
    opt = build_optimizer(run)
    state = fs.init_train_state(model.init(), opt, seed=run.train.seed, plan=plan, mesh=mesh, model=model)
    step = fs.make_train_step(model, opt, plan=plan, mesh=mesh)
    reference = []
    for s in range(steps):
        state, metrics = step(state, lm_dict_batch(8, s))
        reference.append(metrics["loss"])
    a, b = fs.gather_params(engine.state, mesh), fs.gather_params(state, mesh)
    return fs.Flat.from_tree(a).buffer, fs.Flat.from_tree(b).buffer, losses, reference, eval_loss, repr(plan), \
        mesh.sizes


def test_initialize_runs_a_deepspeed_pipeline_block_with_train_batch(world2):
    for engine_params, functional_params, losses, reference, eval_loss, plan, sizes in \
            world2.run(engine_pipeline_case):
        assert "pipeline" in plan and sizes["pipe"] == 2 and sizes["data"] == 1
        assert torch.equal(engine_params, functional_params) and losses == reference
        assert eval_loss > 0


def test_initialize_refuses_a_pipeline_for_a_model_without_layers():
    with pytest.raises(ValueError, match="cuts the model at its layers"):
        fs.initialize(model=fs.functionalize(hf_gpt2()), config={**ds_config(0), "pipeline": {"stages": 2}})
    with pytest.raises(ValueError, match="pass training_data="):
        fs.initialize(model=hf_gpt2(), config={**ds_config(0), "pipeline": {"stages": 2}})


def engine_traced_pipeline_case(steps=2):
    """A Hugging Face module itself with a pipeline block: traced on training_data's first micro-batch
    into layers, trained by train_batch, against the functional API on fs.models.traced_layers; the
    stages balanced by each layer's time measured on that micro-batch (partition "profile")."""
    from tests.hf_models import LMDataset, lm_batch
    config = {**ds_config(1, micro=2, accum=2), "pipeline": {"stages": 2, "partition": "profile"}}
    engine, _, _, _ = fs.initialize(model=hf_gpt2(layers=3), config=config, training_data=LMDataset(16, 0))
    losses = [engine.train_batch(data_iter=iter(fs.train_step.split_micro_batches(lm_batch(4, s), 2)))
              for s in range(steps)]
    model = fs.models.traced_layers(hf_gpt2(layers=3), lm_batch(2, 0))
    engine_params, functional_params, reference = _functional_run(engine, config, model, steps)
    return (engine_params, functional_params, losses, reference, engine.model.name,
            engine.plan.find("pipeline").partition)


def _functional_run(engine, config: dict, model, steps: int, overrides=()) -> tuple:
    """The functional API on `model` with the engine's plan, mesh, optimizer and seed, on the
    batches the engine trained on (`lm_batch(4, s)`): both runs' gathered parameters (flat) and
    the functional run's losses."""
    from fspeed.config.build import build_optimizer
    from fspeed.config.compose import compose_run_config
    from tests.hf_models import lm_batch
    run, _ = compose_run_config(config, overrides=list(overrides), dp_world_size=1)
    opt = build_optimizer(run)
    state = fs.init_train_state(model.init(), opt, seed=run.train.seed, plan=engine.plan, mesh=engine.mesh,
                                model=model)
    step = fs.make_train_step(model, opt, plan=engine.plan, mesh=engine.mesh)
    reference = []
    for s in range(steps):
        state, metrics = step(state, lm_batch(4, s))
        reference.append(metrics["loss"])
    a, b = fs.gather_params(engine.state, engine.mesh), fs.gather_params(state, engine.mesh)
    return fs.Flat.from_tree(a).buffer, fs.Flat.from_tree(b).buffer, reference


def test_initialize_traces_a_module_into_pipeline_stages(world2):
    results = world2.run(engine_traced_pipeline_case)
    assert results[0][-1] == results[1][-1] and len(results[0][-1]) == 2 and sum(results[0][-1]) == 4
    for engine_params, functional_params, losses, reference, name, _ in results:
        assert "traced, 4 layers" in name
        assert torch.equal(engine_params, functional_params) and losses == reference


def engine_sliced_pipeline_case(steps=3):
    """A Hugging Face Llama itself with parallel.pipe=2 and parallel.tensor=2 on 4 ranks: its own
    layers and tp_plan (`fs.models.decoder_layers`), trained by train_batch, against the functional
    API on the same layers, plan and mesh."""
    from tests.hf_models import LMDataset, hf_llama, lm_batch
    config = {**ds_config(1, micro=2, accum=2), "pipeline": {"stages": 2}}
    engine, _, _, _ = fs.initialize(model=hf_llama(layers=3), config=config, training_data=LMDataset(16, 0),
                                    overrides=["parallel.tensor=2"])
    losses = [engine.train_batch(data_iter=iter(fs.train_step.split_micro_batches(lm_batch(4, s), 2)))
              for s in range(steps)]
    model = fs.models.decoder_layers(hf_llama(layers=3))
    engine_params, functional_params, reference = _functional_run(engine, config, model, steps, ["parallel.tensor=2"])
    trained = engine.module.model.layers[0].mlp.up_proj.weight  # a collective: every rank asks
    full = fs.gather_params(engine.state, engine.mesh)["1"]["layer"]["mlp"]["up_proj"]["weight"]
    moved = torch.equal(trained, full), float((trained - hf_llama(layers=3).model.layers[0].mlp.up_proj.weight).abs().max())
    return engine_params, functional_params, losses, reference, engine.model.name, repr(engine.plan), moved


def test_initialize_slices_a_hugging_face_llama_in_a_pipeline(world4):
    for engine_params, functional_params, losses, reference, name, plan, moved in world4.run(engine_sliced_pipeline_case):
        assert name == "LlamaForCausalLM-layers" and "tensor_slicing" in plan and "pipeline" in plan
        # engine.module: the trained weights under the module's names (WarmupLR: the first step's lr is 0)
        assert moved[0] and moved[1] > 0, moved
        assert torch.equal(engine_params, functional_params) and losses == reference
    from fspeed.models.decoder_layers import sliceable_layers
    with pytest.raises(ValueError, match="decoder_layers builds for Hugging Face model types"):
        sliceable_layers(hf_gpt2(), None)
    with pytest.raises(ValueError, match="leave loss_fn out"):
        sliceable_layers(hf_gpt2(), lambda out, batch: out.loss)
