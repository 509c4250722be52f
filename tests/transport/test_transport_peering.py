"""Peers authenticate each other (`dial_peer`, `accept_peer`) over both fabrics.

Hostile dialers speak the handshake by hand: the frame layout is written out again here
(aiopipe/transport/peering.py, [Note: the peer handshake]), so a change to the wire
shows up as a failing test, not as two sides that agree on a mistake.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from aiopipe.auth import (
    client_ssl_context,
    new_run_secret,
    pair_key,
    peer_proof,
    server_ssl_context,
)
from aiopipe.clock import Clock, SystemClock, VirtualClock, wait_for
from aiopipe.errors import (
    AuthenticationError,
    ConfigError,
    LinkBrokenError,
    LinkClosedError,
    RemoteProtocolError,
)
from aiopipe.transport import (
    MAX_HANDSHAKES,
    Endpoint,
    Link,
    LinkSpec,
    LinkStatistics,
    MemoryFabric,
    WireSpan,
    accept_peer,
    dial_peer,
    open_websocket_endpoint,
)

pytestmark = pytest.mark.timeout(30)

RUN = new_run_secret()
KEY_AB = pair_key(RUN, "a", "b")
KEY_CB = pair_key(RUN, "c", "b")
OTHER_RUN_KEY_AB = pair_key(new_run_secret(), "a", "b")
HELLO, CHALLENGE, PROOF, REFUSE = b"APA\x01\x01", b"APA\x01\x02", b"APA\x01\x03", b"APA\x01\x04"


def hello(dialer: str, listener: str, nonce: bytes) -> bytes:
    names = b"".join(bytes([len(n)]) + n.encode() for n in (dialer, listener))
    return HELLO + names + nonce


def challenge_of(frame: bytes) -> tuple[bytes, bytes]:
    assert frame[:5] == CHALLENGE, frame[:5]
    assert len(frame) == 69
    return frame[5:37], frame[37:]


@dataclass
class Net:
    """One fabric to test on: endpoints by name, and its clock."""

    kind: str
    clock: Clock
    opened: Callable[[str], contextlib.AbstractAsyncContextManager[Endpoint]]


@pytest.fixture(params=["memory", "websocket"])
async def net(request: pytest.FixtureRequest) -> AsyncIterator[Net]:
    if request.param == "memory":
        clock = VirtualClock()
        fabric = MemoryFabric(clock, default=LinkSpec(100e6, 0.01), max_frame_bytes=1 << 20)

        @contextlib.asynccontextmanager
        async def memory(name: str) -> AsyncIterator[Endpoint]:
            endpoint = fabric.endpoint(name)
            try:
                yield endpoint
            finally:
                await endpoint.aclose()

        yield Net("memory", clock, memory)
        await clock.aclose()
    else:
        system = SystemClock()

        def websocket(name: str) -> contextlib.AbstractAsyncContextManager[Endpoint]:
            return open_websocket_endpoint("127.0.0.1", clock=system, max_frame_bytes=1 << 20,
                                           close_timeout=1.0)

        yield Net("websocket", system, websocket)


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """The listener's warnings (``log.messages``)."""
    caplog.set_level(logging.WARNING, logger="aiopipe.peering")
    return caplog


async def _accept(endpoint: Endpoint, net: Net, keys: dict[str, bytes],
                  me: str = "b") -> tuple[str, Link]:
    return await accept_peer(endpoint, me=me, keys=keys, clock=net.clock, timeout=10.0)


async def _exchange(mine: Link, theirs: Link) -> None:
    """Real frames flow both ways after the handshake."""
    await mine.send(b"activation")
    assert await theirs.receive() == b"activation"
    await theirs.send(b"gradient")
    assert await mine.receive() == b"gradient"


async def _receive_all(link: Link, into: list[bytes]) -> None:
    while True:
        into.append(await link.receive())


async def _close_both(*links: Link) -> None:
    await asyncio.gather(*(link.aclose() for link in links))


# -- honest peers ---------------------------------------------------------------------------


async def test_peers_authenticate_each_other_both_ways(net: Net) -> None:
    async with net.opened("a") as a, net.opened("b") as b:
        for dialer, listener, names in ((a, b, ("a", "b")), (b, a, ("b", "a"))):
            me, peer = names
            listening = asyncio.ensure_future(
                _accept(listener, net, {me: KEY_AB}, me=peer))
            async with dial_peer(dialer, listener.address, me=me, peer=peer, key=KEY_AB,
                                 clock=net.clock) as link:
                name, theirs = await listening
                assert name == me
                await _exchange(link, theirs)
                assert link.statistics().sent.frames == 3  # hello, proof, activation
                await _close_both(link, theirs)


