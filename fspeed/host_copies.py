"""Checkpointed block inputs kept on the host (`cpu_checkpointing`), copied off and back on a side stream.

On CUDA the forward's device→host copy of a block's input runs on a side stream into pinned
memory, overlapping the next block's forward; in backward, the recompute of a block starts the
copy back of the block recomputed after it (the one offloaded before it), so that copy overlaps
this block's recompute and backward: one block ahead, as DeepSpeed's `cpu_checkpointing`
promises for GPUs. Elsewhere (the CPU, where there is no side stream) the copies run inline.
"""

from __future__ import annotations

from typing import Optional

import torch


class HostCopy:
    """One offloaded tensor: its host copy, the event that marks that copy done (CUDA), and, once
    prefetched, its device copy with the event that marks that one done."""

    def __init__(self, host: torch.Tensor, device: torch.device, copied: Optional[torch.cuda.Event] = None):
        self.host: Optional[torch.Tensor] = host
        self.device, self.copied = device, copied
        self.fetched: Optional[torch.Tensor] = None
        self.fetched_event: Optional[torch.cuda.Event] = None
        self.before: Optional[HostCopy] = None  # the one offloaded just before this: recomputed next
        self.fetches = 0


class HostCopies:
    """The copies of one run's offloaded block inputs, linked in forward order (module docstring).
    `prefetch=False` copies back only when a recompute asks (what the benchmark compares)."""

    def __init__(self, prefetch: bool = True):
        self.prefetch = prefetch
        self.last: Optional[HostCopy] = None
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.bytes_to_host = self.bytes_to_device = 0

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def offload(self, tensor: torch.Tensor) -> HostCopy:
        """`tensor`'s values, to be had back by `fetch`; the caller drops `tensor` after this."""
        tensor = tensor.detach()
        self.bytes_to_host += tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda":
            held = HostCopy(tensor.to("cpu", copy=True), tensor.device)
        else:
            side = self._side(tensor.device)
            side.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor's producer is done
            with torch.cuda.stream(side):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(side)
            tensor.record_stream(side)  # its memory is reused only after the copy
            held = HostCopy(host, tensor.device, copied)
        held.before, self.last = self.last, held
        return held

    def fetch(self, held: HostCopy) -> torch.Tensor:
        """`held`'s values on its device again, ready on the current stream; the copy back of the
        input recomputed next starts here."""
        if held.fetched is not None:
            value = held.fetched
            current = torch.cuda.current_stream(held.device)
            current.wait_event(held.fetched_event)
            value.record_stream(current)
        else:
            value = self._to_device(held, torch.cuda.current_stream(held.device) if held.copied else None)
        held.fetched = held.fetched_event = None
        held.fetches += 1
        following, held.before = held.before, None
        if self.last is held:  # backward has begun: the next forward starts a new chain
            self.last = None
        if (self.prefetch and following is not None and following.copied is not None and following.fetches == 0
                and following.fetched is None):
            side = self._side(following.device)
            side.wait_stream(torch.cuda.current_stream(following.device))
            following.fetched = self._to_device(following, side)
            following.fetched_event = torch.cuda.Event()
            following.fetched_event.record(side)
        return value

    def _to_device(self, held: HostCopy, stream: Optional[torch.cuda.Stream]) -> torch.Tensor:
        self.bytes_to_device += held.host.numel() * held.host.element_size()
        if stream is None:  # the host copy is the tensor's own: a second recompute may need it again
            return held.host.to(held.device, copy=True)
        with torch.cuda.stream(stream):
            stream.wait_event(held.copied)
            return held.host.to(held.device, non_blocking=True)


__all__ = ["HostCopies", "HostCopy"]
