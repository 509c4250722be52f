"""Who takes part in the run: hellos, sessions and connections (DESIGN §7).

`Admission.serve_link` runs one device connection from its `Hello` to its goodbye: it
checks the hello (protocol version, the id the connection authenticated as, the id
range, what the system needs of a device), answers with the device's `Plan` (a new
session then announces what it holds: `Ready`, taken by the coordinator), and either
starts a `DeviceSession` or re-attaches the device's session after a reconnection
([Note: reconnection] in aiopipe/runtime/session.py). It keeps the sessions, the set of
open connections and the addresses devices announced for peer links.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from aiopipe.clock import wait_for
from aiopipe.errors import (
    AiopipeError,
    RefusedError,
    RemoteProtocolError,
    TransportError,
)
from aiopipe.protocol import PROTOCOL_VERSION, ErrorMessage, Hello, Plan, Rest
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.session import DeviceSession, SessionHost
from aiopipe.transport import Link

__all__ = ["HELLO_TIMEOUT_S", "Admission", "AdmissionHost"]

log = logging.getLogger("aiopipe.server")

#: Seconds a new connection has to say hello before it is dropped.
HELLO_TIMEOUT_S = 30.0


class AdmissionHost(SessionHost, Protocol):
    """What admission needs from the coordinator, besides what a session needs."""

    max_frame_bytes: int
    finished: bool
    #: rest the links of devices in no round ([Note: idle links rest] in
    #: aiopipe.runtime.liveness): a simulation that samples devices per round
    rests_idle_links: bool

    def plan_for(self, device_id: int, session: int) -> Plan:
        """The `Plan` answering device ``device_id``'s hello."""
        ...

    def refuse_hello(self, hello: Hello) -> str:
        """Why the system cannot take this device ("" when it can)."""
        ...


