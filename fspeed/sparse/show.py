"""Seeing a layout: text (`format_layout`) and a PNG image (`save_layout_png`, numpy + zlib only)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch


def _heads(layout: torch.Tensor, heads: Optional[Sequence[int]]) -> list[int]:
    if layout.dim() != 3:
        raise ValueError(f"layout must be [heads, blocks, blocks], got shape {tuple(layout.shape)}")
    if heads is None:
        return list(range(layout.shape[0]))
    for h in heads:
        if not 0 <= h < layout.shape[0]:
            raise ValueError(f"head {h} is out of range for a layout with {layout.shape[0]} heads")
    return list(heads)


def format_layout(layout: torch.Tensor, heads: Optional[Sequence[int]] = None, *, on: str = "#",
                  off: str = ".") -> str:
    """One character per block, a titled grid per head, with each head's density.

    Heads whose layout equals the previous printed head's are folded into one title
    ("heads 0-7"), so a shared layout prints once.
    """
    chosen = _heads(layout, heads)
    grid = layout.detach().cpu().numpy() != 0
    nb = grid.shape[1]
    groups: list[list[int]] = []
    for h in chosen:
        if groups and np.array_equal(grid[groups[-1][-1]], grid[h]) and groups[-1][-1] == h - 1:
            groups[-1].append(h)
        else:
            groups.append([h])
    parts = []
    for group in groups:
        title = f"head {group[0]}" if len(group) == 1 else f"heads {group[0]}-{group[-1]}"
        dens = grid[group[0]].mean()
        rows = ["".join(on if x else off for x in row) for row in grid[group[0]]]
        parts.append(f"{title}: {nb}x{nb} blocks, {int(grid[group[0]].sum())} present ({dens:.1%})\n" + "\n".join(rows))
    return "\n\n".join(parts)


def layout_image(layout: torch.Tensor, heads: Optional[Sequence[int]] = None, *, pixels_per_block: int = 0,
                 gap: int = 4) -> np.ndarray:
    """A uint8 grey image [height, width] of the chosen heads side by side (present = dark).

    `pixels_per_block=0` picks a size that makes each head about 256 pixels wide.
    """
    chosen = _heads(layout, heads)
    grid = layout.detach().cpu().numpy() != 0
    nb = grid.shape[1]
    scale = pixels_per_block if pixels_per_block > 0 else max(1, 256 // nb)
    side = nb * scale
    width = len(chosen) * side + (len(chosen) - 1) * gap
    image = np.full((side, width), 200, dtype=np.uint8)  # the gap between heads is light grey
    for i, h in enumerate(chosen):
        tile = np.where(grid[h], 20, 255).astype(np.uint8)
        tile = tile.repeat(scale, axis=0).repeat(scale, axis=1)
        image[:, i * (side + gap): i * (side + gap) + side] = tile
    return image


def write_png(path: Union[str, Path], image: np.ndarray) -> Path:
    """Write a uint8 greyscale [height, width] array as a PNG file (8-bit, no filtering)."""
    if image.dtype != np.uint8 or image.ndim != 2:
        raise ValueError(f"image must be a 2-D uint8 array, got {image.dtype} with shape {image.shape}")
    height, width = image.shape
    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path = Path(path)
    path.write_bytes(png)
    return path


def save_layout_png(layout: torch.Tensor, path: Union[str, Path], heads: Optional[Sequence[int]] = None, *,
                    pixels_per_block: int = 0) -> Path:
    """Save the layout of the chosen heads (all by default) as a PNG, side by side."""
    return write_png(path, layout_image(layout, heads, pixels_per_block=pixels_per_block))
