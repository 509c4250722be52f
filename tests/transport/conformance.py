"""The conformance suite every `Link` implementation passes.

The `link_pair` fixture yields a connected pair for each implementation: memory links on
the system clock, memory links on a virtual clock, and a real websocket over loopback
(an aiohttp server on 127.0.0.1 in the same event loop); and the pairs a fabric makes
when one endpoint dials another and that one accepts: a `MemoryFabric` in virtual time
with a different shape per ordered pair, and two websocket endpoints (each its own
site on 127.0.0.1). Each kind also runs "swapped",
with ``a`` and ``b`` exchanged, so both ends (client and server, for a websocket) are
exercised as sender and as closer. ``test_transport_conformance.py`` collects the tests.

Conventions the suite relies on (see `aiopipe.transport.base`): a websocket's ``aclose``
waits for the peer to read up to the close frame, so a test that closes one end keeps
the other end receiving at the same time.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web
from late_clock import LateClock

from aiopipe.clock import Clock, SystemClock, VirtualClock, wait_for
from aiopipe.errors import ConfigError, LinkBrokenError, LinkClosedError, LocalProtocolError
from aiopipe.transport import (
    GuardedLink,
    Link,
    LinkSpec,
    MemoryFabric,
    WebSocketLink,
    accept_websocket,
    open_memory_link_pair,
    open_websocket_endpoint,
    open_websocket_link,
)

LIMIT = 32 * 2**20  # the frame limit of every pair in the suite
WS_CLOSE_TIMEOUT_S = 1.0

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True, slots=True)
class LinkPair:
    """Two connected ends and the clock their timing runs on."""

    a: Link
    b: Link
    clock: Clock


async def queued_send_returns(link: Link, clock: LateClock, frames: int,
                              frame_bytes: int, *, one_by_one: bool = False) -> list[float]:
    """``frames`` frames of ``frame_bytes``, all ready at once, sent on ``link``: when
    each send returned. Sent by that many tasks at once, or ``one_by_one`` by one task
    telling the link when they were ready (as the runtime's send loop does)."""
    returned: list[float] = []
    ready = clock.now()

    async def send() -> None:
        await link.send(bytes(frame_bytes), ready_at=ready if one_by_one else None)
        returned.append(clock.now())

    if one_by_one:
        for _ in range(frames):
            await send()
    else:
        await asyncio.gather(*(send() for _ in range(frames)))
    return returned


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    """Run ``app`` on 127.0.0.1 (a free port); yield its base URL."""
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def open_websocket_pair(
    clock: Clock,
    *,
    client_limit: int | None = LIMIT,
    server_limit: int | None = LIMIT,
    client_shaping: LinkSpec | None = None,
    server_shaping: LinkSpec | None = None,
    token: str | None = None,
    close_timeout: float = WS_CLOSE_TIMEOUT_S,
    seen: list[dict[str, str]] | None = None,
) -> AsyncIterator[tuple[WebSocketLink, WebSocketLink]]:
    """Yield ``(client, server)`` links of one websocket over loopback; close both after.

    ``seen`` collects the handshake request headers the server got.
    """
    accepted: asyncio.Queue[WebSocketLink] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        if seen is not None:
            seen.append(dict(request.headers))
        link = await accept_websocket(
            request,
            clock=clock,
            max_frame_bytes=server_limit,
            shaping=server_shaping,
            close_timeout=close_timeout,
        )
        accepted.put_nowait(link)
        await done.wait()
        await link.aclose()
        return link.response

    app = web.Application()
    app.router.add_get("/ws", handler)
    async with serve(app) as base:
        try:
            async with open_websocket_link(
                f"{base}/ws",
                clock=clock,
                token=token,
                max_frame_bytes=client_limit,
                shaping=client_shaping,
                close_timeout=close_timeout,
            ) as client:
                server = await accepted.get()
                try:
                    yield client, server
                finally:
                    # Close both ends at once: each acknowledges the other's close frame.
                    await asyncio.gather(client.aclose(), server.aclose())
        finally:
            done.set()


@pytest.fixture(
    params=[
        "memory-system",
        "memory-system-swapped",
        "memory-virtual",
        "memory-virtual-swapped",
        "websocket",
        "websocket-swapped",
        "fabric-memory-virtual",
        "fabric-memory-virtual-swapped",
        "fabric-websocket",
        "fabric-websocket-swapped",
    ]
)
async def link_pair(request: pytest.FixtureRequest) -> AsyncIterator[LinkPair]:
    """A connected pair of every Link implementation (see the module docstring)."""
    kind: str = request.param
    swapped = kind.endswith("-swapped")
    a: Link
    b: Link
    if kind.startswith("memory-system"):
        clock: Clock = SystemClock()
        a, b = open_memory_link_pair(
            clock,
            a_to_b=LinkSpec(8e9, 0.001),
            b_to_a=LinkSpec(4e9, 0.002),
            max_frame_bytes=LIMIT,
        )
        yield LinkPair(b, a, clock) if swapped else LinkPair(a, b, clock)
        await asyncio.gather(a.aclose(), b.aclose())
    elif kind.startswith("memory-virtual"):
        virtual = VirtualClock()
        a, b = open_memory_link_pair(
            virtual,
            a_to_b=LinkSpec(10e6, 0.02),
            b_to_a=LinkSpec(25e6, 0.02),
            max_frame_bytes=LIMIT,
        )
        yield LinkPair(b, a, virtual) if swapped else LinkPair(a, b, virtual)
        await asyncio.gather(a.aclose(), b.aclose())
        await virtual.aclose()
    elif kind.startswith("fabric-memory"):
        virtual = VirtualClock()
        fabric = MemoryFabric(
            virtual,
            default=LinkSpec(1e6, 0.5),  # never applied: a and b have shapes of their own
            links={("a", "b"): LinkSpec(10e6, 0.02), ("b", "a"): LinkSpec(40e6, 0.005)},
            max_frame_bytes=LIMIT,
        )
        at_a, at_b = fabric.endpoint("a"), fabric.endpoint("b")
        async with at_a.dial(at_b.address) as a:
            b = await at_b.accept()
            yield LinkPair(b, a, virtual) if swapped else LinkPair(a, b, virtual)
            await asyncio.gather(a.aclose(), b.aclose())
        await asyncio.gather(at_a.aclose(), at_b.aclose())
        await virtual.aclose()
    elif kind.startswith("fabric-websocket"):
        clock = SystemClock()
        async with (
            open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=LIMIT,
                                    close_timeout=WS_CLOSE_TIMEOUT_S) as site_a,
            open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=LIMIT,
                                    close_timeout=WS_CLOSE_TIMEOUT_S) as site_b,
            site_a.dial(site_b.address) as a,
        ):
            b = await site_b.accept()
            assert isinstance(b, GuardedLink)
            b.admit("a")  # as accept_peer would: the link's own frame limit from now on
            try:
                yield LinkPair(b, a, clock) if swapped else LinkPair(a, b, clock)
            finally:
                await asyncio.gather(a.aclose(), b.aclose())
    else:
        clock = SystemClock()
        async with open_websocket_pair(clock) as (client, server):
            yield LinkPair(server, client, clock) if swapped else LinkPair(client, server, clock)