async def test_peers_dialing_at_once_are_all_admitted_by_successive_accepts(net: Net) -> None:
    run = new_run_secret()
    names = ["d0", "d1", "d2"]
    keys = {name: pair_key(run, name, "hub") for name in names}
    async with (
        net.opened("hub") as hub,
        net.opened("d0") as d0,
        net.opened("d1") as d1,
        net.opened("d2") as d2,
        contextlib.AsyncExitStack() as stack,
    ):
        dials = [
            asyncio.ensure_future(stack.enter_async_context(dial_peer(
                endpoint, hub.address, me=name, peer="hub", key=keys[name], clock=net.clock)))
            for name, endpoint in zip(names, (d0, d1, d2), strict=True)
        ]
        admitted = dict([await _accept(hub, net, keys, me="hub") for _ in names])
        dialed = [await dial for dial in dials]
        assert sorted(admitted) == names
        for name, link in zip(names, dialed, strict=True):
            await _exchange(link, admitted[name])
        await _close_both(*dialed, *admitted.values())


@pytest.mark.parametrize("keepable", [True, False], ids=["paused", "unhashable endpoint"])
async def test_a_handshake_under_way_when_accept_peer_returns(keepable: bool) -> None:
    clock = VirtualClock()
    fabric = MemoryFabric(clock, default=LinkSpec(None, 0.01))
    a, b, x = fabric.endpoint("a"), fabric.endpoint("b"), fabric.endpoint("x")
    # a Recording is a plain dataclass, hence unhashable: nothing can be kept for it
    listener: Endpoint = b if keepable else Recording(b)
    keys = {"a": KEY_AB, "c": KEY_CB}
    async with x.dial(b.address) as slow:  # c, by hand, halfway through when a comes
        nonce_d = secrets.token_bytes(32)
        listening = asyncio.ensure_future(accept_peer(listener, me="b", keys=keys, clock=clock))
        await slow.send(hello("c", "b", nonce_d))
        nonce_l, _ = challenge_of(await slow.receive())
        async with dial_peer(a, b.address, me="a", peer="b", key=KEY_AB, clock=clock) as link:
            name, theirs = await listening
            assert name == "a"
            if keepable:
                await slow.send(PROOF + peer_proof(KEY_CB, "dialer", "c", "b", nonce_d, nonce_l))
                await clock.sleep(7.0)  # nobody listens meanwhile; the deadline is at 10 s
                name, from_c = await accept_peer(listener, me="b", keys=keys, clock=clock)
                assert name == "c"
                await from_c.send(b"welcome")
                assert await slow.receive() == b"welcome"
                await from_c.aclose()
            else:
                with pytest.raises(LinkBrokenError, match="the listener stopped"):
                    await slow.receive()
            await _close_both(link, theirs)
    await asyncio.gather(a.aclose(), b.aclose(), x.aclose())
    await clock.aclose()


async def test_peers_meet_over_wss(certificate: tuple[Path, Path]) -> None:
    clock = SystemClock()
    served, trusting = server_ssl_context(*certificate), client_ssl_context(certificate[0])
    async with (
        open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=1024, ssl=served,
                                client_ssl=trusting, close_timeout=1.0) as a,
        open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=1024, ssl=served,
                                client_ssl=trusting, close_timeout=1.0) as b,
        open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=1024) as stranger,
    ):
        assert b.address.startswith("wss://127.0.0.1:")
        listening = asyncio.ensure_future(accept_peer(b, me="b", keys={"a": KEY_AB}, clock=clock))
        with pytest.raises(LinkBrokenError, match="TLS failed"):  # it trusts no such CA
            async with dial_peer(stranger, b.address, me="a", peer="b", key=KEY_AB,
                                 clock=clock):
                pytest.fail("a certificate nobody vouches for was trusted")
        async with dial_peer(a, b.address, me="a", peer="b", key=KEY_AB, clock=clock) as link:
            name, theirs = await listening
            assert name == "a"
            await _exchange(link, theirs)
            await _close_both(link, theirs)


# -- refusals -------------------------------------------------------------------------------


