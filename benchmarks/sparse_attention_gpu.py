"""fspeed's CUDA paths on a real GPU: block-sparse attention, fused Adam/LAMB, activation checkpointing.

For a session lent a GPU: one prepared run of a few minutes. The Numba CUDA kernels (backend
"cuda") have so far run only in Numba's simulator; this checks them, and the default CUDA path
(backend "bmm" on cuBLAS), against the float64 reference on the GPU, then times both against
dense SDPA and compiled FlexAttention (which has a GPU backward) at B=1, H=8, D=64, block 64,
bigbird at ~10% density, forward+backward, as benchmarks/sparse_attention.py does on CPU.
The Numba fused Adam and LAMB kernels (likewise simulator-only so far) are checked against the
torch reference through the optimizers' public API, with a bf16 compute copy. Then the train step on
CUDA with remat and cpu_checkpointing (side-stream copies, prefetched one block ahead), against no
remat, and their kept bytes and step time against plain PyTorch with torch.utils.checkpoint
(`activation_memory.gpu_check`), and a Hugging Face GPT-2 trained by fspeed against an eager loop
(`your_model.gpu_one_process`), and `train.device=cuda` through `fs.initialize` and `fspeed-train`
(`check_engine_on_device`: equal to the CPU run, also with the fused head of `fs.causal_lm_loss`;
train, checkpoint, resume). Correctness failures are listed and make the exit status 1; timing
always runs. `--sections` picks some of these.

The device image has every dependency but optree and hydra (the `engine` section's), and its
numba-cuda fails under its numpy 2.5 (`np.row_stack` is gone): carry numpy 2.4.6 and numba-cuda
0.30.4 (the pinned one) too, all as wheels (see /work/.library/device/README.md). Here:

    echo /.whl/ >> .git/info/exclude
    WHEELS="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64"
    python3 -m pip download $WHEELS -d .whl optree==0.20.0 numpy==2.4.6 numba-cuda==0.30.4
    python3 -m pip download --no-deps --only-binary=:all: -d .whl hydra-core==1.3.8 omegaconf==2.3.1
    python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3     # an sdist: built here

then run with carry [".whl"] and a timeout of about 480 s:

    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . .whl/*.whl &&
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/sparse_attention_gpu.py | tee $OUT/gpu.txt

(fspeed is installed, not put on the path: its `fspeed.kernels` package lives in `kernels/`.)

`--device cpu` runs the same script without a GPU (backend "cuda" and flex skipped, small S),
which is how it is kept working here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import activation_memory  # noqa: E402
from activation_memory import relative_error  # noqa: E402
import fspeed.sparse as sp  # noqa: E402
import your_model  # noqa: E402
from sparse_attention import BLOCK, D, H, make_layout  # noqa: E402

# attention kernels, fused optimizers, remat + cpu_checkpointing, HF GPT-2, fs.initialize and fspeed-train on the device
SECTIONS = ("sparse", "optim", "remat", "hf", "engine")
# Largest error against the float64 reference, relative to the reference's largest magnitude.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # measured on CPU: 1e-6, 3e-3, 5e-4
CASES = [  # (layout config, seq_len, causal, key padding)
    (sp.BigBirdConfig(num_heads=4, block=64, num_random_blocks=2), 1024, False, True),
    (sp.FixedConfig(num_heads=4, block=16, num_local_blocks=4, attention="unidirectional"), 512, True, False),
    (sp.VariableConfig(num_heads=4, block=32, local_window_blocks=[2, 4], global_block_indices=[0]), 1024, False,
     False),
]


def check_correctness(device: str, backends: list[str]) -> list[str]:
    """Output and q/k/v gradients of each backend and dtype against float64 `reference_attention`."""
    failures = []
    print(f"{'case':46s} {'backend':7s} {'dtype':9s} {'out err':>9s} {'grad err':>9s}")
    for config, S, causal, padded in CASES:
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
                inputs = [t.detach().requires_grad_() for t in x]
                name = f"{type(config).__name__} S={S} causal={causal} pad={padded}"
                try:
                    out = sp.attention(*inputs, layout, backend=backend, **kwargs)
                    grads = torch.autograd.grad(out, inputs, dout.to(dtype))
                except Exception as error:  # a launch or compile failure is a finding, not a crash
                    failures.append(f"{name} {backend} {dtype}: {type(error).__name__}: {error}")
                    print(f"{name:46s} {backend:7s} {str(dtype)[6:]:9s} {'FAILED':>9s}")
                    continue
                out_err = relative_error(out, ref)
                grad_err = max(relative_error(a, b) for a, b in zip(grads, ref_grads))
                print(f"{name:46s} {backend:7s} {str(dtype)[6:]:9s} {out_err:9.1e} {grad_err:9.1e}")
                if not out_err <= TOLERANCE[dtype] or not grad_err <= TOLERANCE[dtype]:
                    failures.append(f"{name} {backend} {dtype}: out {out_err:.1e}, grads {grad_err:.1e} "
                                    f"(tolerance {TOLERANCE[dtype]:.0e})")
    return failures


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


def check_engine_on_device(device: str, steps: int = 3, cli_steps: tuple[int, int] = (20, 25)) -> list[str]:
    """`train.device`: a Hugging Face GPT-2 through `fs.initialize` (a DeepSpeed config, batches on
    the CPU that the step moves), with its own loss and with `fs.causal_lm_loss` (the fused head),
    equals the same run on the CPU (fp32, no TF32); then `fspeed-train` trains, checkpoints and
    resumes on the device. Needs hydra (carry its wheels)."""
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
    """Forward+backward milliseconds per (method, dtype, S): dense SDPA, fspeed backends, flex."""
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
                methods[f"fspeed_{backend}"] = lambda a, b, c, be=backend: sp.attention(a, b, c, plan, backend=be)
            if flex and dtype == torch.bfloat16 and S == 8192:  # each compile takes tens of seconds
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
                dense = layout.bool().to(device)
                # flex's kernels tile by 128 on Hopper: its block mask is at 128, the mask_mod exact at BLOCK
                mask = create_block_mask(lambda b, h, qi, ki: dense[h, qi // BLOCK, ki // BLOCK], B=None, H=H,
                                         Q_LEN=S, KV_LEN=S, BLOCK_SIZE=128, device=device)
                compiled = torch.compile(flex_attention, dynamic=False)
                methods["flex"] = lambda a, b, c: compiled(a, b, c, block_mask=mask)
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
    backends = ["bmm", "cuda"] if gpu else ["bmm"]
    name = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"torch {torch.__version__} on {name}; bigbird ~10% density, B=1 H={H} D={D} block={BLOCK}\n")

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
    print(f"gpu_sparse_speedup_bf16_s8192={results[('sdpa', dt, S)] / best[0]:.2f}  # fastest fspeed: {best[1]}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
