"""Websocket links: shaping, credentials, refused handshakes, misbehaving peers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import WSCloseCode, web
from conformance import open_websocket_pair, queued_send_returns, serve
from late_clock import LateClock

from aiopipe.clock import SystemClock
from aiopipe.errors import (
    AuthenticationError,
    ConfigError,
    FrameTooLargeError,
    LinkBrokenError,
    LinkClosedError,
    RemoteProtocolError,
)
from aiopipe.transport import CHUNK_BYTES, LinkSpec, accept_websocket, open_websocket_link
from aiopipe.transport.wire_timer import wire_timing_available

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def app_with(handler: Handler) -> web.Application:
    app = web.Application()
    app.router.add_get("/ws", handler)
    return app


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/ws"


async def test_shaping_paces_frames_at_the_link_rate() -> None:
    clock = SystemClock()
    shaping = LinkSpec(20e6)  # 500 kB = 0.2 s on the wire
    async with open_websocket_pair(clock, client_shaping=shaping) as (client, server):
        start = clock.now()
        await client.send(bytes(500_000))
        first = clock.now() - start
        await client.send(bytes(500_000))
        both = clock.now() - start
        assert len(await server.receive()) == 500_000
        assert len(await server.receive()) == 500_000
        # Lower bounds on sleeps, not speed claims: they cannot be flaky.
        assert first >= 0.9 * 0.2
        assert both >= 0.9 * 0.4
        assert client.statistics().sent.busy_s == pytest.approx(0.4)
        # The unshaped direction counts the time spent inside send.
        await server.send(b"ack")
        assert await client.receive() == b"ack"
        assert 0.0 <= server.statistics().sent.busy_s < 5.0
        # the shaped end's send time measures its link (the re-planner relies on it);
        # an unshaped end's where acknowledgements time it (Linux)
        assert client.times_the_wire()
        assert server.times_the_wire() == wire_timing_available()
        client.reshape(LinkSpec(None))
        assert client.times_the_wire() == wire_timing_available()


async def test_late_wake_ups_do_not_slow_a_shaped_websocket() -> None:
    # as for memory links ([Note: wire slots do not drift])
    clock = LateClock(late=0.01)
    async with open_websocket_pair(clock, client_shaping=LinkSpec(1e6)) as (client, server):
        returned = await queued_send_returns(client, clock, frames=4, frame_bytes=12_500)
        assert returned == pytest.approx([0.11, 0.21, 0.31, 0.41])
        returned = await queued_send_returns(client, clock, frames=4, frame_bytes=12_500,
                                             one_by_one=True)
        assert returned == pytest.approx([0.52, 0.62, 0.72, 0.82])  # ready at 0.41
        for _ in range(8):
            assert len(await server.receive()) == 12_500


async def test_bearer_token_reaches_the_server() -> None:
    clock = SystemClock()
    seen: list[dict[str, str]] = []
    async with open_websocket_pair(clock, token="s3cret", seen=seen) as (client, server):
        await client.send(b"hi")
        assert await server.receive() == b"hi"
    async with open_websocket_pair(clock, seen=seen):
        pass
    assert seen[0]["Authorization"] == "Bearer s3cret"
    assert "Authorization" not in seen[1]
    # Per-message compression is never offered.
    assert "Sec-WebSocket-Extensions" not in seen[0]


@pytest.mark.parametrize("status", [401, 403])
async def test_refused_credentials_raise_authentication_error(status: int) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, text="no\n")

    async with serve(app_with(handler)) as base:
        with pytest.raises(AuthenticationError, match=str(status)):
            async with open_websocket_link(
                ws_url(base), clock=SystemClock(), token="wrong", max_frame_bytes=1000
            ):
                pytest.fail("connected without valid credentials")


async def test_other_refusals_raise_link_broken_naming_the_url() -> None:
    async with serve(web.Application()) as base:  # no routes: 404
        url = ws_url(base)
        with pytest.raises(LinkBrokenError, match=f"{url}.*404"):
            async with open_websocket_link(url, clock=SystemClock(), max_frame_bytes=1000):
                pytest.fail("connected to a missing route")


async def test_nothing_listening_raises_link_broken_naming_the_url() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"ws://127.0.0.1:{port}/ws"
    with pytest.raises(LinkBrokenError, match=url):
        async with open_websocket_link(url, clock=SystemClock(), max_frame_bytes=1000):
            pytest.fail("connected to nothing")


@pytest.mark.parametrize("url", ["not a url", "ftp://example.invalid/ws"])
async def test_invalid_urls_raise_config_error(url: str) -> None:
    with pytest.raises(ConfigError):
        async with open_websocket_link(url, clock=SystemClock(), max_frame_bytes=1000):
            pytest.fail("connected to an invalid URL")


async def test_text_frame_raises_remote_protocol_error_and_closes_with_1003() -> None:
    clock = SystemClock()
    close_codes: list[int | None] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str("hello")
        msg = await ws.receive()  # the client's close frame
        close_codes.append(msg.data)
        await ws.close()
        return ws

    async with (
        serve(app_with(handler)) as base,
        open_websocket_link(ws_url(base), clock=clock, max_frame_bytes=1000) as link,
    ):
        with pytest.raises(RemoteProtocolError, match="text frame"):
            await link.receive()
        with pytest.raises(LinkBrokenError, match="text frame"):
            await link.receive()
        with pytest.raises(LinkBrokenError):
            await link.send(b"x")
    assert close_codes == [WSCloseCode.UNSUPPORTED_DATA]


async def test_frame_above_the_limit_raises_frame_too_large() -> None:
    clock = SystemClock()
    limit = 1 << 20

    async def handler(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        await ws.send_bytes(bytes(limit))  # exactly at the limit: fine
        await ws.send_bytes(bytes(limit + 1))
        await ws.receive()
        return ws

    async with (
        serve(app_with(handler)) as base,
        open_websocket_link(ws_url(base), clock=clock, max_frame_bytes=limit) as link,
    ):
        assert len(await link.receive()) == limit
        with pytest.raises(FrameTooLargeError, match=str(limit)):
            await link.receive()
        with pytest.raises(LinkBrokenError):
            await link.receive()


async def test_frames_above_aiohttp_default_limit_pass_to_the_server() -> None:
    clock = SystemClock()
    async with open_websocket_pair(clock, server_limit=8 << 20) as (client, server):
        big = bytes(range(256)) * (6 << 12)  # 6 MiB > aiohttp's 4 MiB default
        async with asyncio.TaskGroup() as tg:
            tg.create_task(client.send(big))
            received = tg.create_task(server.receive())
        assert received.result() == big


async def test_server_never_accepts_compression() -> None:
    clock = SystemClock()
    done = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        link = await accept_websocket(request, clock=clock, max_frame_bytes=1000)
        await done.wait()
        await link.aclose()
        return link.response

    async with (
        serve(app_with(handler)) as base,
        aiohttp.ClientSession() as session,
        session.ws_connect(ws_url(base), compress=15) as ws,
    ):
        assert ws.compress == 0
        done.set()


async def test_accept_refuses_a_plain_http_request() -> None:
    errors: list[Exception] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            link = await accept_websocket(request, clock=SystemClock(), max_frame_bytes=1000)
        except RemoteProtocolError as exc:
            errors.append(exc)
            return web.Response(status=400)
        return link.response

    async with (
        serve(app_with(handler)) as base,
        aiohttp.ClientSession() as session,
        session.get(f"{base}/ws") as response,
    ):
        assert response.status == 400
    assert len(errors) == 1


async def test_aclose_is_bounded_when_the_peer_never_reads() -> None:
    clock = SystemClock()
    async with open_websocket_pair(clock, close_timeout=0.3) as (client, server):
        start = clock.now()
        await client.aclose()
        assert clock.now() - start < 5.0  # bounded by close_timeout (0.3 s), not hung
        with pytest.raises(LinkBrokenError):
            await server.receive()


async def test_lost_connection_raises_link_broken() -> None:
    clock = SystemClock()

    async def handler(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_bytes(b"first")
        assert request.transport is not None
        request.transport.abort()
        return ws

    async with (
        serve(app_with(handler)) as base,
        open_websocket_link(ws_url(base), clock=clock, max_frame_bytes=1000) as link,
    ):
        assert await link.receive() == b"first"
        with pytest.raises(LinkBrokenError, match=r"lost|closed"):
            await link.receive()


async def test_long_close_reason_is_truncated_to_fit_a_close_frame() -> None:
    clock = SystemClock()
    async with open_websocket_pair(clock) as (client, server):
        reason = "é" * 100  # 200 bytes of UTF-8
        async with asyncio.TaskGroup() as tg:
            tg.create_task(client.aclose(reason))
            with pytest.raises(LinkBrokenError, match="é" * 61) as info:
                await server.receive()
        assert "é" * 62 not in str(info.value)


async def test_client_side_link_has_no_server_response() -> None:
    clock = SystemClock()
    async with open_websocket_pair(clock) as (client, server):
        assert isinstance(server.response, web.WebSocketResponse)
        with pytest.raises(ConfigError):
            _ = client.response


async def test_silent_server_hits_the_connect_timeout() -> None:
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    async with server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/ws"
        with pytest.raises(LinkBrokenError, match=f"{url}.*0.2 s"):
            async with open_websocket_link(
                url, clock=SystemClock(), max_frame_bytes=1000, connect_timeout=0.2
            ):
                pytest.fail("connected to a silent server")


async def test_aclose_cuts_a_shaping_wait_short() -> None:
    clock = SystemClock()
    slow = LinkSpec(1e6)  # 1 MB would take 8 s
    async with open_websocket_pair(clock, client_shaping=slow) as (client, server):
        start = clock.now()

        async def close_soon() -> None:
            await clock.sleep(0.05)
            await client.aclose()

        async def peer_sees_close() -> None:
            with pytest.raises(LinkBrokenError):
                await server.receive()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(close_soon())
            tg.create_task(peer_sees_close())
            with pytest.raises(LinkClosedError):
                await client.send(bytes(1_000_000))
        assert clock.now() - start < 4.0


def _first_part(size: int) -> bytes:
    return b"APC\x01" + size.to_bytes(8, "little") + bytes(CHUNK_BYTES)


async def test_a_large_frame_arrives_in_parts_and_each_part_is_a_sign_of_life() -> None:
    clock = SystemClock()
    rest_sent = asyncio.Event()
    go_on = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_bytes(_first_part(CHUNK_BYTES + 5))
        await go_on.wait()  # a slow uplink: the frame's end is still on its way
        await ws.send_bytes(b"APC\x02" + b"12345")
        rest_sent.set()
        await ws.receive()
        return ws

    async with (
        serve(app_with(handler)) as base,
        open_websocket_link(ws_url(base), clock=clock, max_frame_bytes=4 << 20) as link,
    ):
        receiving = asyncio.create_task(link.receive())
        async with asyncio.timeout(10):
            while link.last_received() == float("-inf"):  # noqa: ASYNC110 (no event to wait on)
                await asyncio.sleep(0.01)
        assert not receiving.done()  # part of the frame arrived, and the watchdog sees it
        go_on.set()
        assert await receiving == bytes(CHUNK_BYTES) + b"12345"
        assert rest_sent.is_set()
        assert link.statistics().received.frames == 1


@pytest.mark.parametrize(("parts", "error", "match"), [
    ([_first_part(3 << 20)], FrameTooLargeError, str(3 << 20)),  # refused before buffering
    ([b"APC\x02" + bytes(10)], RemoteProtocolError, "out of order"),
    ([_first_part(CHUNK_BYTES + 5), b"plain frame"], RemoteProtocolError, "out of order"),
    ([_first_part(CHUNK_BYTES + 5), b"APC\x02" + bytes(6)], RemoteProtocolError, "wrong size"),
    ([b"APC\x01" + (10).to_bytes(8, "little") + bytes(10)], RemoteProtocolError, "malformed"),
])
async def test_bad_frame_parts_are_refused(parts: list[bytes], error: type[Exception],
                                           match: str) -> None:
    clock = SystemClock()

    async def handler(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        for part in parts:
            await ws.send_bytes(part)
        await ws.receive()
        return ws

    async with (
        serve(app_with(handler)) as base,
        open_websocket_link(ws_url(base), clock=clock, max_frame_bytes=2 << 20) as link,
    ):
        with pytest.raises(error, match=match):
            await link.receive()
        with pytest.raises(LinkBrokenError):
            await link.receive()
