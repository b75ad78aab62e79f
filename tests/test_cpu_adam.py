"""The Numba CPU Adam kernel, and the `backend` / `cast_to` wiring of fspeed's optimizers.

Kernel against torch.optim.Adam/AdamW and a float64 transcription of DeepSpeed's update, over
sizes with tails (not multiples of the chunk or of the SIMD width), hyperparameters, step counts
and gradient dtypes. Tolerances as in test_optim (rtol=1e-5, atol=1e-6): both sides compute the
same fp32 formula in a different operation order (FMA contraction here), a few ulps per step.

Exactness claims are tested exactly: bf16/fp16 gradients give the bits fp32 copies of them give
(widening is exact), `cast_out` is bit for bit `params.to(dtype)` on every float32 bit pattern
(NaN payloads, subnormals, ties, overflow), and the thread count does not change any bit.
"""

from __future__ import annotations

import math

import subprocess
import sys

import numba
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fspeed as fs
from fspeed import Flat
from fspeed.kernels import cpu_adam
from fspeed.optim import adam, adamw, chain, clip_by_global_norm, lamb, optimizer_step, sgd

RTOL, ATOL = 1e-5, 1e-6
HALF = (torch.bfloat16, torch.float16)

# sizes around the chunk and the 16-lane vector width: 1, tails, several chunks plus a tail
size_st = st.one_of(
    st.integers(1, 40),
    st.integers(cpu_adam.CHUNK - 17, cpu_adam.CHUNK + 17),
    st.integers(2 * cpu_adam.CHUNK + 1, 3 * cpu_adam.CHUNK - 1),
)


@st.composite
def hparams_st(draw) -> dict:
    return dict(
        lr=draw(st.floats(1e-4, 1e-1)),
        beta1=draw(st.floats(0.0, 0.99)),
        beta2=draw(st.floats(0.9, 0.9999)),
        eps=draw(st.sampled_from([1e-8, 1e-6, 1e-3])),
        weight_decay=draw(st.sampled_from([0.0, 0.01, 0.3])),
        adam_w_mode=draw(st.booleans()),
        bias_correction=draw(st.booleans()),
    )


def random_problem(n: int, steps: int, seed: int, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(steps)]
    return params, grads


def run_kernel(params, grads, hp, cast_dtype=None):
    """Final (params, m, v, cast copy) after one kernel call per gradient."""
    p, m, v = params.clone(), torch.zeros_like(params), torch.zeros_like(params)
    out = None if cast_dtype is None else torch.empty(params.shape, dtype=cast_dtype)
    for t, g in enumerate(grads, start=1):
        cpu_adam.adam_step(p, g, m, v, step=t, cast_out=out, **hp)
    return p, m, v, out


def float64_reference(params, grads, hp):
    """DeepSpeed's update (reference sections 3.2 / 5.1) transcribed in float64, and a first-order
    bound on what fp32 rounding may add per element.

    The bound matters where Adam is ill-conditioned: when L2 decay cancels the gradient
    (g + wd*p ~ 0) or the momentum cancels (b1*m + (1-b1)*g ~ 0), fp32 leaves an absolute error of a
    few ulps of the cancelled terms in m, and m / denom with denom ~ eps turns it into a large
    change of the step. Any fp32 implementation (torch's included) shows it; a wrong formula
    shows errors of the size of the step itself, far above the bound.
    """
    p, m, v = params.double(), torch.zeros(params.shape, dtype=torch.float64), torch.zeros(params.shape, dtype=torch.float64)
    b1, b2, lr, wd = hp["beta1"], hp["beta2"], hp["lr"], hp["weight_decay"]
    slack = torch.zeros(params.shape, dtype=torch.float64)
    ulp = 2.0**-23
    for t, g in enumerate(grads, start=1):
        g = g.double()
        cancelled = b1 * m.abs() + (1 - b1) * (g.abs() + (0.0 if hp["adam_w_mode"] else wd * p.abs()))
        if not hp["adam_w_mode"]:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if hp["bias_correction"] else (1.0, 1.0)
        if hp["adam_w_mode"]:
            p = p - lr * wd * p
        denom = v.sqrt() / math.sqrt(bc2) + hp["eps"]
        p = p - (lr / bc1) * m / denom
        slack = slack + (lr / bc1) * 8 * ulp * cancelled / denom
    return p, slack


