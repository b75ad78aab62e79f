"""The one seam between torch tensors and numba-cuda kernels: availability, arrays, stream.

On a GPU, kernels receive torch CUDA tensors through `__cuda_array_interface__` (zero-copy,
`sync=False`: torch's interface names no stream) and launch on torch's current stream, so they
are ordered with the torch ops around them without a synchronisation. Under Numba's CUDA
simulator (`NUMBA_ENABLE_CUDASIM=1`, set before Numba is imported) they receive zero-copy
`tensor.numpy()` views of CPU tensors and the default stream: the simulator has no external
streams, and indexing torch tensors directly is ~100x slower there. Nothing else in the CUDA
kernels knows which of the two it runs on.

numba 0.68 still ships a deprecated built-in `numba.cuda`; installing numba-cuda redirects
`from numba import cuda` to NVIDIA's maintained package, which these kernels require
(`cuda.implementation == "NVIDIA"`).
"""

from __future__ import annotations

from typing import Any

import torch
from numba import cuda

INSTALL_HINT = (
    "pip install numba-cuda==0.30.4 nvidia-cuda-nvrtc==13.0.88 (pin nvidia-cuda-nvrtc to the CUDA "
    "toolkit and driver of the machine; not the numba-cuda[cu13] extra, whose NVVM 13.5 emits PTX "
    "that CUDA 13.0 rejects)"
)


class CudaKernelsUnavailable(RuntimeError):
    """numba-cuda, a GPU or the CUDA toolkit is missing; the message says what to install."""


def simulator_enabled() -> bool:
    """Whether numba-cuda runs kernels on its CPU simulator (NUMBA_ENABLE_CUDASIM=1 at import)."""
    try:
        from numba.cuda.core import config
    except ImportError:  # numba's built-in cuda package
        from numba import config
    return bool(config.ENABLE_CUDASIM)


def problem() -> str | None:
    """Why the kernels cannot run here, or None when they can."""
    implementation = getattr(cuda, "implementation", "Built-in")
    if implementation != "NVIDIA":
        return f"numba.cuda is numba's deprecated built-in ({implementation!r}), not numba-cuda; {INSTALL_HINT}"
    if simulator_enabled():
        return None
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (a CPU-only torch build or no GPU); use the torch backend"
    if not cuda.is_available():
        return f"numba-cuda finds no CUDA driver or device; {INSTALL_HINT}"
    return None


def is_available() -> bool:
    return problem() is None


def require() -> None:
    """Raise CudaKernelsUnavailable naming what to install when the kernels cannot run."""
    why = problem()
    if why is not None:
        raise CudaKernelsUnavailable(f"fspeed's numba CUDA kernels cannot run: {why}")


def device_array(t: torch.Tensor) -> Any:
    """A zero-copy 1-D array view of `t` for a kernel launch (see the module docstring)."""
    flat = t.detach().reshape(-1)
    if simulator_enabled():
        if flat.device.type != "cpu":
            raise ValueError(f"under the CUDA simulator kernels take CPU tensors, got one on {flat.device}")
        return flat.numpy()
    if flat.device.type != "cuda":
        raise ValueError(f"numba CUDA kernels take CUDA tensors, got one on {flat.device}")
    return cuda.as_cuda_array(flat, sync=False)


def launch_stream(t: torch.Tensor) -> Any:
    """The stream to launch on: torch's current stream on `t`'s device (the simulator's default)."""
    if simulator_enabled():
        return cuda.default_stream()
    return cuda.external_stream(torch.cuda.current_stream(t.device).cuda_stream)


def check_buffers(kernel: str, named: dict[str, torch.Tensor], numel: int) -> None:
    """Every tensor fp32, contiguous, on one device, with `numel` elements (clear errors otherwise)."""
    device = None
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kernel}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{kernel}: {name} is {t.dtype}; allowed: torch.float32")
        if not t.is_contiguous():
            raise ValueError(f"{kernel}: {name} (shape {list(t.shape)}) must be contiguous")
        if t.numel() != numel:
            raise ValueError(f"{kernel}: {name} has {t.numel()} elements, params has {numel}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{kernel}: {name} is on {t.device}, params on {device}")