def _frames(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.choice((0, 1, 17, 300, 5000, 70_000))) for _ in range(count)]


async def _receive_n(link: Link, count: int) -> list[bytes]:
    return [await link.receive() for _ in range(count)]


async def _send_all(link: Link, frames: list[bytes]) -> None:
    for frame in frames:
        await link.send(frame)


async def _close_while_peer_receives(closer: Link, peer: Link, reason: str = "") -> LinkBrokenError:
    """Close ``closer`` while ``peer`` receives; return the error the peer's receive got."""
    async with asyncio.TaskGroup() as tg:
        tg.create_task(closer.aclose(reason))
        with pytest.raises(LinkBrokenError) as info:
            await peer.receive()
    return info.value


async def _yield_a_few(times: int = 5) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


async def test_order_preserved(link_pair: LinkPair) -> None:
    a, b = link_pair.a, link_pair.b
    frames = [bytes([i % 256]) * (i * 37) for i in range(60)]
    async with asyncio.TaskGroup() as tg:
        tg.create_task(_send_all(a, frames))
        received = tg.create_task(_receive_n(b, len(frames)))
    assert received.result() == frames


async def test_both_directions_at_once(link_pair: LinkPair) -> None:
    a, b = link_pair.a, link_pair.b
    a_frames, b_frames = _frames(40, seed=1), _frames(40, seed=2)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(_send_all(a, a_frames))
        tg.create_task(_send_all(b, b_frames))
        at_b = tg.create_task(_receive_n(b, len(a_frames)))
        at_a = tg.create_task(_receive_n(a, len(b_frames)))
    assert at_b.result() == a_frames
    assert at_a.result() == b_frames


async def test_large_frame_passes_intact(link_pair: LinkPair) -> None:
    a, b = link_pair.a, link_pair.b
    big = random.Random(3).randbytes(20_000_000)
    assert b.last_received() == float("-inf")
    sent_at = link_pair.clock.now()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.send(big))
        received = tg.create_task(b.receive())
    assert received.result() == big
    assert sent_at <= b.last_received() <= link_pair.clock.now()
    await b.send(big[:1000])
    assert await a.receive() == big[:1000]


async def test_empty_frame(link_pair: LinkPair) -> None:
    a, b = link_pair.a, link_pair.b
    await a.send(b"")
    await a.send(b"after")
    assert await b.receive() == b""
    assert await b.receive() == b"after"


