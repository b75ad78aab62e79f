"""numba-cuda kernels (fused Adam, fused LAMB) without a GPU: the simulator, and PTX for sm_80/sm_90.

Both run in subprocesses. The CUDA simulator replaces `numba.cuda` for a whole process and must
be chosen (NUMBA_ENABLE_CUDASIM=1) before Numba is imported, while `compile_ptx` exists only
without it. So this pytest process keeps the real numba-cuda, and:

* `tests/cuda_sim_suite.py` (not collected by name) runs under `NUMBA_ENABLE_CUDASIM=1`: every
  kernel against the pure-torch references at sizes <= 1e4, tails included;
* a second process compiles every kernel to PTX for compute capabilities 8.0 and 9.0 (no GPU or
  driver needed; numba-cuda asks NVRTC for the supported architectures, hence the pinned
  nvidia-cuda-nvrtc). When the CUDA toolkit's `ptxas` is on this machine, the PTX is also
  assembled, which catches PTX the toolkit would reject (the NVVM version trap).

A missing numba-cuda or NVRTC fails these tests, with the pip line that fixes it. On a machine
with a GPU the same kernels run through `fspeed.optim.adam/lamb(backend="numba")`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL = (
    "pip install numba-cuda==0.30.4 nvidia-cuda-nvrtc==13.0.88 "
    "(pinned to CUDA 13.0; not the numba-cuda[cu13] extra, whose NVVM 13.5 PTX CUDA 13.0 rejects)"
)

PTX_SCRIPT = r"""
import sys
from numba import cuda
from fspeed.kernels import cuda_adam, cuda_lamb

assert cuda.implementation == "NVIDIA", cuda.implementation
kernels = [("adam_kernel", cuda_adam.adam_kernel, cuda_adam.SIGNATURE)]
kernels += [(name, getattr(cuda_lamb, name), sig) for name, sig in cuda_lamb.SIGNATURES.items()]
for target in sys.argv[2:]:  # sm_80 sm_90: into <dir>/<target>/
    cc = (int(target[3]), int(target[4]))
    for name, kernel, signature in kernels:
        try:
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=cc)
        except Exception as error:  # a missing NVRTC/NVVM surfaces here
            print(f"MISSING TOOLCHAIN {type(error).__name__}: {error}")
            sys.exit(3)
        with open(f"{sys.argv[1]}/{target}/{name}.ptx", "w") as f:
            f.write(ptx)
        print(target, name, len(ptx))
"""


def run(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def require_numba_cuda() -> None:
    if importlib.util.find_spec("numba_cuda") is None:
        pytest.fail(f"numba-cuda is not installed, so the CUDA kernels cannot be tested; {INSTALL}")


def env_without_simulator() -> dict:
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


def test_cuda_kernels_under_the_simulator():
    require_numba_cuda()
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    result = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",  # in that process
                  "tests/cuda_sim_suite.py"], env, timeout=600)
    assert result.returncode == 0, f"simulator suite failed:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]


def test_kernels_compile_to_ptx_for_sm80_and_sm90(tmp_path):
    require_numba_cuda()
    targets = ("sm_80", "sm_90")  # one process for both: its start is most of the time
    for target in targets:
        (tmp_path / target).mkdir()
    result = run([sys.executable, "-c", PTX_SCRIPT, str(tmp_path), *targets], env_without_simulator(), timeout=300)
    if result.returncode == 3:
        pytest.fail(f"numba-cuda cannot compile PTX here ({result.stdout.strip()}); {INSTALL}")
    assert result.returncode == 0, f"PTX compilation failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    for target in targets:
        _check_ptx(tmp_path / target, (int(target[3]), int(target[4])))


def _check_ptx(directory, cc: tuple[int, int]) -> None:
    files = sorted(directory.glob("*.ptx"))
    assert [f.stem for f in files] == ["adam_kernel", "moments_and_norms_kernel", "trust_kernel", "update_kernel"]
    target = f".target sm_{cc[0]}{cc[1]}"
    for f in files:
        ptx = f.read_text()
        assert target in ptx and ".entry" in ptx, f"{f.name}: no {target} kernel entry"
    ptxas = shutil.which("ptxas") or next(
        (p for p in ("/usr/local/cuda/bin/ptxas", "/usr/local/cuda-13.0/bin/ptxas") if os.path.exists(p)), None
    )
    if ptxas is not None:  # the toolkit's assembler accepts the PTX (its .version included)
        for f in files:
            assembled = run([ptxas, f"-arch=sm_{cc[0]}{cc[1]}", str(f), "-o", str(f.with_suffix(".cubin"))],
                            env_without_simulator(), timeout=120)
            assert assembled.returncode == 0, f"ptxas rejected {f.name}: {assembled.stderr[-2000:]}"
