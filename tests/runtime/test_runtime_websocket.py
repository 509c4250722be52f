"""The real path: server and devices over aiohttp websockets (in one event loop here; the
multi-process path is tests/test_cli.py). It must compute exactly what the memory-link
simulation computes, and refuse strangers without disturbing the run."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from aiopipe import (
    AuthenticationError,
    Device,
    RunConfig,
    RunResult,
    Server,
    VirtualClock,
    simulate,
)
from aiopipe.auth import mint_token
from aiopipe.clock import SystemClock
from aiopipe.protocol import PROTOCOL_VERSION, ErrorMessage, Hello, decode, encode
from aiopipe.transport import open_websocket_link

SECRET = b"test-secret-of-32-bytes-at-least"
CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=80, batch_size=20, epochs=2,
                   split_point=2, parallel_batches=2, test_samples=40, seed=5)


async def _device(url: str, device_id: int) -> None:
    async with Device(url, device_id, token=mint_token(SECRET, device_id)) as device:
        await device.run()


async def _run_over_websockets(config: RunConfig) -> RunResult:
    async with (Server(config, token_secret=SECRET, join_timeout=60) as server,
                asyncio.TaskGroup() as tasks):
        for k in range(config.devices):
            tasks.create_task(_device(server.url, k))
        result = await server.run()
    return result


@pytest.mark.slow  # (about 2 s)
async def test_websocket_run_computes_what_the_simulation_computes() -> None:
    result = await _run_over_websockets(CONFIG)
    reference = await simulate(CONFIG, clock=VirtualClock())
    assert [e.samples for e in result.epochs] == [160, 160]
    got, want = result.model.state_dict(), reference.model.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7)
    # link statistics were counted on the real path
    first = result.epochs[0]
    assert first.bytes_up > 0
    assert first.bytes_down > 0


async def test_devices_without_the_right_token_are_refused() -> None:
    async with Server(CONFIG, token_secret=SECRET, join_timeout=5) as server:
        for token in (None, "wrong"):
            with pytest.raises(AuthenticationError):
                async with open_websocket_link(server.url, clock=SystemClock(), token=token,
                                               max_frame_bytes=1 << 20):
                    pass


async def _stranger(url: str, first_frame: bytes, token_for: int = 0) -> str:
    """Connect with device ``token_for``'s token, send one frame, return the answer."""
    async with open_websocket_link(url, clock=SystemClock(), token=mint_token(SECRET, token_for),
                                   max_frame_bytes=1 << 20) as link:
        await link.send(first_frame)
        answer = decode(await link.receive())
        assert isinstance(answer, ErrorMessage)
        return answer.message


async def test_strangers_are_refused_and_the_run_goes_on() -> None:
    async with Server(CONFIG, token_secret=SECRET, join_timeout=60) as server:
        answers = [
            await _stranger(server.url, b"not a frame at all"),
            await _stranger(server.url, encode(Hello(version=99, device_id=0))),
            await _stranger(server.url, encode(Hello(PROTOCOL_VERSION, device_id=7)),
                            token_for=7),
        ]

        async with asyncio.TaskGroup() as tasks:
            for k in range(CONFIG.devices):
                tasks.create_task(_device(server.url, k))
            training = tasks.create_task(server.run())
            await server.node.joined.wait()
            # a stranger holding device 1's token claims to be device 0, mid-run
            answers.append(await _stranger(server.url, encode(Hello(PROTOCOL_VERSION, 0)),
                                           token_for=1))
            # device 0's own token replayed while device 0 trains: busy, not admitted
            answers.append(await _stranger(server.url, encode(Hello(PROTOCOL_VERSION, 0)),
                                           token_for=0))
            result = await training
    assert "bad hello" in answers[0]
    assert "protocol version 99" in answers[1]
    assert "device id 7 is not in 0..1" in answers[2]
    assert "token is for device 1, not device 0" in answers[3]
    assert "device 0 is already connected" in answers[4]
    assert [e.samples for e in result.epochs] == [160, 160]


async def test_status_and_metrics_routes_describe_the_run() -> None:
    import aiohttp

    async with Server(CONFIG, token_secret=SECRET, join_timeout=60) as server:
        base = server.url.removesuffix("/ws")

        async with asyncio.TaskGroup() as tasks:
            for k in range(CONFIG.devices):
                tasks.create_task(_device(server.url, k))
            await server.run()
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/status") as response:
                status = await response.json()
            async with http.get(f"{base}/metrics") as response:
                metrics = await response.text()
            async with http.get(f"{base}/ws") as response:  # not a websocket upgrade
                plain_status = response.status
    assert status["mode"] == "pipar"
    assert status["joined"] == [0, 1]
    assert status["connected"] == []  # the run is over: everyone said goodbye
    assert [p["parallel_batches"] for p in status["plan"]] == [2, 2]
    assert len(status["finished_epochs"]) == 2
    assert set(status["busy_fraction"]) == {"device", "uplink", "server", "downlink"}
    assert all(0.0 <= f <= 1.0 for f in status["busy_fraction"].values())
    assert "aiopipe_epochs_finished 2" in metrics
    assert 'aiopipe_busy_seconds{resource="server"}' in metrics
    assert plain_status == 401  # no token: refused before anything else


async def _until(condition: Callable[[], bool]) -> None:
    """Poll the node's state (it has no event for everything a test wants to wait for)."""
    for _ in range(6000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the condition never held")


@pytest.mark.slow
async def test_a_device_reconnects_by_itself_after_its_connection_drops() -> None:
    """The server drops device 1's websocket mid-round, twice; the device reconnects with
    its token, re-sends what was in flight, and the run computes what an undisturbed one
    computes (nothing lost, nothing applied twice)."""
    async with (Server(CONFIG, token_secret=SECRET, join_timeout=60) as server,
                asyncio.TaskGroup() as tasks):
        for k in range(CONFIG.devices):
            tasks.create_task(_device(server.url, k))
        training = tasks.create_task(server.run())
        for epoch in range(2):
            await _until(lambda e=epoch: server.node.epoch == e  # type: ignore[misc]
                         and bool(server.node.sessions[1].seen))
            await server.node.sessions[1].peer.link.aclose("the test cuts this link")
        result = await training
    assert [e.device_samples for e in result.epochs] == [(80, 80), (80, 80)]
    assert [e.devices_lost for e in result.epochs] == [(), ()]
    reference = await simulate(CONFIG, clock=VirtualClock())
    got, want = result.model.state_dict(), reference.model.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7)
