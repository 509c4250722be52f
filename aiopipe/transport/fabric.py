"""A fabric of links: every node listens and dials on its one event loop.

An `Endpoint` is a node's place on the fabric: an ``address`` others dial, ``dial`` (an
async context manager yielding a `Link`) and ``accept`` (the next incoming link, which
the caller owns and closes). Both kinds pass the Link conformance suite:

- `MemoryFabric` (one process): ``fabric.endpoint(name)`` listens at ``memory://<name>``;
  a dial makes a memory link pair shaped per ordered pair of names (``links[(a, b)]``
  shapes what a sends to b, else ``default``), exact in virtual time.
- `open_websocket_endpoint`: a node's own aiohttp site at ``ws://host:port/peer``.
  Incoming connections wait in a bounded accept queue; beyond ``backlog`` they get HTTP
  503 before any upgrade. A handler must not return while its websocket is in use, so
  each incoming link's request lasts until the link is closed. The site is guarded as
  the server's port is ([Note: bounded before authentication] in
  aiopipe/transport/guard.py; `PEER_LIMITS`): until an incoming link is *admitted*
  (`GuardedLink.admit`, which `aiopipe.transport.peering.accept_peer` calls once the
  dialer proved who it is) its connection has a deadline from its TCP accept, counts
  towards a cap on pending connections (one more closes the oldest) and takes only
  handshake-sized frames; at most ``max_per_device`` admitted links per peer are open.

An endpoint's ``aclose`` stops listening and closes its incoming links, accepted or not
(they cannot outlive a websocket endpoint's site, and memory ones follow suit); links it
dialed live until their ``dial`` context exits.

Endpoints carry bytes between anyone who dials; `aiopipe.transport.peering` makes the
two ends prove who they are before a link is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as ssl_module
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping
from types import MappingProxyType
from typing import Generic, Protocol, TypeVar

from aiohttp import web

from aiopipe.auth import check_node_name
from aiopipe.clock import Clock, wait_for
from aiopipe.errors import (
    AuthenticationError,
    ConfigError,
    LinkBrokenError,
    LinkClosedError,
    RemoteProtocolError,
)
from aiopipe.transport.base import Link, LinkStatistics, WireSpan
from aiopipe.transport.guard import ConnectionGuard, ConnectionLimits, GuardedSite
from aiopipe.transport.memory import MemoryLink, open_memory_link_pair
from aiopipe.transport.network import LinkSpec
from aiopipe.transport.websocket import (
    DEFAULT_CLOSE_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    WebSocketLink,
    accept_websocket,
    open_websocket_link,
)

__all__ = [
    "PEER_LIMITS",
    "Endpoint",
    "MemoryEndpoint",
    "MemoryFabric",
    "WebSocketEndpoint",
    "open_websocket_endpoint",
]

#: A websocket endpoint's bounds before a link is admitted (`open_websocket_endpoint`):
#: the peer handshake's frames are under 600 bytes and take milliseconds; fewer pending
#: connections than the server's, as a device has less to spare (and at most
#: `aiopipe.transport.peering.MAX_HANDSHAKES` run at once anyway).
PEER_LIMITS = ConnectionLimits(handshake_timeout=10.0, max_pending=32, max_per_device=2,
                               hello_frame_bytes=1024)

#: Seconds a refused stranger (a link never admitted) gets for the closing handshake.
_STRANGER_CLOSE_S = 0.5

log = logging.getLogger("aiopipe.peering")

_UNSHAPED = LinkSpec(None)
_NO_LINKS: Mapping[tuple[str, str], LinkSpec] = MappingProxyType({})
_MEMORY = "memory://"


class Endpoint(Protocol):
    """A node's place on the fabric: it dials others and accepts their links."""

    @property
    def address(self) -> str:
        """How others dial this node."""
        ...

    def dial(
        self, address: str, *, shaping: LinkSpec | None = None
    ) -> contextlib.AbstractAsyncContextManager[Link]:
        """Connect to the endpoint at ``address``; yields the link and closes it on exit.

        ``shaping``: how to shape this side's sends, where the kind of endpoint shapes
        links per dial (a memory fabric shapes them per pair of nodes instead).

        Raises:
            LinkBrokenError: nothing listens there, or it cannot be reached.
            ConfigError: the address is not one this kind of endpoint dials.
        """
        ...

    async def accept(self) -> Link:
        """The next incoming link (the caller owns and closes it).

        Raises:
            LinkClosedError: the endpoint is closed (also wakes a pending call).
        """
        ...

    async def aclose(self) -> None:
        """Stop listening and close the incoming links, accepted or not; a pending
        ``accept`` raises `LinkClosedError`; idempotent."""
        ...


