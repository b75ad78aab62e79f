"""CUDA kernels under Numba's CUDA simulator, against the pure-torch references.

Not collected by a plain `pytest` run (the name does not match test_*.py): tests/test_cuda_kernels.py
runs this file in a subprocess with NUMBA_ENABLE_CUDASIM=1, because the simulator replaces
`numba.cuda` for the whole process and must be chosen before Numba is imported. Run it by hand
with `NUMBA_ENABLE_CUDASIM=1 pytest tests/cuda_sim_suite.py`.

The simulator runs every GPU thread as a Python thread (~20 us per element-iteration, ~10x more
with syncthreads), so sizes stay <= 1e4 and grids tiny; small grids are the point anyway: fewer
threads than elements exercise the grid-stride loop, chunks that do not divide the tensor sizes
exercise the tails, and empty and one-element tensors the edge cases.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    raise RuntimeError("tests/cuda_sim_suite.py needs NUMBA_ENABLE_CUDASIM=1 in the environment (set before Numba loads)")

from fspeed import Flat  # noqa: E402
from fspeed.kernels import cuda_adam, cuda_interop, cuda_lamb  # noqa: E402
from fspeed.optim import adam, lamb, optimizer_step  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6

assert cuda_interop.simulator_enabled() and cuda_interop.problem() is None


@st.composite
def adam_hparams(draw) -> dict:
    return dict(
        lr=draw(st.floats(1e-4, 1e-1)),
        b1=draw(st.floats(0.0, 0.99)),
        b2=draw(st.floats(0.9, 0.9999)),
        eps=draw(st.sampled_from([1e-8, 1e-3])),
        weight_decay=draw(st.sampled_from([0.0, 0.1])),
        adam_w_mode=draw(st.booleans()),
        bias_correction=draw(st.booleans()),
    )


def flat_problem(sizes, steps, seed, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = Flat.from_tree({f"w{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)})
    grads = [Flat.from_tree({k: torch.randn(v.shape, generator=gen).to(grad_dtype) for k, v in params.items()})
             for _ in range(steps)]
    return params, grads


def run(opt, params, grads, cast_dtype=None):
    params, state = params.clone(), opt.init(params)
    cast_to = params.to(cast_dtype) if cast_dtype is not None else None
    for g in grads:
        params, state = optimizer_step(opt, g, state, params, cast_to=cast_to)
    return params, state, cast_to


@settings(max_examples=8)
@given(st.integers(1, 3000), adam_hparams(), st.integers(1, 3), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_cuda_adam_matches_torch_reference(n, hp, steps, seed, grad_dtype):
    """The kernel with a 2-block grid (512 threads: most sizes loop, with a tail) against torch."""
    params, grads = flat_problem([n], steps, seed, grad_dtype)
    p, m, v = params.buffer.clone(), torch.zeros(n), torch.zeros(n)
    for t, g in enumerate(grads, start=1):
        cuda_adam.adam_step(p, g.buffer, m, v, lr=hp["lr"], beta1=hp["b1"], beta2=hp["b2"], eps=hp["eps"],
                            weight_decay=hp["weight_decay"], step=t, adam_w_mode=hp["adam_w_mode"],
                            bias_correction=hp["bias_correction"], max_blocks=2)
    ref, state, _ = run(adam(**hp, backend="torch"), params, grads)
    torch.testing.assert_close(p, ref.buffer, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(m, state.mu.buffer, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(v, state.nu.buffer, rtol=RTOL, atol=ATOL)


@pytest.fixture
def cpu_tensors_take_cuda_kernels(monkeypatch):
    """Under the simulator the "CUDA" tensors are CPU tensors: route the optimizers' kernel choice
    for CPU tensors to the CUDA kernel modules."""
    from fspeed.optim.base import numba_kernel

    def as_cuda(name, backend, kernels, tensors):
        return numba_kernel(name, backend, {"cpu": kernels["cuda"]}, tensors)

    for module in ("fspeed.optim.adam", "fspeed.optim.lamb"):  # modules, not the functions of that name
        monkeypatch.setattr(importlib.import_module(module), "numba_kernel", as_cuda)


def test_adam_backend_numba_runs_the_cuda_kernel_and_casts(cpu_tensors_take_cuda_kernels, monkeypatch):
    """Through the optimizer: backend="numba" on (simulated) CUDA, with the compute-copy cast."""
    launches = []
    real = cuda_adam.adam_step
    monkeypatch.setattr(cuda_adam, "adam_step", lambda *a, **k: launches.append(a[0].numel()) or real(*a, **k))
    params, grads = flat_problem([5, 300, 1], 2, 3, torch.bfloat16)
    got, state, cast = run(adam(1e-2, weight_decay=0.1, adam_w_mode=True, backend="numba"), params, grads,
                           torch.bfloat16)
    ref, ref_state, _ = run(adam(1e-2, weight_decay=0.1, adam_w_mode=True, backend="torch"), params, grads)
    assert launches == [306, 306]  # one launch per flat buffer and step
    torch.testing.assert_close(got.buffer, ref.buffer, rtol=RTOL, atol=ATOL)
    assert torch.equal(cast.buffer, got.buffer.to(torch.bfloat16))


LAMB_CASES = [
    # sizes (tails: none divides the chunk), threads per block, chunk, weight decay, eps_inside_sqrt
    ([37, 1, 200, 64], 16, 48, 0.0, False),
    ([129, 0, 3, 250], 32, 64, 0.1, True),
    ([1000], 8, 96, 0.01, False),
]


@pytest.mark.parametrize("sizes, threads, chunk, wd, inside", LAMB_CASES)
def test_cuda_lamb_matches_torch_reference(sizes, threads, chunk, wd, inside):
    params, grads = flat_problem(sizes, 2, sum(sizes))
    hp = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-6, weight_decay=wd, eps_inside_sqrt=inside)
    ref, ref_state, _ = run(lamb(**hp, backend="torch"), params, grads)
    p, m, v = params.buffer.clone(), torch.zeros(params.numel), torch.zeros(params.numel)
    for t, g in enumerate(grads, start=1):
        trust = cuda_lamb.lamb_step(p, g.buffer, m, v, params.layout.sizes, lr=hp["lr"], beta1=hp["b1"],
                                    beta2=hp["b2"], eps=hp["eps"], weight_decay=wd, step=t, eps_inside_sqrt=inside,
                                    threads=threads, chunk=chunk)
    torch.testing.assert_close(p, ref.buffer, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(m, ref_state.mu.buffer, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(trust, ref_state.trust_ratio, rtol=RTOL, atol=ATOL)


def test_cuda_lamb_clamps_and_zero_norm_tensors():
    """Trust ratio clamped at max_coeff/min_coeff, and 1 for an all-zero tensor (||p|| = 0)."""
    sizes = [40, 40, 40]
    params = Flat.from_tree({"big": torch.full((40,), 100.0), "small": torch.full((40,), 1e-6),
                             "zero": torch.zeros(40)})
    grads = Flat.from_tree({k: torch.ones(40) for k in ("big", "small", "zero")})
    p, m, v = params.buffer.clone(), torch.zeros(120), torch.zeros(120)
    trust = cuda_lamb.lamb_step(p, grads.buffer, m, v, sizes, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                weight_decay=0.0, step=1, max_coeff=10.0, min_coeff=0.01, threads=16, chunk=32)
    assert trust.tolist() == pytest.approx([10.0, 0.01, 1.0])


def test_lamb_backend_numba_through_the_optimizer(cpu_tensors_take_cuda_kernels):
    params, grads = flat_problem([33, 70], 2, 11)
    got, state, cast = run(lamb(1e-2, weight_decay=0.01, backend="numba"), params, grads, torch.float16)
    ref, ref_state, _ = run(lamb(1e-2, weight_decay=0.01, backend="torch"), params, grads)
    torch.testing.assert_close(got.buffer, ref.buffer, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(state.trust_ratio, ref_state.trust_ratio, rtol=RTOL, atol=ATOL)
    assert torch.equal(cast.buffer, got.buffer.to(torch.float16))


def test_bad_inputs_raise_clear_errors():
    x = torch.zeros(4)
    with pytest.raises(TypeError, match=r"cuda adam_step: exp_avg is torch.float64; allowed: torch.float32"):
        cuda_adam.adam_step(x, x, x.double(), x, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            step=1, adam_w_mode=True)
    with pytest.raises(ValueError, match=r"segment sizes add up to 5, params has 4"):
        cuda_lamb.lamb_step(x, x, x.clone(), x.clone(), [2, 3], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match=r"threads=24 must be a power of two"):
        cuda_lamb.lamb_step(x, x, x.clone(), x.clone(), [4], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.0, step=1, threads=24)
