"""Devices profiled where they run (aiopipe.runtime.profiling [Note: device profiles]):
with "auto" plans on a clock that charges no table, the coordinator asks each device for
its own cost table and times both directions of its link with probes; the planner plans
with what they measured. Each device's links are its own (``network`` per device)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from fleet import vgg5_shaped

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.errors import AiopipeError
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.device import run_device
from aiopipe.runtime.profiling import PROBE_BYTES, rate_bps
from aiopipe.transport import open_memory_link_pair

# vgg5_shaped: what each device measures of itself takes a tenth of vgg5's time
CONFIG = RunConfig(mode="pipar", model=vgg5_shaped, devices=2, samples_per_device=40,
                   batch_size=20, epochs=1, split_point="auto", parallel_batches="auto",
                   network=["4g", "wifi"], test_samples=20, device_slowdown=[1.0, 3.0])


async def _run(node: Coordinator, clock: VirtualClock, *, profile: bool) -> None:
    """The coordinator and its devices over memory links shaped per device; devices
    without a cost table: their compute is real, time stands still while it runs."""
    config = node.config

    async def device(k: int) -> None:
        network = config.device_network(k)
        device_end, server_end = open_memory_link_pair(clock, a_to_b=network.up,
                                                       b_to_a=network.down)
        serving = asyncio.ensure_future(node.serve_link(server_end))
        try:
            await run_device(device_end, k, clock=clock, clock_offset=0.0, profile=profile,
                             model=vgg5_shaped(10, (3, 32, 32)))
        finally:
            await device_end.aclose()
            with contextlib.suppress(AiopipeError):
                await serving

    async with asyncio.TaskGroup() as tasks:
        for k in range(config.devices):
            tasks.create_task(device(k))
        await node.train()
    await clock.aclose()


@pytest.mark.slow
async def test_each_device_measures_its_compute_and_its_links() -> None:
    clock = VirtualClock()
    node = Coordinator(CONFIG, clock=clock)
    assert node.system.wants_profiles
    await _run(node, clock, profile=True)
    profiles = node.system.live  # what the planner planned with
    for k, (up, down) in enumerate([(10e6, 25e6), (50e6, 50e6)]):
        profile = profiles[k]
        # a probe's frame is PROBE_BYTES and a header: timed on the wire, to 1e-3
        assert profile.uplink.bandwidth_bps == pytest.approx(up, rel=1e-3)
        assert profile.downlink.bandwidth_bps == pytest.approx(down, rel=1e-3)
        assert profile.costs is not None
        assert profile.costs.units == 5
        assert all(t > 0 for t in profile.costs.forward[0].values())
        assert profile.slowdown == CONFIG.device_slowdown_of(k)  # emulation on top
    assert [p["split_point"] for p in node.system.plan_entries()]  # it planned


@pytest.mark.slow
async def test_a_device_that_shares_the_coordinators_table_is_planned_as_declared() -> None:
    clock = VirtualClock()
    node = Coordinator(CONFIG, clock=clock)
    await _run(node, clock, profile=False)
    for k, profile in enumerate(node.system.live):
        assert profile.costs is None
        assert profile.uplink == CONFIG.device_network(k).up


async def test_a_simulation_shapes_each_devices_links_as_its_network_says() -> None:
    """Same plan, same frames: device 1's 1 Mbit/s uplink takes 10x as long as device
    0's 10 Mbit/s (4g) one, its 1 Mbit/s downlink 25x as long as 4g's 25."""
    config = CONFIG.replace(network=["4g", {"up_mbps": 1, "down_mbps": 1}], split_point=2,
                            parallel_batches=2, device_slowdown=1.0)
    result = await simulate(config, clock=VirtualClock(),
                            cost_table=CostTable.uniform(5, forward=0.001, backward=0.002))

    def wire(k: int, track: str, name: str) -> float:
        return sum(s.duration for s in result.trace
                   if s.track == f"device{k}/{track}" and s.name == name)

    assert wire(1, "uplink", "u") == pytest.approx(10 * wire(0, "uplink", "u"), rel=1e-4)
    assert wire(1, "downlink", "d") == pytest.approx(25 * wire(0, "downlink", "d"), rel=1e-4)


def test_a_probe_is_timed_by_its_delay() -> None:
    assert rate_bps(8 * PROBE_BYTES / 10e6) == pytest.approx(10e6)
    assert rate_bps(0.0) == 0.0  # too fast to time: unshaped
