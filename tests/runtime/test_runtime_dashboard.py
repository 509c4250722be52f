"""The dashboard's routes over real HTTP (aiopipe/runtime/dashboard.py): the page at ``/``
and its event stream at ``/events``, open as ``/status`` is, bounded by the guard as
``/status`` is; the stream pushes a finished epoch. The page in a real browser:
tests/runtime/test_runtime_dashboard_browser.py."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import time
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from aiopipe import Device, RunConfig, Server
from aiopipe.auth import mint_token
from aiopipe.runtime.dashboard import RETRY_MS
from aiopipe.runtime.guard import ConnectionLimits

SECRET = b"test-secret-of-32-bytes-at-least"
CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=80, batch_size=20, epochs=2,
                   split_point=2, parallel_batches=2, test_samples=40, seed=5)


def _base(server: Server) -> str:
    return server.dashboard_url.removesuffix("/")


async def _device(url: str, device_id: int) -> None:
    async with Device(url, device_id, token=mint_token(SECRET, device_id)) as device:
        await device.run()


async def _events(response: aiohttp.ClientResponse) -> Any:
    """(name, data) of each event of a stream, as they come."""
    name = ""
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield name, orjson.loads(line.removeprefix("data: "))


async def test_the_page_is_open_as_status_is_and_loads_nothing_else() -> None:
    async with (Server(CONFIG, token_secret=SECRET, join_timeout=60) as server,
                aiohttp.ClientSession() as http):
        base = _base(server)
        async with http.get(f"{base}/") as response:
            page, headers, status = await response.text(), response.headers, response.status
        async with http.get(f"{base}/status") as response:
            status_code = response.status
        async with http.get(f"{base}/ws") as response:  # the device route wants a token
            device_route = response.status
    assert (status, status_code, device_route) == (200, 200, 401)
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert headers["Connection"] == "close"  # [Note: bounded before authentication]
    # the one inline script is the only one the page may run, and nothing is fetched
    # from elsewhere: no src or href but data: URLs, no http(s) URL but SVG's namespace
    (script,) = re.findall(r"<script>(.*?)</script>", page, re.S)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in headers["Content-Security-Policy"]
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert all(url.startswith("data:") for url in re.findall(r'(?:src|href)="([^"]*)"', page))
    assert set(re.findall(r"https?://[^\s\"']+", page)) == {"http://www.w3.org/2000/svg"}
    assert '"colors":{"f":"#4C72B0"' in script  # the timeline's legend, inlined


@pytest.mark.slow  # (a training of about 3 s)
async def test_the_event_stream_pushes_each_epoch_when_it_ends() -> None:
    # devices at 10x: the run spans several of the feed's looks (POLL_S apart, longer
    # under load), so one of them sees it under way; at 1x a loaded host once ran both
    # epochs between two looks
    config = CONFIG.replace(device_slowdown=10.0)
    async with (Server(config, token_secret=SECRET, join_timeout=60) as server,
                aiohttp.ClientSession() as http,
                http.get(f"{_base(server)}/events") as response):  # no token, as /status
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        assert await response.content.readline() == f"retry: {RETRY_MS}\n".encode()
        events = _events(response)
        name, state = await anext(events)
        assert name == "state"
        assert [d["state"] for d in state["device_states"]] == ["waiting", "waiting"]
        seen: list[tuple[str, Any]] = []
        async with asyncio.TaskGroup() as tasks:
            for k in range(config.devices):
                tasks.create_task(_device(server.url, k))
            training = tasks.create_task(server.run())
            async with asyncio.timeout(60):  # to the second epoch's timeline
                async for name, data in events:
                    seen.append((name, data))
                    if name == "timeline" and data["caption"].startswith("epoch 2,"):
                        break
            await training
    pushed = [data for name, data in seen if name == "epochs"]
    assert [e["epoch"] for data in pushed for e in data["epochs"]] == [1, 2]
    assert pushed[0]["from"] == 0
    assert pushed[0]["epochs"][0]["samples"] == 160
    states = [data for name, data in seen if name == "state"]
    assert any(s["connected"] == [0, 1] and s["epoch"] >= 1 for s in states)
    timelines = [data for name, data in seen if name == "timeline"]
    assert timelines
    assert {bar[1] for bar in timelines[-1]["bars"]} >= {"f", "u", "s", "d", "b"}


async def test_a_stream_ends_itself_cleanly_before_the_guard_would_cut_it() -> None:
    limits = ConnectionLimits(handshake_timeout=1.0)
    async with (Server(CONFIG, limits=limits) as server, aiohttp.ClientSession() as http):
        started = time.monotonic()
        async with http.get(f"{_base(server)}/events") as response:
            body = await response.read()  # a cut connection would raise here
        took = time.monotonic() - started
    assert 0.4 < took < 1.0  # `stream_margin`: half the handshake timeout here
    assert body.startswith(b"retry: ")
    assert body.endswith(b"\n\n")
    assert b"event: state\n" in body


async def test_a_stream_ends_by_its_connection_s_deadline_not_its_request_s() -> None:
    # a browser sends the request on a connection it opened earlier; the guard counts
    # from the accept
    limits = ConnectionLimits(handshake_timeout=2.0)  # a stream ends 1 s before
    async with Server(CONFIG, limits=limits) as server:
        port = int(server.url.rsplit(":", 1)[1].removesuffix("/ws"))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.7)
        asked = time.monotonic()
        writer.write(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = await reader.read()  # to the end: the server closes
        took = time.monotonic() - asked
        writer.close()
        await writer.wait_closed()
    assert took < 0.6
    assert answer.startswith(b"HTTP/1.1 200 OK")
    assert answer.endswith(b"\r\n0\r\n\r\n")  # the chunked body's proper end


async def test_streams_end_when_the_server_closes() -> None:
    async with aiohttp.ClientSession() as http:
        async with Server(CONFIG) as server:  # its streams last 8 s
            response = await http.get(f"{_base(server)}/events")
            await response.content.readline()
            closing = time.monotonic()
        took = time.monotonic() - closing
        await response.read()
        response.close()
    assert took < 3.0


async def test_a_mounted_dashboard_lives_under_its_prefix() -> None:
    server = Server(CONFIG, host=None)
    app = web.Application()
    server.add_routes(app, prefix="/run")
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/run", allow_redirects=False) as r:
                redirect = (r.status, r.headers["Location"])
            async with http.get(f"http://127.0.0.1:{port}/run/") as r:
                page = r.status
    finally:
        await runner.cleanup()
    assert redirect == (302, "/run/")
    assert page == 200


async def test_the_dashboard_s_address_is_the_server_s_over_http() -> None:
    server = Server(CONFIG, host="127.0.0.1", port=0)
    assert server.dashboard_url == ""
    async with server:
        assert server.dashboard_url == server.url.replace("ws://", "http://").removesuffix("ws")
