"""Clock sleeps that a closing link can cut short."""

from __future__ import annotations

import asyncio

from aiopipe.clock import Clock
from aiopipe.light_event import LightEvent

__all__ = ["SHORT_SLEEP_S", "sleep_unless_set"]

#: Sleeps up to this long are not cut short: watching the event costs two tasks, more
#: than the sleep itself (a heartbeat's wire time is microseconds), and a sleep this
#: short ending late changes nothing a caller can see
SHORT_SLEEP_S = 1e-3


async def sleep_unless_set(clock: Clock, seconds: float,
                           event: asyncio.Event | LightEvent) -> bool:
    """Sleep ``seconds`` on ``clock`` unless ``event`` is (or gets) set first; a sleep of
    at most `SHORT_SLEEP_S` runs to its end either way.

    Returns True when the event was set (the sleep may have been cut short), False when
    the full time passed. Always yields to the loop at least once.
    """
    if event.is_set():
        await clock.sleep(0)
        return True
    if seconds <= SHORT_SLEEP_S:
        await clock.sleep(seconds)
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
