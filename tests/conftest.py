"""Shared test setup.

Async tests run under the default asyncio event loop. Tests whose outcome depends on the
event loop — the runtime's cancellation, repair, drain and timing paths — are marked
``@pytest.mark.both_loops`` (or ``pytestmark = pytest.mark.both_loops`` for a whole module) and
run twice: under asyncio and under uvloop (S13), through pytest-asyncio's
``pytest_asyncio_loop_factories`` hook. Pure codec round trips run once: the loop does not
matter there. ``AIOSYNC_TEST_LOOPS=asyncio,uvloop`` (or one of them) forces that set on every
async test.
"""

from __future__ import annotations

import asyncio
import os

import pytest


def _loop_factories() -> dict:
    factories = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        pass
    else:
        factories["uvloop"] = uvloop.new_event_loop
    wanted = os.environ.get("AIOSYNC_TEST_LOOPS")
    if wanted:
        names = [n.strip() for n in wanted.split(",") if n.strip()]
        unknown = [n for n in names if n not in factories]
        if unknown:
            raise pytest.UsageError(f"AIOSYNC_TEST_LOOPS names unavailable loops {unknown}; have {list(factories)}")
        factories = {n: factories[n] for n in names}
    return factories


def pytest_asyncio_loop_factories(config, item):
    """asyncio for every async test; every available loop for ``both_loops`` tests."""
    factories = _loop_factories()
    if os.environ.get("AIOSYNC_TEST_LOOPS") or item.get_closest_marker("both_loops") is not None:
        return factories
    return {"asyncio": factories.get("asyncio", asyncio.new_event_loop)}



@pytest.fixture(autouse=True)
def _grad_mode_is_left_as_found():
    """A test (or the code it drives) must not leave torch's grad mode switched off for the
    tests after it: a ``with torch.no_grad():`` around an ``await`` does, when two of them
    interleave on one loop thread."""
    import torch

    before = torch.is_grad_enabled()
    yield
    after = torch.is_grad_enabled()
    torch.set_grad_enabled(before)
    assert after == before, "grad mode was left switched off: keep no_grad inside the thread that runs the model"


@pytest.fixture(scope="session", autouse=True)
def _kernels_loaded():
    """The suite runs with the numba kernels loaded, as a warmed-up installation does (compiled
    on a cold cache: once per checkout). Syncers never wait for them; until they are ready the
    torch paths serve — ``tests/test_cold_start.py`` covers those, forcing them with
    ``AIOSYNC_KERNELS=torch`` and in fresh processes."""
    from aiosync.syncers.kernels.warmup import warm_up

    warm_up()
