"""Shared test setup: a deterministic hypothesis profile for CI, a faster one by default, and
gloo worlds of 2 and 4 ranks reused by every test that asks for one (spawning a world costs 2-5 s,
and two dozen modules use them)."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from fspeed.testing import GlooWorld

settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, max_examples=25,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): a worker per core, at most 4. Most of the suite's time is spent
    in one process or waiting on the ranks and runs its distributed tests start, so two workers on two
    cores keep both busy; more than 4 would start more gloo ranks than a machine's memory is worth."""
    return max(1, min(4, _cores()))


# at most 2 torch threads, and under pytest-xdist the cores shared out between the workers (two workers
# of 2 threads each on 2 cores would have each worker's threads wait for the other's)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads(), _cores() // max(1, _workers))))


@pytest.fixture(scope="session")
def world2():
    with GlooWorld(2) as world:
        yield world


@pytest.fixture(scope="session")
def world4():
    with GlooWorld(4) as world:
        yield world
