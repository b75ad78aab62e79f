"""ZeRO-Offload: CPU masters and optimizer state (stages 1-3), CPU parameter shards (stage 3),
their configuration, against non-offloaded training (the estimator's tests are in test_parallel_memory)."""


import pytest
import torch
from hydra import compose, initialize_config_module
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed as fs
import fspeed.parallel.offload as offload_mod
from fspeed.config import ConfigError, check_overrides, to_run_config
from fspeed.config.build import build_zero_config
from fspeed.config.deepspeed import DeepSpeedConfigError, translate_deepspeed_config
from fspeed.optim.base import Capabilities, GradientTransformation, TransformInfo
from fspeed.parallel import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig, zero
from fspeed.parallel import gather_params
from tests.parallel_cases import offload_plan, tiny_gpt


def adamw():
    return fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.adamw(3e-3, weight_decay=0.1))


def train_case(seed, steps, stage, precision, offload, offload_param=False, grad_accum=1, micro=2, persistence=0,
               dims=None):
    """Train the tiny GPT on this rank's share of every global batch; the gathered fp32 params,
    the losses and grad norms, and where the final state's buffers live."""
    mesh = fs.Mesh(data=-1)
    cfg, model, params = tiny_gpt(seed, **(dims or {}))
    opt, plan = adamw(), offload_plan(stage, offload, offload_param, persistence)
    state = fs.init_train_state(params, opt, precision=getattr(fs.precision, precision)(), plan=plan, mesh=mesh,
                                logical_axes=model.logical_axes)
    step = fs.make_train_step(model.loss, opt, grad_accum=grad_accum, plan=plan, mesh=mesh)
    dp, rank = mesh.size("data"), mesh.coordinate("data")
    rows = micro * grad_accum * dp
    losses, norms = [], []
    for i in range(steps):
        x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=torch.Generator().manual_seed(seed + i))
        share = x[rank * rows // dp:(rank + 1) * rows // dp]
        state, metrics = step(state, {"inputs": share[:, :-1], "targets": share[:, 1:]})
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    adam_state = state.opt_state[1]
    where = {name: (t.device.type, t.is_pinned()) for name, t in
             [("master", state.master_params.buffer), ("mu", adam_state.mu.buffer), ("nu", adam_state.nu.buffer),
              ("params", state.params.buffer)]}
    separate_master = state.master is not None and state.master.buffer.data_ptr() != state.params.buffer.data_ptr()
    return fs.Flat.from_tree(gather_params(state, mesh)).buffer, losses, norms, where, separate_master


def both_ways(seed, steps, stage, precision, offload_param=False, **kw):
    """The same run without and with offload on this rank (both under the same plan otherwise)."""
    return (train_case(seed, steps, stage, precision, False, **kw),
            train_case(seed, steps, stage, precision, True, offload_param, **kw))


def assert_same_training(results):
    for plain, offloaded in results:
        assert torch.equal(offloaded[0], plain[0])  # bit for bit: the same kernels on the same numbers
        assert offloaded[1] == plain[1] and offloaded[2] == plain[2]
        assert torch.equal(offloaded[0], results[0][1][0])  # every rank gathered the same params


def assert_on_host(where):
    pinned = torch.cuda.is_available()  # page-locked memory needs CUDA; without it, plain CPU memory
    for name in ("master", "mu", "nu"):
        assert where[name] == ("cpu", pinned), (name, where[name])


# ------------------------------------------------------------------- training equality


@pytest.mark.parametrize("stage, precision", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (2, "bf16"),
                                              (3, "bf16")])
def test_offloaded_training_equals_plain_training_on_2_ranks(world2, stage, precision):
    results = world2.run(both_ways, 5 + stage, 3, stage, precision, grad_accum=2)
    assert_same_training(results)
    for _, offloaded in results:
        assert_on_host(offloaded[3])
        assert offloaded[4]  # the CPU masters are their own buffer, apart from the compute params


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage3_with_offload_param_equals_plain_training_on_2_ranks(world2, precision):
    results = world2.run(both_ways, 21, 3, 3, precision, offload_param=True, persistence=300)
    assert_same_training(results)
    for _, offloaded in results:
        assert_on_host(offloaded[3])
        assert offloaded[3]["params"] == ("cpu", torch.cuda.is_available())  # the compute shards too


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 1000), stage=st.sampled_from([1, 2, 3]), precision=st.sampled_from(["fp32", "bf16"]),
       grad_accum=st.sampled_from([1, 2]), n_layer=st.integers(1, 2), d_model=st.sampled_from([8, 16]),
       vocab=st.integers(5, 30), persistence=st.sampled_from([0, 300]), offload_param=st.booleans())