async def test_a_dialer_with_the_wrong_key_is_refused_and_the_listener_goes_on(
    net: Net, log: pytest.LogCaptureFixture
) -> None:
    async with net.opened("a") as a, net.opened("b") as b:
        listening = asyncio.ensure_future(_accept(b, net, {"a": KEY_AB}))
        with pytest.raises(AuthenticationError) as info:
            async with dial_peer(a, b.address, me="a", peer="b", key=OTHER_RUN_KEY_AB,
                                 clock=net.clock):
                pytest.fail("a wrong key was admitted")
        assert "the listener b of the link a -> b sent a wrong proof" in str(info.value)
        assert not listening.done()
        await _meet(a, b, "a", "b", KEY_AB, net, listening)
    assert any("dialer a refused us: our proof was wrong" in m for m in log.messages)


async def _meet(dialer: Endpoint, listener: Endpoint, me: str, peer: str, key: bytes,
                net: Net, listening: asyncio.Future[tuple[str, Link]]) -> None:
    """``me`` dials ``peer`` honestly: the listener admits it, and frames flow."""
    async with dial_peer(dialer, listener.address, me=me, peer=peer, key=key,
                         clock=net.clock) as link:
        name, theirs = await listening
        assert name == me
        await _exchange(link, theirs)
        await _close_both(link, theirs)


async def test_a_listener_with_the_wrong_key_is_refused_and_goes_on(
    net: Net, log: pytest.LogCaptureFixture
) -> None:
    async with net.opened("a") as a, net.opened("b") as b, net.opened("c") as c:
        listening = asyncio.ensure_future(_accept(b, net, {"a": OTHER_RUN_KEY_AB, "c": KEY_CB}))
        with pytest.raises(AuthenticationError, match=r"listener b .* sent a wrong proof"):
            async with dial_peer(a, b.address, me="a", peer="b", key=KEY_AB, clock=net.clock):
                pytest.fail("a listener with a wrong key was trusted")
        await _meet(c, b, "c", "b", KEY_CB, net, listening)
    assert any("dialer a refused us" in m for m in log.messages)


async def test_an_unknown_dialer_and_a_wrong_listener_name_are_refused(net: Net) -> None:
    async with net.opened("a") as a, net.opened("b") as b, net.opened("c") as c:
        listening = asyncio.ensure_future(_accept(b, net, {"a": KEY_AB}))
        with pytest.raises(AuthenticationError, match="refused c: it has no key for us"):
            async with dial_peer(c, b.address, me="c", peer="b", key=KEY_CB, clock=net.clock):
                pytest.fail("an unknown dialer was admitted")
        key_ac = pair_key(RUN, "a", "c")
        with pytest.raises(AuthenticationError, match="it is not the node we asked for"):
            async with dial_peer(a, b.address, me="a", peer="c", key=key_ac, clock=net.clock):
                pytest.fail("a dialer was admitted by the wrong node")
        assert not listening.done()
        listening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listening


async def test_a_dialer_claiming_another_nodes_name_is_refused(
    net: Net, log: pytest.LogCaptureFixture
) -> None:
    async with net.opened("b") as b, net.opened("c") as c:
        listening = asyncio.ensure_future(_accept(b, net, {"a": KEY_AB, "c": KEY_CB}))
        # through dial_peer: c, posing as a, finds that b does not hold c's key
        with pytest.raises(AuthenticationError, match="wrong proof"):
            async with dial_peer(c, b.address, me="a", peer="b", key=KEY_CB, clock=net.clock):
                pytest.fail("an impostor was admitted")
        # by hand, ignoring b's proof: b finds that "a" does not hold a's key
        async with c.dial(b.address) as link:
            nonce_d = secrets.token_bytes(32)
            await link.send(hello("a", "b", nonce_d))
            nonce_l, _ = challenge_of(await link.receive())
            await link.send(PROOF + peer_proof(KEY_CB, "dialer", "a", "b", nonce_d, nonce_l))
            with pytest.raises(LinkBrokenError, match="refused"):
                await link.receive()
        assert not listening.done()
        listening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listening
    assert any("the dialer a of the link a -> b sent a wrong proof" in m
               for m in log.messages)


