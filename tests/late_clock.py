"""Test clocks whose sleeps wake late, as the event loop's timers do on the real clock."""

from __future__ import annotations

import asyncio
import contextlib

from aiopipe.clock import VirtualClock

__all__ = ["LateClock", "LateVirtualClock"]


class LateClock:
    """A clock whose sleeps wake ``late`` seconds after their deadline, as the event
    loop's timers do on the real clock (they round up to the millisecond).

    Time moves only by sleeping, one sleeper at a time: enough for sends that queue on
    one direction's lock, which sleep one after another. Sleeps longer than ``forever``
    seconds (a connection's timeouts) never end, so that real I/O is never timed out.
    """

    def __init__(self, late: float, forever: float = 1.0) -> None:
        self.late = late
        self.forever = forever
        self._now = 0.0

    def now(self) -> float:
        """Seconds slept so far, late wake-ups included."""
        return self._now

    async def sleep(self, seconds: float) -> None:
        """Advance by ``seconds`` plus the late wake-up (nothing for ``<= 0``); yield."""
        if seconds > self.forever:
            await asyncio.Event().wait()
        if seconds > 0:
            self._now += seconds + self.late
        await asyncio.sleep(0)

    def hold(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to hold: time moves only by sleeping."""
        return contextlib.nullcontext()


class LateVirtualClock:
    """A `VirtualClock` whose sleeps wake ``late`` seconds after their deadline."""

    def __init__(self, late: float) -> None:
        self.virtual, self.late = VirtualClock(), late

    def now(self) -> float:
        return self.virtual.now()

    async def sleep(self, seconds: float) -> None:
        await self.virtual.sleep(seconds + self.late if seconds > 0 else seconds)

    def hold(self) -> contextlib.AbstractContextManager[None]:
        return self.virtual.hold()