def test_property_offload_equals_plain_over_shapes_and_stages(world2, seed, stage, precision, grad_accum, n_layer,
                                                              d_model, vocab, persistence, offload_param):
    dims = dict(n_layer=n_layer, d_model=d_model, vocab=fs.models.pad_vocab(vocab, 2))
    results = world2.run(both_ways, seed, 2, stage, precision, offload_param and stage == 3, grad_accum=grad_accum,
                         persistence=persistence, dims=dims)
    assert_same_training(results)


def test_offload_moves_gradients_down_and_params_up(monkeypatch):
    """One process: the reduced gradient partition is downloaded into a host buffer in the
    accumulation dtype, the CPU update writes a 16-bit staging buffer, which is uploaded."""
    calls = []
    real_down, real_up = offload_mod.HostDeviceCopies.download, offload_mod.HostDeviceCopies.upload
    monkeypatch.setattr(offload_mod.HostDeviceCopies, "download",
                        lambda self, host, src: calls.append(("down", host.dtype, host is not src)) or real_down(self, host, src))
    monkeypatch.setattr(offload_mod.HostDeviceCopies, "upload",
                        lambda self, dst, src: calls.append(("up", src.dtype, dst is not src)) or real_up(self, dst, src))
    cfg, model, params = tiny_gpt(0)
    mesh, plan, opt = fs.Mesh(data=1), offload_plan(2, True), adamw()
    state = fs.init_train_state(params, opt, precision=fs.precision.bf16(grad_accum_dtype="bf16"), plan=plan, mesh=mesh)
    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    before = state.params.buffer.clone()
    state, _ = step(state, {"inputs": x[:, :-1], "targets": x[:, 1:]})
    assert calls == [("down", torch.bfloat16, True), ("up", torch.bfloat16, True)]
    assert not torch.equal(before, state.params.buffer)
    torch.testing.assert_close(state.params.buffer[: state.master.numel],
                               state.master.buffer.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("stage, offload_param", [(2, False), (3, True)])
def test_offloaded_state_checkpoint_resumes_bit_exact(tmp_path, stage, offload_param):
    cfg, model, _ = tiny_gpt(0)
    mesh, plan, opt = fs.Mesh(data=1), offload_plan(stage, True, offload_param), adamw()

    def fresh():
        params = model.init(torch.Generator().manual_seed(0))
        return fs.init_train_state(params, opt, precision=fs.precision.bf16(), plan=plan, mesh=mesh)

    step = fs.make_train_step(model.loss, opt, plan=plan, mesh=mesh)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
    state, _ = step(fresh(), batch)
    fs.checkpoint.save_checkpoint(tmp_path, state, mesh=mesh)
    resumed, _ = fs.checkpoint.load_checkpoint(tmp_path, fresh(), mesh=mesh)
    assert resumed.master.device.type == "cpu" and resumed.opt_state[1].mu.device.type == "cpu"
    a, _ = step(state, batch)
    b, _ = step(resumed, batch)
    assert torch.equal(a.params.buffer, b.params.buffer) and torch.equal(a.master.buffer, b.master.buffer)


# ------------------------------------------------------------------------ configuration


@pytest.mark.parametrize("options, message", [
    (dict(stage=0, offload_optimizer="cpu"), "needs zero stage 1, 2 or 3"),
    (dict(stage=2, offload_param="cpu"), "only valid with zero stage 3"),
    (dict(stage=3, offload_param="cpu"), "needs zero.offload_optimizer.device='cpu' too"),
    (dict(stage=2, offload_optimizer="nvme"), "'nvme' is not supported"),
    (dict(stage=2, offload_optimizer="gpu"), "device='gpu' is not allowed; allowed: 'none', 'cpu'"),
    (dict(stage=2, offload_optimizer={"device": "cpu", "ratio": 0.3}), "ratio=0.3: partial offload"),
    (dict(stage=2, offload_optimizer={"device": "cpu", "buffer_count": 4}), r"unknown key\(s\) \['buffer_count'\]"),
])
def test_bad_offload_configs_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**options)


def test_offload_config_forms_and_repr():
    assert ZeroConfig(stage=2, offload_optimizer="cpu").offload_optimizer == OffloadOptimizerConfig("cpu")
    assert ZeroConfig(stage=2, offload_optimizer=None).offload_optimizer.device == "none"
    plan = zero(3, offload_optimizer={"device": "cpu", "pin_memory": False}, offload_param="cpu")
    assert repr(plan) == "zero(stage=3, offload_optimizer='cpu', offload_param='cpu')"
    cfg = plan.find("zero").config
    assert not cfg.offload_optimizer.pin_memory and cfg.offload_param.pin_memory


