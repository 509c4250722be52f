"""Bounds on connections before they are a device's (DESIGN §7; docs/design.md, Hostile
peers; [Note: bounded before authentication]).

A `ConnectionGuard` sits between the server's listening socket and aiohttp: it sees
every TCP connection from its accept, and aiohttp's handler serves it as usual. Until a
connection is *admitted* (a device's hello was taken on it), the guard holds it to
`ConnectionLimits`: it is closed ``handshake_timeout`` seconds after its accept (HTTP
headers, token, websocket upgrade and hello included; ``/status`` and ``/metrics`` answer
within it and close), and at most ``max_pending`` such connections are open at once: one
more closes the oldest. An admitted connection is the device's for as long as it lives.

`GuardedSite` listens like aiohttp's ``TCPSite`` with the guard in place; the routes tell
the guard when a connection is admitted (`aiopipe.runtime.http.add_routes`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from ssl import SSLContext
from typing import cast

from aiohttp import web

from aiopipe.errors import ConfigError

__all__ = ["ConnectionGuard", "ConnectionLimits", "GuardedSite"]

log = logging.getLogger("aiopipe.server")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How much a connection may hold of the server before it is a device's.

    Attributes:
        handshake_timeout: seconds from a connection's accept until a device's hello was
            taken on it; any other connection (``/status``, ``/metrics``, a stranger) is
            closed then too.
        max_pending: connections open at once that are not (yet) a device's; one more
            closes the oldest of them.
        max_per_device: websocket connections open at once with one device's token (its
            live connection and a reconnection); more are refused with HTTP 429.
        hello_frame_bytes: the largest frame a device's websocket takes before its hello
            was taken (the plan's frame limit applies after).
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


class ConnectionGuard:
    """Keeps the server's connections within `ConnectionLimits` (module docstring)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        #: connections not yet admitted, oldest first, with their deadline's timer
        self.pending: OrderedDict[asyncio.Transport, asyncio.TimerHandle] = OrderedDict()
        self.evicted = 0  # connections closed to keep max_pending
        self.timed_out = 0  # connections closed at handshake_timeout

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` that serves each connection with
        ``factory``'s protocol, under the guard."""
        return lambda: _Guarded(self, factory())

    def admit(self, transport: asyncio.Transport | None) -> None:
        """The connection of ``transport`` is a device's now: no more deadline or cap."""
        timer = self.pending.pop(transport, None) if transport is not None else None
        if timer is not None:
            timer.cancel()

    def _opened(self, transport: asyncio.Transport) -> None:
        while len(self.pending) >= self.limits.max_pending:
            oldest, timer = self.pending.popitem(last=False)
            timer.cancel()
            self.evicted += 1
            if self.evicted == 1 or self.evicted % 100 == 0:
                log.warning("closed %d connection(s) that were not a device's yet: more than "
                            "%d at once (max_pending)", self.evicted, self.limits.max_pending)
            oldest.abort()
        loop = asyncio.get_running_loop()
        self.pending[transport] = loop.call_later(self.limits.handshake_timeout,
                                                  self._expire, transport)

    def _expire(self, transport: asyncio.Transport) -> None:
        if self.pending.pop(transport, None) is not None:
            self.timed_out += 1
            if self.timed_out == 1 or self.timed_out % 100 == 0:
                log.warning("closed %d connection(s) that were not a device's within %g s "
                            "(handshake_timeout)", self.timed_out, self.limits.handshake_timeout)
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
        """Listen (aiohttp calls this through the runner's site registry)."""
        await super().start()
        server = self._runner.server
        assert server is not None
        _warn_if_few_descriptors(self._guard.limits)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._guard.wrap(server), self._host, self._port, ssl=self._ssl_context,
            backlog=self._backlog)


def _warn_if_few_descriptors(limits: ConnectionLimits) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2 * limits.max_pending + 64:
        log.warning("the open-file limit (%d) leaves little room beside max_pending=%d "
                    "connections: raise it (ulimit -n) or lower max_pending", soft,
                    limits.max_pending)


# Note [bounded before authentication]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What a stranger can make the server hold, before it proves anything: one TCP
# connection per file descriptor, the bytes of a frame, and time. Each has a bound.
# Descriptors: at most `max_pending` connections that are not a device's; the oldest
# goes first, so a flood of idle connections cannot keep an honest device (whose
# handshake takes milliseconds) or `/status` out, and the process keeps descriptors to
# spare under a small `ulimit -n`. Time: `handshake_timeout` from accept to hello ends
# slowloris headers and silent websockets alike. Bytes: `hello_frame_bytes` until hello
# (aiohttp may still read one websocket message of up to a chunk, 1 MiB, per
# connection: at most `max_pending` MiB in all), and `max_per_device` connections per
# token, so a token, even a valid one, buys no more than two plan-sized buffers.
# Evicting the oldest is not per-address fairness: many devices may share one address
# behind NAT, so the guard does not count addresses.