def assert_close_within(actual, expected, slack, what=""):
    bound = ATOL + RTOL * expected.abs() + slack
    err = (actual.double() - expected.double()).abs()
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), f"{what} element {worst}: |{actual[worst]} - {expected[worst]}| > {bound[worst]}"


# --------------------------------------------------------------------------- kernel numerics


@given(size_st, hparams_st(), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_kernel_matches_float64_deepspeed_transcription(n, hp, steps, seed):
    params, grads = random_problem(n, steps, seed)
    p, _, _, _ = run_kernel(params, grads, hp)
    assert_close_within(p, *float64_reference(params, grads, hp))


@given(size_st, hparams_st(), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_kernel_matches_torch_optim(n, hp, steps, seed):
    """Bias-corrected runs against torch.optim.AdamW (decoupled) or Adam (L2), moments included."""
    hp = dict(hp, bias_correction=True)
    params, grads = random_problem(n, steps, seed)
    p, m, v, _ = run_kernel(params, grads, hp)
    ref = torch.nn.Parameter(params.clone())
    cls = torch.optim.AdamW if hp["adam_w_mode"] else torch.optim.Adam
    opt = cls([ref], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
              weight_decay=hp["weight_decay"], foreach=False)
    for g in grads:
        ref.grad = g.clone()
        opt.step()
    slack = float64_reference(params, grads, hp)[1]
    assert_close_within(p, ref.detach(), 2 * slack)  # both sides round: twice the bound
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"], rtol=RTOL, atol=ATOL)


@given(st.lists(size_st, min_size=1, max_size=5), hparams_st(), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_one_pass_over_runs_gives_the_bits_of_one_call_per_run(sizes, hp, steps, seed):
    """`adam_step_runs` (a parameter group's runs in one dispatch) against `adam_step` on each run,
    the runs being views at odd offsets of shared buffers, as a group's runs of a flat buffer are."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes) + len(sizes)
    bases = [torch.randn(total, generator=gen) for _ in range(4)]
    bases[3].abs_()
    grads = [torch.randn(total, generator=gen) for _ in range(steps)]
    cuts = [(sum(sizes[:i]) + i + 1, size) for i, size in enumerate(sizes)]  # a gap before each run

    def views(buffers):
        return [[b[a:a + n] for a, n in cuts] for b in buffers]
    one, each = [b.clone() for b in bases], [b.clone() for b in bases]
    for t, g in enumerate(grads, start=1):
        p, _, m, v = views(one[:1] + [g] + one[2:])
        cpu_adam.adam_step_runs(p, views([g])[0], m, v, step=t, **hp)
        for run in zip(*views(each[:1] + [g] + each[2:])):
            cpu_adam.adam_step(*run, step=t, **hp)
    for a, b in zip(one, each):
        assert torch.equal(a, b)  # gaps untouched too


@given(st.lists(st.lists(size_st, max_size=4), min_size=1, max_size=3), hparams_st(), st.integers(1, 3),
       st.integers(0, 2**31 - 1), st.integers(0, 17), st.booleans())
def test_loose_gradients_over_flat_buffers_give_the_bits_of_the_runs_pass(buffers, hp, steps, seed, padding, summed):
    """`adam_step_loose` (flat p, m, v buffers, or a group's several; one gradient tensor per
    parameter, as backward leaves them) against `adam_step_runs` over the buffers' per-parameter
    views: the same bits, the padding past the parameters untouched, the same squared-gradient sum."""
    if not any(buffers):
        buffers[0].append(1)
    gen = torch.Generator().manual_seed(seed)
    bases = [[torch.randn(sum(sizes) + padding, generator=gen) for sizes in buffers] for _ in range(3)]
    for b in bases[2]:
        b.abs_()
    loose, runs = ([[b.clone() for b in kind] for kind in bases] for _ in range(2))
    for t in range(1, steps + 1):
        grads = [[torch.randn(n, generator=gen) for n in sizes] for sizes in buffers]
        sq_loose, sq_runs = ([] if summed else None), ([] if summed else None)
        assert cpu_adam.adam_step_loose(loose[0], grads, loose[1], loose[2], step=t, grad_sq=sq_loose, **hp)
        p, m, v = ([x for b, sizes in zip(kind, buffers) for x in torch.split(b[:sum(sizes)], sizes)] for kind in runs)
        cpu_adam.adam_step_runs(p, [g for run in grads for g in run], m, v, step=t, grad_sq=sq_runs, **hp)
        assert sq_loose == sq_runs
    for kind_loose, kind_runs, kind_base in zip(loose, runs, bases):
        for a, b, base, sizes in zip(kind_loose, kind_runs, kind_base, buffers):
            assert torch.equal(a, b)
            assert torch.equal(a[sum(sizes):], base[sum(sizes):])


@pytest.mark.parametrize("change", ["bf16 grad", "strided grad", "short buffer", "fp64 buffer", "no grads"])
def test_loose_gradients_it_cannot_take_update_nothing(change):
    """`adam_step_loose` declines (returns False, nothing written) what its one table cannot hold,
    so that the caller takes the general path."""
    p, m, v = torch.randn(20), torch.randn(20), torch.rand(20)
    grads = [torch.randn(8), torch.randn(12)]
    if change == "bf16 grad":
        grads[1] = grads[1].bfloat16()
    elif change == "strided grad":
        grads[0] = torch.randn(16)[::2]
    elif change == "short buffer":
        m = m[:19]
    elif change == "fp64 buffer":
        v = v.double()
    else:
        grads = []
    before = [t.clone() for t in (p, m, v)]
    assert not cpu_adam.adam_step_loose([p], [grads], [m], [v], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                        weight_decay=0.1, step=1, adam_w_mode=True)
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), before))
    with pytest.raises(ValueError, match="one of each per buffer"):
        cpu_adam.adam_step_loose([p, p], [grads], [m], [v], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                 weight_decay=0.1, step=1, adam_w_mode=True)


@given(st.lists(size_st, min_size=1, max_size=4), hparams_st(), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.float32, *HALF]), st.sampled_from([None, *HALF]), st.booleans())
def test_grad_sq_is_the_sum_of_squared_gradients_and_changes_no_bits(sizes, hp, seed, grad_dtype, cast_dtype,
                                                                     runs):
    """`grad_sq` (the grad norm taken in the update's own pass): the float64 sum of the squared
    gradients within fp32 summation error, one sum per call, for the flat kernel (fp32 and 16-bit
    gradients, with a cast copy) and the runs kernel; the update's bits are those of a call without."""
    runs = runs and grad_dtype == torch.float32 and cast_dtype is None
    gen = torch.Generator().manual_seed(seed)
    problems = [random_problem(n, 1, seed + k, grad_dtype) for k, n in enumerate(sizes)]
    params, grads = [p for p, _ in problems], [g[0] for _, g in problems]
    if not runs:
        params, grads = [torch.cat(params)], [torch.cat(grads)]
    moments = [torch.randn(x.shape, generator=gen) for x in params], [torch.rand(x.shape, generator=gen) for x in params]
    results = []
    for grad_sq in (None, []):
        p = [x.clone() for x in params]
        m, v = ([x.clone() for x in xs] for xs in moments)
        out = [torch.empty(x.shape, dtype=cast_dtype) if cast_dtype else None for x in p]
        if runs:
            cpu_adam.adam_step_runs(p, grads, m, v, step=2, grad_sq=grad_sq, **hp)
        else:
            cpu_adam.adam_step(p[0], grads[0], m[0], v[0], step=2, cast_out=out[0], grad_sq=grad_sq, **hp)
        results.append((p, m, v, out, grad_sq))
    for a, b in zip(results[0][:3], results[1][:3]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    if cast_dtype is not None:
        assert torch.equal(results[0][3][0].view(torch.int16), results[1][3][0].view(torch.int16))
    expected = sum(float(g.double().square().sum()) for g in grads)
    assert len(results[1][4]) == 1 and results[1][4][0] == pytest.approx(expected, rel=1e-5, abs=1e-30)


def test_grad_sq_propagates_inf_and_nan():
    for bad, expected in ((float("inf"), math.inf), (float("nan"), None)):
        g = torch.ones(40000)
        g[33333] = bad
        grad_sq: list = []
        cpu_adam.adam_step(torch.zeros(40000), g, torch.zeros(40000), torch.zeros(40000), lr=1e-3, beta1=0.9,
                           beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, adam_w_mode=True, grad_sq=grad_sq)
        assert grad_sq[0] == expected if expected is not None else math.isnan(grad_sq[0])


@pytest.mark.parametrize("runs, error, match", [
    (([torch.zeros(4)], [], [torch.zeros(4)], [torch.zeros(4)]), ValueError, r"1 params, 0 grads"),
    (([torch.zeros(4)], [torch.zeros(4, dtype=torch.float64)], [torch.zeros(4)], [torch.zeros(4)]), ValueError,
     r"run 0 must be four contiguous fp32 CPU tensors of one size, got torch.float32 \[4\] on cpu, torch.float64"),
    (([torch.zeros(4)] * 2, [torch.zeros(4), torch.zeros(8)[::2]], [torch.zeros(4)] * 2, [torch.zeros(4)] * 2),
     ValueError, r"run 1 must be"),
    (([torch.zeros(4)], [torch.zeros(5)], [torch.zeros(4)], [torch.zeros(4)]), ValueError, r"run 0 must be"),
])
def test_bad_runs_raise_clear_errors(runs, error, match):
    with pytest.raises(error, match=match):
        cpu_adam.adam_step_runs(*runs, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                                adam_w_mode=True)
    with pytest.raises(ValueError, match=r"step=0 must be a positive integer"):
        cpu_adam.adam_step_runs([], [], [], [], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=0,
                                adam_w_mode=True)


@given(size_st, hparams_st(), st.integers(1, 4), st.integers(0, 2**31 - 1), st.sampled_from(HALF))
def test_half_gradients_give_the_bits_of_their_fp32_copies(n, hp, steps, seed, grad_dtype):
    params, grads = random_problem(n, steps, seed, grad_dtype)
    half = run_kernel(params, grads, hp)
    full = run_kernel(params, [g.float() for g in grads], hp)
    for a, b in zip(half[:3], full[:3]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@given(size_st, hparams_st(), st.integers(1, 4), st.integers(0, 2**31 - 1), st.sampled_from(HALF),
       st.sampled_from([torch.float32, *HALF]))
def test_cast_out_is_torch_cast_of_updated_params(n, hp, steps, seed, cast_dtype, grad_dtype):
    params, grads = random_problem(n, steps, seed, grad_dtype)
    p, m, v, out = run_kernel(params, grads, hp, cast_dtype)
    assert torch.equal(out.view(torch.int16), p.to(cast_dtype).view(torch.int16))
    plain = run_kernel(params, grads, hp)  # writing the cast copy changes nothing else
    for a, b in zip((p, m, v), plain[:3]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("cast_dtype", HALF)
def test_cast_out_is_bit_exact_on_every_kind_of_float(cast_dtype):
    """Random bit patterns (NaNs with payloads, infinities, subnormals, huge values) plus exact
    rounding ties; lr=0 and zero gradients leave the params as they are."""
    gen = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31, (50_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    shift = 16 if cast_dtype == torch.bfloat16 else 13  # the dropped mantissa bits: ties are 1 << (shift-1)
    ties = (torch.randint(0, 2**31, (5_000,), generator=gen, dtype=torch.int64) >> shift << shift) | (1 << (shift - 1))
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65520.0, 1e-8,
                             -1e-45, 3.4e38, 5.96e-8, 2.98e-8])
    params = torch.cat([random_bits.view(torch.float32), ties.to(torch.int32).view(torch.float32), specials])
    zeros = torch.zeros_like(params)
    p, out = params.clone(), torch.empty(params.shape, dtype=cast_dtype)
    cpu_adam.adam_step(p, zeros, zeros.clone(), zeros.clone(), lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.0, step=1, adam_w_mode=True, cast_out=out)
    finite = torch.isfinite(params)
    assert torch.equal(p[finite].abs(), params[finite].abs())  # lr=0: unchanged (up to the sign of 0)
    assert torch.equal(out.view(torch.int16), p.to(cast_dtype).view(torch.int16))


def test_thread_count_follows_torch_and_changes_no_bits():
    params, grads = random_problem(5 * cpu_adam.CHUNK + 123, 3, 7, torch.bfloat16)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adam_w_mode=True)
    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results[threads] = run_kernel(params, grads, hp, torch.bfloat16)
            assert numba.get_num_threads() == min(threads, numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(results[1], results[2]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_the_first_call_leaves_torchs_thread_count_alone():
    # Numba's OpenMP pool starts on the first parallel call and resets the process's OpenMP
    # thread count; with several ranks per host that oversubscribed the cores. Fresh process.
    code = """
import torch
torch.set_num_threads(1)
from fspeed.kernels import cpu_adam
b = [torch.zeros(4096) for _ in range(4)]
cpu_adam.adam_step(*b, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, adam_w_mode=True)
print(torch.get_num_threads())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1", out.stderr


def test_shapes_are_used_flat_and_empty_buffers_are_fine():
    params, grads = random_problem(60, 2, 3)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=False)
    flat = run_kernel(params, grads, hp)[0]
    shaped = run_kernel(params.view(3, 4, 5), [g.view(3, 4, 5) for g in grads], hp)[0]
    assert torch.equal(shaped.reshape(-1), flat)
    empty = torch.empty(0)
    cpu_adam.adam_step(empty, empty, empty, empty, step=1, **hp)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(params=torch.zeros(8, dtype=torch.float64)), TypeError, r"params is torch.float64; allowed: torch.float32"),
        (dict(exp_avg=torch.zeros(8, dtype=torch.bfloat16)), TypeError, r"exp_avg is torch.bfloat16"),
        (dict(grads=torch.zeros(8, dtype=torch.int32)), TypeError, r"grads is torch.int32; allowed: torch.float32, torch.bfloat16"),
        (dict(cast_out=torch.zeros(8)), TypeError, r"cast_out is torch.float32; allowed: torch.bfloat16, torch.float16"),
        (dict(exp_avg_sq=torch.zeros(9)), ValueError, r"exp_avg_sq has 9 elements, params has 8"),
        (dict(grads=torch.zeros(16)[::2]), ValueError, r"grads \(shape \[8\]\) must be contiguous"),
        (dict(grads=[0.0] * 8), TypeError, r"grads must be a torch.Tensor, got list"),
        (dict(step=0), ValueError, r"step=0 must be a positive integer"),
    ],
)
def test_bad_buffers_raise_clear_errors(change, error, match):
    args = dict(params=torch.zeros(8), grads=torch.zeros(8), exp_avg=torch.zeros(8), exp_avg_sq=torch.zeros(8),
                step=1, cast_out=None)
    args.update(change)
    with pytest.raises(error, match=match):
        cpu_adam.adam_step(args.pop("params"), args.pop("grads"), args.pop("exp_avg"), args.pop("exp_avg_sq"),
                           lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=True, **args)
    assert not cpu_adam.supports(torch.zeros(8, dtype=torch.float64), torch.zeros(8), torch.zeros(8), torch.zeros(8))


# --------------------------------------------------------------------------- optimizer backends and cast_to


def tree_problem(seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"a": (37,), "b": (5, 7), "c": (), "d": (cpu_adam.CHUNK + 3,)}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()} for _ in range(3)]
    return params, grads


def run_opt(opt, params, grads, *, flat: bool, cast_dtype=None):
    """Final (params, state, cast copy) through optimizer_step, on a dict or on Flats."""
    make = (lambda t: Flat.from_tree(t)) if flat else (lambda t: {k: v.clone() for k, v in t.items()})
    params = make(params)
    state = opt.init(params)
    cast_to = None
    if cast_dtype is not None:
        cast_to = Flat.from_tree(params.tree(), dtype=cast_dtype) if flat else {k: v.to(cast_dtype) for k, v in params.items()}
    for g in grads:
        g = Flat.from_tree(g) if flat else g
        params, state = optimizer_step(opt, g, state, params, cast_to=cast_to)
    return params, state, cast_to


def leaves(tree):
    return fs.pytree.tensor_leaves(tree)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("make", [lambda b: adam(1e-2, weight_decay=0.1, backend=b),
                                  lambda b: adamw(1e-2, weight_decay=0.1, bias_correction=False, backend=b),
                                  lambda b: chain(clip_by_global_norm(1.0), adamw(3e-3, backend=b))])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_numba_backend_equals_torch_backend(flat, make, grad_dtype):
    params, grads = tree_problem(1, grad_dtype)
    got, got_state, got_cast = run_opt(make("numba"), params, grads, flat=flat, cast_dtype=torch.bfloat16)
    ref, ref_state, ref_cast = run_opt(make("torch"), params, grads, flat=flat, cast_dtype=torch.bfloat16)
    for a, b in zip(leaves((got, got_state)), leaves((ref, ref_state))):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    for c, p in zip(leaves(got_cast), leaves(got)):
        assert torch.equal(c, p.to(torch.bfloat16))
    for c, p in zip(leaves(ref_cast), leaves(ref)):
        assert torch.equal(c, p.to(torch.bfloat16))


def test_auto_backend_takes_the_kernel_on_cpu_fp32_and_torch_elsewhere(monkeypatch):
    calls = []
    real = cpu_adam.adam_step
    monkeypatch.setattr(cpu_adam, "adam_step", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    params, grads = tree_problem(2)
    run_opt(adamw(), params, grads, flat=True)
    assert calls == [torch.float32] * 3
    run_opt(adamw(backend="torch"), params, grads, flat=True)
    assert len(calls) == 3
    as64 = {k: v.double() for k, v in params.items()}
    run_opt(adamw(), as64, [{k: v.double() for k, v in g.items()} for g in grads], flat=False)  # torch path
    assert len(calls) == 3
    with pytest.raises(TypeError, match="params is torch.float64"):
        run_opt(adamw(backend="numba"), as64, [{k: v.double() for k, v in g.items()} for g in grads], flat=False)


@pytest.mark.parametrize("make", [adam, adamw, lamb])
def test_unknown_backend_is_a_clear_error(make):
    with pytest.raises(ValueError, match=r"backend='triton' is not allowed; allowed: 'auto', 'torch', 'numba'"):
        make(backend="triton")


def test_numba_lamb_on_cpu_tensors_is_a_clear_error():
    params = {"w": torch.ones(3)}
    opt = lamb(backend="numba")
    with pytest.raises(ValueError, match=r"lamb: backend='numba' has kernels for cuda tensors, got cpu"):
        opt.apply(params, opt.init(params), params)


@pytest.mark.parametrize("make", [lambda: sgd(0.1, 0.9), lambda: lamb(1e-2, weight_decay=0.1),
                                  lambda: clip_by_global_norm(0.5), lambda: chain()])
@pytest.mark.parametrize("flat", [False, True])
def test_every_transform_honours_cast_to(make, flat):
    params, grads = tree_problem(3)
    got, _, cast = run_opt(make(), params, grads, flat=flat, cast_dtype=torch.float16)
    for c, p in zip(leaves(cast), leaves(got)):
        assert torch.equal(c, p.to(torch.float16))


def test_custom_apply_without_cast_to_is_cast_by_optimizer_step():
    base = sgd(0.1)
    legacy = base._replace(apply=lambda grads, state, params: base.apply(grads, state, params))
    params, grads = tree_problem(4)
    got, _, cast = run_opt(legacy, params, grads, flat=True, cast_dtype=torch.bfloat16)
    assert torch.equal(cast.buffer, got.buffer.to(torch.bfloat16))


def test_cast_to_of_the_wrong_structure_is_a_clear_error():
    params, grads = tree_problem(5)
    opt = adamw()
    flat = Flat.from_tree(params)
    with pytest.raises(ValueError, match=r"cast_to has 4 tensor leaves but params has 1"):
        opt.apply(Flat.from_tree(grads[0]), opt.init(flat), flat, cast_to={k: v.bfloat16() for k, v in params.items()})


# --------------------------------------------------------------------------- train_step


def tiny_gpt():
    cfg = fs.models.GPTConfig(vocab_size=40, seq_len=12, n_layer=2, n_head=2, d_model=16)
    return cfg, fs.models.gpt(cfg)


@pytest.mark.parametrize("name, accum", [("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp16")])
def test_train_step_single_pass_mixed_precision(name, accum):
    """train_step writes the compute copy through cast_to (== masters cast, bit for bit), and with
    16-bit accumulation hands the 16-bit gradients to the kernel. Each numba step is compared with
    a torch-backend step from a copy of the same state (over several steps, ulp differences flip
    bf16 roundings of the compute copy and Adam amplifies the resulting tiny gradient changes)."""
    cfg, model = tiny_gpt()
    params = model.init(torch.Generator().manual_seed(0))
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
    kwargs = dict(grad_accum_dtype=accum) if name == "bf16" else dict(grad_accum_dtype=accum, initial_scale_power=8)
    precision = getattr(fs.precision, name)(**kwargs)
    opts = {b: chain(clip_by_global_norm(1.0), adamw(1e-2, weight_decay=0.1, backend=b)) for b in ("numba", "torch")}
    steps = {b: fs.make_train_step(model.loss, opt, grad_accum=2) for b, opt in opts.items()}
    state = fs.init_train_state(params, opts["numba"], precision=precision)
    copy = lambda x: x.clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    for _ in range(3):
        reference, ref_metrics = steps["torch"](fs.pytree.tree_map(copy, state), batch)
        state, metrics = steps["numba"](state, batch)
        assert not metrics["skipped"] and metrics["grad_norm"] == ref_metrics["grad_norm"]
        assert torch.equal(state.params.buffer, state.master.buffer.to(precision.param_dtype))
        torch.testing.assert_close(state.master.buffer, reference.master.buffer, rtol=RTOL, atol=ATOL)
