"""Bounds on connections before they are authenticated (DESIGN §7; docs/design.md, Hostile
peers and Peer ports; [Note: bounded before authentication]).

A `ConnectionGuard` sits between a listening socket and aiohttp: it sees every TCP
connection from its accept, and aiohttp's handler serves it as usual. Until a connection
is *admitted* (a device's hello was taken on it, on the server; a peer's handshake
proved who dialed, on a device's peer port), the guard holds it to `ConnectionLimits`: it
is closed ``handshake_timeout`` seconds after its accept (HTTP headers, websocket upgrade
and the handshake included), and at most ``max_pending`` such connections are open at
once: one more closes the oldest. An admitted connection is its owner's for as long as
it lives. The routes that serve the connections bound the rest: the frame size before
admission (``hello_frame_bytes``) and the connections per device (``max_per_device``).

`GuardedSite` listens like aiohttp's ``TCPSite`` with the guard in place. The server's
routes (`aiopipe.runtime.http`) and a websocket endpoint's (`aiopipe.transport.fabric`)
tell the guard when a connection is admitted.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from ssl import SSLContext
from typing import Protocol, cast, runtime_checkable

from aiohttp import web

from aiopipe.errors import ConfigError

__all__ = ["ConnectionGuard", "ConnectionLimits", "GuardedLink", "GuardedSite"]


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How much a connection may hold of a listener before it is authenticated.

    The same bounds guard the server's port (before a device's hello) and a device's peer
    port (before a peer's handshake; `aiopipe.transport.fabric.PEER_LIMITS`).

    Attributes:
        handshake_timeout: seconds from a connection's accept until it was admitted (a
            device's hello taken; a peer's handshake done); any other connection
            (``/status``, ``/metrics``, a stranger) is closed then too.
        max_pending: connections open at once that are not admitted (yet); one more
            closes the oldest of them.
        max_per_device: connections open at once as one device (with its token, on the
            server: more are refused with HTTP 429; as one authenticated peer, on a peer
            port: more are refused at the handshake).
        hello_frame_bytes: the largest frame a websocket takes before it was admitted (the
            link's own frame limit applies after).
    """

    handshake_timeout: float = 10.0
    max_pending: int = 64
    max_per_device: int = 2
    hello_frame_bytes: int = 16 * 1024

    def __post_init__(self) -> None:
        if not self.handshake_timeout > 0:
            raise ConfigError(f"handshake_timeout must be > 0 s, got {self.handshake_timeout}")
        for name in ("max_pending", "max_per_device", "hello_frame_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")


@runtime_checkable
class GuardedLink(Protocol):
    """An incoming link held to its listener's bounds until it is admitted (a websocket
    endpoint's: `aiopipe.transport.fabric`)."""

    def admit(self, peer: str) -> None:
        """``peer`` proved that it dialed this link: lift the bounds before admission
        (deadline, pending cap, handshake-sized frames) and count the link as one of
        ``peer``'s.

        Raises:
            AuthenticationError: ``peer`` already has ``max_per_device`` links open here.
            LinkBrokenError: the connection is gone (closed by the guard or the peer).
        """
        ...