_L = TypeVar("_L", bound=Link)


class _AcceptQueue(Generic[_L]):
    """Incoming links waiting for ``accept``; closing it wakes every waiter."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = False
        self._links: deque[_L] = deque()
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._links)

    def put(self, link: _L) -> None:
        self._links.append(link)
        self._changed.set()

    def purge(self, dead: Callable[[_L], bool]) -> list[_L]:
        """Take the waiting links that are ``dead`` out of the queue; return them."""
        gone = [link for link in self._links if dead(link)]
        if gone:
            self._links = deque(link for link in self._links if not dead(link))
        return gone

    async def get(self) -> _L:
        while True:  # takes a link only when returning: a cancelled get loses none
            if self.closed:
                raise LinkClosedError(f"the endpoint {self.address} is closed")
            if self._links:
                return self._links.popleft()
            self._changed.clear()
            await self._changed.wait()

    def close(self) -> None:
        """Close the queue (its owner closes the links that were waiting)."""
        self.closed = True
        self._changed.set()
        self._links.clear()


# -- memory -------------------------------------------------------------------------------


class MemoryFabric:
    """In-process endpoints whose links are memory link pairs shaped per ordered pair.

    ``links[(a, b)]`` shapes what node ``a`` sends to node ``b`` (bandwidth, latency) on
    every link between them, whoever dialed; other pairs get ``default``.
    ``max_frame_bytes`` limits every link's frames (None: no limit).

    Raises:
        ConfigError: a spec that is not a `LinkSpec`, a key that is not a pair of node
            names, or a negative ``max_frame_bytes``.
    """

    def __init__(
        self,
        clock: Clock,
        *,
        default: LinkSpec = _UNSHAPED,
        links: Mapping[tuple[str, str], LinkSpec] = _NO_LINKS,
        max_frame_bytes: int | None = None,
    ) -> None:
        if not isinstance(default, LinkSpec):
            raise ConfigError(f"default must be a LinkSpec, got {type(default).__name__}")
        shapes: dict[tuple[str, str], LinkSpec] = {}
        for pair, spec in links.items():
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ConfigError(f"a links key must be a (sender, receiver) pair, got {pair!r}")
            if not isinstance(spec, LinkSpec):
                raise ConfigError(f"links[{pair!r}] must be a LinkSpec, got {spec!r}")
            shapes[(check_node_name(pair[0]), check_node_name(pair[1]))] = spec
        open_memory_link_pair(clock, max_frame_bytes=max_frame_bytes)  # checks the limit
        self.clock = clock
        self._default = default
        self._shapes = shapes
        self._max_frame_bytes = max_frame_bytes
        self._endpoints: dict[str, MemoryEndpoint] = {}

    def endpoint(self, name: str) -> MemoryEndpoint:
        """A new endpoint listening at ``memory://<name>``.

        A name is taken while its endpoint is open (a restarted node may take it again).

        Raises:
            ConfigError: an open endpoint has this name, or it is not a valid node name.
        """
        check_node_name(name)
        if name in self._endpoints:
            raise ConfigError(f"the memory fabric already has an endpoint named {name!r}")
        endpoint = MemoryEndpoint(self, name)
        self._endpoints[name] = endpoint
        return endpoint

    def shape(self, sender: str, receiver: str) -> LinkSpec:
        """The shape of what ``sender`` sends to ``receiver``."""
        return self._shapes.get((sender, receiver), self._default)

    def _connect(self, dialer: str, address: str) -> tuple[MemoryLink, MemoryLink, MemoryEndpoint]:
        """A new pair's dialer end, listener end, and the listening endpoint."""
        if not isinstance(address, str) or not address.startswith(_MEMORY):
            raise ConfigError(f"a memory endpoint dials memory://<name>, got {address!r}")
        target = self._endpoints.get(address.removeprefix(_MEMORY))
        if target is None:
            raise LinkBrokenError(f"no memory endpoint listens at {address}")
        listener = target.name
        ours, theirs = open_memory_link_pair(
            self.clock,
            a_to_b=self.shape(dialer, listener),
            b_to_a=self.shape(listener, dialer),
            max_frame_bytes=self._max_frame_bytes,
        )
        target._deliver(theirs)
        return ours, theirs, target

    def _release(self, endpoint: MemoryEndpoint) -> None:
        if self._endpoints.get(endpoint.name) is endpoint:
            del self._endpoints[endpoint.name]