async def test_statistics_count_frames_and_bytes_per_direction(link_pair: LinkPair) -> None:
    a, b = link_pair.a, link_pair.b
    sizes = [0, 1, 1000, 70_000]
    for size in sizes:
        await a.send(bytes(size))
        assert len(await b.receive()) == size
    await b.send(b"xyz")
    assert await a.receive() == b"xyz"
    a_stats, b_stats = a.statistics(), b.statistics()
    assert (a_stats.sent.frames, a_stats.sent.bytes) == (4, sum(sizes))
    assert (b_stats.received.frames, b_stats.received.bytes) == (4, sum(sizes))
    assert (b_stats.sent.frames, b_stats.sent.bytes) == (1, 3)
    assert (a_stats.received.frames, a_stats.received.bytes) == (1, 3)
    for stats in (a_stats.sent, a_stats.received, b_stats.sent, b_stats.received):
        assert stats.busy_s >= 0.0


async def test_aclose_is_idempotent(link_pair: LinkPair) -> None:
    a, b = link_pair.a, link_pair.b
    await _close_while_peer_receives(a, b)
    await a.aclose()
    await a.aclose("again")
    await b.aclose()
    await b.aclose()


async def test_after_own_aclose_send_and_receive_raise_closed(link_pair: LinkPair) -> None:
    a, b = link_pair.a, link_pair.b
    await _close_while_peer_receives(a, b)
    with pytest.raises(LinkClosedError):
        await a.send(b"late")
    with pytest.raises(LinkClosedError):
        await a.receive()
    assert a.statistics().sent.frames == 0


async def test_own_aclose_wakes_pending_receive(link_pair: LinkPair) -> None:
    a, b = link_pair.a, link_pair.b
    pending = asyncio.ensure_future(a.receive())
    await _yield_a_few()
    assert not pending.done()
    await _close_while_peer_receives(a, b)
    with pytest.raises(LinkClosedError):
        await pending


async def test_after_peer_aclose_receive_drains_then_raises_broken(link_pair: LinkPair) -> None:
    a, b = link_pair.a, link_pair.b
    frames = [b"one", b"two", bytes(100_000)]
    await _send_all(a, frames)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.aclose("bye now"))
        received = await _receive_n(b, len(frames))
        with pytest.raises(LinkBrokenError, match="bye now"):
            await b.receive()
    assert received == frames
    with pytest.raises(LinkBrokenError):
        await b.receive()
    with pytest.raises(LinkBrokenError):
        await b.send(b"to nobody")


async def test_after_peer_aclose_send_raises_broken_eventually(link_pair: LinkPair) -> None:
    a, b, clock = link_pair.a, link_pair.b, link_pair.clock

    async def send_until_broken() -> int:
        for attempt in range(2000):
            try:
                await b.send(b"x" * 1000)
            except LinkBrokenError:
                return attempt
            await clock.sleep(0.01)
        raise AssertionError("send never failed after the peer closed")

    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.aclose())
        attempts = tg.create_task(send_until_broken())
    assert attempts.result() >= 0


async def test_oversize_frame_is_refused_and_link_stays_usable(link_pair: LinkPair) -> None:
    a, b = link_pair.a, link_pair.b
    with pytest.raises(LocalProtocolError, match=str(LIMIT)):
        await a.send(bytes(LIMIT + 1))
    await a.send(b"still fine")
    assert await b.receive() == b"still fine"
    assert a.statistics().sent.frames == 1


async def test_cancelled_receive_loses_no_frame(link_pair: LinkPair) -> None:
    a, b, clock = link_pair.a, link_pair.b, link_pair.clock
    with pytest.raises(TimeoutError):
        await wait_for(clock, b.receive(), 0.05)
    await a.send(b"later")
    assert await b.receive() == b"later"


async def test_reshape_is_taken_by_every_link(link_pair: LinkPair) -> None:
    """`Link.reshape` works on any link, whatever its kind: once shaped, ``send`` paces
    (its time measures the link), and frames sent around a reshape arrive in order."""
    a, b = link_pair.a, link_pair.b
    before, shaped, after = _frames(5, seed=4), _frames(5, seed=5), _frames(5, seed=6)
    async with asyncio.TaskGroup() as tg:
        received = tg.create_task(_receive_n(b, len(before) + len(shaped) + len(after)))
        await _send_all(a, before)
        a.reshape(LinkSpec(1e9, 0.001))
        assert a.times_the_wire()
        await _send_all(a, shaped)
        a.reshape(LinkSpec(None))
        await _send_all(a, after)
    assert received.result() == before + shaped + after
    with pytest.raises(ConfigError, match="LinkSpec"):
        a.reshape(1e9)  # type: ignore[arg-type]
