"""A pipeline over real websockets (in one event loop; separate processes are in
tests/test_launcher_faults_processes.py): the coordinator's links and authenticated
device-to-device links on each device's own endpoint. It computes what the memory-link
simulation computes; a device that does not listen, and a stranger on a device's
endpoint, are refused without disturbing the run."""

from __future__ import annotations

import asyncio

import pytest
import torch

from aiopipe import Device, RunConfig, Server, TrainingError, VirtualClock, simulate
from aiopipe.auth import mint_token, pair_key
from aiopipe.clock import SystemClock
from aiopipe.errors import AiopipeError, AuthenticationError
from aiopipe.models.crossing import single
from aiopipe.transport.fabric import open_websocket_endpoint
from aiopipe.transport.peering import dial_peer

SECRET = b"test-secret-of-32-bytes-at-least"
CONFIG = RunConfig(mode="pipeline", devices=3, samples_per_device=32, batch_size=8,
                   epochs=2, parallel_batches=4, test_samples=40, seed=5,
                   options={"partition": [1, 3]})


async def _device(url: str, k: int, *, listen: bool = True) -> None:
    async with Device(url, k, token=mint_token(SECRET, k),
                      listen=("127.0.0.1", 0) if listen else None) as device:
        await device.run()


@pytest.mark.slow  # (about 2 s)
async def test_a_pipeline_over_websockets_computes_what_the_simulation_computes() -> None:
    async with (Server(CONFIG, token_secret=SECRET, join_timeout=60) as server,
                asyncio.TaskGroup() as tasks):
        for k in range(CONFIG.devices):
            tasks.create_task(_device(server.url, k))
        result = await server.run()
    reference = await simulate(CONFIG, clock=VirtualClock())
    assert [e.samples for e in result.epochs] == [32, 32]
    got, want = result.model.state_dict(), reference.model.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7)
    # activations and gradients went device to device, not through the coordinator
    links = result.final.links
    assert set(links) == {"device0->device1", "device1->device0", "device1->device2",
                          "device2->device1"}
    assert not [s for s in result.trace if s.track.endswith("/uplink") and s.name == "u"]
    assert [s["peak_live"] for s in result.final.stages] == [4, 3, 1]


async def test_a_device_that_does_not_listen_is_refused_with_the_reason() -> None:
    config = CONFIG.replace(devices=2, options={"partition": [2]})
    async with Server(config, token_secret=SECRET, join_timeout=5) as server:
        with pytest.raises(TrainingError, match="start device 0 with an address its peers"):
            await _device(server.url, 0, listen=False)


@pytest.mark.slow
async def test_a_stranger_on_a_device_endpoint_is_refused_and_the_run_goes_on() -> None:
    """Someone who knows device 1's address but not its pair key with device 0 tries to
    pass for device 0: refused at the handshake; the pipeline trains as if nothing
    happened."""
    clock = SystemClock()
    attempts: list[BaseException] = []

    async def intruder(address: str) -> None:
        wrong = pair_key(b"another-run-secret-32-bytes-long", "device0", "device1")
        async with open_websocket_endpoint("127.0.0.1", clock=clock,
                                           max_frame_bytes=1 << 20) as mine:
            try:
                async with dial_peer(mine, address, me="device0", peer="device1", key=wrong,
                                     clock=clock, timeout=5.0):
                    pass
            except AiopipeError as exc:
                attempts.append(exc)

    async with (Server(CONFIG, token_secret=SECRET, join_timeout=60) as server,
                asyncio.TaskGroup() as tasks):
        for k in range(CONFIG.devices):
            tasks.create_task(_device(server.url, k))
        await server.node.admission.joined.wait()
        await intruder(server.node.admission.addresses[1])
        result = await server.run()
    assert len(attempts) == 1
    assert isinstance(attempts[0], AuthenticationError)
    assert result.final.device_samples == (32, 32, 32)


async def test_links_between_devices_are_paced_at_the_sender_s_uplink() -> None:
    """Sender-side shaping (``shape_links``) covers the device-to-device links too: device
    0's activations to device 1 leave at device 0's uplink rate, so the epoch lasts at
    least their bytes' wire time at that rate."""
    from aiopipe import models
    from aiopipe.runtime.plan import build_model, unit_crossings

    rate_mbps = 16.0
    config = CONFIG.replace(devices=2, epochs=1, network=[
        {"up_mbps": rate_mbps, "down_mbps": 1000.0}, {"up_mbps": 1000.0, "down_mbps": 1000.0}],
                            options={"partition": [1]})
    model = build_model(config, num_classes=10, in_shape=(3, 32, 32))
    shape = unit_crossings(model, single((3, 32, 32)))[0][0][1]
    assert models.unit_count(model) == 5
    micro = config.batch_size // 4
    activations = config.samples_per_device // micro
    wire_s = activations * 4 * micro * int(torch.tensor(shape).prod()) * 8 / (rate_mbps * 1e6)
    async with (Server(config, token_secret=SECRET, join_timeout=60) as server,
                asyncio.TaskGroup() as tasks):
        for k in range(config.devices):
            tasks.create_task(_device(server.url, k))
        result = await server.run()
    assert result.final.time_s >= 0.9 * wire_s
    assert result.final.links["device0->device1"]["busy_s"] >= 0.9 * wire_s
