"""fspeed's CUDA paths on a real GPU: block-sparse attention, fused Adam/LAMB, activation checkpointing.

One run of a few minutes on one GPU. fspeed's CUDA backends are checked against the float64
reference on the GPU: "flex" (the default on CUDA: compiled FlexAttention over the BlockMask fspeed
builds from the layout's block table, with FlexAttention's fused backward; also under
torch.func.grad, where the backward recomputes its forward), "bmm" (cuBLAS) and "cuda" (the Numba
CUDA kernels, which the test suite runs in Numba's simulator). Then all of them are timed against dense
SDPA, dense FlexAttention (no mask) and FlexAttention with a mask_mod-built BlockMask, at B=1, H=8,
D=64, block 64, bigbird at ~10% density, forward+backward, as benchmarks/sparse_attention.py does
on CPU (fspeed's flex in bf16 at every S, the flex baselines at S=8192: each compile takes tens of
seconds). The `tensorcore` section puts the Numba kernels' missing piece on the table: tensor-core
MMA, through nvmath-python's device matmul (cuBLASDx, callable from Numba) when it is importable,
and through CUDA C++ compiled by NVRTC (an `mma.sync` bf16 QK^T tile: compiled to PTX here, launched
and checked against torch on the GPU).
The Numba fused Adam and LAMB kernels (likewise tested in the simulator) are checked against the
torch reference through the optimizers' public API, with a bf16 compute copy. Then the train step on
CUDA with remat and cpu_checkpointing (side-stream copies, prefetched one block ahead), against no
remat, and their kept bytes and step time against plain PyTorch with torch.utils.checkpoint
(`activation_memory.gpu_check`), and a Hugging Face GPT-2 trained by fspeed against an eager loop
(`your_model.gpu_one_process`), and `train.device=cuda` through `fs.initialize` and `fspeed-train`
(`check_engine_on_device`: equal to the CPU run, also with the fused head of `fs.causal_lm_loss`;
train, checkpoint, resume), and `fspeed-autotune` on the device (`check_autotune_on_device`: one
rank, a few layouts profiled on the GPU, their trials' device peaks against the predicted ones).
Correctness failures are listed and make the exit status 1; timing always runs. `--sections` picks some of these.

On a GPU machine without network access, bring fspeed's wheels along. An image with torch, numpy
and numba-cuda already installed still needs optree and hydra (the `engine` section's), and numba-cuda
0.30.4 fails under numpy 2.5 (`np.row_stack` is gone), so numpy 2.4.6 and numba-cuda 0.30.4 come too.
On a machine with network access:

    WHEELS="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64"
    python3 -m pip download $WHEELS -d .whl optree==0.20.0 numpy==2.4.6 numba-cuda==0.30.4
    python3 -m pip download --no-deps --only-binary=:all: -d .whl hydra-core==1.3.8 omegaconf==2.3.1
    python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3     # an sdist: built here

then, on the GPU machine, with the repository and `.whl/` copied over:

    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . .whl/*.whl &&
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/sparse_attention_gpu.py | tee gpu.txt

(fspeed is installed, not put on the path: its `fspeed.kernels` package lives in `kernels/`.)

`--device cpu` runs the same script without a GPU (backend "cuda" and the flex baselines skipped,
small S; fspeed's flex runs its CPU form: compiled forward, bmm backward), which is how the test
suite keeps it working.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import activation_memory  # noqa: E402
from activation_memory import relative_error  # noqa: E402
import fspeed.sparse as sp  # noqa: E402
from fspeed.sparse.attention import resolve_backend  # noqa: E402
import your_model  # noqa: E402
from sparse_attention import BLOCK, D, H, make_layout  # noqa: E402

# attention kernels, fused optimizers, remat + cpu_checkpointing, HF GPT-2, fs.initialize and fspeed-train on the
# device, the tensor-core route for the Numba kernels, fspeed-autotune on the device
SECTIONS = ("sparse", "optim", "remat", "hf", "engine", "tensorcore", "autotune")
# Largest error against the float64 reference, relative to the reference's largest magnitude.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # measured on CPU: 1e-6, 3e-3, 5e-4
CASES = [  # (layout config, seq_len, causal, key padding)
    (sp.BigBirdConfig(num_heads=4, block=64, num_random_blocks=2), 1024, False, True),
    (sp.FixedConfig(num_heads=4, block=16, num_local_blocks=4, attention="unidirectional"), 512, True, False),
    (sp.VariableConfig(num_heads=4, block=32, local_window_blocks=[2, 4], global_block_indices=[0]), 1024, False,
     False),
]


def flex_checked(device: str, case: int, dtype: torch.dtype) -> bool:
    """Whether backend "flex" is checked on this case and dtype: each (shape, dtype) compiles anew, so on
    the GPU every case in bf16 (fp16 runs bf16's code) and the first in fp32 too, and in the CPU dry run
    the first case in fp32."""
    if device == "cuda":
        return dtype == torch.bfloat16 or (case == 0 and dtype == torch.float32)
    return case == 0 and dtype == torch.float32


def check_correctness(device: str, backends: list[str]) -> list[str]:
    """Output and q/k/v gradients of each backend and dtype against float64 `reference_attention`; for
    "flex" also the gradients under torch.func.grad (the path that recomputes flex's forward)."""
    failures = []
    print(f"{'case':46s} {'backend':9s} {'dtype':9s} {'out err':>9s} {'grad err':>9s}")
    for case, (config, S, causal, padded) in enumerate(CASES):
        layout = sp.layout(config, S, seed=1)
        g = torch.Generator(device=device).manual_seed(S)
        q, k, v, dout = (torch.randn(2, 4, S, 64, generator=g, device=device) for _ in range(4))
        kpm = torch.ones(2, S, dtype=torch.bool, device=device)
        if padded:
            kpm[1, S - 100:] = False
        kwargs = dict(causal=causal, key_padding_mask=kpm if padded else None)
        for dtype in TOLERANCE:
            x = [t.to(dtype) for t in (q, k, v)]
            ref_in = [t.double().requires_grad_() for t in x]
            ref = sp.reference_attention(*ref_in, layout, **kwargs)
            ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
            for backend in backends:
                if backend == "flex" and not flex_checked(device, case, dtype):
                    continue
                inputs = [t.detach().requires_grad_() for t in x]
                name = f"{type(config).__name__} S={S} causal={causal} pad={padded}"
                runs = [(backend, lambda: _grads_autograd(inputs, layout, backend, kwargs, dout.to(dtype)))]
                if backend == "flex" and case == 0:
                    runs.append(("flex/func", lambda: _grads_func(x, layout, kwargs, dout.to(dtype))))
                for label, run in runs:
                    try:
                        out, grads = run()
                    except Exception as error:  # a launch or compile failure is a finding, not a crash
                        failures.append(f"{name} {label} {dtype}: {type(error).__name__}: {error}")
                        print(f"{name:46s} {label:9s} {str(dtype)[6:]:9s} {'FAILED':>9s}")
                        continue
                    out_err = relative_error(out, ref)
                    grad_err = max(relative_error(a, b) for a, b in zip(grads, ref_grads))
                    print(f"{name:46s} {label:9s} {str(dtype)[6:]:9s} {out_err:9.1e} {grad_err:9.1e}")
                    if not out_err <= TOLERANCE[dtype] or not grad_err <= TOLERANCE[dtype]:
                        failures.append(f"{name} {label} {dtype}: out {out_err:.1e}, grads {grad_err:.1e} "
                                        f"(tolerance {TOLERANCE[dtype]:.0e})")
    return failures


def _grads_autograd(inputs, layout, backend, kwargs, dout):
    out = sp.attention(*inputs, layout, backend=backend, **kwargs)
    return out, torch.autograd.grad(out, inputs, dout)


def _grads_func(x, layout, kwargs, dout):
    """Backend "flex" under torch.func.vjp: fspeed's Function, flex's backward after a recomputed forward."""
    out, vjp = torch.func.vjp(lambda q, k, v: sp.attention(q, k, v, layout, backend="flex", **kwargs), *x)
    return out, vjp(dout)


def check_optimizers(device: str) -> list[str]:
    """Adam(W) and LAMB with backend="numba" (the CUDA kernels on CUDA tensors) against backend="torch",
    three steps on a flat buffer with a tail, writing a bf16 compute copy; AdamW's `grad_sq` (the grad
    norm train_step takes from the update where nothing reads it first) on both backends."""
    from fspeed import Flat
    from fspeed.optim import adam, lamb, optimizer_step

    g = torch.Generator(device=device).manual_seed(0)
    params = Flat.from_tree({"w": torch.randn(1000, 77, generator=g, device=device),
                             "b": torch.randn(13, generator=g, device=device)})
    grads = [Flat.from_tree({k: torch.randn(v.shape, generator=g, device=device) for k, v in params.items()})
             for _ in range(3)]

    def run(opt):
        p, state = params.clone(), opt.init(params)
        cast = p.to(torch.bfloat16)
        for grad in grads:
            p, state = optimizer_step(opt, grad, state, p, cast_to=cast)
        return p, cast

    failures = []
    for name, make in (("adamw", lambda be: adam(1e-2, weight_decay=0.1, adam_w_mode=True, backend=be)),
                       ("lamb", lambda be: lamb(1e-2, weight_decay=0.01, backend=be))):
        try:
            (got, cast), (ref, _) = run(make("numba")), run(make("torch"))
            err = relative_error(got.buffer, ref.buffer.double())
            exact_cast = bool(torch.equal(cast.buffer, got.buffer.to(torch.bfloat16)))
        except Exception as error:
            failures.append(f"{name} backend=numba: {type(error).__name__}: {error}")
            continue
        print(f"{name:6s} numba kernel vs torch: relative error {err:.1e}, bf16 copy exact: {exact_cast}")
        if not err <= 1e-5 or not exact_cast:
            failures.append(f"{name} backend=numba: error {err:.1e} (tolerance 1e-5), bf16 copy exact: {exact_cast}")
    for backend in ("numba", "torch"):
        grad_sq: list = []
        opt = adam(1e-2, weight_decay=0.1, adam_w_mode=True, backend=backend)
        optimizer_step(opt, grads[0], opt.init(params), params.clone(), grad_sq=grad_sq)
        want = float(grads[0].buffer.double().square().sum())
        err = abs(sum(grad_sq) / want - 1)
        print(f"adamw backend={backend} grad_sq: relative error {err:.1e} against the float64 sum of squares")
        if not err <= 1e-5:
            failures.append(f"adamw backend={backend} grad_sq: relative error {err:.1e} (tolerance 1e-5)")
    return failures


def check_autotune_on_device(device: str, trials: int = 3, tolerance: float = 0.25) -> list[str]:
    """fspeed-autotune for one rank with `train.device=<device>`: the profiling pass on the device,
    `trials` real trials, each ok and its measured peak (on CUDA: the allocator's reserved bytes the
    ranks record) within `tolerance` of the predicted one, relative to the measured."""
    import tempfile  # noqa: PLC0415

    from fspeed.autotune.space import SearchSpace  # noqa: PLC0415
    from fspeed.autotune.trials import TrialSettings  # noqa: PLC0415
    from fspeed.autotune.tuner import TuneSettings, tune  # noqa: PLC0415

    gpu = device == "cuda"
    size = ("model.n_layer=4", "model.n_head=8", "model.d_model=512", "model.seq_len=512") if gpu else \
        ("model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=32")
    base = (*size, "data.max_bytes=400000", f"train.device={device}", "train.train_batch_size=16",
            "precision=bf16" if gpu else "precision=fp32")
    space = SearchSpace(zero_stage=(0,), remat=("none", "full"), offload_optimizer=(False,), offload_param=(False,),
                        tensor=(1,), pipe=(1,), micro_batch=(4, 16) if gpu else (16,))
    with tempfile.TemporaryDirectory(prefix="fspeed-autotune-gpu-") as tmp:
        report = tune(TuneSettings(world=1, base_overrides=base, workdir=Path(tmp), space=space, strategy="grid",
                                   max_trials=trials, trial=TrialSettings(warm_steps=2, measured_steps=3,
                                                                          timeout_s=300)),
                      progress=lambda line: print(" ", line, flush=True))
    print(report.table())
    failures = []
    for row in report.rows:
        if row.result is None:
            continue
        if not row.result.ok:
            failures.append(f"autotune on {device}: trial {row.candidate.label()} {row.status}: {row.reason}")
        elif row.result.max_peak_bytes and row.predicted_bytes:
            error = abs(row.predicted_bytes - row.result.max_peak_bytes) / row.result.max_peak_bytes
            print(f"autotune on {device}: {row.candidate.label()} peak predicted/measured error {error:.3f}")
            if error > tolerance:
                failures.append(f"autotune on {device}: {row.candidate.label()} predicted peak "
                                f"{row.predicted_bytes} is {error:.0%} off the measured {row.result.max_peak_bytes}")
    return failures


def check_engine_on_device(device: str, steps: int = 3, cli_steps: tuple[int, int] = (20, 25)) -> list[str]:
    """`train.device`: a Hugging Face GPT-2 through `fs.initialize` (a DeepSpeed config, batches on
    the CPU that the step moves), with its own loss and with `fs.causal_lm_loss` (the fused head),
    equals the same run on the CPU (fp32, no TF32); then `fspeed-train` trains, checkpoints and
    resumes on the device. Needs hydra."""
    import copy  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    import fspeed as fs  # noqa: PLC0415

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    failures = []
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    module = your_model.build_gpt2(2, 128)
    trained, curves = {}, {}
    runs = (("cpu", None), (device, None), (f"{device}, causal_lm_loss", fs.causal_lm_loss))
    for label, loss_fn in runs:
        where = label.split(",")[0]
        engine, *_ = fs.initialize(copy.deepcopy(module), config, loss_fn=loss_fn, overrides=[f"train.device={where}"])
        losses = [engine.train_batch(batch=your_model.batch_for(i, 8)) for i in range(steps)]
        trained[label] = {n: p.detach().cpu() for n, p in engine.module.named_parameters()}
        curves[label] = losses
        print(f"fs.initialize, HF GPT-2 on {label}: losses {[round(v, 4) for v in losses]}, parameters on "
              f"{next(engine.module.parameters()).device}")
    # the same math: the parameters (GPT-2's key biases aside: their true gradient is zero, so Adam
    # turns rounding into whole steps there)
    err = max(relative_error(trained[device][n], ref) for n, ref in trained["cpu"].items()
              if not n.endswith("c_attn.bias"))
    print(f"engine on {device} vs cpu after {steps} steps: parameters' largest relative error {err:.1e}")
    if err > 1e-4:
        failures.append(f"fs.initialize with train.device={device}: parameters differ from the CPU run by {err:.1e}")
    # the fused head sums in another order than autograd, which Adam amplifies in the parameters: its losses
    fused = f"{device}, causal_lm_loss"
    err = max(abs(a - b) / abs(b) for a, b in zip(curves[fused], curves["cpu"]))
    print(f"engine on {fused} vs cpu: losses' largest relative difference {err:.1e}")
    if err > 1e-5:
        failures.append(f"fs.initialize on {fused}: losses differ from the CPU run by {err:.1e}")
    # the module traced into pipeline layers (traced_layers) on the device: its loss and gradients, fp32 and
    # a bf16 graph traced on first use
    traced_module = copy.deepcopy(module).to(device)
    model = fs.models.traced_layers(traced_module, {k: v.to(device) for k, v in your_model.batch_for(0, 4).items()})
    batch = {k: v.to(device) for k, v in your_model.batch_for(1, 6).items()}
    params = fs.tree_map(lambda t: t.detach().requires_grad_(), model.init())
    loss = model.loss(params, batch, rng=torch.Generator(device=device).manual_seed(0))
    loss.backward()
    want = traced_module(**batch).loss
    want.backward()
    named = dict(traced_module.named_parameters())
    err = max(relative_error(t.grad, named[path].grad) for path, t in zip(fs.tree_paths(params),
                                                                           fs.pytree.tree_leaves(params)))
    print(f"traced_layers on {device}: loss {loss.item():.5f} vs the module's {want.item():.5f}; gradients' largest "
          f"relative error {err:.1e}")
    if abs(loss.item() - want.item()) > 1e-5 or err > 1e-4:
        failures.append(f"traced_layers on {device} differs from the module (loss or gradients, {err:.1e})")
    with torch.no_grad():
        half = model.loss(fs.tree_map(lambda t: t.to(torch.bfloat16), model.init()), batch,
                          rng=torch.Generator(device=device).manual_seed(0))
    print(f"traced_layers on {device} in bf16: loss {float(half):.4f}")
    if abs(float(half) - want.item()) > 0.05:
        failures.append(f"traced_layers on {device} in bf16: loss {float(half):.4f} against fp32's {want.item():.4f}")
    with tempfile.TemporaryDirectory() as tmp:
        common = [sys.executable, "-m", "fspeed.cli.train", f"train.device={device}", "data.max_bytes=200000",
                  "model.n_layer=2", "scheduler.warmup_num_steps=5", "train.eval_every=0", "monitor.progress_bar=false",
                  f"checkpoint.dir={tmp}/ck"]
        for steps_to, extra in zip(cli_steps, ([], ["checkpoint.resume=true"])):
            proc = subprocess.run(common + [f"train.steps={steps_to}", f"hydra.run.dir={tmp}/run{steps_to}"] + extra,
                                  capture_output=True, text=True, timeout=300)
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            print(f"fspeed-train train.device={device} to step {steps_to}{' (resumed)' if extra else ''}: exit "
                  f"{proc.returncode}; " + " | ".join(tail))
            if proc.returncode != 0:
                failures.append(f"fspeed-train train.device={device} (to step {steps_to}) exited {proc.returncode}")
                break
    return failures


def timed(fn, device: str, reps: int) -> float:
    """Median milliseconds of `fn()` after a warm-up (compiles, JITs)."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def time_methods(device: str, seqs: list[int], dtypes: list[torch.dtype], backends: list[str], flex: bool,
                 reps: int) -> dict:
    """Forward+backward milliseconds per (method, dtype, S): dense SDPA, fspeed's backends (its "flex" in
    bf16, or fp32 on the CPU, only), and with `flex`, at bf16 S=8192, dense FlexAttention and FlexAttention
    over a mask_mod-built BlockMask."""
    results = {}
    print(f"\n{'S':>6s} {'dtype':9s} {'method':12s} {'f+b ms':>9s} {'vs sdpa':>8s}")
    for S in seqs:
        layout = make_layout("bigbird", S)
        plan = sp.make_plan(layout, BLOCK)
        for dtype in dtypes:
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(1, H, S, D, generator=g, device=device, dtype=dtype) for _ in range(3))
            methods = {"sdpa": lambda a, b, c: F.scaled_dot_product_attention(a, b, c)}
            for backend in backends:
                if backend == "flex" and dtype != dtypes[0]:  # a compile per shape: the first dtype only
                    continue
                methods[f"fspeed_{backend}"] = lambda a, b, c, be=backend: sp.attention(a, b, c, plan, backend=be)
            if flex and dtype == torch.bfloat16 and S == 8192:  # each compile takes tens of seconds
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
                dense = layout.bool().to(device)
                # flex's kernels tile by 128 on Hopper: its block mask is at 128, the mask_mod exact at BLOCK
                mask = create_block_mask(lambda b, h, qi, ki: dense[h, qi // BLOCK, ki // BLOCK], B=None, H=H,
                                         Q_LEN=S, KV_LEN=S, BLOCK_SIZE=128, device=device)
                compiled = torch.compile(flex_attention, dynamic=False)
                methods["flex"] = lambda a, b, c: compiled(a, b, c, block_mask=mask)
                methods["flex_dense"] = lambda a, b, c: compiled(a, b, c)
            for name, fn in methods.items():
                def train(fn=fn):
                    a, b, c = (x.detach().requires_grad_() for x in (q, k, v))
                    out = fn(a, b, c)
                    out.backward(torch.ones_like(out))
                try:
                    ms = timed(train, device, reps)
                except Exception as error:
                    print(f"{S:6d} {str(dtype)[6:]:9s} {name:12s} failed: {type(error).__name__}: {error}")
                    continue
                results[(name, dtype, S)] = ms
                ratio = results[("sdpa", dtype, S)] / ms if ("sdpa", dtype, S) in results else float("nan")
                print(f"{S:6d} {str(dtype)[6:]:9s} {name:12s} {ms:9.2f} {ratio:7.2f}x")
    return results


# One warp multiplies a 16 x D bf16 query tile by an 8 x D key tile (S = Q K^T, fp32 accumulate) with the
# tensor cores' mma.sync m16n8k16: the instruction a Numba attention kernel would need for its two
# matmuls. Fragment layout per PTX ISA (mma.m16n8k16, .bf16): lane = 4 g + t holds A rows g and g + 8,
# columns 2t, 2t+1 (and + 8); B column g, rows 2t, 2t+1 (and + 8); C rows g and g + 8, columns 2t, 2t+1.
MMA_TILE_SOURCE = r"""
extern "C" __global__ void qk_tile(const unsigned short* q, const unsigned short* k, float* s, int d) {
  int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
  for (int k0 = 0; k0 < d; k0 += 16) {
    const unsigned short *q0 = q + g * d + k0 + 2 * t, *q8 = q0 + 8 * d, *kk = k + g * d + k0 + 2 * t;
    unsigned a0 = q0[0] | (unsigned(q0[1]) << 16), a1 = q8[0] | (unsigned(q8[1]) << 16);
    unsigned a2 = q0[8] | (unsigned(q0[9]) << 16), a3 = q8[8] | (unsigned(q8[9]) << 16);
    unsigned b0 = kk[0] | (unsigned(kk[1]) << 16), b1 = kk[8] | (unsigned(kk[9]) << 16);
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  s[g * 8 + 2 * t] = c0; s[g * 8 + 2 * t + 1] = c1; s[(g + 8) * 8 + 2 * t] = c2; s[(g + 8) * 8 + 2 * t + 1] = c3;
}
"""


def _nvrtc_ptx(source: str, arch: str) -> str:
    """PTX of CUDA C++ `source` for `arch` (e.g. "compute_90") through NVRTC; needs no GPU or driver."""
    from cuda.bindings import nvrtc  # noqa: PLC0415

    def ok(result):
        err, *rest = result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC: {err}")
        return rest[0] if len(rest) == 1 else rest

    prog = ok(nvrtc.nvrtcCreateProgram(source.encode(), b"qk_tile.cu", 0, [], []))
    opts = [f"--gpu-architecture={arch}".encode()]
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        size = ok(nvrtc.nvrtcGetProgramLogSize(prog))
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC compile failed: {log.decode(errors='replace').strip()}")
    ptx = b" " * ok(nvrtc.nvrtcGetPTXSize(prog))
    ok((nvrtc.nvrtcGetPTX(prog, ptx)[0], None))
    return ptx.decode().rstrip("\x00 ")


def tensor_core_route(device: str) -> list[str]:
    """What a tensor-core Numba attention kernel could be built on, as far as this machine shows it.

    The Numba CUDA kernels multiply with scalar FMAs (numba-cuda has no MMA intrinsic), which is why
    they trail cuBLAS and FlexAttention's Triton kernels by an order of magnitude on an H200. Two ways
    to give them tensor cores: nvmath-python's device matmul (cuBLASDx, called from inside a Numba
    kernel), and CUDA C++ device code with `mma.sync`, compiled by NVRTC (numba-cuda can link such a
    .cu into a kernel: `cuda.jit(link=[...])` with `cuda.declare_device`). Each part runs if its
    package is importable and says why not otherwise; nothing here is a timing."""
    failures = []
    print("tensor-core route for the Numba kernels (not timed):")
    try:
        import nvmath  # noqa: PLC0415
        from nvmath.device import matmul as device_matmul  # noqa: PLC0415
    except ImportError as error:
        print(f"  nvmath-python: not importable ({error}); it would be `pip install nvmath-python[cu13]` plus "
              "libmathdx, and a Numba kernel then calls a cuBLASDx block GEMM (nvmath.device.matmul)")
    else:
        try:
            mm = device_matmul(size=(BLOCK, BLOCK, D), precision=np.float16, data_type="real",
                               arrangement=("row_major", "col_major", "row_major"), execution="Block",
                               compiler="numba", code_type=("lto", "sm_90"))
            print(f"  nvmath-python {nvmath.__version__}: device matmul {BLOCK}x{BLOCK}x{D} fp16 built for Numba, "
                  f"block_dim {getattr(mm, 'block_dim', '?')}")
        except Exception as error:  # noqa: BLE001 - a finding, not a crash
            print(f"  nvmath-python {getattr(nvmath, '__version__', '?')} importable, device matmul not built: "
                  f"{type(error).__name__}: {error}")
    try:
        arch = "compute_90"
        if device == "cuda":
            major, minor = torch.cuda.get_device_capability()
            arch = f"compute_{major}{minor}"
        ptx = _nvrtc_ptx(MMA_TILE_SOURCE, arch)
    except ImportError as error:
        print(f"  CUDA C++ through NVRTC: cuda-bindings' nvrtc not importable ({error})")
        return failures
    except Exception as error:  # noqa: BLE001 - e.g. libnvrtc missing
        print(f"  CUDA C++ through NVRTC: not compiled: {type(error).__name__}: {error}")
        return failures
    mmas = sum("mma.sync.aligned.m16n8k16" in line for line in ptx.splitlines())
    print(f"  CUDA C++ through NVRTC ({arch}): bf16 QK^T tile compiled to PTX with {mmas} mma.sync.m16n8k16 "
          "instruction(s)")
    if mmas == 0:
        failures.append("tensorcore: NVRTC's PTX of the MMA tile has no mma.sync instruction")
    if device != "cuda":
        print("  (no GPU: the tile is compiled, not launched)")
        return failures
    try:
        from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch  # noqa: PLC0415

        dev = Device()
        dev.set_current()
        stream = dev.create_stream()
        kernel = Program(MMA_TILE_SOURCE, "c++", ProgramOptions(arch=f"sm_{dev.arch}")).compile("cubin") \
            .get_kernel("qk_tile")
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(16, D, generator=g, device=device).to(torch.bfloat16)
        k = torch.randn(8, D, generator=g, device=device).to(torch.bfloat16)
        s = torch.empty(16, 8, device=device)
        torch.cuda.synchronize()
        launch(stream, LaunchConfig(grid=1, block=32), kernel, q.data_ptr(), k.data_ptr(), s.data_ptr(), np.int32(D))
        stream.sync()
        err = relative_error(s, q.double() @ k.double().T)
        print(f"  launched through cuda.core on {torch.cuda.get_device_name()}: relative error {err:.1e} against "
              "torch (fp32 accumulate)")
        if not err <= 1e-5:
            failures.append(f"tensorcore: the NVRTC mma.sync tile differs from torch by {err:.1e}")
    except Exception as error:  # noqa: BLE001 - a finding, not a crash
        failures.append(f"tensorcore: launching the NVRTC tile failed: {type(error).__name__}: {error}")
        print(f"  launch failed: {type(error).__name__}: {error}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--profile", metavar="DIR", help="only profile fspeed's and PyTorch's GPT steps (tables to DIR)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="which checks to run (default: all)")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu to exercise the script without one")
    gpu = device == "cuda"
    if args.profile:
        activation_memory.gpu_profile(args.profile)
        return
    backends = ["flex", "bmm", "cuda"] if gpu else ["bmm", "flex"]
    name = torch.cuda.get_device_name() if gpu else "cpu"
    default = resolve_backend("auto", device, torch.bfloat16)
    print(f"torch {torch.__version__} on {name}; bigbird ~10% density, B=1 H={H} D={D} block={BLOCK}; "
          f"backend 'auto' here (bf16) is {default!r}\n")

    run = set(args.sections)
    failures, results = [], {}
    if "sparse" in run:
        failures += check_correctness(device, backends)
    if gpu and "optim" in run:
        print()
        failures += check_optimizers(device)
    if "sparse" in run:
        seqs = args.seqs if gpu else [1024]
        dtypes = [torch.bfloat16, torch.float16, torch.float32] if gpu else [torch.float32]
        results = time_methods(device, seqs, dtypes, backends, flex=gpu, reps=args.reps if gpu else 2)
    if "remat" in run:
        print()
        sizes = {} if gpu else dict(layers=2, width=128, seq=128, batch=2, steps=2)
        failures += activation_memory.gpu_check(device=device, **sizes)
    if "hf" in run:
        print()
        hf_sizes = {} if gpu else dict(layers=2, width=128, rows=4, steps=2)
        your_model.gpu_one_process(device=device, **hf_sizes)
        your_model.gpu_one_process(device=device, headline="gpu_hf_step_time_vs_eager_same_ops", fused_ops=False,
                                   **hf_sizes)  # the module's own ops: the runtime's ratio alone

    if "engine" in run:
        print()
        failures += check_engine_on_device(device, **({} if gpu else dict(steps=2, cli_steps=(3, 4))))
    if "tensorcore" in run:
        print()
        failures += tensor_core_route(device)
    if "autotune" in run:
        print()
        failures += check_autotune_on_device(device, **({} if gpu else dict(trials=1)))

    print()
    for f in failures:
        print("FAILED:", f)
    print(f"gpu_correctness_failures={len(failures)}")
    if not gpu:
        print("(dry run on the CPU: no GPU figures)")
        sys.exit(1 if failures else 0)
    S, dt = 8192, torch.bfloat16
    if ("sdpa", dt, S) not in results:
        sys.exit(1 if failures else 0)
    best = min((results[(m, dt, S)], m) for m in (f"fspeed_{b}" for b in backends) if (m, dt, S) in results)
    if ("fspeed_cuda", dt, S) in results:
        print(f"gpu_numba_cuda_vs_bmm={results[('fspeed_bmm', dt, S)] / results[('fspeed_cuda', dt, S)]:.2f}")
    if ("flex", dt, S) in results:
        print(f"gpu_sparse_vs_flex={results[('flex', dt, S)] / best[0]:.2f}")
    if ("fspeed_flex", dt, S) in results:
        ours = results[("fspeed_flex", dt, S)]
        print(f"gpu_flex_backend_vs_sdpa_bf16_s8192={results[('sdpa', dt, S)] / ours:.2f}")
        for other, key in (("flex", "gpu_flex_backend_vs_flex_mask_mod"),
                           ("flex_dense", "gpu_flex_backend_vs_flex_dense"),
                           ("fspeed_cuda", "gpu_flex_backend_vs_numba_cuda"),
                           ("fspeed_bmm", "gpu_flex_backend_vs_bmm")):
            if (other, dt, S) in results:
                print(f"{key}={results[(other, dt, S)] / ours:.2f}")
    print(f"gpu_sparse_speedup_bf16_s8192={results[('sdpa', dt, S)] / best[0]:.2f}  # fastest fspeed: {best[1]}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    from figures import recorded  # benchmarks/figures.py: a GPU run's figures (the CPU dry run writes none)

    on = argparse.ArgumentParser(add_help=False)
    on.add_argument("--device", default="cuda")
    with recorded("sparse_attention_gpu", enabled=on.parse_known_args()[0].device == "cuda"):
        main()
