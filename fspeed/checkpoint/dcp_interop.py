"""Weights from a `torch.distributed.checkpoint` (DCP) directory, for `init_from_weights`.

DCP stores a state_dict's tensors with their global shapes (`.metadata` plus `__<rank>_<n>.distcp`
files). A DCP checkpoint of the same model (`dcp.save(module.state_dict(), ...)`, or the model
part of `get_state_dict`, whose keys then start with `model.`) gives a state's parameters and
buffers by name: each name is loaded whole, one at a time (DCP reads only the files holding it,
with `no_dist=True`, so no collective is needed), and each rank copies the boxes it holds.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import torch

from .errors import CheckpointError
from .slices import Box

DCP_METADATA = ".metadata"


def is_dcp(source: Path) -> bool:
    return source.is_dir() and (source / DCP_METADATA).is_file()


class DcpWeights:
    """The tensors of a DCP checkpoint by name (a `model.` prefix dropped); reads one whole tensor
    at a time and serves boxes of it."""

    def __init__(self, source: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.source = source
        try:
            metadata = FileSystemReader(str(source)).read_metadata()
        except Exception as e:  # DCP's reader raises several types
            raise CheckpointError(f"{source / DCP_METADATA} cannot be read as DCP metadata ({e})") from None
        tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        strip = bool(tensors) and all(k.startswith("model.") for k in tensors)
        self.keys = {(k[len("model."):] if strip else k): k for k in tensors}
        self.meta = {name: tensors[key] for name, key in self.keys.items()}
        self.current: Optional[tuple[str, torch.Tensor]] = None

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(m.size) for name, m in self.meta.items()}

    def read(self, chunk: list, box: Box) -> torch.Tensor:
        name = chunk[1]
        if self.current is None or self.current[0] != name:
            from torch.distributed.checkpoint import FileSystemReader, load

            m = self.meta[name]
            tensor = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            try:
                with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                    warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                    load({self.keys[name]: tensor}, storage_reader=FileSystemReader(str(self.source)), no_dist=True)
            except Exception as e:
                raise CheckpointError(f"{self.source}: cannot read {self.keys[name]!r} ({e})") from None
            self.current = (name, tensor)
        return self.current[1][box.within(Box(tuple(chunk[2]), tuple(chunk[3])))]

    path = property(lambda self: self.source)


__all__ = ["DCP_METADATA", "DcpWeights", "is_dcp"]
