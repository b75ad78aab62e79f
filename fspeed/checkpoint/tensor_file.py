"""One safetensors file of a checkpoint: streamed out of the state's buffers, checksummed, read back.

The file is written directly in the safetensors format (an 8-byte header length, a JSON header,
then each tensor's bytes), streaming every tensor from its own memory: no copy of the state is
made. Reading uses `safetensors.safe_open` (no pickle).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .errors import CheckpointError

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_tensor_file(path: Path, tensors: dict[str, torch.Tensor], file_format: str) -> dict:
    """Write `tensors` (by key) to `path` in the safetensors format, fsynced; returns what meta.json
    records of the file (its size and sha256).

    The checksum is computed from the tensors' memory while the kernel flushes the file to disk
    (`os.fsync` in a thread; both release the GIL), instead of reading the file back afterwards."""
    header: dict[str, Any] = {"__metadata__": {"format": file_format}}
    offset = 0
    items = []
    for key, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"cannot save tensor {key!r} of dtype {tensor.dtype}")
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        if nbytes:
            items.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section
    parts = [struct.pack("<Q", len(blob)), blob, *items]
    with open(path, "wb") as f:
        for part in parts:
            f.write(part)
        f.flush()
        flushed = _in_thread(os.fsync, f.fileno())
        digest = hashlib.sha256()
        for part in parts:
            digest.update(part)
        flushed.join()
    if flushed.error is not None:
        raise flushed.error
    return {"bytes": sum(len(part) for part in parts), "sha256": digest.hexdigest()}


class _Call(threading.Thread):
    """`fn(*args)` in a thread; `error` holds what it raised. (Not a ThreadPoolExecutor: a background
    save may still be writing while the interpreter exits, when executors take no new work.)"""

    def __init__(self, fn, *args) -> None:
        super().__init__(daemon=True)
        self.fn, self.args, self.error = fn, args, None

    def run(self) -> None:
        try:
            self.fn(*self.args)
        except BaseException as e:  # handed to the caller
            self.error = e


def _in_thread(fn, *args) -> _Call:
    call = _Call(fn, *args)
    call.start()
    return call


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """The bytes the tensors' data takes in a file (headers aside)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def nonfinite_keys(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Keys of the floating-point tensors holding an inf or NaN."""
    return [key for key, t in tensors.items()
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_info(path: Path) -> dict:
    """What meta.json records of a file: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def open_tensor_file(path: Path) -> Any:
    """A safetensors reader of `path` (`keys()`, `get_tensor(key)`); CheckpointError naming it if unreadable."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{path} cannot be read as safetensors ({e})") from None