class MemoryEndpoint:
    """An `Endpoint` of a `MemoryFabric` (made by `MemoryFabric.endpoint`)."""

    def __init__(self, fabric: MemoryFabric, name: str) -> None:
        self._fabric = fabric
        self.name = name
        self._queue: _AcceptQueue[MemoryLink] = _AcceptQueue(f"{_MEMORY}{name}")
        self._incoming: set[MemoryLink] = set()  # until their dialer's context ends

    def __repr__(self) -> str:
        return f"<MemoryEndpoint {self.address}{' closed' if self._queue.closed else ''}>"

    @property
    def address(self) -> str:
        """``memory://<name>``."""
        return self._queue.address

    @contextlib.asynccontextmanager
    async def dial(
        self, address: str, *, shaping: LinkSpec | None = None
    ) -> AsyncIterator[MemoryLink]:
        """Connect to the endpoint at ``address``; yields this side and closes it on exit.

        The link is shaped by the fabric; ``shaping`` is ignored.

        Raises:
            LinkBrokenError: no open endpoint of this fabric listens at ``address``.
            ConfigError: ``address`` is not ``memory://<name>``.
        """
        link, theirs, target = self._fabric._connect(self.name, address)
        try:
            yield link
        finally:
            await link.aclose()
            target._incoming.discard(theirs)  # its aclose need not close it any more

    async def accept(self) -> MemoryLink:
        """The next incoming link, in the order they were dialed.

        Raises:
            LinkClosedError: the endpoint is closed.
        """
        return await self._queue.get()

    async def aclose(self) -> None:
        """Stop listening, wake pending ``accept`` calls and close the incoming links;
        idempotent."""
        if not self._queue.closed:
            self._queue.close()
            self._fabric._release(self)
        for link in list(self._incoming):
            await link.aclose("the endpoint closed")
        await self._fabric.clock.sleep(0)

    def _deliver(self, link: MemoryLink) -> None:
        self._incoming.add(link)
        self._queue.put(link)


# -- websocket ----------------------------------------------------------------------------


class _IncomingLink:
    """A websocket link a `WebSocketEndpoint` accepted: its request lasts until it closes.
    A `GuardedLink` (see the module docstring)."""

    def __init__(self, link: WebSocketLink, endpoint: WebSocketEndpoint,
                 transport: asyncio.Transport | None) -> None:
        self._link = link
        self._endpoint = endpoint
        self._transport = transport
        self._closed = asyncio.Event()
        self.peer: str | None = None  # who it was admitted as

    def __repr__(self) -> str:
        return repr(self._link)

    @property
    def max_frame_bytes(self) -> int | None:
        """The largest frame this link sends or accepts (None: no limit)."""
        return self._link.max_frame_bytes

    async def send(self, frame: bytes, *, ready_at: float | None = None) -> WireSpan | None:
        """As `WebSocketLink.send`."""
        return await self._link.send(frame, ready_at=ready_at)

    async def receive(self) -> bytes:
        """As `WebSocketLink.receive`."""
        return await self._link.receive()

    async def aclose(self, reason: str = "") -> None:
        """As `WebSocketLink.aclose`, then the endpoint's request ends; a link of a
        guarded endpoint that was never admitted gets half a second for its closing
        handshake, then its connection is dropped (a stranger that keeps sending would
        have us read and discard for the whole ``close_timeout``)."""
        try:
            if self.peer is None and self._endpoint.limits is not None:
                try:
                    await wait_for(self._endpoint._clock, self._link.aclose(reason),
                                   _STRANGER_CLOSE_S)
                except TimeoutError:
                    if self._transport is not None:
                        self._transport.abort()
            else:
                await self._link.aclose(reason)
        finally:
            self._closed.set()

    def statistics(self) -> LinkStatistics:
        """As `WebSocketLink.statistics`."""
        return self._link.statistics()

    def last_received(self) -> float:
        """As `WebSocketLink.last_received`."""
        return self._link.last_received()

    def times_the_wire(self) -> bool:
        """As `WebSocketLink.times_the_wire`."""
        return self._link.times_the_wire()

    def reshape(self, spec: LinkSpec) -> None:
        """As `WebSocketLink.reshape` (this end's sender-side shaping)."""
        self._link.reshape(spec)

    def admit(self, peer: str) -> None:
        """As `GuardedLink.admit`."""
        self._endpoint._admit(self, peer)

    def gone(self) -> bool:
        """Whether its connection is closed or closing (the guard may have dropped it)."""
        return self._transport is None or self._transport.is_closing()

    def drop(self) -> None:
        """End its request now (its connection is gone)."""
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()