class Admission:
    """Sessions and connections of the run's devices (see the module docstring)."""

    def __init__(self, host: AdmissionHost) -> None:
        self.host = host
        self.sessions: dict[int, DeviceSession] = {}  # every device that joined the run
        self.connected: set[int] = set()  # devices whose connection is open now
        self.addresses: dict[int, str] = {}  # where each device listens for peers
        self.left = asyncio.Event()  # set whenever a connection closes
        self.arrived = asyncio.Event()  # set whenever a device is admitted
        #: set once every device has said hello and announced what it holds (the
        #: coordinator's `announce`)
        self.joined = asyncio.Event()

    async def serve_link(self, link: Link, *, device_id: int | None = None,
                         admitted: Callable[[int], None] | None = None) -> None:
        """Run one device connection from hello to goodbye (the websocket handler's body).

        ``device_id``: the id the connection authenticated as (from its token); a Hello
        for any other id is refused. ``admitted``: called with the device's id once its
        hello is taken (the websocket route lifts its pre-hello bounds and shapes the
        downlink; [Note: bounded before authentication] in aiopipe/runtime/guard.py).

        Raises:
            ProtocolError: the device broke the contract (it was told why).
            TransportError: the connection failed.
        """
        host = self.host
        peer = Peer(link, host.clock, host.recorder, "server/unknown",
                    max_frame_bytes=host.max_frame_bytes)
        hello = await self._hello(peer, device_id)
        k = hello.device_id
        if admitted is not None:
            admitted(k)
        session, resumed = await self._session_for(hello, link)
        try:
            if session.rests:  # the link starts at rest ([Note: idle links rest])
                await peer.send(Rest())
            await peer.send(host.plan_for(k, session.nonce))
        except TransportError:
            if not resumed:  # nobody will serve it: do not count it among the living
                session.end("its plan could not be sent")
            raise
        except Exception as exc:  # the server's own plan failed: not the device's doing
            await self._plan_failed(peer, session, exc)
            return
        self.sessions[k] = session
        self.addresses[k] = hello.address
        session.attach(link, resumed=resumed)
        self.connected.add(k)
        self.arrived.set()
        del peer, hello  # the session's serves the link: not held while it does
        await self._serve(session)

    async def _plan_failed(self, peer: Peer, session: DeviceSession, error: Exception
                           ) -> None:
        """[Note: server faults] making or encoding a device's plan failed: every device
        would fail the same way, so the run stops with the error (not with a join
        timeout); the device is told why."""
        self.host.server_failed(session.device_id, error)
        session.end(f"its plan could not be made: {error}")
        with contextlib.suppress(TransportError):
            await peer.send(ErrorMessage("server-error", f"the server failed: {error}"))
        await peer.link.aclose()

    async def _hello(self, peer: Peer, authenticated: int | None) -> Hello:
        """The connection's Hello, once it is acceptable.

        Raises:
            RemoteProtocolError: none came in time, or it is refused (the device was
                told why, and the link closed).
        """
        try:
            hello: object = await wait_for(self.host.clock, peer.receive(), HELLO_TIMEOUT_S)
        except TimeoutError:
            hello = None
            problem = f"no hello within {HELLO_TIMEOUT_S:g} s"
        except RemoteProtocolError as exc:
            hello = None
            problem = f"bad hello: {exc}"
        else:
            problem = self._check_hello(hello, authenticated)
        if problem:
            code = "busy" if isinstance(problem, _Busy) else "refused"
            log.warning("refused a device: %s", problem)
            with contextlib.suppress(TransportError):
                await peer.send(ErrorMessage(code, str(problem)))
            await peer.link.aclose()
            raise RemoteProtocolError(problem)
        assert isinstance(hello, Hello)
        return hello

    async def _session_for(self, hello: Hello, link: Link) -> tuple[DeviceSession, bool]:
        """The session that serves this connection, and whether it resumes one: the
        device's own after a reconnection, else a new one (its old one, if any, ends)."""
        host, k = self.host, hello.device_id
        session = self.sessions.get(k)
        resumed = session is not None and not session.ended and hello.session == session.nonce
        if session is not None:
            log.warning("device %d reconnected (%s)", k, "resuming its session" if resumed
                        else "afresh: it takes part from the next round")
        if session is not None and not session.ended:
            await self._supersede(session)
        if session is not None and resumed:
            return session, True
        if session is not None:
            # a device that starts afresh cannot continue its old round: drop that round
            session.end("it restarted")
        earlier = session.link_bytes() if session is not None else (0, 0)
        return DeviceSession(
            host, Peer(link, host.clock, host.recorder, f"device{k}/downlink",
                       max_frame_bytes=host.max_frame_bytes), k,
            earlier_bytes=earlier,  # the epoch's byte counts span sessions
            rests=host.rests_idle_links), False

    async def _serve(self, session: DeviceSession) -> None:
        """Serve the attached session until its connection ends; when it broke, wait
        ``reconnect_grace`` for the device to come back before it is lost.

        Raises:
            ProtocolError: the device broke the contract.
            TransportError: the connection failed and the device did not come back.
        """
        host, k = self.host, session.device_id
        try:
            await session.serve()
        except TransportError as exc:
            # [Note: reconnection] wait for the device to come back before giving up
            self.connected.discard(k)
            self.left.set()
            grace = host.config.reconnect_grace
            log.warning("device %d: %s; waiting %g s for it to reconnect", k, exc, grace)
            broke = host.clock.now()
            back = await session.wait_reattached(grace)
            # on the timeline: how long the device's connection was down
            host.recorder.add(f"device{k}/connection", "reconnected" if back else "lost",
                              broke, host.clock.now())
            if back:
                return  # the new connection's serve_link carries on
            session.end(f"{exc}, and it did not reconnect within {grace:g} s")
            log.warning("device %d was lost", k)
            raise
        except (AiopipeError, OSError) as exc:
            session.end(str(exc))
            if not isinstance(exc, RefusedError):  # that was said already
                log.warning("device %d was lost: %s", k, exc)
            raise
        except Exception as exc:
            host.server_failed(k, exc)
            if session.bye is not None:  # tell it why, if it still listens
                with contextlib.suppress(TransportError):
                    await session.peer.send(session.bye)
        else:
            session.end("it said goodbye")
            log.info("device %d left: it said goodbye", k)
        finally:
            if self.sessions.get(k) is session and session.ended:
                self.connected.discard(k)
                self.left.set()

    async def _supersede(self, session: DeviceSession) -> None:
        """A device (authenticated as itself) said hello again: retire its old connection,
        which may still look alive (a stalled link)."""
        if not session.idle.is_set():
            await session.peer.link.aclose("superseded by a new connection")
            try:
                await wait_for(self.host.clock, session.idle.wait(), 30.0)
            except TimeoutError:
                raise RemoteProtocolError(f"device {session.device_id}'s old connection "
                                          "did not close") from None

    async def wait_disconnected(self, seconds: float) -> bool:
        """Wait up to ``seconds`` until every device connection has closed (after Bye).

        Returns whether they all did. Closing the listening site earlier would drop the
        devices' close handshakes.
        """

        async def all_gone() -> None:
            while self.connected:
                self.left.clear()
                await self.left.wait()

        try:
            await wait_for(self.host.clock, all_gone(), seconds)
        except TimeoutError:
            return False
        return True

    def alive(self) -> list[int]:
        """Devices taking part now (connected, or reconnecting within reconnect_grace)."""
        return sorted(k for k, s in self.sessions.items() if not s.ended)

    async def wait_for_someone(self) -> None:
        """Wait until some device is alive."""
        while not self.alive():
            self.arrived.clear()
            await self.arrived.wait()

    def _check_hello(self, hello: object, authenticated: int | None) -> str:
        """Why this hello is refused ("" when it is taken; a `_Busy` when only for now)."""
        host = self.host
        if not isinstance(hello, Hello):
            return f"expected Hello, got {type(hello).__name__}"
        if hello.version != PROTOCOL_VERSION:
            return f"protocol version {hello.version} is not {PROTOCOL_VERSION}"
        if host.finished:
            return "the run is over"
        if authenticated is not None and hello.device_id != authenticated:
            return f"token is for device {authenticated}, not device {hello.device_id}"
        if not hello.device_id < host.config.devices:
            return f"device id {hello.device_id} is not in 0..{host.config.devices - 1}"
        session = self.sessions.get(hello.device_id)
        if session is not None and not session.idle.is_set() and hello.session != session.nonce:
            # [Note: a session is bound to its connection]
            return _Busy(f"device {hello.device_id} is already connected: a second "
                         "connection with its token but not its session's secret")
        return host.refuse_hello(hello)


class _Busy(str):
    """A hello refused for now: the device's session is live on another connection. The
    device retries (code "busy") and is admitted once that connection is declared dead."""


# Note [a session is bound to its connection]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A token says which device a connection is; it does not say that the connection is
# the device's live session. The first hello's answer (`Plan.session`, 62 random bits,
# over TLS where configured) is that session's secret, and a hello that carries it may
# take the session over from a stalled connection (a reconnection). A hello without it
# while the session's connection is alive is refused as busy, never admitted: a replayed
# or stolen token cannot displace the honest device, whose rounds go on untouched. A
# device whose process restarted (so it lost the secret) is busy until the server's
# liveness declares the old connection dead (`device_timeout`), then starts afresh; the
# device retries busy hellos with backoff. While the session is idle (its connection
# broke, within `reconnect_grace`), a hello without the secret is a restart: it ends the
# old session (`_session_for`).
