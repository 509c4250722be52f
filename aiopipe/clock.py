"""Injected time: `SystemClock` for real runs, `VirtualClock` for simulations.

Nothing in aiopipe calls ``time.monotonic()`` or ``asyncio.sleep(d)`` with ``d > 0``
directly: it asks its clock. With a `VirtualClock`, time stands still while any task can
run and jumps to the earliest wake-up as soon as every task is waiting ("autojump", as in
trio's ``MockClock``). Work that runs outside the event loop (a compute thread) must be
wrapped in `Clock.hold` so the clock does not jump while that work is still going on.

Theory of operation (VirtualClock): sleepers are kept in a heap of (deadline, seq,
future). A driver task, started by the first sleep and ended when no sleeper is left,
repeatedly yields to the loop until the loop's ready queue is empty (every other task is
blocked), then advances ``now`` to the earliest deadline and wakes every sleeper due by
then. Ties wake in the order the sleeps were made, so runs are deterministic.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import time
from collections.abc import Awaitable, Iterator
from typing import Protocol, TypeVar

from aiopipe.errors import ConfigError

__all__ = ["Clock", "SystemClock", "VirtualClock", "ready_time", "wait_for"]

T = TypeVar("T")


class Clock(Protocol):
    """A source of time that every runtime component receives instead of the OS."""

    def now(self) -> float:
        """Seconds on this clock (monotonic; the origin is arbitrary)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on this clock (``<= 0`` just yields to the loop)."""
        ...

    def hold(self) -> contextlib.AbstractContextManager[None]:
        """Mark work outside the event loop as running: time may not jump meanwhile."""
        ...


class SystemClock:
    """The real monotonic clock of this machine."""

    def now(self) -> float:
        """Seconds of ``time.monotonic()``."""
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        """Sleep for real."""
        await asyncio.sleep(max(0.0, seconds))

    def hold(self) -> contextlib.AbstractContextManager[None]:
        """Real time never waits for anyone: a no-op."""
        return contextlib.nullcontext()


class VirtualClock:
    """Deterministic simulated time that jumps whenever every task is waiting.

    Needs the standard asyncio event loop: it watches the loop's ready queue to know when
    every task waits. Run a simulation with ``asyncio.run(...)`` (no uvloop event loop
    policy installed) or in pytest-asyncio's default loop, not with ``uvloop.run(...)``
    (the loop aiopipe's commands use for real runs). `aiopipe.simulate`,
    `aiopipe.testing`'s entry points, `Server` and `Device` call `check_loop` before they
    start anything, so another loop is a `ConfigError` there, not a hang.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._holds = 0
        self._released: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None

    def now(self) -> float:
        """Current virtual time in seconds."""
        return self._now

    async def sleep(self, seconds: float) -> None:
        """Wait until ``now() + seconds``; returns as soon as the clock gets there."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._ensure_driver(loop)
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), future))
        await future

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Keep time still while the body runs (for work done outside the loop)."""
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
            if self._holds == 0 and self._released is not None:
                self._released.set()

    async def aclose(self) -> None:
        """Stop the driver task, if one is running."""
        driver, self._driver = self._driver, None
        if driver is not None and not driver.done():
            driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driver

    @staticmethod
    def check_loop(loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Refuse ``loop`` (default: the running one; none running: nothing to check) if
        a `VirtualClock` cannot drive it.

        Raises:
            ConfigError: it is not the standard asyncio loop (uvloop's, say); the message
                says how to run a simulation.
        """
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
        if not isinstance(getattr(loop, "_ready", None), collections.deque):
            kind = f"{type(loop).__module__}.{type(loop).__qualname__}"
            raise ConfigError(
                f"a VirtualClock cannot drive this event loop ({kind}): it needs the "
                "standard asyncio event loop, whose ready queue it watches. Run the "
                "simulation with asyncio.run(...) and no uvloop event loop policy "
                "installed (or in pytest-asyncio's default loop), not with "
                "uvloop.run(...)")

    def _ensure_driver(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._driver is not None and not self._driver.done():
            return
        self.check_loop(loop)
        self._released = asyncio.Event()
        self._driver = loop.create_task(self._drive(loop), name="aiopipe-virtual-clock")

    async def _drive(self, loop: asyncio.AbstractEventLoop) -> None:
        ready = loop._ready  # type: ignore[attr-defined]
        while True:
            # Let every runnable task run until all of them are blocked.
            await asyncio.sleep(0)
            while ready:  # noqa: ASYNC110 - yielding until the loop is idle is the point
                await asyncio.sleep(0)
            if self._holds:
                assert self._released is not None
                self._released.clear()
                await self._released.wait()
                continue
            while self._sleepers and self._sleepers[0][2].done():
                heapq.heappop(self._sleepers)  # cancelled sleeps
            if not self._sleepers:
                return
            self._now = max(self._now, self._sleepers[0][0])
            while self._sleepers and self._sleepers[0][0] <= self._now:
                _, _, future = heapq.heappop(self._sleepers)
                if not future.done():
                    future.set_result(None)


def ready_time(clock: Clock, ready_at: float | None) -> float:
    """When something a caller says was ready at ``ready_at`` counts as ready: now when
    None, and never later than now (callers pass it to undo a late wake-up: see
    aiopipe/transport/memory.py, [Note: wire slots do not drift])."""
    now = clock.now()
    return now if ready_at is None else min(now, ready_at)


async def wait_for(clock: Clock, awaitable: Awaitable[T], seconds: float | None) -> T:
    """Await ``awaitable`` for at most ``seconds`` on ``clock`` (None: no limit).

    Raises:
        TimeoutError: the time ran out first (the awaitable is cancelled).
    """
    if seconds is None:
        return await awaitable
    work = asyncio.ensure_future(awaitable)
    timer = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait({work, timer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        if not work.done():
            work.cancel()
        for task in (work, timer):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if work.cancelled():
        raise TimeoutError(f"timed out after {seconds:g} s")
    return work.result()
