"""Shared test setup.

Every async test runs twice: under the default asyncio event loop and under uvloop (S13),
through pytest-asyncio's ``pytest_asyncio_loop_factories`` hook. Set
``AIOSYNC_TEST_LOOPS=asyncio`` (or ``uvloop``) to run one of them only.
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
    """Run each async test under every available event loop implementation."""
    return _loop_factories()

