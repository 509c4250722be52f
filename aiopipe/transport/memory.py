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

Faults for tests (`aiopipe.testing`): `MemoryLink.hold` stalls a direction, frames
that would arrive during the stall wait at the far end and are delivered, in order, when
it ends (nothing is lost; the sender's wire keeps going, as if the network buffered
them); `MemoryLink.reshape` with ``seconds`` changes a direction's shape for a while.
Both are kept as clock times and read when a frame is sent or received, so they need no
task of their own and work on any clock.

[Note: wire slots do not drift] A frame's slot starts when the wire frees or when the
frame was ready (its ``send`` was called, or the ``ready_at`` its sender gives),
whichever is later, not when the send got going after the previous one. On the real
clock a sleep wakes late (the event loop rounds timers up to the millisecond), so the
previous send returns, and the next send of a queue gets going, that much after the
previous slot ended. Starting the next slot from there would add the delay to every
frame of a busy link, which would then carry less than its bandwidth, the more so the
shorter its frames' wire time.
The runtime's send loop (`aiopipe.runtime.peer`) passes each frame's posting time as
``ready_at``. Each send still returns up to one late wake-up after its slot ends,
without adding up. Under a `VirtualClock`, sleeps are exact and nothing changes.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from aiopipe.clock import Clock, ready_time
from aiopipe.errors import ConfigError, LinkBrokenError, LinkClosedError, LocalProtocolError
from aiopipe.light_event import LightEvent
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
        self.base_spec = spec
        self.temporary: tuple[LinkSpec, float] | None = None  # (spec, until) from reshape
        self.held_since = math.inf  # frames arriving from then on wait ...
        self.held_until = -math.inf  # ... until then (inf: until released)
        #: (a list: short, and an empty deque is 760 bytes, an empty list 56)
        self.frames: list[_InFlight] = []
        self.wire_free_at = float("-inf")
        self.on_wire_since: float | None = None  # wire slot start of the frame on it
        self.send_lock = asyncio.Lock()
        self.receive_lock = asyncio.Lock()
        self.sender_closed = False
        self.close_reason = ""
        self.receiver_closed = False
        self.broken: str | None = None
        self.stop_sending = LightEvent()  # any closure or break
        self.stop_receiving = LightEvent()  # receiver closed or broken
        self.changed = LightEvent()  # a frame was queued, or any closure or break
        self.timing = LightEvent()  # a hold changed, or the receiver closed or broke

    def spec_at(self, now: float) -> LinkSpec:
        """The shape a frame whose wire slot starts at ``now`` gets."""
        if self.temporary is not None and now < self.temporary[1]:
            return self.temporary[0]
        return self.base_spec

    def holding(self, now: float) -> bool:
        """Whether frames arriving at ``now`` are held."""
        return self.held_since <= now < self.held_until

    def due(self, frame: _InFlight) -> float:
        """When ``frame`` is delivered: on arrival, or when the hold it arrived in ends."""
        if self.held_since < frame.deliver_at < self.held_until:
            return self.held_until
        return frame.deliver_at

    def hold(self, now: float, until: float) -> None:
        if not self.holding(now):
            self.held_since = now
        self.held_until = until
        self.timing.set()

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
        self.timing.set()

    def break_(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
        self.frames.clear()
        self.stop_sending.set()
        self.stop_receiving.set()
        self.changed.set()
        self.timing.set()


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
            now = clock.now()
            start = max(called, out.wire_free_at)  # [Note: wire slots do not drift]
            spec = out.spec_at(start)
            wire_s = spec.wire_time(size)
            end = start + wire_s
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
            out.frames.append(_InFlight(end + spec.latency_s, frame, wire_s))
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
                    now, due = clock.now(), incoming.due(head)
                    if due <= now:
                        incoming.frames.pop(0)
                        self._last_received = due
                        self._received = _count(self._received, len(head.data), head.wire_s)
                        return head.data
                    incoming.timing.clear()  # a release or a new hold moves ``due``
                    if due == math.inf:  # held until released
                        await incoming.timing.wait()
                    else:
                        await sleep_unless_set(clock, due - now, incoming.timing)
                elif incoming.sender_closed:
                    raise LinkBrokenError(_closed_by_peer(incoming.close_reason))
                else:
                    incoming.changed.clear()
                    await incoming.changed.wait()

    def times_the_wire(self) -> bool:
        """Always: a frame's send ends when its wire slot does (immediately when
        unshaped)."""
        return True

    def last_received(self) -> float:
        """Clock time the last bytes from the peer arrived: now while a frame's bytes are
        arriving (from its wire slot's start plus latency until its delivery), else when
        the last frame arrived."""
        incoming, now = self._in, self._clock.now()
        # a hold stops the bytes where they are: nothing arrives after it began
        cutoff = min(now, incoming.held_since) if incoming.holding(now) else now
        starts = [incoming.frames[0].deliver_at - incoming.frames[0].wire_s] if (
            incoming.frames) else []
        if incoming.on_wire_since is not None:
            starts.append(incoming.on_wire_since + incoming.spec_at(incoming.on_wire_since)
                          .latency_s)
        if any(start <= cutoff for start in starts):
            return max(cutoff, self._last_received)
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

    @property
    def spec(self) -> LinkSpec:
        """The shape of this end's outgoing direction now (`reshape`)."""
        return self._out.spec_at(self._clock.now())

    def reshape(self, spec: LinkSpec, *, seconds: float | None = None) -> None:
        """Change the bandwidth and latency of this end's outgoing direction
        (`Link.reshape`: a memory link emulates the whole spec).

        Applies to frames whose wire slot starts from now on (a slower or faster network):
        for good, or, with ``seconds``, to those whose slot starts in the next ``seconds``
        of the clock; later ones get the shape it had before (a temporary shape replaces
        the one under way; a lasting one ends it).

        Raises:
            ConfigError: ``spec`` is not a `LinkSpec`, or ``seconds`` is not a
                non-negative number.
        """
        if not isinstance(spec, LinkSpec):
            raise ConfigError(f"reshape needs a LinkSpec, got {type(spec).__name__}")
        if seconds is None:
            self._out.base_spec, self._out.temporary = spec, None
        else:
            self._out.temporary = (spec, self._clock.now() + _duration(seconds))

    def hold(self, seconds: float | None = None) -> None:
        """Stall this end's outgoing direction: frames that reach the peer from now on
        wait there, and are delivered in order, when ``seconds`` of the clock have passed
        (None: when `release` is called). Nothing is lost; sends go on at the wire's pace
        (the network buffers what it cannot deliver), and while held the peer's
        `last_received` stands still. A hold while one is under way moves its end.

        Raises:
            ConfigError: ``seconds`` is not a non-negative number.
        """
        now = self._clock.now()
        until = math.inf if seconds is None else now + _duration(seconds)
        self._out.hold(now, until)

    def release(self) -> None:
        """End a `hold` of this end's outgoing direction now: the frames it held are
        delivered at once, in order. Nothing happens when none is under way."""
        now = self._clock.now()
        if self._out.holding(now):
            self._out.hold(now, now)

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


def _duration(seconds: object) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not (
            0 <= seconds < math.inf):
        raise ConfigError(f"seconds must be a finite number >= 0, got {seconds!r}")
    return float(seconds)


def _count(stats: DirectionStatistics, size: int, wire_s: float) -> DirectionStatistics:
    return DirectionStatistics(stats.frames + 1, stats.bytes + size, stats.busy_s + wire_s)


def _closed_by_peer(reason: str) -> str:
    return f"the peer closed the link: {reason}" if reason else "the peer closed the link"
