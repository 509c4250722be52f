"""`sleep_unless_set`: a link's sleep that closing cuts short, except the shortest."""

from __future__ import annotations

import asyncio

import pytest

from aiopipe.clock import VirtualClock
from aiopipe.transport._waiting import SHORT_SLEEP_S, sleep_unless_set


async def _set_after(clock: VirtualClock, seconds: float, event: asyncio.Event) -> None:
    await clock.sleep(seconds)
    event.set()


@pytest.mark.parametrize("seconds", [1.0, 10 * SHORT_SLEEP_S])
async def test_a_sleep_is_cut_short_when_the_event_is_set(seconds: float) -> None:
    clock, event = VirtualClock(), asyncio.Event()
    setter = asyncio.ensure_future(_set_after(clock, seconds / 4, event))
    assert await sleep_unless_set(clock, seconds, event)
    assert clock.now() == pytest.approx(seconds / 4)
    await setter
    await clock.aclose()


async def test_a_short_sleep_runs_to_its_end_and_says_whether_the_event_came() -> None:
    clock, event = VirtualClock(), asyncio.Event()
    setter = asyncio.ensure_future(_set_after(clock, SHORT_SLEEP_S / 4, event))
    assert await sleep_unless_set(clock, SHORT_SLEEP_S, event)
    assert clock.now() == pytest.approx(SHORT_SLEEP_S)
    await setter
    assert not await sleep_unless_set(clock, SHORT_SLEEP_S, asyncio.Event())
    assert clock.now() == pytest.approx(2 * SHORT_SLEEP_S)
    await clock.aclose()


async def test_an_event_already_set_returns_at_once() -> None:
    clock, event = VirtualClock(), asyncio.Event()
    event.set()
    assert await sleep_unless_set(clock, 5.0, event)
    assert clock.now() == 0.0
