"""When a frame written to a TCP socket has crossed the wire: the peer's acknowledgements.

[Note: wire time from acknowledgements] An unshaped websocket's ``send`` returns once
the operating system has buffered the frame: a 12.8 kB activation on a 10 Mbit/s link
returns in 0.1 ms and then spends 10 ms on the wire. Busy time read from send calls
therefore shows a memory copy, not the link (issue 46 measured 0.02 s of uploads for
2.1 s of wire time). The truthful end of a frame's transmission is when its last byte
reached the peer; the sender learns it from the peer's acknowledgement, which Linux
counts in ``tcp_info.tcpi_bytes_acked``.

So after a send, `WireTimer.track` takes as the frame's last byte every byte written so
far: the bytes already acknowledged, plus those the kernel still holds (``TIOCOUTQ``:
unsent and unacknowledged), plus those still in asyncio's transport buffer. A poller
reads ``tcpi_bytes_acked`` every `POLL_S` while a frame is pending and resolves the
frame's future with the clock time the count reached it. The frame's wire span is then
[the later of its send and the previous frame's end, that time]: a serial resource, as
a shaped link's slots are.

What it measures: the time the frame occupied the path, plus the acknowledgement's way
back (a round trip's half: microseconds between namespaces, tens of milliseconds on the
internet) and up to `POLL_S` of polling. The receiving `WebSocketLink` asks its kernel
to acknowledge at once after each frame (``TCP_QUICKACK``), since a delayed
acknowledgement (up to 40 ms on Linux) would otherwise lengthen a small frame's span
several times over. With TLS the target counts plaintext still in the transport's buffer
as its ciphertext, a few bytes per 16 kB record short. Elsewhere than Linux (no
``TCP_INFO``) there is no timer and sends are timed as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import sys
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Literal

from aiopipe.clock import Clock
from aiopipe.transport.base import WireSpan

__all__ = ["POLL_S", "WireTimer", "acknowledge_at_once", "timer_for_websocket",
           "wire_timing_available"]

#: Seconds between two reads of the acknowledged count while a frame is pending.
POLL_S: Final = 0.001

_TCP_INFO_BYTES: Final = 256
_BYTES_ACKED_AT: Final = 120  # struct tcp_info: 8 bytes, 24 u32, then u64 pacing_rate,
# max_pacing_rate, bytes_acked (Linux >= 4.1)
_TIOCOUTQ: Final = 0x5411  # termios.TIOCOUTQ on Linux (SIOCOUTQ for a TCP socket)


def wire_timing_available() -> bool:
    """Whether this platform reports acknowledged bytes (Linux's ``TCP_INFO``)."""
    return sys.platform.startswith("linux") and hasattr(socket, "TCP_INFO")


def acknowledge_at_once(sock: Any) -> None:
    """Ask the kernel to acknowledge what ``sock`` receives next without delay (Linux's
    ``TCP_QUICKACK``, which the kernel clears again by itself); nothing elsewhere."""
    quickack = getattr(socket, "TCP_QUICKACK", None)
    if quickack is not None and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, quickack, 1)


def timer_for_websocket(ws: Any, clock: Clock) -> WireTimer | Literal[False]:
    """A timer for an aiohttp websocket's connection (its writer's transport holds the
    bytes not yet in the kernel), or False where there can be none."""
    transport = getattr(getattr(ws, "_writer", None), "transport", None)
    if transport is None:
        return False
    timer = WireTimer.for_socket(ws.get_extra_info("socket"), clock,
                                 transport.get_write_buffer_size)
    return False if timer is None else timer


class WireTimer:
    """The wire span of each frame written to one TCP socket: from its send (or the
    previous frame's end, if later) to the clock time its last byte was acknowledged
    ([Note: wire time from acknowledgements]); ``busy_s``, their total so far.

    Build it with `for_socket`; `close` cancels what is pending.
    """

    def __init__(self, sock: Any, clock: Clock, buffered: Callable[[], int]) -> None:
        self._sock = sock
        self._clock = clock
        self._buffered = buffered
        self._pending: deque[tuple[int, float, WireSpan]] = deque()
        self._poller: asyncio.Task[None] | None = None
        self._closed = False
        self._free_at = float("-inf")  # the last span's end
        self.busy_s = 0.0

    @classmethod
    def for_socket(cls, sock: Any, clock: Clock,
                   buffered: Callable[[], int]) -> WireTimer | None:
        """A timer for ``sock`` (``buffered()``: bytes written but still in user space),
        or None where the platform or the socket cannot tell acknowledged bytes."""
        if sock is None or not wire_timing_available():
            return None
        timer = cls(sock, clock, buffered)
        try:
            timer._acknowledged()
            timer._in_kernel()
        except (OSError, struct.error, ValueError):
            return None
        return timer

    def track(self, started: float) -> WireSpan:
        """The span of the frame whose send began at clock time ``started`` and whose
        bytes are the last written so far: resolved once they are all acknowledged.

        Raises:
            OSError: the socket no longer answers (a closed connection).
        """
        target = self._acknowledged() + self._in_kernel() + self._buffered()
        span: WireSpan = asyncio.get_running_loop().create_future()
        if self._closed:
            span.cancel()
            return span
        self._pending.append((target, started, span))
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        return span

    def close(self) -> None:
        """Stop polling; the futures still pending are cancelled."""
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
        while self._pending:
            self._pending.popleft()[2].cancel()

    async def _poll(self) -> None:
        while self._pending:
            try:
                acknowledged = self._acknowledged()
            except OSError:  # the connection is gone: its frames have no end
                self.close()
                return
            now = self._clock.now()
            while self._pending and self._pending[0][0] <= acknowledged:
                _, started, span = self._pending.popleft()
                start = max(started, self._free_at)  # a serial wire
                self._free_at = end = max(start, now)
                self.busy_s += end - start
                if not span.done():
                    span.set_result((start, end))
            if self._pending:
                await asyncio.sleep(POLL_S)

    def _acknowledged(self) -> int:
        info = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        return int(struct.unpack_from("Q", info, _BYTES_ACKED_AT)[0])

    def _in_kernel(self) -> int:
        answer = fcntl.ioctl(self._sock.fileno(), _TIOCOUTQ, b"\0\0\0\0")
        return int(struct.unpack("i", answer)[0])
