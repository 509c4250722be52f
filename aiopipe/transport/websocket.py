"""Links over aiohttp websockets: `accept_websocket` (server) and `open_websocket_link`.

A frame is one binary websocket message, or several for a frame above `CHUNK_BYTES`
([Note: chunked frames]). This module is the boundary where aiohttp,
OSError and asyncio exceptions become `aiopipe.errors` classes; nothing foreign leaks.

Frame limit: aiohttp's default ``max_msg_size`` (4 MiB) is replaced by the link's own
``max_frame_bytes``, which aiohttp enforces while parsing a frame's header, so an
oversized frame is refused before its payload is buffered. Per-message compression is
never negotiated (activations do not compress; it only costs CPU). aiohttp's websocket
heartbeat is off unless ``heartbeat`` is given (the runtime has its own).

Shaping (optional, ``shaping=LinkSpec(...)``): the sender paces its frames as a wire of
that bandwidth would: frame n's slot starts at ``max(now, end of slot n-1)`` and lasts
``len * 8 / bandwidth``; the frame is written when its slot ends, so the peer gets it no
earlier than a shaped link would deliver it. ``latency_s`` is not emulated here (it
would need a delay line); the real network's latency applies.

Timeouts (connecting, the closing handshake) and shaping run on the injected clock;
websockets move real bytes, so use them with a `SystemClock` (a `VirtualClock` would
jump past a timeout while the loop waits on the network).

[Note: peer misbehaviour] A text frame, a malformed frame or an oversized one from the
peer raises `RemoteProtocolError` (`FrameTooLargeError`) from ``receive``; the link is
then unusable (`LinkBrokenError`). aiohttp has already closed the websocket with 1002 or
1009 for a bad or oversized frame; for a text frame, ``aclose`` tells the peer with
close code 1003 and the error as the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ssl as ssl_module
from collections.abc import AsyncIterator
from typing import Any, Literal

import aiohttp
from aiohttp import WSCloseCode, WSMsgType, web

from aiopipe.auth.refusals import explain_refusal
from aiopipe.clock import Clock, ready_time, wait_for
from aiopipe.errors import (
    AuthenticationError,
    ConfigError,
    FrameTooLargeError,
    LinkBrokenError,
    LinkClosedError,
    LocalProtocolError,
    RemoteProtocolError,
)
from aiopipe.transport import wire_timer
from aiopipe.transport._waiting import sleep_unless_set
from aiopipe.transport.base import DirectionStatistics, LinkStatistics, WireSpan
from aiopipe.transport.network import LinkSpec

__all__ = [
    "CHUNK_BYTES",
    "WebSocketLink",
    "accept_websocket",
    "open_websocket_link",
    "turned_away",
]

#: Frames above this many bytes travel as several websocket messages of at most this
#: many bytes of the frame each ([Note: chunked frames]).
CHUNK_BYTES = 1 << 20
_FIRST_CHUNK = b"APC\x01"  # + the frame's size (u64, little-endian) + its first part
_NEXT_CHUNK = b"APC\x02"  # + the next part
_CHUNK_HEADER = len(_FIRST_CHUNK) + 8

# [Note: chunked frames] aiohttp hands over a websocket message only when all of it has
# arrived, and a model upload can take minutes on a slow uplink (vgg16's 134 MB at
# 10 Mbit/s: 107 s), during which the receiver hears nothing: its watchdog would take a
# busy link for a dead one, and the resend after the reconnection would be cut off the
# same way, for ever. So a large frame goes as a first message holding its size and
# first CHUNK_BYTES, then one message per further CHUNK_BYTES; the receiver reassembles
# them (refusing a size above max_frame_bytes before buffering anything) and
# `last_received` moves with every part. Codec frames start with b"APW", never with
# the chunk markers; a frame never interleaves with another one's parts (sends hold
# the send lock for the whole frame).

DEFAULT_CLOSE_TIMEOUT_S = 5.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
_MAX_REASON_BYTES = 123  # a close frame carries at most 125 bytes: 2 for the code

_AnyWebSocket = aiohttp.ClientWebSocketResponse[Any] | web.WebSocketResponse[Any]
_FOREIGN_ERRORS = (aiohttp.ClientError, aiohttp.WebSocketError, OSError, RuntimeError)


class WebSocketLink:
    """A `Link` over one aiohttp websocket (client or server side).

    Build it with `accept_websocket` or `open_websocket_link`, which open the websocket
    with the right frame limit and no compression. Wrapping a websocket opened by other
    means works too; it must have been opened with ``max_msg_size`` greater than
    ``max_frame_bytes`` (or 0) and without compression.

    Raises:
        ConfigError: an invalid ``max_frame_bytes``, ``shaping`` or ``close_timeout``.
    """

    def __init__(
        self,
        ws: _AnyWebSocket,
        *,
        clock: Clock,
        max_frame_bytes: int | None,
        shaping: LinkSpec | None = None,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT_S,
        peer: str = "peer",
    ) -> None:
        _check_options(max_frame_bytes, shaping)
        self._close_timeout = _check_timeout("close_timeout", close_timeout)
        self._ws = ws
        self._clock = clock
        self._max_frame_bytes = max_frame_bytes
        self._frame_ceiling = max_frame_bytes  # what aiohttp's reader was opened for
        self._shaping = shaping if shaping is not None and shaping.shaped else None
        self._peer = peer
        self._send_lock = asyncio.Lock()
        self._receive_lock = asyncio.Lock()
        self._wire_free_at = float("-inf")
        self._closing = asyncio.Event()  # set by aclose: cuts a pacing sleep short
        self._closed = False
        self._failure: LinkBrokenError | None = None  # why the link is unusable
        self._failure_code = WSCloseCode.OK
        self._sent = DirectionStatistics()
        self._received = DirectionStatistics()
        self._last_received = float("-inf")
        self._parts: list[bytes] = []  # a chunked frame being reassembled
        self._parts_size = 0  # its size, from its first part
        self._parts_bytes = 0  # bytes of it received so far
        self._timer: wire_timer.WireTimer | Literal[False] | None = None  # False: none to be had
        self._socket: Any = None  # for acknowledging received frames at once

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._failure else "open"
        return f"<WebSocketLink {self._peer} {state}>"

    @property
    def max_frame_bytes(self) -> int | None:
        """The largest frame this link sends or accepts (None: no limit)."""
        return self._max_frame_bytes

    def set_frame_limit(self, max_frame_bytes: int | None) -> None:
        """Take frames up to ``max_frame_bytes`` from now on (a server's websocket takes
        only hello-sized ones until the hello is accepted), at most the limit the link was
        opened with.

        Raises:
            ConfigError: the limit is not a non-negative int, or above the opening limit.
        """
        _check_options(max_frame_bytes, None)
        ceiling = self._frame_ceiling
        if ceiling is not None and (max_frame_bytes is None or max_frame_bytes > ceiling):
            raise ConfigError(f"a frame limit of {max_frame_bytes} is above the {ceiling} "
                              "bytes the link was opened with")
        self._max_frame_bytes = max_frame_bytes

    @property
    def response(self) -> web.WebSocketResponse[Any]:
        """The server side's aiohttp response, which the handler returns when it is done.

        Raises:
            ConfigError: this is a client-side link (it has no server response).
        """
        if not isinstance(self._ws, web.WebSocketResponse):
            raise ConfigError(f"link to {self._peer} is a client-side link: it has no response")
        return self._ws

    def reshape(self, spec: LinkSpec) -> None:
        """Change this end's sender-side shaping (`Link.reshape`: bandwidth only; latency
        is not emulated).

        Applies to frames sent from now on; an unshaped spec turns shaping off.

        Raises:
            ConfigError: ``spec`` is not a `LinkSpec`.
        """
        if not isinstance(spec, LinkSpec):
            raise ConfigError(f"reshape needs a LinkSpec, got {type(spec).__name__}")
        self._shaping = spec if spec.shaped else None

    async def send(self, frame: bytes, *, ready_at: float | None = None) -> WireSpan | None:
        """Send ``frame`` as one binary message; returns once the socket has taken it.

        With shaping, first waits (on the clock) until the frame's wire slot ends, and
        returns None (the wait was the wire time). Unshaped, returns the frame's wire
        span, known once the peer has acknowledged its last byte
        ([Note: wire time from acknowledgements]), where the platform tells (Linux);
        elsewhere None. ``ready_at``: see `Link.send`.

        Raises:
            LinkClosedError: this side closed the link.
            LinkBrokenError: the peer closed the link or the connection failed.
            LocalProtocolError: the frame is larger than ``max_frame_bytes``.
        """
        size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
        if self._max_frame_bytes is not None and size > self._max_frame_bytes:
            raise LocalProtocolError(
                f"frame of {size} bytes exceeds the link's limit of {self._max_frame_bytes} bytes"
            )
        self._check_usable()
        called = ready_time(self._clock, ready_at)
        async with self._send_lock:
            self._check_usable()
            clock = self._clock
            wire_s = 0.0
            if self._shaping is not None:
                wire_s = self._shaping.wire_time(size)
                now = clock.now()
                # from the call, not the lock (aiopipe/transport/memory.py,
                # [Note: wire slots do not drift])
                end = max(called, self._wire_free_at) + wire_s
                self._wire_free_at = end
                if await sleep_unless_set(clock, end - now, self._closing):
                    self._check_usable()
            started = clock.now()
            try:
                if size <= CHUNK_BYTES:
                    await self._ws.send_bytes(frame)
                else:
                    view = memoryview(frame).cast("B")
                    await self._ws.send_bytes(
                        _FIRST_CHUNK + size.to_bytes(8, "little") + view[:CHUNK_BYTES])
                    for start in range(CHUNK_BYTES, size, CHUNK_BYTES):
                        await self._ws.send_bytes(
                            _NEXT_CHUNK + view[start:start + CHUNK_BYTES])
            except _FOREIGN_ERRORS as exc:
                raise self._translate(exc, "send failed") from exc
            if self._shaping is None and self._timer is None:
                self._timer = wire_timer.timer_for_websocket(self._ws, clock)
            if self._shaping is not None or not self._timer:
                if self._shaping is None:
                    wire_s = clock.now() - started
                self._sent = _count(self._sent, size, wire_s)
                return None
            self._sent = _count(self._sent, size, 0.0)  # its wire time: `statistics`
            try:
                return self._timer.track(started)
            except OSError as exc:
                raise self._translate(exc, "send failed") from exc

    async def receive(self) -> bytes:
        """Wait for the next binary message from the peer.

        Raises:
            LinkClosedError: this side closed the link.
            LinkBrokenError: the peer closed the link (close code and reason in the
                message) or the connection failed.
            FrameTooLargeError: the peer sent a frame above ``max_frame_bytes``.
            RemoteProtocolError: the peer sent a text frame or broke the websocket
                protocol (see [Note: peer misbehaviour]).
        """
        self._check_usable()
        async with self._receive_lock:
            while True:
                self._check_usable()
                try:
                    msg = await self._ws.receive()
                except _FOREIGN_ERRORS as exc:
                    raise self._translate(exc, "receive failed") from exc
                kind = msg.type
                if kind is WSMsgType.BINARY:
                    self._last_received = self._clock.now()
                    if self._socket is None:
                        self._socket = self._ws.get_extra_info("socket")
                    wire_timer.acknowledge_at_once(self._socket)  # the sender times its frames by
                    # our acknowledgements ([Note: wire time from acknowledgements])
                    frame = self._reassemble(msg.data)
                    if frame is None:
                        continue
                    self._received = _count(self._received, len(frame), 0.0)
                    return frame
                if kind is WSMsgType.TEXT:
                    raise self._fail(
                        RemoteProtocolError(f"{self._peer} sent a text frame; links are binary"),
                        WSCloseCode.UNSUPPORTED_DATA,
                    )
                if kind is WSMsgType.ERROR:
                    raise self._receive_error(msg.data)
                if kind in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                    raise self._peer_closed(
                        msg.data if kind is WSMsgType.CLOSE else None, msg.extra
                    )
                # PING/PONG surface only when autoping is off; they carry no frame.

    async def aclose(self, reason: str = "") -> None:
        """Close the websocket with code 1000 and ``reason``; idempotent, never raises.

        Waits for the peer's closing handshake at most ``close_timeout`` seconds on the
        clock (given when the link was opened), then drops the connection. A pending
        ``receive`` or ``send`` on this side raises `LinkClosedError`.
        """
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        if self._timer:
            self._timer.close()
        code = self._failure_code
        if self._failure is not None and self._failure_code != WSCloseCode.OK:
            reason = reason or str(self._failure.__cause__ or self._failure)
        # aiohttp bounds each read of the handshake, not the whole: a peer that keeps
        # sending would hold us, hence the overall bound. A timeout drops the connection.
        with contextlib.suppress(TimeoutError, *_FOREIGN_ERRORS):
            await wait_for(
                self._clock,
                self._ws.close(code=code, message=_encode_reason(reason)),
                self._close_timeout,
            )

    def statistics(self) -> LinkStatistics:
        """Frames and bytes sent and received; ``sent.busy_s`` per the `Link` docstring."""
        sent = self._sent
        if self._timer:  # the acknowledged frames' spans
            sent = DirectionStatistics(sent.frames, sent.bytes, sent.busy_s + self._timer.busy_s)
        return LinkStatistics(sent=sent, received=self._received)

    def last_received(self) -> float:
        """Clock time the last bytes from the peer arrived (a part of a large frame
        counts); ``-inf`` before any."""
        return self._last_received

    def times_the_wire(self) -> bool:
        """With sender-side shaping (the module docs), or where acknowledgements time
        the frames (Linux: [Note: wire time from acknowledgements]); elsewhere ``send``
        returns once the OS has buffered the frame and nothing tells its wire time."""
        return self._shaping is not None or wire_timer.wire_timing_available()

    def _reassemble(self, data: bytes) -> bytes | None:
        """The frame ``data`` completes (None while parts are missing).

        Raises:
            FrameTooLargeError: a frame above ``max_frame_bytes``.
            RemoteProtocolError: parts out of order or of the wrong size.
        """
        marker = data[:len(_FIRST_CHUNK)]
        limit = self._max_frame_bytes
        if marker == _FIRST_CHUNK and not self._parts:
            size = int.from_bytes(data[len(_FIRST_CHUNK):_CHUNK_HEADER], "little")
            if limit is not None and size > limit:
                raise self._fail(FrameTooLargeError(
                    f"{self._peer} sent a frame of {size} bytes, above the limit of {limit} "
                    "bytes"), WSCloseCode.MESSAGE_TOO_BIG)
            if size <= CHUNK_BYTES or len(data) != _CHUNK_HEADER + CHUNK_BYTES:
                raise self._fail(RemoteProtocolError(
                    f"{self._peer} sent a malformed first part of a frame"),
                    WSCloseCode.PROTOCOL_ERROR)
            self._parts, self._parts_size = [data[_CHUNK_HEADER:]], size
            self._parts_bytes = CHUNK_BYTES
            return None
        if marker == _NEXT_CHUNK and self._parts:
            part = data[len(_NEXT_CHUNK):]
            self._parts.append(part)
            self._parts_bytes += len(part)
            left = self._parts_size - self._parts_bytes
            if left > 0 and len(part) == CHUNK_BYTES:
                return None
            if left == 0:
                frame = b"".join(self._parts)
                self._parts, self._parts_size, self._parts_bytes = [], 0, 0
                return frame
            raise self._fail(RemoteProtocolError(
                f"{self._peer} sent a part of a frame of the wrong size"),
                WSCloseCode.PROTOCOL_ERROR)
        if self._parts or marker in (_FIRST_CHUNK, _NEXT_CHUNK):
            raise self._fail(RemoteProtocolError(
                f"{self._peer} sent the parts of a frame out of order"),
                WSCloseCode.PROTOCOL_ERROR)
        if limit is not None and len(data) > limit:
            raise self._fail(FrameTooLargeError(
                f"{self._peer} sent a frame above the limit of {limit} bytes"),
                WSCloseCode.MESSAGE_TOO_BIG)
        return data

    def _check_usable(self) -> None:
        if self._closed:
            raise LinkClosedError(f"link to {self._peer}: this side closed it")
        if self._failure is not None:
            raise LinkBrokenError(str(self._failure)) from self._failure

    def _translate(self, exc: BaseException, what: str) -> Exception:
        if self._closed:
            return LinkClosedError(f"link to {self._peer}: this side closed it")
        if self._failure is not None:
            return LinkBrokenError(str(self._failure))
        return self._fail(LinkBrokenError(f"link to {self._peer}: {what}: {exc!r}"))

    def _fail(self, error: Exception, code: WSCloseCode = WSCloseCode.OK) -> Exception:
        """Record why the link is unusable (later calls raise LinkBrokenError); return it."""
        if self._failure is None:
            if isinstance(error, LinkBrokenError):
                self._failure = error
            else:
                broken = LinkBrokenError(f"link to {self._peer} is unusable: {error}")
                broken.__cause__ = error
                self._failure = broken
            self._failure_code = code
        return error

    def _receive_error(self, exc: object) -> Exception:
        if self._closed:
            return LinkClosedError(f"link to {self._peer}: this side closed it")
        if isinstance(exc, aiohttp.WebSocketError):
            if exc.code == WSCloseCode.MESSAGE_TOO_BIG:
                error: Exception = FrameTooLargeError(
                    f"{self._peer} sent a frame above the limit of {self._max_frame_bytes} bytes"
                    f" ({exc})"
                )
            else:
                error = RemoteProtocolError(f"{self._peer} broke the websocket protocol: {exc}")
            # aiohttp has already closed the websocket with the matching code.
            return self._fail(error)
        return self._fail(LinkBrokenError(f"link to {self._peer}: connection lost: {exc!r}"))

    def _peer_closed(self, code: object, reason: str | None) -> Exception:
        if self._closed:
            return LinkClosedError(f"link to {self._peer}: this side closed it")
        if code is None:
            text = f"the connection to {self._peer} was lost (code {self._ws.close_code})"
        else:
            text = f"{self._peer} closed the link (code {code}"
            text += f": {reason})" if reason else ")"
        return self._fail(LinkBrokenError(text))


async def accept_websocket(
    request: web.Request,
    *,
    clock: Clock,
    max_frame_bytes: int | None,
    shaping: LinkSpec | None = None,
    heartbeat: float | None = None,
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT_S,
) -> WebSocketLink:
    """Answer a websocket upgrade ``request`` in an aiohttp handler and wrap it as a link.

    Authenticate the request before calling this. The handler must not return before it
    is done with the link (returning closes the websocket); it returns
    ``link.response``, as aiohttp requires. ``heartbeat``: seconds
    between aiohttp pings (None: off); ``close_timeout``: real seconds to wait for the
    peer's closing handshake.

    Raises:
        RemoteProtocolError: the request is not a valid websocket upgrade (answer 400).
        LinkBrokenError: the connection was lost during the handshake.
        ConfigError: an invalid limit, timeout or shaping.
    """
    _check_options(max_frame_bytes, shaping, heartbeat)
    ws: web.WebSocketResponse[Any] = web.WebSocketResponse(
        timeout=_check_timeout("close_timeout", close_timeout),  # also bounded by aclose
        heartbeat=heartbeat,
        compress=False,
        max_msg_size=_aiohttp_max_msg_size(max_frame_bytes),
    )
    peer = f"websocket client {request.remote or '?'}"
    try:
        await ws.prepare(request)
    except web.HTTPException as exc:
        raise RemoteProtocolError(f"{peer}: not a websocket upgrade: {exc.reason}") from exc
    except _FOREIGN_ERRORS as exc:
        raise LinkBrokenError(f"{peer}: lost during the websocket handshake: {exc!r}") from exc
    return WebSocketLink(ws, clock=clock, max_frame_bytes=max_frame_bytes, shaping=shaping,
                         close_timeout=close_timeout, peer=peer)


@contextlib.asynccontextmanager
async def open_websocket_link(
    url: str,
    *,
    clock: Clock,
    token: str | None = None,
    max_frame_bytes: int | None,
    shaping: LinkSpec | None = None,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT_S,
    heartbeat: float | None = None,
    ssl: ssl_module.SSLContext | bool = True,
) -> AsyncIterator[WebSocketLink]:
    """Connect to the websocket at ``url`` and yield it as a link; closes it on exit.

    Sends ``Authorization: Bearer <token>`` when ``token`` is given. Owns its aiohttp
    ``ClientSession``. ``connect_timeout`` bounds the connection and the handshake,
    ``close_timeout`` the closing handshake (real seconds); ``heartbeat``: seconds
    between aiohttp pings (None: off); ``ssl``: as aiohttp's (True: verify certificates).

    Raises:
        AuthenticationError: the server answered the handshake with HTTP 401 or 403;
            the message says the server's reason (RFC 6750's ``WWW-Authenticate``) and
            what to do (`aiopipe.auth.explain_refusal`).
        LinkBrokenError: the server cannot be reached or refused the upgrade (the
            message names the URL; for HTTP 429, why).
        ConfigError: the URL or an option is invalid.
    """
    _check_options(max_frame_bytes, shaping, heartbeat)
    connect_s = _check_timeout("connect_timeout", connect_timeout)
    close_s = _check_timeout("close_timeout", close_timeout)
    async with aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else None
        try:
            ws = await wait_for(
                clock,
                session.ws_connect(
                    url,
                    headers=headers,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=close_s),
                    heartbeat=heartbeat,
                    compress=0,
                    max_msg_size=_aiohttp_max_msg_size(max_frame_bytes),
                    ssl=ssl,
                ),
                connect_s,
            )
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in (401, 403, 429):  # the server's reason, and what to do
                challenges = exc.headers.getall("WWW-Authenticate", []) if exc.headers else []
                said = explain_refusal(url, exc.status, challenges, token)
                if exc.status == 429:  # turned away for now: `turned_away`
                    raise LinkBrokenError(said) from exc
                raise AuthenticationError(said) from exc
            raise LinkBrokenError(
                f"cannot open a websocket to {url}: HTTP {exc.status} {exc.message}"
            ) from exc
        except aiohttp.ClientSSLError as exc:  # before ValueError: a certificate error is one
            raise LinkBrokenError(f"cannot connect to {url}: TLS failed: {exc}") from exc
        except (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError, ValueError) as exc:
            raise ConfigError(f"invalid websocket URL {url!r}: {exc}") from exc
        except TimeoutError as exc:
            raise LinkBrokenError(
                f"cannot connect to {url}: no handshake within {connect_s:g} s"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise LinkBrokenError(f"cannot connect to {url}: {exc!r}") from exc
        link = WebSocketLink(ws, clock=clock, max_frame_bytes=max_frame_bytes, shaping=shaping,
                             close_timeout=close_s, peer=url)
        try:
            yield link
        finally:
            await link.aclose()


def turned_away(error: LinkBrokenError) -> bool:
    """Whether ``error``, from `open_websocket_link`, says that the listener was reached
    and turned the connection away for now (HTTP 5xx or 429 at the upgrade, such as 503
    for a full accept queue, or the connection reset or closed on the way), so that trying
    again later may succeed; False when it was not reached at all (nothing listens there,
    no route, TLS failed, nothing answered in time) or answered for good (HTTP 404, say)."""
    cause = error.__cause__
    if isinstance(cause, aiohttp.WSServerHandshakeError):
        return cause.status >= 500 or cause.status == 429
    if isinstance(cause, aiohttp.ServerDisconnectedError | ConnectionResetError
                  | ConnectionAbortedError | BrokenPipeError):
        return True
    return (isinstance(cause, aiohttp.ClientOSError)
            and not isinstance(cause, aiohttp.ClientConnectorError | aiohttp.ClientSSLError)
            and cause.errno in (errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE))


def _aiohttp_max_msg_size(max_frame_bytes: int | None) -> int:
    # aiohttp refuses a message whose size is >= max_msg_size; 0 means no limit. A frame
    # above CHUNK_BYTES arrives in parts of CHUNK_BYTES + a header ([Note: chunked frames]);
    # the link checks the frame's own limit.
    if max_frame_bytes is None:
        return 0
    if max_frame_bytes <= CHUNK_BYTES:
        return max_frame_bytes + 1
    return CHUNK_BYTES + _CHUNK_HEADER + 1


def _check_options(
    max_frame_bytes: int | None, shaping: LinkSpec | None, heartbeat: float | None = None
) -> None:
    if max_frame_bytes is not None and (
        isinstance(max_frame_bytes, bool)
        or not isinstance(max_frame_bytes, int)
        or max_frame_bytes < 0
    ):
        raise ConfigError(f"max_frame_bytes must be a non-negative int, got {max_frame_bytes!r}")
    if shaping is not None and not isinstance(shaping, LinkSpec):
        raise ConfigError(f"shaping must be a LinkSpec or None, got {type(shaping).__name__}")
    if heartbeat is not None:
        _check_timeout("heartbeat", heartbeat)


def _check_timeout(name: str, seconds: float) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ConfigError(f"{name} must be a positive number of seconds, got {seconds!r}")
    return float(seconds)


def _encode_reason(reason: str) -> bytes:
    data = reason.encode("utf-8")[:_MAX_REASON_BYTES]
    return data.decode("utf-8", errors="ignore").encode("utf-8")


def _count(stats: DirectionStatistics, size: int, busy_s: float) -> DirectionStatistics:
    return DirectionStatistics(stats.frames + 1, stats.bytes + size, stats.busy_s + busy_s)
