"""The compute resource: emulated slow devices are charged slowdown x CPU time."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aiopipe.clock import SystemClock, VirtualClock
from aiopipe.metrics.trace import Recorder
from aiopipe.runtime import compute as compute_module
from aiopipe.runtime.compute import Compute


class FakeCpu:
    """A thread CPU clock that only the work advances."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.lock = threading.Lock()

    def read(self) -> float:
        with self.lock:
            return self.seconds

    def spend(self, seconds: float) -> None:
        with self.lock:
            self.seconds += seconds


def slices(recorder: Recorder) -> list[tuple[str, float, float]]:
    return [(s.name, round(s.start, 6), round(s.end, 6)) for s in recorder.slices]


async def test_queued_items_follow_one_another_on_the_emulated_timeline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = FakeCpu()
    monkeypatch.setattr(compute_module, "_thread_seconds", cpu.read)
    clock, recorder = VirtualClock(), Recorder()
    resource = Compute(clock, recorder, "device0/compute", slowdown=4.0)
    try:
        await asyncio.gather(*(resource.run(f"f{i}", lambda: cpu.spend(0.1)) for i in range(3)))
        await clock.sleep(5.0 - clock.now())
        await resource.run("b", lambda: cpu.spend(0.25))  # after idling: starts when submitted
    finally:
        resource.close()
    assert slices(recorder) == [("f0", 0.0, 0.4), ("f1", 0.4, 0.8), ("f2", 0.8, 1.2),
                                ("b", 5.0, 6.0)]


async def test_waiting_inside_an_item_is_not_multiplied_by_the_slowdown() -> None:
    # elapsed 0.2 s but almost no CPU: the old emulation (slowdown x elapsed) took 0.8 s
    recorder = Recorder()
    resource = Compute(SystemClock(), recorder, "device0/compute", slowdown=4.0)
    try:
        await resource.run("f", lambda: time.sleep(0.2))
    finally:
        resource.close()
    (item,) = recorder.slices
    assert 0.2 <= item.end - item.start < 0.6


async def test_an_item_busy_on_cpu_takes_slowdown_times_its_cpu_time() -> None:
    def spin() -> None:
        started = time.thread_time()
        while time.thread_time() - started < 0.05:
            pass

    recorder = Recorder()
    resource = Compute(SystemClock(), recorder, "device0/compute", slowdown=4.0)
    try:
        await resource.run("f", spin)
    finally:
        resource.close()
    (item,) = recorder.slices
    assert item.end - item.start >= 4 * 0.05