class ConnectionGuard:
    """Keeps a listener's connections within `ConnectionLimits` (module docstring).

    ``kind`` names what an admitted connection is in log lines ("device", "peer");
    ``log`` is where they go.
    """

    def __init__(self, limits: ConnectionLimits, *, kind: str = "device",
                 log: logging.Logger | None = None) -> None:
        self.limits = limits
        self.kind = kind
        self.log = log or logging.getLogger("aiopipe.server")
        #: connections not yet admitted, oldest first, with their deadline's timer
        self.pending: OrderedDict[asyncio.Transport, asyncio.TimerHandle] = OrderedDict()
        self.evicted = 0  # connections closed to keep max_pending
        self.timed_out = 0  # connections closed at handshake_timeout

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` that serves each connection with
        ``factory``'s protocol, under the guard."""
        return lambda: _Guarded(self, factory())

    def admit(self, transport: asyncio.Transport | None) -> None:
        """The connection of ``transport`` is admitted now: no more deadline or cap."""
        timer = self.pending.pop(transport, None) if transport is not None else None
        if timer is not None:
            timer.cancel()

    def deadline(self, transport: asyncio.Transport | None) -> float | None:
        """When (in the loop's time) the connection of ``transport`` is closed unless it is
        admitted first; None once it is admitted, or if it is not this guard's."""
        timer = self.pending.get(transport) if transport is not None else None
        return timer.when() if timer is not None else None

    def _opened(self, transport: asyncio.Transport) -> None:
        while len(self.pending) >= self.limits.max_pending:
            oldest, timer = self.pending.popitem(last=False)
            timer.cancel()
            self.evicted += 1
            if self.evicted == 1 or self.evicted % 100 == 0:
                self.log.warning("closed %d connection(s) that were not a %s's yet: more "
                                 "than %d at once (max_pending)", self.evicted, self.kind,
                                 self.limits.max_pending)
            oldest.abort()
        loop = asyncio.get_running_loop()
        self.pending[transport] = loop.call_later(self.limits.handshake_timeout,
                                                  self._expire, transport)

    def _expire(self, transport: asyncio.Transport) -> None:
        if self.pending.pop(transport, None) is not None:
            self.timed_out += 1
            if self.timed_out == 1 or self.timed_out % 100 == 0:
                self.log.warning("closed %d connection(s) that were not a %s's within %g s "
                                 "(handshake_timeout)", self.timed_out, self.kind,
                                 self.limits.handshake_timeout)
            transport.abort()

    def _closed(self, transport: asyncio.Transport) -> None:
        timer = self.pending.pop(transport, None)
        if timer is not None:
            timer.cancel()


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the guard told of its start and end."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard, self._inner = guard, inner
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a socket's, TLS or not
        self._guard._opened(self._transport)
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._guard._closed(self._transport)
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class GuardedSite(web.BaseSite):
    """aiohttp's TCP site (host, port, optional TLS) with a `ConnectionGuard` on every
    connection it accepts."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard,
                 *, ssl_context: SSLContext | None = None) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        """The site's URL, as aiohttp names sites."""
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        """Listen (aiohttp calls this through the runner's site registry).

        Raises:
            ConfigError: the runner was not set up.
            OSError: the address cannot be listened on (in use, not local).
        """
        await super().start()
        server = self._runner.server
        if server is None:
            raise ConfigError("set the runner up before starting a site on it")
        _warn_if_few_descriptors(self._guard)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._guard.wrap(server), self._host, self._port, ssl=self._ssl_context,
            backlog=self._backlog)


def _warn_if_few_descriptors(guard: ConnectionGuard) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2 * guard.limits.max_pending + 64:
        guard.log.warning("the open-file limit (%d) leaves little room beside max_pending=%d "
                          "connections: raise it (ulimit -n) or lower max_pending", soft,
                          guard.limits.max_pending)


# Note [bounded before authentication]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What a stranger can make a listener hold, before it proves anything: one TCP
# connection per file descriptor, the bytes of a frame, and time. Each has a bound.
# Descriptors: at most `max_pending` connections that are not admitted; the oldest
# goes first, so a flood of idle connections cannot keep an honest device (whose
# handshake takes milliseconds) or `/status` out, and the process keeps descriptors to
# spare under a small `ulimit -n`. Time: `handshake_timeout` from accept to admission
# ends slowloris headers and silent websockets alike. Bytes: `hello_frame_bytes` until
# admission (aiohttp may still read one websocket message of up to a chunk, 1 MiB, per
# connection: at most `max_pending` MiB in all), and `max_per_device` connections per
# device, so a credential, even a valid one, buys no more than two plan-sized buffers.
# Evicting the oldest is not per-address fairness: many devices may share one address
# behind NAT, so the guard does not count addresses. The server's port and every
# device's peer port (aiopipe/transport/fabric.py) are guarded alike.
