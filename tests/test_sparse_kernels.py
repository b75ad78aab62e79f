"""The Numba block-sparse attention kernels: CPU kernels directly, CUDA kernels under the simulator
at tiny sizes and compiled to PTX for sm_80 and sm_90.

The CUDA checks run in subprocesses: the simulator must be chosen (NUMBA_ENABLE_CUDASIM=1) before
numba.cuda is imported, and PTX compilation only works without it. They need numba-cuda and
nvidia-cuda-nvrtc; when those are missing the tests fail and say what to install.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fspeed.sparse as sp

INSTALL = 'pip install "numba-cuda==0.30.4" "nvidia-cuda-nvrtc==13.0.88"'
TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("causal", [False, True])
def test_numba_cpu_backend_matches_reference(causal):
    g = torch.Generator().manual_seed(2)
    B, H, S, D = 2, 2, 24, 5
    q, k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    layout = sp.layout(sp.BigBirdConfig(num_heads=H, block=4, different_layout_per_head=True, num_random_blocks=1,
                                        attention="unidirectional" if causal else "bidirectional"), S, seed=1)
    layout[1, 2] = 0  # an empty query block
    kpm = torch.rand(B, S, generator=g) > 0.3
    am = torch.randn(1, H, S, S, generator=g, dtype=torch.float64)
    kwargs = dict(causal=causal, key_padding_mask=kpm, attn_mask=am)
    out = sp.attention(q, k, v, layout, backend="numba", **kwargs)
    ref = sp.reference_attention(q, k, v, layout, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(ref, (q, k, v), cot)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)
    grads = torch.func.grad(lambda x: sp.attention(x, k, v, layout, backend="numba", **kwargs).sum())(q.detach())
    want = torch.autograd.grad(sp.reference_attention(q, k, v, layout, **kwargs).sum(), q)[0]
    torch.testing.assert_close(grads, want)


def _require_numba_cuda():
    try:
        import numba_cuda  # noqa: F401
    except ImportError:
        pytest.fail(f"numba-cuda is not installed; the CUDA kernel tests need it: {INSTALL}")


def _run(code: str, simulator: bool, timeout: int = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=TESTS, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        hint = ""
        if "nvrtc" in done.stderr.lower() or "DynamicLibNotFoundError" in done.stderr:
            hint = f"\nNVRTC was not found: {INSTALL}"
        pytest.fail(f"subprocess failed (rc={done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}{hint}")
    return done.stdout


def simulator_check(storage: str, causal: bool) -> None:
    """Run forward and both backward kernels in the simulator and compare with the reference."""
    from numba import config

    from fspeed.kernels import sparse_attention_cuda as kernels

    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[storage]
    g = torch.Generator().manual_seed(5)
    B, H, S, D, block = 2, 2, 12, 3, 4
    layout = sp.layout(sp.BigBirdConfig(num_heads=H, block=block, different_layout_per_head=True, num_random_blocks=1),
                       S, seed=2)
    layout[0, 1] = 0  # an empty query block
    plan = sp.make_plan(layout, block, causal=causal)
    q, k, v, dout = (torch.randn(B, H, S, D, generator=g).to(dtype) for _ in range(4))
    kpm = torch.rand(B, S, generator=g) > 0.25
    am = torch.randn(1, H, S, S, generator=g)
    key_bias = sp.additive_mask(kpm, torch.float32).numpy()

    def bits(x):
        return x.view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.numpy()

    out = np.zeros((B, H, S, D), np.float32)
    lse = np.zeros((B, H, S), np.float32)
    kernels.forward(bits(q), bits(k), bits(v), plan.row_ptr, plan.col_idx, key_bias, am.numpy(), causal, D ** -0.5,
                    out, lse)
    q32, k32, v32 = (x.float().clone().requires_grad_() for x in (q, k, v))
    ref = sp.reference_attention(q32, k32, v32, layout, causal=causal, key_padding_mask=kpm, attn_mask=am)
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-5, atol=1e-5)
    want = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    delta = (dout.float() * torch.from_numpy(out)).sum(-1).numpy()
    grads = [np.zeros((B, H, S, D), np.float32) for _ in range(3)]
    kernels.backward(bits(q), bits(k), bits(v), bits(dout), lse, delta, plan.row_ptr, plan.col_idx, plan.col_ptr,
                     plan.row_idx, key_bias, am.numpy(), causal, D ** -0.5, *grads)
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-4, atol=1e-4)
    print("ok", storage, causal)


def test_cuda_kernels_under_the_simulator():
    _require_numba_cuda()
    storages = ("float32", "float16", "bfloat16")  # one process for all: its start is most of a check's time
    code = "import test_sparse_kernels as t\n" + "".join(
        f"t.simulator_check({s!r}, False)\nt.simulator_check({s!r}, True)\n" for s in storages)
    assert _run(code, simulator=True).split("\n")[:6] == [f"ok {s} {c}" for s in storages for c in (False, True)]


def test_bf16_decoding_is_exact_across_bit_patterns():
    _require_numba_cuda()
    code = """
import numpy as np, torch
from numba import cuda
from fspeed.kernels import sparse_attention_cuda as kernels

@cuda.jit
def decode(bits, out):
    i = cuda.grid(1)
    if i < bits.size:
        out[i] = kernels._load_bf16_bits(bits[i])

patterns = np.arange(-32768, 32768, 97, dtype=np.int64).astype(np.int16)
patterns = np.concatenate([patterns, np.array([0, -32768, 1, 127, 128, 0x7F80, -128, 0x7FC0], np.int16)])
out = np.zeros(patterns.size, np.float32)
decode[(patterns.size + 63) // 64, 64](patterns, out)
want = torch.from_numpy(patterns).view(torch.bfloat16).float().numpy()
same = (out == want) | (np.isnan(out) & np.isnan(want))
assert same.all(), patterns[~same][:10]
print("exact", patterns.size)
"""
    assert _run(code, simulator=True).startswith("exact")


def test_cuda_kernels_compile_to_ptx_for_sm80_and_sm90():
    _require_numba_cuda()
    code = """
from fspeed.kernels import sparse_attention_cuda as kernels
for cc in ((8, 0), (9, 0)):
    ptx = kernels.compile_ptx(cc)
    for name, text in sorted(ptx.items()):
        target = next(line for line in text.splitlines() if line.startswith(".target"))
        entries = text.count(".entry")
        print(cc[0], cc[1], name, target, entries)
"""
    lines = _run(code, simulator=False).strip().splitlines()
    kernels = {f"{k}_{s}" for k in ("forward", "backward_dq", "backward_dkdv")
               for s in ("float32", "float16", "bfloat16")}
    for major in (8, 9):
        rows = [line.split() for line in lines if line.startswith(f"{major} 0 ")]
        assert {r[2] for r in rows} == kernels
        assert all(r[3:] == [".target", f"sm_{major}0", "1"] for r in rows), rows


def test_gpu_check_script_runs_without_a_gpu():
    """benchmarks/sparse_attention_gpu.py --device cpu (its dry run without a GPU) completes: every
    correctness check passes, the timing table lists fspeed's backends, exit status 0."""
    script = TESTS.parent / "benchmarks" / "sparse_attention_gpu.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu_correctness_failures=0" in done.stdout and "fspeed_bmm" in done.stdout
    assert "fspeed_flex" in done.stdout and "flex/func" in done.stdout  # the default CUDA backend, in its CPU form
    assert "tensor-core route for the Numba kernels" in done.stdout
    assert "autotune on cpu: z0 mb16x1 dp1 peak predicted/measured error" in done.stdout
