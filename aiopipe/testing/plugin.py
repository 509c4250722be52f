"""aiopipe's pytest fixtures: ``pytest_plugins = ["aiopipe.testing.plugin"]`` in a
conftest (not loaded by itself: it needs pytest-asyncio)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from aiopipe.clock import VirtualClock

__all__ = ["virtual_clock"]


@pytest_asyncio.fixture
async def virtual_clock() -> AsyncIterator[VirtualClock]:
    """A `VirtualClock` for the test, closed after it (refused at once, with a
    `ConfigError` saying why, on a loop it cannot drive: `VirtualClock.check_loop`)."""
    VirtualClock.check_loop()
    clock = VirtualClock()
    try:
        yield clock
    finally:
        await clock.aclose()
