"""In-process links that charge each frame its wire time and latency on a `Clock`.

Theory of operation: a pair of `MemoryLink` ends shares two `_Direction` objects, one
per direction. A direction is a serial resource, like the uplink or downlink of DESIGN
§4: ``send`` takes the direction's FIFO lock, occupies the wire from
``max(called, wire_free_at)`` (``called``: when ``send`` was called, or its
``ready_at``) for
``len(frame) * 8 / bandwidth`` seconds (sleeping on the clock until the slot ends), then
queues the frame with a delivery time ``latency_s`` after the slot. ``receive`` waits
on the clock until the head frame's delivery time, so latency overlaps with the next
frame's transmission and no task is spawned to carry frames. With a `VirtualClock`
every timing is exact: a 1.25 MB frame at 10 Mbit/s with 20 ms latency, sent at t=0, is
received at t=1.02.

Closing is graceful, as with TCP: frames whose ``send`` returned before the sender
closed are still delivered on time; the receiver then gets `LinkBrokenError`. Frames
queued towards the side that closes are dropped. `MemoryLink.break_` simulates a dead
network: both ends fail at once and frames in flight are lost. A closure or break wakes
every sender and receiver waiting on the affected directions (no hangs until the end of
a long wire slot). The peer learns of a close immediately (not after ``latency_s``).

[Note: wire slots do not drift] A frame's slot starts when the wire frees or when the
frame was ready (its ``send`` was called, or the ``ready_at`` its sender gives),
whichever is later, not when the send got going after the previous one. On the real
clock a sleep wakes late (the event loop rounds timers up to the millisecond: 0.6 ms
on average here), so the previous send returns, and the next send of a queue gets
going, that much after the previous slot ended. Starting the next slot from there
added the delay to every frame of a busy link: vgg5's 66 kB activations on wifi
(10.5 ms on the wire) took 11.4 ms each, a link about 9% slower than its bandwidth.
The runtime's send loop (`aiopipe.runtime.peer`) passes each frame's posting time as
``ready_at``. Each send still returns up to one late wake-up after its slot ends,
without adding up. Under a `VirtualClock`, sleeps are exact and nothing changes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from aiopipe.clock import Clock, ready_time
from aiopipe.errors import ConfigError, LinkBrokenError, LinkClosedError, LocalProtocolError
from aiopipe.transport._waiting import sleep_unless_set
from aiopipe.transport.base import DirectionStatistics, LinkStatistics
from aiopipe.transport.network import LinkSpec

__all__ = ["MemoryLink", "open_memory_link_pair"]

_UNSHAPED = LinkSpec(None)


@dataclass(frozen=True, slots=True)
class _InFlight:
    deliver_at: float
    data: bytes
    wire_s: float


class _Direction:
    """One direction of a memory link pair: the wire, the frames on it, its state."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.frames: deque[_InFlight] = deque()
        self.wire_free_at = float("-inf")
        self.on_wire_since: float | None = None  # wire slot start of the frame on it
        self.send_lock = asyncio.Lock()
        self.receive_lock = asyncio.Lock()
        self.sender_closed = False
        self.close_reason = ""
        self.receiver_closed = False
        self.broken: str | None = None
        self.stop_sending = asyncio.Event()  # any closure or break
        self.stop_receiving = asyncio.Event()  # receiver closed or broken
        self.changed = asyncio.Event()  # a frame was queued, or any closure or break

    def close_sender(self, reason: str) -> None:
        self.sender_closed = True
        self.close_reason = reason
        self.stop_sending.set()
        self.changed.set()

    def close_receiver(self) -> None:
        self.receiver_closed = True
        self.frames.clear()
        self.stop_sending.set()
        self.stop_receiving.set()
        self.changed.set()

    def break_(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
        self.frames.clear()
        self.stop_sending.set()
        self.stop_receiving.set()
        self.changed.set()


class MemoryLink:
    """One end of an in-memory link pair made by `open_memory_link_pair`.

    Implements `aiopipe.transport.base.Link`; see the module docstring for the timing
    model. Frames are ``bytes``; other bytes-like objects are copied on ``send``.
    """

    def __init__(
        self,
        clock: Clock,
        outgoing: _Direction,
        incoming: _Direction,
        *,
        max_frame_bytes: int | None,
        name: str,
    ) -> None:
        self._clock = clock
        self._out = outgoing
        self._in = incoming
        self._max_frame_bytes = max_frame_bytes
        self._name = name
        self._closed = False
        self._sent = DirectionStatistics()
        self._received = DirectionStatistics()
        self._last_received = float("-inf")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._out.broken else "open"
        return f"<MemoryLink {self._name} {state}>"

    @property
    def max_frame_bytes(self) -> int | None:
        """The largest frame this link carries (None: no limit)."""
        return self._max_frame_bytes

    async def send(self, frame: bytes, *, ready_at: float | None = None) -> None:
        """Put ``frame`` on the wire; returns when its wire slot has ended.

        Sends in one direction are served one at a time, in the order they were made.
        ``ready_at``: see `Link.send`.
        If the link closes or breaks while this send waits or transmits, it fails at once.
        Cancelling it drops the frame.

        Raises:
            LinkClosedError: this side closed the link.
            LinkBrokenError: the peer closed it, or `break_` broke it.
            LocalProtocolError: the frame is larger than ``max_frame_bytes``.
        """
        if type(frame) is not bytes:
            frame = bytes(frame)
        size = len(frame)
        if self._max_frame_bytes is not None and size > self._max_frame_bytes:
            raise LocalProtocolError(
                f"frame of {size} bytes exceeds the link's limit of {self._max_frame_bytes} bytes"
            )
        out = self._out
        self._check_sendable()
        called = ready_time(self._clock, ready_at)
        async with out.send_lock:
            self._check_sendable()
            clock = self._clock
            wire_s = out.spec.wire_time(size)
            now = clock.now()
            # [Note: wire slots do not drift]
            end = max(called, out.wire_free_at) + wire_s
            out.wire_free_at = end
            out.on_wire_since = end - wire_s
            try:
                stopped = await sleep_unless_set(clock, end - now, out.stop_sending)
            except asyncio.CancelledError:
                out.wire_free_at = min(end, clock.now())
                raise
            finally:
                out.on_wire_since = None
            if stopped:
                self._check_sendable()
            out.frames.append(_InFlight(end + out.spec.latency_s, frame, wire_s))
            out.changed.set()
            self._sent = _count(self._sent, size, wire_s)

    async def receive(self) -> bytes:
        """Wait for the next frame and return it at its delivery time.

        Raises:
            LinkClosedError: this side closed the link.
            LinkBrokenError: the peer closed it (after every frame it had sent was
                received), or `break_` broke it.
        """
        incoming = self._in
        clock = self._clock
        self._check_receivable()
        async with incoming.receive_lock:
            await clock.sleep(0)
            while True:
                self._check_receivable()
                if incoming.frames:
                    head = incoming.frames[0]
                    now = clock.now()
                    if head.deliver_at <= now:
                        incoming.frames.popleft()
                        self._last_received = head.deliver_at
                        self._received = _count(self._received, len(head.data), head.wire_s)
                        return head.data
                    await sleep_unless_set(clock, head.deliver_at - now, incoming.stop_receiving)
                elif incoming.sender_closed:
                    raise LinkBrokenError(_closed_by_peer(incoming.close_reason))
                else:
                    incoming.changed.clear()
                    await incoming.changed.wait()

    def paces_sends(self) -> bool:
        """Always: a frame's send ends when its wire slot does (immediately when
        unshaped)."""
        return True

    def last_received(self) -> float:
        """Clock time the last bytes from the peer arrived: now while a frame's bytes are
        arriving (from its wire slot's start plus latency until its delivery), else when
        the last frame arrived."""
        incoming, now = self._in, self._clock.now()
        latency = incoming.spec.latency_s
        starts = [incoming.frames[0].deliver_at - incoming.frames[0].wire_s] if (
            incoming.frames) else []
        if incoming.on_wire_since is not None:
            starts.append(incoming.on_wire_since + latency)
        if any(start <= now for start in starts):
            return now
        return self._last_received

    async def aclose(self, reason: str = "") -> None:
        """Close both directions of this end; idempotent, never raises.

        Pending and later operations on this end raise `LinkClosedError`. The peer still
        receives every frame this end had finished sending, then `LinkBrokenError`
        carrying ``reason``; its sends fail with `LinkBrokenError`.
        """
        if not self._closed:
            self._closed = True
            self._out.close_sender(reason)
            self._in.close_receiver()
        await self._clock.sleep(0)

    def break_(self, reason: str = "the network failed") -> None:
        """Simulate a dead network: both ends' pending and later operations fail.

        Every ``send`` and ``receive`` on either end (unless that end had closed itself)
        raises `LinkBrokenError` with ``reason``; frames in flight are lost. Idempotent.
        """
        self._out.break_(reason)
        self._in.break_(reason)

    def reshape(self, spec: LinkSpec) -> None:
        """Change the bandwidth and latency of this end's outgoing direction.

        Applies to frames whose wire slot starts from now on (a slower or faster network).

        Raises:
            ConfigError: ``spec`` is not a `LinkSpec`.
        """
        if not isinstance(spec, LinkSpec):
            raise ConfigError(f"reshape needs a LinkSpec, got {type(spec).__name__}")
        self._out.spec = spec

    def statistics(self) -> LinkStatistics:
        """Frames, bytes and wire seconds sent and received by this end.

        ``busy_s`` is the wire time at the direction's bandwidth (0.0 when unshaped).
        """
        return LinkStatistics(sent=self._sent, received=self._received)

    def _check_sendable(self) -> None:
        out = self._out
        if out.sender_closed:
            raise LinkClosedError(f"{self._name}: this side closed the link")
        if out.broken is not None:
            raise LinkBrokenError(f"{self._name}: link broken: {out.broken}")
        if out.receiver_closed:
            raise LinkBrokenError(_closed_by_peer(self._in.close_reason))

    def _check_receivable(self) -> None:
        incoming = self._in
        if incoming.receiver_closed:
            raise LinkClosedError(f"{self._name}: this side closed the link")
        if incoming.broken is not None:
            raise LinkBrokenError(f"{self._name}: link broken: {incoming.broken}")


def open_memory_link_pair(
    clock: Clock,
    *,
    a_to_b: LinkSpec = _UNSHAPED,
    b_to_a: LinkSpec = _UNSHAPED,
    max_frame_bytes: int | None = None,
) -> tuple[MemoryLink, MemoryLink]:
    """Two connected `MemoryLink` ends ``(a, b)`` whose timing runs on ``clock``.

    ``a_to_b`` shapes what ``a`` sends (for a device ``a``: its uplink), ``b_to_a`` the
    other direction. ``max_frame_bytes`` limits frames both ways (None: no limit).

    Raises:
        ConfigError: a spec is not a `LinkSpec`, or ``max_frame_bytes`` is negative.
    """
    for label, spec in (("a_to_b", a_to_b), ("b_to_a", b_to_a)):
        if not isinstance(spec, LinkSpec):
            raise ConfigError(f"{label} must be a LinkSpec, got {type(spec).__name__}")
    if max_frame_bytes is not None and (
        isinstance(max_frame_bytes, bool)
        or not isinstance(max_frame_bytes, int)
        or max_frame_bytes < 0
    ):
        raise ConfigError(f"max_frame_bytes must be a non-negative int, got {max_frame_bytes!r}")
    forward, backward = _Direction(a_to_b), _Direction(b_to_a)
    a = MemoryLink(clock, forward, backward, max_frame_bytes=max_frame_bytes, name="a")
    b = MemoryLink(clock, backward, forward, max_frame_bytes=max_frame_bytes, name="b")
    return a, b


def _count(stats: DirectionStatistics, size: int, wire_s: float) -> DirectionStatistics:
    return DirectionStatistics(stats.frames + 1, stats.bytes + size, stats.busy_s + wire_s)


def _closed_by_peer(reason: str) -> str:
    return f"the peer closed the link: {reason}" if reason else "the peer closed the link"
