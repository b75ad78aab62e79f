"""The flops profiler against an analytic count (reference GPT) and against torch's FlopCounterMode on
the plain nn.Module (functionalize'd Hugging Face GPT-2 and a CNN); its DeepSpeed-style printout; TFLOPS."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fspeed as fs
from fspeed.models import Model
from tests.hf_models import call, cnn_batch, cnn_loss, hf_gpt2, lm_batch, lm_loss, small_cnn


def gpt_flops(cfg: fs.models.GPTConfig, rows: int, seq: int) -> dict[str, int]:
    """The reference GPT's forward flops by hand: 2 x MACs of every matmul, attention's QK^T and PV
    over the full (unmasked) square, as DeepSpeed and torch count them."""
    d, v = cfg.d_model, cfg.vocab_size
    tokens = rows * seq
    linear = 2 * tokens * (d * 3 * d + d * d + d * cfg.hidden + cfg.hidden * d)
    attention = 2 * 2 * rows * seq * seq * d
    return {"block": linear + attention, "head": 2 * tokens * d * v,
            "total": cfg.n_layer * (linear + attention) + 2 * tokens * d * v}


@pytest.mark.parametrize("layers, d_model, heads, seq, tied", [(2, 32, 2, 16, True), (3, 48, 4, 24, False)])
def test_reference_gpt_matches_the_analytic_count(layers, d_model, heads, seq, tied):
    cfg = fs.models.GPTConfig(vocab_size=50, seq_len=seq, n_layer=layers, n_head=heads, d_model=d_model,
                              tie_embeddings=tied)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(0))
    x = torch.randint(0, 50, (3, seq + 1), generator=torch.Generator().manual_seed(1))
    with fs.profile.flops(model, params, {"inputs": x[:, :-1], "targets": x[:, 1:]}) as prof:
        expected = gpt_flops(cfg, 3, seq)
    assert prof.total_flops == pytest.approx(expected["total"], rel=0.02)
    assert prof.total_macs == prof.total_flops // 2
    paths, leaves, _ = fs.tree_flatten_with_paths(params)
    for i in range(layers):
        assert prof.modules[f"blocks.{i}"].flops == pytest.approx(expected["block"], rel=0.02)
        assert prof.modules[f"blocks.{i}"].params == sum(
            t.numel() for p, t in zip(paths, leaves) if p.startswith(f"blocks.{i}."))
    head = prof.modules["wte" if tied else "head"]
    assert head.flops == pytest.approx(expected["head"], rel=0.02)
    assert prof.modules["blocks.0.mlp.w_in"].flops == 2 * 3 * seq * d_model * cfg.hidden
    assert prof.total_params == fs.models.count_params(params) and prof.batch_rows == 3
    assert prof.latency_s > 0 and prof.modules["blocks"].latency_s > 0


@pytest.mark.parametrize("make, loss_fn, make_batch", [(hf_gpt2, lm_loss, lm_batch), (small_cnn, cnn_loss, cnn_batch)])
def test_functionalized_module_equals_flop_counter_mode_on_the_plain_module(make, loss_fn, make_batch):
    module = make()
    if hasattr(module, "set_attn_implementation"):
        module.set_attn_implementation("eager")  # torch counts no CPU fused attention in the plain module
    batch = make_batch(4, 0)
    with torch.no_grad(), FlopCounterMode(display=False) as reference:
        call(module, batch)
    by_module = {name.split(".", 1)[1]: sum(ops.values()) for name, ops in reference.get_flop_counts().items()
                 if "." in name}  # "GPT2LMHeadModel.transformer.h.0" -> "transformer.h.0"
    model = fs.functionalize(module, loss_fn)
    prof = fs.profile.flops(model, model.init(), batch)
    assert prof.total_flops == reference.get_total_flops() > 0
    assert {name: prof.modules[name].flops for name in by_module} == by_module
    named = dict(module.named_parameters())
    first = next(iter(by_module))
    assert prof.modules[first].params == sum(p.numel() for n, p in named.items() if n.startswith(first + "."))


def test_printout_follows_deepspeed_layout():
    cfg = fs.models.GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)
    model = fs.models.gpt(cfg)
    x = torch.randint(0, 32, (2, 9))
    prof = fs.profile.flops(model, model.init(torch.Generator().manual_seed(0)), {"inputs": x[:, :-1],
                                                                                  "targets": x[:, 1:]})
    table = prof.table(depth=2, top=2)
    assert "Aggregated Profile per GPU" in table and "depth 2:" in table and "depth 3:" not in table
    assert "'blocks.0'" in table and "'blocks.1'" in table and "MACs" in table
    text = fs.profile.report(prof, step=5, name="gpt", bwd_latency_s=0.002, step_latency_s=0.001, module_depth=1,
                             detailed_profile=True)
    for needle in ("DeepSpeed Flops Profiler", "Profile Summary at step 5", "fwd MACs per GPU:", "bwd latency:",
                   "FLOPS per GPU = 3 * fwd flops per GPU / iter latency:", "Detailed Profile per GPU",
                   "gpt(", "  blocks(", "100.00% Params"):
        assert needle in text, needle
    assert "blocks.0(" not in text  # module_depth=1
    assert "Detailed" not in fs.profile.report(prof, step=1, detailed_profile=False)


def test_tflops_and_peak():
    assert fs.profile.step_tflops(10**12, grad_accum=2, step_seconds=3.0) == pytest.approx(2.0)
    assert fs.profile.step_tflops(10**12, 1, 1.0, recompute_fwd_factor=1.0) == pytest.approx(4.0)
    assert fs.profile.measure_peak_tflops(size=128, repeats=2) > 0


def test_a_model_without_named_modules_is_a_clear_error():
    model = Model(init=lambda g=None: {"w": torch.ones(2)}, apply=None, loss=lambda p, b, *, rng=None: p["w"].sum())
    with pytest.raises(TypeError, match="functionalize'd nn.Module or a Model whose loss takes ops="):
        fs.profile.flops(model, {"w": torch.ones(2)}, {"x": torch.ones(1, 2)})


def test_fspeed_train_profiles_at_profile_step_and_logs_tflops(tmp_path):
    import csv

    from tests.test_cli import fspeed_train

    out = tmp_path / "prof" / "flops.txt"
    proc = fspeed_train("train.steps=3", "train.eval_every=0", "data.max_bytes=200000", "model.n_layer=2",
                        "model.d_model=32", "model.seq_len=32", "train.micro_batch_size=4", "train.grad_accum=2",
                        "flops_profiler.enabled=true", "flops_profiler.profile_step=2", "flops_profiler.top_modules=2",
                        "flops_profiler.peak_tflops=1.0", f"flops_profiler.output_file={out}",
                        f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "Profile Summary at step 2" in text and "batch size per GPU:" in text and "bwd latency:" in text
    assert "'blocks.0': " in text and "'blocks.1': " in text and "of a 1 TFLOPS peak (given)" in text
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [bool(r["tflops"]) for r in rows] == [False, False, True, True]  # from the profiled step on
    assert float(rows[3]["mfu"]) == pytest.approx(float(rows[3]["tflops"]))  # a 1 TFLOPS peak
    assert all(float(r["fwd_ms"]) > 0 for r in rows[1:])  # the profiler turns the breakdown on, as in DeepSpeed
    late = fspeed_train("train.steps=3", "flops_profiler.enabled=true", "flops_profiler.profile_step=4",
                        "data.max_bytes=200000", f"hydra.run.dir={tmp_path / 'late'}", cwd=tmp_path)
    assert late.returncode == 2 and "flops_profiler.profile_step = 4: is after the last step" in late.stderr
