"""Clock sleeps that a closing link can cut short."""

from __future__ import annotations

import asyncio

from aiopipe.clock import Clock

__all__ = ["sleep_unless_set"]


async def sleep_unless_set(clock: Clock, seconds: float, event: asyncio.Event) -> bool:
    """Sleep ``seconds`` on ``clock`` unless ``event`` is (or gets) set first.

    Returns True when the event was set (the sleep may have been cut short), False when
    the full time passed. Always yields to the loop at least once.
    """
    if event.is_set():
        await clock.sleep(0)
        return True
    if seconds <= 0:
        await clock.sleep(0)
        return event.is_set()
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    watcher = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((sleeper, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        watcher.cancel()
        # Both are ours: reap them before leaving, even when we are being cancelled.
        await asyncio.wait((sleeper, watcher))
    return event.is_set()