@dataclass
class Recording:
    """An endpoint whose dialed links record every frame they carry: a wiretap."""

    inner: Endpoint
    sent: list[bytes] = field(default_factory=list)
    received: list[bytes] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.inner.address

    @contextlib.asynccontextmanager
    async def dial(self, address: str, *, shaping: LinkSpec | None = None
                   ) -> AsyncIterator[Link]:
        async with self.inner.dial(address, shaping=shaping) as link:
            yield _Tapped(link, self)

    async def accept(self) -> Link:
        return await self.inner.accept()

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class _Tapped:
    link: Link
    tap: Recording

    async def send(self, frame: bytes, *, ready_at: float | None = None) -> WireSpan | None:
        self.tap.sent.append(frame)
        return await self.link.send(frame, ready_at=ready_at)

    async def receive(self) -> bytes:
        frame = await self.link.receive()
        self.tap.received.append(frame)
        return frame

    async def aclose(self, reason: str = "") -> None:
        await self.link.aclose(reason)

    def statistics(self) -> LinkStatistics:
        return self.link.statistics()

    def last_received(self) -> float:
        return self.link.last_received()

    def times_the_wire(self) -> bool:
        return self.link.times_the_wire()

    def reshape(self, spec: LinkSpec) -> None:
        self.link.reshape(spec)


async def test_a_replayed_transcript_is_refused(net: Net, log: pytest.LogCaptureFixture) -> None:
    async with net.opened("a") as a, net.opened("b") as b, net.opened("c") as c:
        tap = Recording(a)
        listening = asyncio.ensure_future(_accept(b, net, {"a": KEY_AB}))
        async with dial_peer(tap, b.address, me="a", peer="b", key=KEY_AB,
                             clock=net.clock) as link:
            _, theirs = await listening
            await _close_both(link, theirs)
        recorded_hello, recorded_proof = tap.sent
        assert recorded_hello.startswith(HELLO)
        assert recorded_proof.startswith(PROOF)
        # an eavesdropper replays a's frames from elsewhere: b's nonce is new
        listening = asyncio.ensure_future(_accept(b, net, {"a": KEY_AB}))
        async with c.dial(b.address) as replay:
            await replay.send(recorded_hello)
            nonce_l, _ = challenge_of(await replay.receive())
            assert nonce_l != challenge_of(tap.received[0])[0]
            await replay.send(recorded_proof)
            with pytest.raises(LinkBrokenError, match="refused"):
                await replay.receive()
        assert not listening.done()
        listening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listening
    assert any("sent a wrong proof" in m for m in log.messages)
    # nothing shown anywhere holds a proof, a nonce or a key, in any spelling
    secrets_seen = [KEY_AB, recorded_proof[5:], *challenge_of(tap.received[0]),
                    recorded_hello[-32:]]
    for message in log.messages:
        for secret in secrets_seen:
            for spelling in (secret.hex(), repr(secret)[2:-1], base64.b64encode(secret).decode(),
                             base64.urlsafe_b64encode(secret).decode().rstrip("=")):
                assert spelling not in message


BAD_HELLOS = {
    "empty": b"",
    "garbage": b"GET / HTTP/1.1\r\n\r\n",
    "a codec frame": b"APW\x01" + bytes(60),
    "another version": b"APA\x02\x01" + hello("a", "b", bytes(32))[5:],
    "an unknown kind": b"APA\x01\x09" + bytes(32),
    "a proof first": PROOF + bytes(32),
    "a truncated hello": hello("a", "b", bytes(32))[:-1],
    "a hello cut in a name": hello("a", "b", bytes(32))[:7],
    "an oversized hello": hello("a", "b", bytes(32)) + bytes(1),
    "a huge frame": HELLO + bytes(300_000),
    "a name of control bytes": hello("a\x00", "b", bytes(32)),
    "a name of 65 bytes": hello("a" * 65, "b", bytes(32)),
    "a refusal of no known reason": REFUSE + b"\x63",
}


@pytest.mark.parametrize("frame", BAD_HELLOS.values(), ids=BAD_HELLOS.keys())
async def test_malformed_handshake_frames_are_refused_and_the_listener_goes_on(
    net: Net, log: pytest.LogCaptureFixture, frame: bytes
) -> None:
    async with net.opened("a") as a, net.opened("b") as b, net.opened("x") as x:
        listening = asyncio.ensure_future(_accept(b, net, {"a": KEY_AB}))
        async with x.dial(b.address) as hostile:
            await hostile.send(frame)
            with pytest.raises(LinkBrokenError, match="refused"):
                await hostile.receive()
        await _meet(a, b, "a", "b", KEY_AB, net, listening)
    [refusal] = log.messages
    assert refusal.startswith("b refused a peer link: ")
    assert "\n" not in refusal
    assert len(refusal) < 200  # it describes the frame; it does not quote it


