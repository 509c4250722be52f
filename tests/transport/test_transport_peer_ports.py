"""A device's peer port is guarded as the server's port is (aiopipe/transport/fabric.py,
`PEER_LIMITS`; [Note: bounded before authentication] in aiopipe/transport/guard.py), over
real sockets in one event loop: a frame above the handshake's size is refused before the
handshake, idle connections are closed at the deadline and beyond ``max_pending``, a flood
of silent upgrades does not keep an honest peer out, a peer holds at most
``max_per_device`` links, and a dial the listener turns away is tried again
([Note: a dial that is turned away] in aiopipe/transport/peering.py). Between processes,
in a real pipeline run: tests/test_peer_port_processes.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest

from aiopipe.auth import new_run_secret, pair_key
from aiopipe.clock import SystemClock
from aiopipe.errors import ConfigError, LinkBrokenError
from aiopipe.transport import (
    CHUNK_BYTES,
    PEER_LIMITS,
    ConnectionLimits,
    Link,
    WebSocketEndpoint,
    accept_peer,
    dial_peer,
    open_websocket_endpoint,
)

pytestmark = pytest.mark.timeout(60)

RUN = new_run_secret()
KEYS = {"a": pair_key(RUN, "a", "b")}
CLOCK = SystemClock()
MAX_FRAME = 1 << 30  # a device's own frame limit (aiopipe.api.Device)


@dataclass
class Listener:
    """Device b's peer port, with an accept loop like `PeerLinks`' running on it."""

    endpoint: WebSocketEndpoint
    admitted: list[tuple[str, Link]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, admitted: tuple[str, Link]) -> None:
        self.admitted.append(admitted)
        self.changed.set()

    async def wait_beyond(self, count: int) -> tuple[str, Link]:
        """The link admitted after the first ``count``."""
        while len(self.admitted) <= count:
            self.changed.clear()
            await self.changed.wait()
        return self.admitted[count]

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.endpoint.address.removeprefix("ws://").split("/")[0].split(":")
        return host, int(port)


@contextlib.asynccontextmanager
async def listening(limits: ConnectionLimits | None = PEER_LIMITS, *, backlog: int = 16,
                    accepting: bool = True) -> AsyncIterator[Listener]:
    async with open_websocket_endpoint("127.0.0.1", clock=CLOCK, max_frame_bytes=MAX_FRAME,
                                       close_timeout=1.0, limits=limits,
                                       backlog=backlog) as endpoint:
        listener = Listener(endpoint)

        async def accept_loop() -> None:
            while True:
                listener.add(await accept_peer(
                    endpoint, me="b", keys=KEYS, clock=CLOCK, timeout=10.0))

        loop = asyncio.ensure_future(accept_loop()) if accepting else None
        try:
            yield listener
        finally:
            if loop is not None:
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
            await asyncio.gather(*(link.aclose() for _, link in listener.admitted))


@contextlib.asynccontextmanager
async def dialer() -> AsyncIterator[WebSocketEndpoint]:
    async with open_websocket_endpoint("127.0.0.1", clock=CLOCK, max_frame_bytes=MAX_FRAME,
                                       close_timeout=1.0) as endpoint:
        yield endpoint


async def _closed_by_peer(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the other side closed this connection within ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(1 << 16):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


async def _honest_peer_is_admitted(listener: Listener, a: WebSocketEndpoint) -> None:
    """Peer a links to b, and a frame far above the handshake's size then passes."""
    before = len(listener.admitted)
    async with (dial_peer(a, listener.endpoint.address, me="a", peer="b", key=KEYS["a"],
                          clock=CLOCK, timeout=10.0) as link, asyncio.timeout(10)):
        name, theirs = await listener.wait_beyond(before)
        assert name == "a"
        big = bytes(3 * CHUNK_BYTES + 5)  # an activation of a few MiB
        await link.send(big)
        assert await theirs.receive() == big


@pytest.mark.slow
async def test_a_big_frame_before_the_handshake_is_refused_at_its_first_part() -> None:
    """Today's port took the whole frame (up to the link's 1 GiB) before its handshake
    looked at it."""
    async with listening() as listener, dialer() as a, aiohttp.ClientSession() as http:
        ws = await http.ws_connect(listener.endpoint.address, max_msg_size=0)
        claimed = 200 * CHUNK_BYTES
        await ws.send_bytes(b"APC\x01" + claimed.to_bytes(8, "little") + bytes(CHUNK_BYTES))
        async with asyncio.timeout(5):  # no second part is awaited
            closing = await ws.receive()
        assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
        await ws.close()
        await _honest_peer_is_admitted(listener, a)


@pytest.mark.slow
async def test_idle_connections_beyond_max_pending_close_the_oldest() -> None:
    """Today's port held every idle connection for ever."""
    async with listening() as listener, dialer() as a:
        idle = [await asyncio.open_connection(*listener.host_port)
                for _ in range(PEER_LIMITS.max_pending + 8)]
        await asyncio.sleep(0.2)
        early = [await _closed_by_peer(r, 0.05) for r, _ in idle]
        assert early == [True] * 8 + [False] * PEER_LIMITS.max_pending
        assert listener.endpoint.guard is not None
        assert listener.endpoint.guard.evicted == 8
        await _honest_peer_is_admitted(listener, a)
        for _, writer in idle:
            writer.close()