class WebSocketEndpoint:
    """An `Endpoint` with its own aiohttp site (made by `open_websocket_endpoint`)."""

    def __init__(self, *, clock: Clock, max_frame_bytes: int | None, backlog: int,
                 client_ssl: ssl_module.SSLContext | bool, connect_timeout: float,
                 close_timeout: float, limits: ConnectionLimits | None = None) -> None:
        self._clock = clock
        #: the bounds before admission (None: unguarded) and the guard that keeps them
        self.limits = limits
        self.guard = (ConnectionGuard(limits, kind="peer", log=log) if limits is not None
                      else None)
        self._per_peer: Counter[str] = Counter()  # admitted links open, by peer
        self._max_frame_bytes = max_frame_bytes
        self._backlog = backlog
        self._client_ssl = client_ssl
        self._connect_timeout = connect_timeout
        self._close_timeout = close_timeout
        self._queue: _AcceptQueue[_IncomingLink] = _AcceptQueue("")
        self._upgrading = 0  # connections past the backlog check, not yet queued
        self._incoming: set[_IncomingLink] = set()
        self._runner: web.AppRunner | None = None

    def __repr__(self) -> str:
        return f"<WebSocketEndpoint {self.address}{' closed' if self._queue.closed else ''}>"

    @property
    def address(self) -> str:
        """``ws://host:port/path`` (``wss://`` with TLS), as the site listens."""
        return self._queue.address

    def dial(
        self, address: str, *, shaping: LinkSpec | None = None
    ) -> contextlib.AbstractAsyncContextManager[WebSocketLink]:
        """Connect to the websocket endpoint at ``address``; yields the link, closes it on
        exit. ``shaping`` paces this side's sends (see `aiopipe.transport.websocket`).

        Raises:
            LinkBrokenError: it cannot be reached or refused the upgrade (HTTP 503: its
                accept queue is full).
            ConfigError: ``address`` is not a ws:// or wss:// URL.
        """
        if not isinstance(address, str) or not address.startswith(("ws://", "wss://")):
            raise ConfigError(f"a websocket endpoint dials ws:// or wss:// URLs, got {address!r}")
        return open_websocket_link(
            address, clock=self._clock, max_frame_bytes=self._max_frame_bytes, shaping=shaping,
            connect_timeout=self._connect_timeout, close_timeout=self._close_timeout,
            ssl=self._client_ssl,
        )

    async def accept(self) -> Link:
        """The next incoming link; closing it ends its connection's request.

        Raises:
            LinkClosedError: the endpoint is closed.
        """
        return await self._queue.get()

    async def aclose(self) -> None:
        """Stop the site, wake pending ``accept`` calls and close the incoming links;
        idempotent."""
        if self._queue.closed:
            return
        self._queue.close()
        await asyncio.gather(*(link.aclose("the endpoint closed") for link in self._incoming))
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def _admit(self, incoming: _IncomingLink, peer: str) -> None:
        """See `GuardedLink.admit`."""
        if incoming.peer is not None:
            return
        if incoming.gone():
            raise LinkBrokenError(f"the connection of {peer}'s link is gone")
        if self.limits is None or self.guard is None:
            incoming.peer = peer
            return
        if self._per_peer[peer] >= self.limits.max_per_device:
            raise AuthenticationError(f"{peer} already has {self._per_peer[peer]} links open "
                                      "(max_per_device)")
        self._per_peer[peer] += 1
        incoming.peer = peer
        self.guard.admit(incoming._transport)
        incoming._link.set_frame_limit(self._max_frame_bytes)

    def _forget(self, incoming: _IncomingLink) -> None:
        self._incoming.discard(incoming)
        if incoming.peer is not None and self.limits is not None:
            self._per_peer[incoming.peer] -= 1
            if self._per_peer[incoming.peer] <= 0:
                del self._per_peer[incoming.peer]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        for dead in self._queue.purge(_IncomingLink.gone):  # dropped by the guard, say
            dead.drop()
        if self._queue.closed or self._upgrading + len(self._queue) >= self._backlog:
            raise web.HTTPServiceUnavailable(text="the endpoint's accept queue is full\n")
        self._upgrading += 1
        try:
            link = await accept_websocket(
                request, clock=self._clock, max_frame_bytes=self._max_frame_bytes,
                close_timeout=self._close_timeout,
            )
        except RemoteProtocolError as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        except LinkBrokenError:  # lost during the upgrade (the guard closed it, say)
            return web.Response(status=400)
        finally:
            self._upgrading -= 1
        if self.limits is not None:  # handshake-sized frames until admitted
            hello = self.limits.hello_frame_bytes
            ceiling = self._max_frame_bytes
            link.set_frame_limit(hello if ceiling is None else min(hello, ceiling))
        incoming = _IncomingLink(link, self, request.transport)
        if self._queue.closed:
            await link.aclose("the endpoint closed")
            return link.response
        self._incoming.add(incoming)
        self._queue.put(incoming)
        try:
            await incoming.wait_closed()
        finally:
            self._forget(incoming)
            await link.aclose()  # the site is shutting down: idempotent otherwise
        return link.response


