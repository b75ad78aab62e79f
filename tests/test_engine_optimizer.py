"""fs.initialize with a client optimizer and lr_scheduler (DeepSpeed's forms) on a Hugging Face ViT:
the config's gradient_clipping and scheduler apply to a client optimizer, against a functional run
that clips and schedules explicitly; a torch optimizer instance (param groups included) and torch
LR schedulers, against a plain torch loop with the same objects."""

import copy

import pytest
import torch

import fspeed as fs
from tests.hf_models import quiet_transformers

LR, WD, CLIP, STEPS = 1e-2, 0.05, 1.0, 4
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": LR, "warmup_num_steps": 3,
                                         "warmup_type": "linear"}}
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": CLIP}


def vit(seed: int = 0) -> torch.nn.Module:
    """A two-layer ViT image classifier with random weights (no download)."""
    transformers = quiet_transformers()
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=32, num_labels=5, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(cfg)


def vit_batch(rows: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(rows, 3, 8, 8, generator=g),
            "labels": torch.randint(0, 5, (rows,), generator=g)}


def micro_batches(seed: int) -> list[dict]:
    batch = vit_batch(8, seed)
    return [{k: v[i * 4:(i + 1) * 4] for k, v in batch.items()} for i in range(2)]


def deepspeed_loop(engine) -> list[dict]:
    """STEPS steps of DeepSpeed's loop; each step's metrics."""
    metrics = []
    for s in range(STEPS):
        for micro in micro_batches(s):
            engine.backward(engine(micro))
            engine.step()
        metrics.append(dict(engine.metrics))
    return metrics


def functional_run(optimizer) -> torch.Tensor:
    """The functional API on the same ViT and batches with `optimizer` (flat parameters after STEPS)."""
    model = fs.functionalize(vit(), lambda out, batch: out.loss)
    state = fs.init_train_state(model.init(torch.Generator().manual_seed(0)), optimizer, seed=0, model=model)
    step = fs.make_train_step(model.loss, optimizer, grad_accum=2)
    for s in range(STEPS):
        state, _ = step(state, vit_batch(8, s))
    return state.master_params.buffer


def torch_loop(module, optimizer, scheduler=None) -> torch.nn.Module:
    """A plain PyTorch loop: accumulation over the two micro-batches, clip, step, scheduler step."""
    for s in range(STEPS):
        optimizer.zero_grad()
        for micro in micro_batches(s):
            (module(**micro).loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return module


def schedule():
    return fs.optim.warmup(1e-3, LR, 3, "linear")


CLIENTS = {
    "adamw": (lambda module: fs.optim.adamw(LR, weight_decay=WD),
              lambda lr: fs.optim.adamw(lr, weight_decay=WD)),
    "from_torch": (lambda module: fs.optim.from_torch(torch.optim.AdamW, lr=LR, weight_decay=WD, foreach=False),
                   lambda lr: fs.optim.from_torch(torch.optim.AdamW, lr=lr, weight_decay=WD, foreach=False)),
    "torch_instance": (lambda module: torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD, foreach=False),
                       lambda lr: fs.optim.from_torch(torch.optim.AdamW, lr=lr, weight_decay=WD, foreach=False)),
}


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_client_optimizer_gets_the_configs_clipping_and_scheduler(client):
    make, reference = CLIENTS[client]
    module = vit()
    engine, optimizer, _, lr_schedule = fs.initialize(model=module, config={**CONFIG, "scheduler": WARMUP},
                                                      optimizer=make(module))
    metrics = deepspeed_loop(engine)
    assert [m["lr"] for m in metrics] == [pytest.approx(schedule()(s)) for s in range(STEPS)]
    assert lr_schedule(10) == pytest.approx(LR) and metrics[0]["grad_norm"] > CLIP  # the clip acts
    expected = functional_run(fs.optim.chain(fs.optim.clip_by_global_norm(CLIP), reference(schedule())))
    assert torch.equal(engine.state.master_params.buffer, expected)
    assert "clip_by_global_norm(max_norm=1.0)" in repr(optimizer)


def test_a_client_schedule_of_the_step_replaces_the_configs_scheduler():
    """An fspeed schedule as lr_scheduler: the config's WarmupCosineLR is not used (a warning says so)."""
    cosine = {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}}
    with pytest.warns(UserWarning, match=r"scheduler \(warmup_cosine\) is not used: lr_scheduler= replaces it"):
        engine, _, _, lr_schedule = fs.initialize(model=vit(), config={**CONFIG, "scheduler": cosine},
                                                  optimizer=fs.optim.adamw(LR, weight_decay=WD),
                                                  lr_scheduler=schedule())
    deepspeed_loop(engine)
    expected = functional_run(fs.optim.chain(fs.optim.clip_by_global_norm(CLIP),
                                             fs.optim.adamw(schedule(), weight_decay=WD)))
    assert torch.equal(engine.state.master_params.buffer, expected) and lr_schedule(1) == schedule()(1)


def groups_of(module) -> list[dict]:
    """torch param groups: decay for matrices, none for biases and norms, a lower lr for the head."""
    named = dict(module.named_parameters())
    return [{"params": [p for n, p in named.items() if p.dim() > 1 and not n.startswith("classifier")]},
            {"params": [p for n, p in named.items() if p.dim() <= 1 and not n.startswith("classifier")],
             "weight_decay": 0.0},
            {"params": [named["classifier.weight"], named["classifier.bias"]], "lr": LR / 10}]