@pytest.mark.slow
async def test_idle_and_slow_connections_are_closed_at_the_handshake_timeout() -> None:
    limits = ConnectionLimits(handshake_timeout=0.5, max_pending=8, hello_frame_bytes=1024)
    async with listening(limits) as listener, dialer() as a:
        host, port = listener.host_port
        idle = [await asyncio.open_connection(host, port) for _ in range(3)]
        slow_reader, slow_writer = await asyncio.open_connection(host, port)
        slow_writer.write(b"GET /peer HTTP/1.1\r\n")  # and the rest never comes
        started = time.monotonic()
        assert all([await _closed_by_peer(r, 2.0) for r, _ in [*idle,
                                                               (slow_reader, slow_writer)]])
        assert time.monotonic() - started < 1.5
        async with dial_peer(a, listener.endpoint.address, me="a", peer="b", key=KEYS["a"],
                             clock=CLOCK) as link:
            await asyncio.sleep(1.0)  # past the deadline: an admitted link has none
            [(_, theirs)] = listener.admitted
            await theirs.send(b"still here")
            assert await link.receive() == b"still here"
        for _, writer in [*idle, (slow_reader, slow_writer)]:
            writer.close()


async def _silent_upgrade(http: aiohttp.ClientSession, url: str,
                          into: list[aiohttp.ClientWebSocketResponse]) -> None:
    with contextlib.suppress(aiohttp.ClientError, ConnectionError):
        into.append(await http.ws_connect(
            url, timeout=aiohttp.ClientWSTimeout(ws_close=0.5)))


@pytest.mark.slow
async def test_a_flood_of_silent_upgrades_does_not_keep_an_honest_peer_out() -> None:
    """Today: 64 in handshakes and 16 queued, and the honest dial got HTTP 503."""
    async with listening() as listener, dialer() as a, aiohttp.ClientSession() as http:
        flood: list[aiohttp.ClientWebSocketResponse] = []
        for _ in range(100):
            await _silent_upgrade(http, listener.endpoint.address, flood)
        await _honest_peer_is_admitted(listener, a)
        await asyncio.gather(*(ws.close() for ws in flood))


@pytest.mark.slow
async def test_a_peer_holds_at_most_max_per_device_links() -> None:
    async with listening() as listener, dialer() as a, contextlib.AsyncExitStack() as stack:
        links = [await stack.enter_async_context(dial_peer(
            a, listener.endpoint.address, me="a", peer="b", key=KEYS["a"], clock=CLOCK))
            for _ in range(PEER_LIMITS.max_per_device + 1)]
        third = links[-1]
        with pytest.raises(LinkBrokenError, match="max_per_device"):
            async with asyncio.timeout(5):
                await third.receive()
        assert [name for name, _ in listener.admitted] == ["a"] * PEER_LIMITS.max_per_device
        # one closes, and its place is free again
        _, first = listener.admitted.pop(0)
        await first.aclose()
        await asyncio.sleep(0.1)
        await _honest_peer_is_admitted(listener, a)


@pytest.mark.slow
async def test_a_dial_turned_away_with_http_503_tries_again() -> None:
    """A one-place accept queue, taken by a stranger while nobody accepts: the honest
    dial gets HTTP 503 until the listener starts accepting (today: it failed at once)."""
    async with (listening(backlog=1, accepting=False) as listener, dialer() as a,
                aiohttp.ClientSession() as http):
        flood: list[aiohttp.ClientWebSocketResponse] = []
        await _silent_upgrade(http, listener.endpoint.address, flood)
        with pytest.raises(LinkBrokenError, match="HTTP 503"):
            async with a.dial(listener.endpoint.address):
                pass
        dialing = asyncio.ensure_future(_honest_peer_is_admitted(listener, a))
        await asyncio.sleep(0.5)
        assert not dialing.done()
        accepting = asyncio.ensure_future(accept_peer(
            listener.endpoint, me="b", keys=KEYS, clock=CLOCK, timeout=10.0))
        listener.add(await accepting)
        await dialing
        await asyncio.gather(*(ws.close() for ws in flood))


async def test_a_dial_that_reaches_nobody_or_a_wrong_path_fails_at_once() -> None:
    """Only a listener that turns us away for now is tried again: a peer that is gone is
    reported at once (the runtime recovers from it), and so is a wrong address."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    async with listening() as listener, dialer() as a:
        wrong_path = listener.endpoint.address.replace("/peer", "/nope")
        for address, error in ((f"ws://127.0.0.1:{port}/peer", "cannot connect"),
                               (wrong_path, "HTTP 404")):
            started = time.monotonic()
            with pytest.raises(LinkBrokenError, match=error):
                async with dial_peer(a, address, me="a", peer="b", key=KEYS["a"],
                                     clock=CLOCK, timeout=10.0):
                    pass
            assert time.monotonic() - started < 2.0


async def test_an_unguarded_endpoint_and_bad_limits() -> None:
    async with listening(None) as listener:
        assert listener.endpoint.guard is None
    with pytest.raises(ConfigError, match="ConnectionLimits"):
        async with open_websocket_endpoint("127.0.0.1", clock=CLOCK, max_frame_bytes=None,
                                           limits={"max_pending": 3}):  # type: ignore[arg-type]
            pass
