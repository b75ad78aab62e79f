"""ZeRO-Offload: the host side of a rank's model states, and the copies between host and device.

With `zero.offload_optimizer.device = "cpu"` (stages 1-3) the fp32 masters and the optimizer
state of this rank's partition live in CPU memory, page-locked where CUDA exists. Per step
(reference 3.5): the reduced gradient partition goes down into a CPU buffer (in the
accumulation dtype: the CPU Adam kernel reads bf16/fp16 gradients as they are), the grad norm
and clipping run there, the optimizer updates the partition on CPU (the CPU Adam kernel writes
the 16-bit cast into a pinned staging buffer in the same pass) and the staging buffer goes up:
stages 1-2 into the device partition that is then all-gathered, stage 3 into the shard.

With `zero.offload_param.device = "cpu"` too (stage 3), the compute parameters themselves stay
on CPU: the unit ops (`ops.py`) upload a unit's shard just before its all-gather and copy
persistent parameters up as the model uses them (`copy_to`), and the gradient sink brings their
gradients back to the CPU accumulator. The optimizer then writes the 16-bit CPU shards directly.

On a machine without CUDA the "device" is the CPU: every copy below still happens (explicit
`copy_` between distinct buffers), but pinning and streams are skipped.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .layout import Layout


def offloads_optimizer(layout: Optional[Layout]) -> bool:
    return layout is not None and layout.zero.offload_optimizer.enabled


def offloads_params(layout: Optional[Layout]) -> bool:
    return layout is not None and layout.zero.offload_param.enabled


def check_optimizer_for_offload(optimizer, layout: Layout) -> None:
    """Refuse an optimizer without a CPU path when the layout offloads the optimizer."""
    if not offloads_optimizer(layout):
        return
    missing = optimizer.lacking("cpu")
    if missing:
        raise ValueError(
            f"zero.offload_optimizer.device='cpu' runs the optimizer on CPU, but {missing!r} has no "
            "CPU path in fspeed (communication-compressed and whole-tensor optimizers need their state on the "
            "device); use adam, adamw or sgd (with clipping), or offload_optimizer.device=none for this optimizer."
        )


def host_buffer(numel: int, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """A zeroed CPU buffer, page-locked when asked and CUDA exists (pinning needs a CUDA driver)."""
    return torch.zeros(numel, dtype=dtype, pin_memory=pin_memory and torch.cuda.is_available())


def to_host(t: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    """A fresh CPU copy of `t` (never a view of it), page-locked when asked and CUDA exists."""
    out = host_buffer(t.numel(), t.dtype, pin_memory).view(t.shape)
    out.copy_(t)
    return out


def compute_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where the model computes when parameters are stored on CPU: where the collectives of
    `group` run (NCCL, alone or for CUDA tensors beside gloo: the current CUDA device; gloo: CPU);
    without a process group, CUDA if present."""
    if dist.is_available() and dist.is_initialized():
        if "nccl" in str(dist.get_backend(group)):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class HostDeviceCopies:
    """Copies between a rank's pinned host buffers and its device, on side streams where CUDA exists.

    `download` returns once the host buffer holds the data (the CPU optimizer reads it next).
    `upload` is asynchronous: the current stream waits for it before using the device buffer,
    and `wait_for_uploads` blocks the host before it overwrites the source buffers.
    """

    def __init__(self):
        self._down: Optional[torch.cuda.Stream] = None
        self._up: Optional[torch.cuda.Stream] = None
        self._uploaded: Optional[torch.cuda.Event] = None

    def download(self, host: torch.Tensor, device_src: torch.Tensor) -> torch.Tensor:
        if device_src.device.type != "cuda":
            host.copy_(device_src)
            return host
        if self._down is None:
            self._down = torch.cuda.Stream(device_src.device)
        self._down.wait_stream(torch.cuda.current_stream(device_src.device))
        with torch.cuda.stream(self._down):
            host.copy_(device_src, non_blocking=host.is_pinned())
        device_src.record_stream(self._down)
        self._down.synchronize()
        return host

    def upload(self, device_dst: torch.Tensor, host_src: torch.Tensor) -> torch.Tensor:
        if device_dst.device.type != "cuda":
            device_dst.copy_(host_src)
            return device_dst
        if self._up is None:
            self._up = torch.cuda.Stream(device_dst.device)
        current = torch.cuda.current_stream(device_dst.device)
        self._up.wait_stream(current)  # the device buffer's previous readers are done
        with torch.cuda.stream(self._up):
            device_dst.copy_(host_src, non_blocking=host_src.is_pinned())
        self._uploaded = torch.cuda.Event()
        self._uploaded.record(self._up)
        current.wait_stream(self._up)
        device_dst.record_stream(self._up)
        return device_dst

    def wait_for_uploads(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None


# ------------------------------------------------------------------- stage 3 + offload_param


class _CopyTo(torch.autograd.Function):
    """`x` on `device` (non-blocking from pinned memory); the gradient goes back to x's device."""

    @staticmethod
    def forward(x, device):
        return x.to(device, non_blocking=x.is_pinned())

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.source = inputs[0].device

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.source), None


def copy_to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Differentiable copy to `device` (identity when already there)."""
    return x if x.device == device else _CopyTo.apply(x, device)


__all__ = [
    "HostDeviceCopies", "check_optimizer_for_offload", "compute_device", "copy_to", "host_buffer",
    "offloads_optimizer", "offloads_params", "to_host",
]