@pytest.mark.parametrize("proof", [b"", PROOF + bytes(31), PROOF + bytes(33), HELLO + bytes(40)],
                         ids=["empty", "short", "long", "a second hello"])
async def test_a_malformed_proof_is_refused(
    net: Net, log: pytest.LogCaptureFixture, proof: bytes
) -> None:
    async with net.opened("b") as b, net.opened("x") as x:
        listening = asyncio.ensure_future(_accept(b, net, {"a": KEY_AB}))
        async with x.dial(b.address) as hostile:
            await hostile.send(hello("a", "b", bytes(32)))
            challenge_of(await hostile.receive())
            await hostile.send(proof)
            with pytest.raises(LinkBrokenError, match="refused"):
                await hostile.receive()
        listening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listening
    assert len(log.messages) == 1


@pytest.mark.parametrize(
    ("reply", "error", "reason"),
    [
        (b"nonsense", RemoteProtocolError, "not a peer handshake frame"),
        (PROOF + bytes(32), RemoteProtocolError, "a proof where a challenge was due"),
        (CHALLENGE + bytes(63), RemoteProtocolError, "a challenge of 68 bytes, not 69"),
        (CHALLENGE + bytes(64), AuthenticationError, "sent a wrong proof"),
        (REFUSE + b"\x01", AuthenticationError, "refused a: it has no key for us"),
    ],
    ids=["garbage", "a proof", "a short challenge", "a wrong proof", "a refusal"],
)
async def test_the_dialer_checks_the_listeners_frames(
    net: Net, reply: bytes, error: type[Exception], reason: str
) -> None:
    after: list[bytes] = []  # what the dialer sent after our reply
    async with net.opened("a") as a, net.opened("b") as b:

        async def listener_by_hand() -> None:
            link = await b.accept()
            assert (await link.receive()).startswith(HELLO)
            await link.send(reply)
            with pytest.raises(LinkBrokenError, match="refused"):
                await _receive_all(link, after)
            await link.aclose()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(listener_by_hand())
            with pytest.raises(error, match=reason) as info:
                async with dial_peer(a, b.address, me="a", peer="b", key=KEY_AB,
                                     clock=net.clock):
                    pytest.fail("a listener that broke the handshake was trusted")
        assert str(info.value).startswith(f"b at {b.address}: ")
    assert after == ([REFUSE + b"\x03"] if "wrong proof" in reason else [])


async def test_a_websocket_text_frame_is_refused(log: pytest.LogCaptureFixture) -> None:
    import aiohttp

    clock = SystemClock()
    async with (
        open_websocket_endpoint("127.0.0.1", clock=clock, max_frame_bytes=1024,
                                close_timeout=1.0) as b,
        aiohttp.ClientSession() as session,
        session.ws_connect(b.address) as hostile,
    ):
        listening = asyncio.ensure_future(
            accept_peer(b, me="b", keys={"a": KEY_AB}, clock=clock))
        await hostile.send_str("hello?")
        message = await hostile.receive()
        assert message.type is aiohttp.WSMsgType.CLOSE
        listening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listening
    assert any("text frame" in m for m in log.messages)


# -- time -----------------------------------------------------------------------------------


