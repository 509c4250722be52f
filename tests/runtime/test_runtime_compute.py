"""The compute resource: emulated slow devices are charged slowdown x CPU time."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest
from late_clock import LateClock, LateVirtualClock

from aiopipe import RunConfig, simulate
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


async def test_items_ready_at_the_previous_end_do_not_inherit_its_late_wake_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a caller submitting one item after another is woken late each time; with
    # ready_at=last_end the emulated timeline stays 0.4 s per item
    cpu = FakeCpu()
    monkeypatch.setattr(compute_module, "_thread_seconds", cpu.read)
    ends = {}
    for chained in (False, True):
        clock, recorder = LateClock(late=0.01), Recorder()
        resource = Compute(clock, recorder, "device0/compute", slowdown=4.0)
        try:
            for i in range(3):
                await resource.run(f"f{i}", lambda: cpu.spend(0.1),
                                   ready_at=resource.last_end if chained and i else None)
        finally:
            resource.close()
        ends[chained] = [end for _, _, end in slices(recorder)]
        if chained:
            assert resource.last_end == pytest.approx(1.2)
    assert ends[False] == pytest.approx([0.41, 0.82, 1.23])
    assert ends[True] == pytest.approx([0.41, 0.81, 1.21])


async def test_a_slow_devices_forwards_in_a_run_follow_each_other_despite_late_wake_ups(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the device's schedule loop passes ready_at=last_end: each forward of an iteration
    # starts when the previous one ended in emulation, not when its caller woke up
    local = threading.local()

    def cpu() -> float:  # each thread's CPU clock moves 5 ms per reading: 5 ms per item
        local.seconds = getattr(local, "seconds", 0.0) + 0.005
        return float(local.seconds)

    monkeypatch.setattr(compute_module, "_thread_seconds", cpu)
    config = RunConfig(mode="pipar", devices=1, samples_per_device=8, batch_size=8,
                       epochs=1, split_point=2, parallel_batches=4, test_samples=20,
                       device_slowdown=4.0, network="lan")
    clock = LateVirtualClock(late=0.001)
    try:
        result = await simulate(config, clock=clock)
    finally:
        await clock.virtual.aclose()
    ends = [s.end for s in result.trace if s.track == "device0/compute" and s.name == "f"]
    assert len(ends) == 4
    # 4 x 5 ms apart; without the chaining each gap also held one late wake-up (21 ms)
    assert [b - a for a, b in itertools.pairwise(ends)] == pytest.approx([0.02] * 3)


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


def test_a_torch_device_is_resolved_or_refused_with_the_reason() -> None:
    import torch

    from aiopipe.errors import ConfigError
    from aiopipe.runtime.compute import resolve_torch_device

    gpu = torch.cuda.is_available()
    assert resolve_torch_device("auto").type == ("cuda" if gpu else "cpu")
    assert resolve_torch_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="unknown 'tpu'"):
        resolve_torch_device("tpu")
    with pytest.raises(ConfigError, match="'meta' is not supported"):
        resolve_torch_device("meta")
    with pytest.raises(ConfigError, match=r"cuda:99.*CUDA device"):
        resolve_torch_device("cuda:99")


async def test_a_whole_models_step_runs_in_the_item_of_its_forward_and_backward() -> None:
    """[Note: a whole model's step] FL's device runs FB and STEP as one compute item,
    charged both costs in virtual time: no "step" slice of its own, and each item lasts
    the forward, the backward and the step of the whole model."""
    from aiopipe import CostTable

    costs = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.0005, batch=1)
    config = RunConfig(mode="fl", devices=1, samples_per_device=20, batch_size=10, epochs=1,
                       test_samples=10)
    result = await simulate(config, clock=VirtualClock(), cost_table=costs)
    items = [s for s in result.trace if s.track == "device0/compute"]
    assert [s.name for s in items] == ["s", "s"]  # two iterations, no separate step
    whole = (costs.forward_time(0, 5, 10) + costs.backward_time(0, 5, 10)
             + costs.step_time(0, 5))
    for item in items:
        assert item.duration == pytest.approx(whole, rel=1e-12)


async def test_a_simulation_refuses_a_torch_device_this_machine_lacks() -> None:
    from aiopipe.errors import ConfigError

    config = RunConfig(mode="fl", devices=1, samples_per_device=20, batch_size=10, epochs=1)
    with pytest.raises(ConfigError, match=r"cuda:99.*CUDA device"):
        await simulate(config, clock=VirtualClock(), torch_device="cuda:99")


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="no CUDA GPU here")
async def test_a_simulation_computed_on_the_gpu_is_charged_the_tables_time() -> None:
    """Where the passes compute changes the run's wall time, not its virtual time, and
    the weights only by the GPU's rounding (runs where a GPU is at hand)."""
    import torch

    from aiopipe.scheduler.costs import CostTable

    config = RunConfig(mode="pipar", model="vgg5", devices=2, samples_per_device=40,
                       batch_size=20, epochs=2, split_point=2, parallel_batches=2,
                       test_samples=20, network="4g")
    costs = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.0005, batch=1)
    runs = [await simulate(config, clock=VirtualClock(), cost_table=costs, torch_device=where)
            for where in ("cpu", "cuda")]
    on_cpu, on_gpu = runs
    assert [e.time_s for e in on_gpu.epochs] == [e.time_s for e in on_cpu.epochs]
    for (name, a), (_, b) in zip(on_cpu.model.state_dict().items(),
                                 on_gpu.model.state_dict().items(), strict=True):
        assert torch.allclose(a.float().cpu(), b.float().cpu(), rtol=1e-3, atol=1e-4), name
