"""`VirtualClock`, `SystemClock` and `wait_for`: ordering and exact times in virtual time,
lower bounds only on the wall clock."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator

import pytest

from aiopipe.clock import SystemClock, VirtualClock, wait_for
from aiopipe.errors import ConfigError

DRIVER_NAME = "aiopipe-virtual-clock"


@pytest.fixture
async def clock() -> AsyncIterator[VirtualClock]:
    clock = VirtualClock()
    yield clock
    await clock.aclose()


def _drivers() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == DRIVER_NAME]


# -- VirtualClock ----------------------------------------------------------------------


async def test_starts_at_the_given_time() -> None:
    assert VirtualClock().now() == 0.0
    assert VirtualClock(start=12.5).now() == 12.5


async def test_sleeps_wake_in_deadline_order_at_exact_times(clock: VirtualClock) -> None:
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, *delays: float) -> None:
        for delay in delays:
            await clock.sleep(delay)
        woke.append((name, clock.now()))

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(sleeper("three", 3.0))
        tasks.create_task(sleeper("one", 1.0))
        tasks.create_task(sleeper("one+two", 1.0, 2.5))  # second sleep starts at 1.0
        tasks.create_task(sleeper("two", 2.0))
    assert woke == [("one", 1.0), ("two", 2.0), ("three", 3.0), ("one+two", 3.5)]
    assert clock.now() == 3.5


async def test_sleep_of_zero_or_less_does_not_move_time(clock: VirtualClock) -> None:
    await clock.sleep(0)
    await clock.sleep(-5.0)
    assert clock.now() == 0.0


async def test_ties_wake_in_the_order_the_sleeps_were_made(clock: VirtualClock) -> None:
    names = list("abcdefgh")
    made: list[str] = []
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, yields_first: int) -> None:
        for _ in range(yields_first):
            await asyncio.sleep(0)
        made.append(name)
        await clock.sleep(1.0)
        woke.append((name, clock.now()))

    async with asyncio.TaskGroup() as tasks:
        # Tasks are created a..h but make their sleeps h..a: order follows the sleeps.
        for i, name in enumerate(names):
            tasks.create_task(sleeper(name, len(names) - i))
    assert made == names[::-1]
    assert woke == [(name, 1.0) for name in made]


async def test_time_stands_still_while_any_task_is_runnable(clock: VirtualClock) -> None:
    seen_by_spinner: list[float] = []
    spins_when_woken: list[int] = []

    async def spinner() -> None:
        for _ in range(1000):
            seen_by_spinner.append(clock.now())
            await asyncio.sleep(0)

    async def sleeper() -> None:
        await clock.sleep(1.0)
        spins_when_woken.append(len(seen_by_spinner))
        assert clock.now() == 1.0

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(sleeper())
        tasks.create_task(spinner())
    assert seen_by_spinner == [0.0] * 1000
    assert spins_when_woken == [1000]
    assert clock.now() == 1.0


async def test_hold_keeps_time_still_while_a_thread_works(clock: VirtualClock) -> None:
    events: list[tuple[str, float]] = []

    async def worker() -> None:
        with clock.hold():
            # Without the hold the loop is idle here, and the clock would jump to 0.1.
            await asyncio.to_thread(time.sleep, 0.2)
            events.append(("thread done", clock.now()))

    async def sleeper() -> None:
        await clock.sleep(0.1)
        events.append(("slept", clock.now()))

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(worker())
        tasks.create_task(sleeper())
    assert events == [("thread done", 0.0), ("slept", 0.1)]
    # Once nothing is held, time jumps again (a real hour would time the test out).
    await clock.sleep(3600.0)
    assert clock.now() == 0.1 + 3600.0


async def test_nested_holds_release_only_at_the_outermost(clock: VirtualClock) -> None:
    events: list[str] = []

    async def worker() -> None:
        with clock.hold():
            with clock.hold():
                await asyncio.to_thread(time.sleep, 0.05)
            await asyncio.to_thread(time.sleep, 0.05)  # still held by the outer hold
            events.append("worker")

    async def sleeper() -> None:
        await clock.sleep(1.0)
        events.append("sleeper")

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(worker())
        tasks.create_task(sleeper())
    assert events == ["worker", "sleeper"]
    assert clock.now() == 1.0


async def test_cancelled_sleep_wakes_nothing_and_does_not_move_time(
    clock: VirtualClock,
) -> None:
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.now()))

    early = asyncio.create_task(sleeper("early", 1.0))
    tie = asyncio.create_task(sleeper("tie", 2.0))
    late = asyncio.create_task(sleeper("late", 2.0))
    await asyncio.sleep(0)  # every sleep is made
    early.cancel()
    tie.cancel()
    await late
    assert woke == [("late", 2.0)]
    assert early.cancelled()
    assert tie.cancelled()

    # The only sleeper cancelled: its deadline (t=102) must not become the time.
    lonely = asyncio.create_task(sleeper("lonely", 100.0))
    await asyncio.sleep(0)
    lonely.cancel()
    await asyncio.sleep(0.05)  # real time: the loop goes idle with no live sleeper
    assert lonely.cancelled()
    assert clock.now() == 2.0
    # ... and the clock still works afterwards.
    await clock.sleep(0.5)
    assert clock.now() == 2.5
    assert woke == [("late", 2.0)]


async def test_aclose_stops_the_driver() -> None:
    clock = VirtualClock()
    await clock.aclose()  # no driver yet: a no-op
    sleeper = asyncio.create_task(clock.sleep(100.0))
    await asyncio.sleep(0)
    assert len(_drivers()) == 1
    await clock.aclose()
    assert _drivers() == []
    await clock.aclose()  # twice is fine
    # Block for real: a live driver would now jump to t=100 and wake the sleeper.
    await asyncio.wait([sleeper], timeout=0.05)
    assert not sleeper.done()
    assert clock.now() == 0.0
    sleeper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeper


async def test_driver_ends_when_no_sleeper_is_left(clock: VirtualClock) -> None:
    await clock.sleep(1.0)
    drivers = _drivers()
    await asyncio.wait(drivers, timeout=5.0)  # the loop goes idle: the driver ends
    assert all(d.done() and not d.cancelled() and d.exception() is None for d in drivers)
    assert _drivers() == []
    await clock.sleep(1.0)  # a new sleep starts a new driver
    assert clock.now() == 2.0


@pytest.mark.timeout(20)
async def test_thousand_sleepers_wake_at_their_exact_deadlines(clock: VirtualClock) -> None:
    rng = random.Random(20240531)
    # Hours of virtual time (the timeout mark fails a clock that really sleeps); rounding
    # to tenths makes ties too.
    deadlines = [round(rng.uniform(0.0, 3600.0), 1) for _ in range(1000)]
    woke: list[tuple[float, int, float]] = []

    async def sleeper(i: int, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((seconds, i, clock.now()))

    async with asyncio.TaskGroup() as tasks:
        for i, deadline in enumerate(deadlines):
            tasks.create_task(sleeper(i, deadline))
    assert len(woke) == 1000
    assert all(now == deadline for deadline, _, now in woke)
    assert [(d, i) for d, i, _ in woke] == sorted((d, i) for i, d in enumerate(deadlines))
    assert len(set(deadlines)) < len(deadlines)  # the tie path was exercised
    assert clock.now() == max(deadlines)


def test_refuses_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")
    loop = uvloop.new_event_loop()
    try:
        with pytest.raises(ConfigError, match="standard asyncio event loop"):
            loop.run_until_complete(VirtualClock().sleep(1.0))
    finally:
        loop.close()


# -- SystemClock -----------------------------------------------------------------------


def test_system_clock_now_is_monotonic() -> None:
    clock = SystemClock()
    before = time.monotonic()
    readings = [clock.now() for _ in range(1000)]
    after = time.monotonic()
    assert readings == sorted(readings)
    assert before <= readings[0]
    assert readings[-1] <= after


async def test_system_clock_sleeps_at_least_roughly_the_time() -> None:
    clock = SystemClock()
    start = time.monotonic()
    await clock.sleep(0.05)
    assert time.monotonic() - start >= 0.045
    await clock.sleep(-1.0)  # negative just yields
    with clock.hold():  # a no-op, but usable
        pass


# -- wait_for --------------------------------------------------------------------------


async def test_wait_for_returns_the_result(clock: VirtualClock) -> None:
    async def work() -> int:
        await clock.sleep(1.0)
        return 42

    assert await wait_for(clock, work(), 5.0) == 42
    assert clock.now() == 1.0
    await asyncio.sleep(0.05)  # real time: the loop goes idle; the cancelled timer is void
    assert clock.now() == 1.0


async def test_wait_for_times_out_at_the_deadline_and_cancels(clock: VirtualClock) -> None:
    cancelled: list[float] = []

    async def work() -> int:
        try:
            await clock.sleep(10.0)
        except asyncio.CancelledError:
            cancelled.append(clock.now())
            raise
        return 1

    with pytest.raises(TimeoutError):
        await wait_for(clock, work(), 2.5)
    assert clock.now() == 2.5
    assert cancelled == [2.5]


async def test_wait_for_cancels_a_task_that_never_finishes(clock: VirtualClock) -> None:
    task = asyncio.create_task(asyncio.Event().wait())
    with pytest.raises(TimeoutError):
        await wait_for(clock, task, 7.0)
    assert task.cancelled()
    assert clock.now() == 7.0


async def test_wait_for_propagates_the_exception(clock: VirtualClock) -> None:
    async def work() -> None:
        await clock.sleep(1.0)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await wait_for(clock, work(), 5.0)
    assert clock.now() == 1.0


async def test_wait_for_none_means_no_limit(clock: VirtualClock) -> None:
    async def work() -> str:
        await clock.sleep(1e6)
        return "done"

    assert await wait_for(clock, work(), None) == "done"
    assert clock.now() == 1e6


async def test_wait_for_cancelled_from_outside_cancels_the_work(clock: VirtualClock) -> None:
    inner = asyncio.create_task(clock.sleep(10.0))
    outer = asyncio.create_task(wait_for(clock, inner, 5.0))
    for _ in range(5):
        await asyncio.sleep(0)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert inner.cancelled()
    assert clock.now() == 0.0


async def test_wait_for_on_the_system_clock() -> None:
    clock = SystemClock()

    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    assert await wait_for(clock, work(), 5.0) == 7
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await wait_for(clock, asyncio.Event().wait(), 0.05)
    assert time.monotonic() - start >= 0.045
