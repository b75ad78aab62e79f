"""Keep freed host memory in the process between training steps (glibc's malloc only).

glibc returns the top of its heap to the operating system whenever more than `M_TRIM_THRESHOLD`
(dynamically about twice the largest freed block) is free there, and it maps every block above
`M_MMAP_THRESHOLD` (at most 32 MiB) fresh from the kernel. A CPU training step frees all of its
activations at the end of backward; when nothing allocated later sits above them, the heap is
trimmed and the next step faults every page back in. An eager PyTorch loop escapes by luck: its
`.grad` tensors, allocated late in backward and freed only at the next `zero_grad`, pin the heap's
top. fspeed's gradients live in a persistent flat buffer, so its steps paid 8-16k page faults each
(13.8M-parameter GPT-2, about 5% of the step). Raising both thresholds keeps the freed pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Optional

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
ENVIRONMENT = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def retain_freed_host_memory(mmap_threshold: int = 64 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Ask glibc to serve blocks below `mmap_threshold` bytes from its heap and to keep up to
    `trim_threshold` free bytes at the heap's top instead of returning them after each step.

    Returns True when applied; False when the C library is not glibc or the user already chose
    through glibc's MALLOC_* environment variables (their choice stands). Process-wide, like
    `torch.set_num_threads`; `fspeed-train` and `fs.initialize` call it, a functional-API loop may.
    """
    if mmap_threshold <= 0 or trim_threshold <= 0:
        raise ValueError(f"thresholds must be positive byte counts, got mmap_threshold={mmap_threshold}, "
                         f"trim_threshold={trim_threshold}")
    chosen = [name for name in ENVIRONMENT if name in os.environ]
    if chosen:
        log.debug("malloc thresholds left as set by %s", ", ".join(chosen))
        return False
    libc = _glibc()
    if libc is None:
        return False
    applied = libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    log.debug("glibc malloc: mmap threshold %d, trim threshold %d (%s)", mmap_threshold, trim_threshold,
              "applied" if applied else "refused")
    return applied


def _glibc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc has it (musl, macOS's libSystem do not)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def live_host_bytes() -> Optional[int]:
    """Bytes the process holds allocated through malloc now (glibc's `mallinfo2`: heap blocks in
    use plus mapped blocks), or None without glibc. CPU tensors live there, so the difference
    around a forward is the memory it keeps for backward."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)