def assert_same_parameters(engine, reference: torch.nn.Module) -> None:
    """Every parameter but the attention key biases (their true gradient is zero: Adam turns rounding
    noise into lr-sized steps there)."""
    for name, p in reference.named_parameters():
        if name.endswith("k_proj.bias"):
            continue
        torch.testing.assert_close(engine.state.master_params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_torch_optimizer_instance_with_groups_trains_as_in_a_torch_loop():
    module = vit()
    reference = copy.deepcopy(module)
    client = torch.optim.AdamW(groups_of(module), lr=LR, weight_decay=WD, foreach=False)
    engine, optimizer, _, lr_schedule = fs.initialize(model=module, config=CONFIG, optimizer=client)
    deepspeed_loop(engine)
    assert "torch.optim.AdamW" in repr(optimizer) and lr_schedule is None  # the client's own lr
    torch_loop(reference, torch.optim.AdamW(groups_of(reference), lr=LR, weight_decay=WD, foreach=False))
    assert_same_parameters(engine, reference)


def lambda_lr(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))


@pytest.mark.parametrize("form", ["object", "callable"])
def test_a_torch_lr_scheduler_over_the_instance_schedules_each_group(form):
    """DeepSpeed's lr_scheduler forms: a scheduler object over the client's optimizer, or a callable
    building one; each group's lr follows it (the head's group from its own lower lr)."""
    module = vit()
    reference = copy.deepcopy(module)
    client = torch.optim.AdamW(groups_of(module), lr=LR, weight_decay=WD, foreach=False)
    scheduler = lambda_lr(client) if form == "object" else lambda_lr
    engine, _, _, lr_schedule = fs.initialize(model=module, config=CONFIG, optimizer=client, lr_scheduler=scheduler)
    metrics = deepspeed_loop(engine)
    assert [m["lr"] for m in metrics] == [pytest.approx(LR * min(1.0, (s + 1) / 3)) for s in range(STEPS)]
    assert lr_schedule(0) == pytest.approx(LR / 3)
    ref_opt = torch.optim.AdamW(groups_of(reference), lr=LR, weight_decay=WD, foreach=False)
    torch_loop(reference, ref_opt, lambda_lr(ref_opt))
    assert_same_parameters(engine, reference)


def test_a_callable_lr_scheduler_gets_a_torch_optimizer_for_the_configs_optimizer():
    """lr_scheduler(optimizer) with the config's optimizer: it is handed a torch optimizer holding the
    config's lr, and its schedule replaces the config's."""
    config = {**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
    engine, _, _, _ = fs.initialize(model=vit(), config=config, lr_scheduler=lambda_lr)
    metrics = deepspeed_loop(engine)
    assert [m["lr"] for m in metrics] == [pytest.approx(LR * min(1.0, (s + 1) / 3)) for s in range(STEPS)]


def test_client_optimizer_and_scheduler_mistakes_are_clear_errors():
    module = vit()
    clip2 = fs.optim.chain(fs.optim.clip_by_global_norm(2.0), fs.optim.adamw(LR))
    with pytest.raises(ValueError, match="clips the gradient norm at 2 and the config's gradient_clipping is 1"):
        fs.initialize(model=module, config=CONFIG, optimizer=clip2)
    engine, optimizer, _, _ = fs.initialize(model=module, config={**CONFIG, "gradient_clipping": 0.0},
                                            optimizer=clip2)  # the client's own clip alone
    assert repr(optimizer).count("clip_by_global_norm") == 1
    with pytest.raises(ValueError, match="schedules a torch optimizer that is not the optimizer= passed"):
        other = torch.optim.SGD(module.parameters(), lr=0.1)
        fs.initialize(model=module, config=CONFIG, optimizer=fs.optim.adamw(LR), lr_scheduler=lambda_lr(other))
    with pytest.raises(ValueError, match="ReduceLROnPlateau steps on a validation metric"):
        client = torch.optim.AdamW(module.parameters(), lr=LR)
        fs.initialize(model=module, config=CONFIG, optimizer=client,
                      lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(client))
    with pytest.raises(ValueError, match="OneCycleLR cycles the optimizer's momentum.*cycle_momentum=False"):
        client = torch.optim.AdamW(module.parameters(), lr=LR)
        fs.initialize(model=module, config=CONFIG, optimizer=client,
                      lr_scheduler=torch.optim.lr_scheduler.OneCycleLR(client, max_lr=LR, total_steps=10))
    with pytest.raises(TypeError, match="lr_scheduler= takes a torch LR scheduler.*got float"):
        fs.initialize(model=module, config=CONFIG, lr_scheduler=0.1)
    with pytest.raises(TypeError, match="the callable given is neither"):
        fs.initialize(model=module, config=CONFIG, lr_scheduler=lambda x: "soon")
    with pytest.raises(TypeError, match="optimizer= takes an fspeed GradientTransformation.*got str"):
        fs.initialize(model=module, config=CONFIG, optimizer="adamw")
    with pytest.raises(ValueError, match="has already stepped"):
        fs.initialize(model=module, config=CONFIG, optimizer=_stepped(module))
    with pytest.raises(ValueError, match="model_parameters and a torch optimizer instance"):
        fs.initialize(model=module, config=CONFIG, optimizer=torch.optim.AdamW(module.parameters()),
                      model_parameters=groups_of(module))
    onecycle = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": LR}}
    with pytest.raises(ValueError, match="OneCycle with cycle_momentum cycles the betas of the config's optimizer"):
        fs.initialize(model=module, config={**CONFIG, "scheduler": onecycle}, optimizer=fs.optim.adamw(LR))
    head_lr = fs.optim.param_groups(fs.optim.adamw(LR), [{"params": "classifier.*", "lr": 1e-4}])
    with pytest.raises(ValueError, match="param group.* set their own lr, which would stay fixed; give them lr_scale"):
        fs.initialize(model=module, config={**CONFIG, "scheduler": WARMUP}, optimizer=head_lr)


def _stepped(module):
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return optimizer
