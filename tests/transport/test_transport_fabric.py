"""Endpoints of the fabric: shapes per ordered pair, dialing and accepting, closing.

The shared Link tests run on fabric-made pairs too (conformance.py); these are about
what only an endpoint does.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from aiopipe.clock import SystemClock, VirtualClock
from aiopipe.errors import ConfigError, LinkBrokenError, LinkClosedError
from aiopipe.transport import (
    Link,
    LinkSpec,
    MemoryFabric,
    WebSocketEndpoint,
    open_websocket_endpoint,
)
from aiopipe.transport.wire_timer import wire_timing_available

pytestmark = pytest.mark.timeout(30)

MB_1_25 = 1_250_000  # 10 Mbit/s: 1.0 s on the wire; 50 Mbit/s: 0.2 s


@pytest.fixture
async def clock() -> VirtualClock:
    return VirtualClock()


# -- memory ----------------------------------------------------------------------------


async def _seconds_to_send(clock: VirtualClock, sender: Link, receiver: Link,
                           size: int) -> float:
    """Virtual seconds from sending a frame of ``size`` bytes to receiving it."""
    start = clock.now()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(sender.send(bytes(size)))
        assert len(await receiver.receive()) == size
    return clock.now() - start


async def test_memory_links_are_shaped_per_ordered_pair_in_virtual_time(
    clock: VirtualClock,
) -> None:
    fabric = MemoryFabric(
        clock,
        default=LinkSpec(1e6),
        links={("a", "b"): LinkSpec(10e6, 0.02), ("b", "a"): LinkSpec(50e6)},
    )
    a, b, c = fabric.endpoint("a"), fabric.endpoint("b"), fabric.endpoint("c")
    async with a.dial(b.address) as at_a:
        at_b = await b.accept()
        assert await _seconds_to_send(clock, at_a, at_b, MB_1_25) == pytest.approx(1.02)
        assert await _seconds_to_send(clock, at_b, at_a, MB_1_25) == pytest.approx(0.2)
        await at_b.aclose()
    # the shape belongs to the ordered pair, not to who dialed
    async with b.dial(a.address) as from_b:
        to_a = await a.accept()
        assert await _seconds_to_send(clock, from_b, to_a, MB_1_25) == pytest.approx(0.2)
        await to_a.aclose()
    # any other pair gets the default
    async with c.dial(a.address) as from_c:
        to_a = await a.accept()
        assert await _seconds_to_send(clock, from_c, to_a, 125_000) == pytest.approx(1.0)
        await to_a.aclose()
    assert fabric.shape("a", "b") == LinkSpec(10e6, 0.02)
    assert fabric.shape("c", "b") == LinkSpec(1e6)
    await asyncio.gather(a.aclose(), b.aclose(), c.aclose())
    await clock.aclose()


async def test_memory_endpoint_accepts_several_dials_in_order(clock: VirtualClock) -> None:
    fabric = MemoryFabric(clock)
    hub, a, c = fabric.endpoint("hub"), fabric.endpoint("a"), fabric.endpoint("c")
    assert hub.address == "memory://hub"
    async with a.dial(hub.address) as a1, c.dial(hub.address) as c1, a.dial(hub.address) as a2:
        accepted = [await hub.accept() for _ in range(3)]
        for index, dialed in enumerate((a1, c1, a2)):
            await dialed.send(f"from {index}".encode())
        assert [await link.receive() for link in accepted] == [b"from 0", b"from 1", b"from 2"]
        await accepted[1].send(b"to c")
        assert await c1.receive() == b"to c"
        for link in accepted:
            await link.aclose()
    await asyncio.gather(hub.aclose(), a.aclose(), c.aclose())
    await clock.aclose()


async def test_dialing_an_unknown_or_closed_memory_address_is_a_broken_link(
    clock: VirtualClock,
) -> None:
    fabric = MemoryFabric(clock)
    a, b = fabric.endpoint("a"), fabric.endpoint("b")
    with pytest.raises(LinkBrokenError, match="memory://nobody"):
        async with a.dial("memory://nobody"):
            pass
    await b.aclose()
    with pytest.raises(LinkBrokenError, match="memory://b"):
        async with a.dial("memory://b"):
            pass
    with pytest.raises(ConfigError, match="memory://<name>"):
        async with a.dial("ws://127.0.0.1:1/peer"):
            pass
    await a.aclose()


async def test_aclose_wakes_a_pending_accept_and_closes_incoming_links(
    clock: VirtualClock,
) -> None:
    fabric = MemoryFabric(clock)
    a, b = fabric.endpoint("a"), fabric.endpoint("b")
    async with a.dial(b.address) as accepted_one, a.dial(b.address) as waiting_one:
        accepted = await b.accept()
        pending = asyncio.ensure_future(b.accept())
        await asyncio.sleep(0)
        assert pending.done()  # the second link was waiting already
        pending = asyncio.ensure_future(b.accept())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not pending.done()
        await b.aclose()
        with pytest.raises(LinkClosedError, match="memory://b"):
            await pending
        with pytest.raises(LinkClosedError):
            await b.accept()
        await b.aclose()  # idempotent
        for dialed in (accepted_one, waiting_one):
            with pytest.raises(LinkBrokenError, match="the endpoint closed"):
                await dialed.receive()
        with pytest.raises(LinkClosedError):
            await accepted.receive()
    await a.aclose()


async def test_endpoint_names_are_unique_while_open(clock: VirtualClock) -> None:
    fabric = MemoryFabric(clock)
    first = fabric.endpoint("dev-0")
    with pytest.raises(ConfigError, match="already has an endpoint named 'dev-0'"):
        fabric.endpoint("dev-0")
    await first.aclose()
    again = fabric.endpoint("dev-0")  # a restarted node takes its name back
    async with fabric.endpoint("x").dial("memory://dev-0"):
        assert (await again.accept()) is not None
    for bad in ("", "a b", "é", "x" * 65, "a/b"):
        with pytest.raises(ConfigError, match="node name"):
            fabric.endpoint(bad)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"default": 10e6}, "default must be a LinkSpec"),
        ({"links": {("a",): LinkSpec(None)}}, "pair"),
        ({"links": {("a", "b"): 10e6}}, "must be a LinkSpec"),
        ({"links": {("a", "b c"): LinkSpec(None)}}, "node name"),
        ({"max_frame_bytes": -1}, "max_frame_bytes"),
    ],
)
def test_memory_fabric_refuses_bad_options(options: dict[str, object], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        MemoryFabric(SystemClock(), **options)  # type: ignore[arg-type]


# -- websocket -------------------------------------------------------------------------


async def test_websocket_endpoints_dial_and_accept_each_other() -> None:
    clock = SystemClock()
    async with (
        open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=1 << 20) as a,
        open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=1 << 20) as b,
    ):
        assert isinstance(a, WebSocketEndpoint)
        assert a.address.startswith("ws://127.0.0.1:")
        assert a.address.endswith("/peer")
        assert a.address != b.address
        async with a.dial(b.address, shaping=LinkSpec(80e6)) as to_b, b.dial(a.address) as to_a:
            from_a, from_b = await b.accept(), await a.accept()
            assert to_b.times_the_wire()
            assert from_a.times_the_wire() == wire_timing_available()
            await to_b.send(b"a->b")
            await to_a.send(b"b->a")
            assert await from_a.receive() == b"a->b"
            assert await from_b.receive() == b"b->a"
            await from_a.send(b"reply")
            assert await to_b.receive() == b"reply"
            await asyncio.gather(from_a.aclose(), from_b.aclose(), to_a.aclose(), to_b.aclose())


async def test_websocket_backlog_overflow_is_refused_with_http_503() -> None:
    clock = SystemClock()
    async with (
        open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=1024) as a,
        open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=1024, backlog=2) as b,
        a.dial(b.address) as first,
        a.dial(b.address) as second,
    ):
        with pytest.raises(LinkBrokenError, match="HTTP 503"):
            async with a.dial(b.address):
                pass
        taken = await b.accept()  # one place frees up
        async with a.dial(b.address) as third:
            await third.send(b"third")
            others = [await b.accept() for _ in range(2)]
            await first.send(b"first")
            assert await taken.receive() == b"first"
            assert await others[1].receive() == b"third"
            # both ends at once: each answers the other's close frame
            ends = (taken, *others, first, second, third)
            await asyncio.gather(*(link.aclose() for link in ends))


async def test_websocket_endpoint_aclose_wakes_accept_and_ends_its_links() -> None:
    clock = SystemClock()
    async with (
        open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=1024) as a,
        open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=1024,
                                close_timeout=1.0) as b,
        a.dial(b.address) as dialed,
    ):
        accepted = await b.accept()
        pending = asyncio.ensure_future(b.accept())
        await asyncio.sleep(0.01)
        assert not pending.done()
        address = b.address
        async with asyncio.TaskGroup() as tg:
            tg.create_task(b.aclose())
            with pytest.raises(LinkBrokenError, match="the endpoint closed"):
                await dialed.receive()
        with pytest.raises(LinkClosedError):
            await pending
        with pytest.raises(LinkClosedError):
            await accepted.receive()
        with pytest.raises(LinkBrokenError, match=address.removeprefix("ws://")):
            async with a.dial(address):
                pass


async def test_websocket_endpoint_refuses_bad_options_and_addresses() -> None:
    clock = SystemClock()
    for options in ({"port": -1}, {"port": 70000}, {"backlog": 0}, {"path": "peer"},
                    {"max_frame_bytes": -1}, {"ssl": True}):
        with pytest.raises(ConfigError):
            async with open_websocket_endpoint("127.0.0.1", clock=clock, **{  # type: ignore[arg-type]
                    "max_frame_bytes": None, **options}):
                pass
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            async with open_websocket_endpoint("127.0.0.1", port, clock=clock,
                                               max_frame_bytes=None):
                pass
    async with open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=None) as a:
        with pytest.raises(ConfigError, match="ws:// or wss://"):
            async with a.dial("memory://b"):
                pass
