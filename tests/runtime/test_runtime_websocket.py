"""The real path: server and devices over aiohttp websockets (in one event loop here; the
multi-process path is tests/test_cli.py). It must compute exactly what the memory-link
simulation computes, and refuse strangers without disturbing the run."""

from __future__ import annotations

import asyncio

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
from aiopipe.clock import SystemClock
from aiopipe.protocol import ErrorMessage, Hello, decode, encode
from aiopipe.transport import open_websocket_link

TOKEN = "test-token"
CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=80, batch_size=20, epochs=2,
                   split_point=2, parallel_batches=2, test_samples=40, seed=5)


async def _device(url: str, device_id: int) -> None:
    async with Device(url, device_id, token=TOKEN) as device:
        await device.run()


async def _run_over_websockets(config: RunConfig) -> RunResult:
    async with (Server(config, token=TOKEN, join_timeout=60) as server,
                asyncio.TaskGroup() as tasks):
        for k in range(config.devices):
            tasks.create_task(_device(server.url, k))
        result = await server.run()
    return result


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
    async with Server(CONFIG, token=TOKEN, join_timeout=5) as server:
        for token in (None, "wrong"):
            with pytest.raises(AuthenticationError):
                async with open_websocket_link(server.url, clock=SystemClock(), token=token,
                                               max_frame_bytes=1 << 20):
                    pass


async def _stranger(url: str, first_frame: bytes) -> str:
    """Connect with a valid token, send one frame, return the server's answer."""
    async with open_websocket_link(url, clock=SystemClock(), token=TOKEN,
                                   max_frame_bytes=1 << 20) as link:
        await link.send(first_frame)
        answer = decode(await link.receive())
        assert isinstance(answer, ErrorMessage)
        return answer.message


async def test_strangers_are_refused_and_the_run_goes_on() -> None:
    async with Server(CONFIG, token=TOKEN, join_timeout=60) as server:
        answers = [
            await _stranger(server.url, b"not a frame at all"),
            await _stranger(server.url, encode(Hello(version=99, device_id=0))),
            await _stranger(server.url, encode(Hello(version=1, device_id=7))),
        ]

        async with asyncio.TaskGroup() as tasks:
            for k in range(CONFIG.devices):
                tasks.create_task(_device(server.url, k))
            training = tasks.create_task(server.run())
            await server.node.joined.wait()
            answers.append(await _stranger(server.url, encode(Hello(version=1, device_id=0))))
            result = await training
    assert "bad hello" in answers[0]
    assert "protocol version 99" in answers[1]
    assert "device id 7 is not in 0..1" in answers[2]
    assert "already connected" in answers[3]
    assert [e.samples for e in result.epochs] == [160, 160]


async def test_status_and_metrics_routes_describe_the_run() -> None:
    import aiohttp

    async with Server(CONFIG, token=TOKEN, join_timeout=60) as server:
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
    assert "aiopipe_epochs_finished 2" in metrics
    assert 'aiopipe_busy_seconds{resource="server"}' in metrics
    assert plain_status == 401  # no token: refused before anything else