@contextlib.asynccontextmanager
async def open_websocket_endpoint(
    host: str,
    port: int = 0,
    *,
    clock: Clock,
    max_frame_bytes: int | None,
    ssl: ssl_module.SSLContext | None = None,
    path: str = "/peer",
    backlog: int = 16,
    client_ssl: ssl_module.SSLContext | bool = True,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT_S,
    advertise: str | None = None,
    limits: ConnectionLimits | None = PEER_LIMITS,
) -> AsyncIterator[WebSocketEndpoint]:
    """Listen on ``host:port`` (0: a free port) at ``path``; yield the endpoint, close it
    on exit.

    ``ssl`` serves wss://; ``client_ssl`` verifies the endpoints this one dials (as
    `open_websocket_link`'s ``ssl``). At most ``backlog`` connections wait for
    ``accept``; more get HTTP 503. The address names ``host`` as given: bind a name or
    address that peers can dial, not a wildcard, or give the URL they dial as
    ``advertise`` (a wildcard bind, NAT). Use a `SystemClock` (as for websockets).
    ``limits`` bound incoming links until they are admitted (`GuardedLink.admit`; see
    the module docstring); None leaves them unbounded (an endpoint whose links are
    trusted as they come, as in tests of the transport).

    Raises:
        ConfigError: an invalid option, or the site cannot listen there (address in use).
    """
    _check_endpoint_options(host, port, path, backlog, ssl, max_frame_bytes)
    if advertise is not None and not (isinstance(advertise, str)
                                      and advertise.startswith(("ws://", "wss://"))):
        raise ConfigError(f"advertise must be a ws:// or wss:// URL, got {advertise!r}")
    if limits is not None and not isinstance(limits, ConnectionLimits):
        raise ConfigError(f"limits must be ConnectionLimits or None, got {type(limits).__name__}")
    endpoint = WebSocketEndpoint(
        clock=clock, max_frame_bytes=max_frame_bytes, backlog=backlog, client_ssl=client_ssl,
        connect_timeout=connect_timeout, close_timeout=close_timeout, limits=limits,
    )
    app = web.Application()
    app.router.add_get(path, endpoint._handle)
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           shutdown_timeout=close_timeout)
    await runner.setup()
    endpoint._runner = runner
    try:
        try:
            site: web.BaseSite = (
                web.TCPSite(runner, host, port, ssl_context=ssl) if endpoint.guard is None
                else GuardedSite(runner, host, port, endpoint.guard, ssl_context=ssl))
            await site.start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        shown = f"[{host}]" if ":" in host else host
        scheme = "ws" if ssl is None else "wss"
        endpoint._queue.address = advertise or (
            f"{scheme}://{shown}:{runner.addresses[0][1]}{path}")
        yield endpoint
    finally:
        await endpoint.aclose()


def _check_endpoint_options(host: str, port: int, path: str, backlog: int,
                            ssl: ssl_module.SSLContext | None, max_frame_bytes: int | None) -> None:
    if not isinstance(host, str) or not host:
        raise ConfigError(f"host must be a non-empty str, got {host!r}")
    for name, value, low, high in (("port", port, 0, 65535), ("backlog", backlog, 1, None)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (
                high is not None and value > high):
            raise ConfigError(f"{name} must be an int in {low}..{high or ''}, got {value!r}")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ConfigError(f"path must start with /, got {path!r}")
    if ssl is not None and not isinstance(ssl, ssl_module.SSLContext):
        raise ConfigError(f"ssl must be an ssl.SSLContext or None, got {type(ssl).__name__}")
    if max_frame_bytes is not None and (isinstance(max_frame_bytes, bool) or not isinstance(
            max_frame_bytes, int) or max_frame_bytes < 0):
        raise ConfigError(f"max_frame_bytes must be a non-negative int, got {max_frame_bytes!r}")