async def test_a_silent_connection_times_out_while_honest_peers_are_admitted(
    log: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()
    fabric = MemoryFabric(clock, default=LinkSpec(None, 0.01))
    a, b, x = fabric.endpoint("a"), fabric.endpoint("b"), fabric.endpoint("x")
    async with x.dial(b.address) as silent:
        listening = asyncio.ensure_future(
            accept_peer(b, me="b", keys={"a": KEY_AB}, clock=clock, timeout=5.0))
        await clock.sleep(3.0)
        async with dial_peer(a, b.address, me="a", peer="b", key=KEY_AB, clock=clock) as link:
            name, theirs = await listening
            assert name == "a"
            assert clock.now() == pytest.approx(3.03)
            # the silent handshake is paused, its deadline kept: the next call ends it
            listening = asyncio.ensure_future(
                accept_peer(b, me="b", keys={"a": KEY_AB}, clock=clock, timeout=5.0))
            with pytest.raises(LinkBrokenError, match="no peer handshake within 5 s"):
                await wait_for(clock, silent.receive(), 60.0)  # a TimeoutError fails
            assert clock.now() == pytest.approx(5.0)
            await _exchange(link, theirs)
            await _close_both(link, theirs)
        listening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listening
    assert log.messages == ["b refused a peer link: no peer handshake within 5 s"]
    await asyncio.gather(a.aclose(), b.aclose(), x.aclose())
    await clock.aclose()


async def test_a_flood_of_silent_connections_waits_its_turn(
    log: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()
    fabric = MemoryFabric(clock, default=LinkSpec(None, 0.01))
    a, b = fabric.endpoint("a"), fabric.endpoint("b")
    flood = [fabric.endpoint(f"x{i}") for i in range(MAX_HANDSHAKES)]
    async with contextlib.AsyncExitStack() as stack:
        for x in flood:
            await stack.enter_async_context(x.dial(b.address))
        listening = asyncio.ensure_future(
            accept_peer(b, me="b", keys={"a": KEY_AB}, clock=clock, timeout=10.0))
        await clock.sleep(1.0)
        async with dial_peer(a, b.address, me="a", peer="b", key=KEY_AB, clock=clock,
                             timeout=30.0) as link:
            name, theirs = await listening
            # its turn came when the flood timed out, not before
            assert name == "a"
            assert clock.now() == pytest.approx(10.02)
            await _exchange(link, theirs)
            await _close_both(link, theirs)
    assert len(log.messages) == MAX_HANDSHAKES
    await asyncio.gather(a.aclose(), b.aclose(), *(x.aclose() for x in flood))
    await clock.aclose()


async def test_a_dialer_gives_up_on_a_silent_listener_after_its_timeout() -> None:
    clock = VirtualClock()
    fabric = MemoryFabric(clock)
    a, b = fabric.endpoint("a"), fabric.endpoint("b")
    with pytest.raises(LinkBrokenError, match="no peer handshake with b at memory://b within 2 s"):
        async with dial_peer(a, b.address, me="a", peer="b", key=KEY_AB, clock=clock,
                             timeout=2.0):
            pytest.fail("a silent listener was trusted")
    assert clock.now() == pytest.approx(2.0)
    with pytest.raises(LinkBrokenError, match="memory://nobody"):
        async with dial_peer(a, "memory://nobody", me="a", peer="b", key=KEY_AB, clock=clock):
            pass
    await asyncio.gather(a.aclose(), b.aclose())
    await clock.aclose()


async def test_accept_peer_ends_when_its_endpoint_closes(net: Net) -> None:
    async with net.opened("a") as a, net.opened("b") as b:
        listening = asyncio.ensure_future(_accept(b, net, {"a": KEY_AB}))
        async with a.dial(b.address) as pending:  # a handshake under way
            await pending.send(hello("a", "b", bytes(32)))
            await pending.receive()
            await b.aclose()
            with pytest.raises(LinkClosedError):
                await listening
            with pytest.raises(LinkBrokenError):
                await pending.receive()
        with pytest.raises(LinkClosedError):
            await _accept(b, net, {"a": KEY_AB})


# -- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"me": "b"}, "cannot be its own peer"),
        ({"me": "no spaces"}, "node name"),
        ({"peer": ""}, "node name"),
        ({"key": b"short"}, "at least 16 bytes"),
        ({"key": "a str key of enough length"}, "at least 16 bytes"),
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"timeout": float("inf")}, "timeout must be a positive number"),
    ],
)
async def test_dial_peer_refuses_bad_arguments(options: dict[str, object], reason: str) -> None:
    clock = VirtualClock()
    fabric = MemoryFabric(clock)
    a, b = fabric.endpoint("a"), fabric.endpoint("b")
    arguments: dict[str, object] = {"me": "a", "peer": "b", "key": KEY_AB, **options}
    with pytest.raises(ConfigError, match=reason):
        async with dial_peer(a, b.address, clock=clock, **arguments):  # type: ignore[arg-type]
            pass
    with pytest.raises(TimeoutError):  # nothing was dialed
        await wait_for(clock, b.accept(), 1.0)


@pytest.mark.parametrize(
    ("keys", "reason"),
    [
        ({}, "non-empty mapping"),
        ({"b": KEY_AB}, "cannot be its own peer"),
        ({"a b": KEY_AB}, "node name"),
        ({"a": b"short"}, "key for peer 'a' must be at least 16 bytes"),
    ],
)
async def test_accept_peer_refuses_bad_arguments(keys: dict[str, bytes], reason: str) -> None:
    clock = VirtualClock()
    b = MemoryFabric(clock).endpoint("b")
    with pytest.raises(ConfigError, match=reason):
        await accept_peer(b, me="b", keys=keys, clock=clock)