def test_optimizer_without_cpu_path_is_refused():
    _, model, params = tiny_gpt(0)
    device_only = GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s), None,
                                         TransformInfo("device_only", {}), capabilities=Capabilities(elementwise=True))
    with pytest.raises(ValueError, match="'device_only' has no CPU path"):
        fs.init_train_state(params, device_only, plan=offload_plan(1, True), mesh=fs.Mesh(data=1))
    fs.init_train_state(params, device_only, plan=offload_plan(1, False), mesh=fs.Mesh(data=1))  # fine on the device
    chained = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), device_only)
    with pytest.raises(ValueError, match="'device_only' has no CPU path"):
        fs.init_train_state(params, chained, plan=offload_plan(2, True), mesh=fs.Mesh(data=1))


def compose_run(*overrides: str):
    check_overrides(list(overrides))  # what fspeed-train does before Hydra composes
    with initialize_config_module("fspeed.conf", version_base=None):
        return to_run_config(compose("train", overrides=["checkpoint.dir=/tmp/fspeed-test-ckpt", *overrides]))


def config_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        compose_run(*overrides)
    return str(info.value)


def test_hydra_config_offload_keys():
    run = compose_run("optimizer=adamw", "zero.stage=2", "zero.offload_optimizer.device=cpu")
    assert run.zero.offload_optimizer.device == "cpu" and run.zero.offload_optimizer.pin_memory
    cfg = build_zero_config(run)
    assert cfg.offload_optimizer.enabled and not cfg.offload_param.enabled and cfg.stage == 2
    both = build_zero_config(compose_run("zero.stage=3", "zero.offload_optimizer.device=cpu",
                                         "zero.offload_param.device=cpu", "zero.offload_param.pin_memory=false"))
    assert both.offload_param == OffloadParamConfig("cpu", pin_memory=False)
    assert "zero.offload_optimizer.device" in config_error("zero.offload_optimizer.device=cpu")
    assert "needs zero stage 1, 2 or 3" in config_error("zero.offload_optimizer.device=cpu")
    assert "'nvme' is not supported" in config_error("zero.stage=3", "zero.offload_optimizer.device=nvme")
    assert "only valid with zero stage 3" in config_error("zero.stage=2", "zero.offload_optimizer.device=cpu",
                                                          "zero.offload_param.device=cpu")
    assert "zero.offload_optimizer.ratio" in config_error("zero.stage=2", "zero.offload_optimizer.ratio=0.5")
    assert "did you mean 'zero.offload_optimizer.pin_memory'" in config_error(
        "zero.stage=2", "zero.offload_optimizer.pin_memroy=false")
    assert "allowed: 'none', 'cpu', 'nvme'" in config_error("zero.stage=2", "zero.offload_optimizer.device=gpu")


def test_deepspeed_offload_blocks_translate_and_report_unused_keys():
    t = translate_deepspeed_config({"zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4, "fast_init": False,
                              "nvme_path": "/local_nvme", "ratio": 1.0},
        "offload_param": {"device": "cpu", "pin_memory": False, "buffer_size": 1e8, "max_in_cpu": 1e9},
    }})
    assert "zero.offload_optimizer.device=cpu" in t.overrides and "zero.offload_param.pin_memory=false" in t.overrides
    accepted = "\n".join(t.no_effect)
    for key in ("offload_optimizer.buffer_count", "offload_optimizer.fast_init", "offload_optimizer.nvme_path",
                "offload_param.buffer_size", "offload_param.max_in_cpu"):
        assert f"zero_optimization.{key}" in accepted
    with pytest.raises(DeepSpeedConfigError) as info:
        translate_deepspeed_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"},
                                                          "offload_param": {"device": "cpu", "ratio": 0.5,
                                                                            "pin_memroy": True}}})
    text = str(info.value)
    assert "zero_optimization.offload_optimizer.device" in text and "nvme" in text
    assert "zero_optimization.offload_param.pin_memroy" in text and "zero_optimization.offload_param.ratio" in text
    legacy = translate_deepspeed_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert "zero.offload_optimizer.device=cpu" in legacy.overrides


# ---------------------------------------------------------------------------------- CLI


def test_fspeed_train_launch_with_zero2_offload(tmp_path):
    from tests.test_cli import fspeed_train

    proc = fspeed_train("--launch", "zero.stage=2", "zero.offload_optimizer.device=cpu", "parallel.data=2",
                        "train.steps=2", "train.eval_every=0", "train.eval_batches=1", "data.max_bytes=100000",
                        "model.n_layer=1", "model.d_model=32", "model.seq_len=32", "train.micro_batch_size=4",
                        f"hydra.run.dir={tmp_path / 'run'}", "monitor.progress_bar=false", cwd=tmp_path, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "zero(stage=2, offload_optimizer='cpu')" in out
    assert "model-state memory" in out and "CPU" in out and "ZeRO paper formula" in out
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "global_step2"
