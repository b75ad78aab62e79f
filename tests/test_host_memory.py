"""retain_freed_host_memory: freed heap pages stay in the process (fewer page faults per step)."""

import os
import subprocess
import sys

import pytest

from fspeed.host_memory import _glibc, retain_freed_host_memory

# Frees and reallocates 48 MiB (above glibc's largest dynamic mmap threshold, 32 MiB) ten times and
# prints the page faults of the last nine allocations.
PROBE = """
import resource, sys, torch
import fspeed
print(fspeed.retain_freed_host_memory() if sys.argv[1] == "retain" else None)
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(12 << 20)
start = faults()
for _ in range(9):
    torch.ones(12 << 20)
print(faults() - start)
"""


def _probe(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**clean, **env}).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(_glibc() is None, reason="glibc's malloc only")
def test_retained_pages_are_not_faulted_in_again():
    applied, retained = _probe("retain")
    assert applied == "True"
    _, default = _probe("default")
    pages = 9 * (48 << 20) // 4096
    assert default > pages // 2, default  # glibc maps each 48 MiB block fresh: every page faults
    assert retained < pages // 4, retained  # at most the heap growing once


@pytest.mark.skipif(_glibc() is None, reason="glibc's malloc only")
def test_the_users_malloc_environment_wins():
    applied, faults = _probe("retain", MALLOC_TRIM_THRESHOLD_="131072")
    assert applied == "False"


def test_bad_thresholds_are_named():
    with pytest.raises(ValueError, match="mmap_threshold=0"):
        retain_freed_host_memory(mmap_threshold=0)
