"""The `Link` interface: how the runtime talks to one peer.

A link carries whole frames (``bytes``) in both directions, in order. It knows nothing
of messages; `aiopipe.protocol` turns messages into frames. Every implementation passes
the shared conformance suite in ``tests/transport/conformance.py``.

Closing: ``aclose(reason)`` is idempotent and never raises. Frames this side finished
sending before it closed still reach the peer, which drains them and then gets
`LinkBrokenError` naming the reason. A websocket waits (at most its ``close_timeout``)
for the peer to read up to the close frame; a link whose peer is receiving closes at once.

Cancellation: cancelling ``receive`` never loses a frame (the next ``receive`` returns
it). A cancelled ``send`` may or may not have delivered its frame; the link stays usable.

Busy time: ``sent.busy_s`` is the time this side's sending direction spent transmitting:
for a shaped link, the time the bytes occupy the wire at its rate; for an unshaped
websocket, from each frame's send to the peer's acknowledgement of its last byte, where
the platform tells (Linux; `aiopipe.transport.wire_timer`), else the time spent inside
``send``. ``send`` returns the frame's `WireSpan` where it ends after ``send`` returns,
None where the time inside ``send`` was the wire time. ``received.busy_s`` is the wire
time of the frames this side received, where the implementation knows it (memory
links), else 0.0.

Shaping: ``reshape(spec)`` changes how this end's sends are shaped from now on; every
link takes it, so a caller paces its sends without asking what kind of link it holds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from aiopipe.transport.network import LinkSpec

__all__ = ["DirectionStatistics", "Link", "LinkStatistics", "WireSpan"]

#: The clock times (start, end) a frame occupied the wire, once known; cancelled when the
#: link closed first.
WireSpan: TypeAlias = asyncio.Future[tuple[float, float]]


@dataclass(frozen=True, slots=True)
class DirectionStatistics:
    """Totals for one direction of a link since it was opened."""

    frames: int = 0
    bytes: int = 0
    busy_s: float = 0.0


@dataclass(frozen=True, slots=True)
class LinkStatistics:
    """Totals for both directions of a link, as seen from this side."""

    sent: DirectionStatistics
    received: DirectionStatistics


class Link(Protocol):
    """A reliable, ordered, frame-oriented connection to one peer."""

    async def send(self, frame: bytes, *, ready_at: float | None = None) -> WireSpan | None:
        """Transmit one frame; returns when it has left this side (after any shaping).

        Returns None when the time inside this call was the frame's wire time (a paced
        link), else the frame's `WireSpan` (an unshaped websocket: see the module docs).

        ``ready_at``: the clock time the frame was ready to go, when that was before this
        call (a queue of frames sent one after another). A link that shapes its sends
        starts the frame's wire slot at the later of that time and the previous slot's
        end, not at this call (memory.py, [Note: wire slots do not drift]); other links
        ignore it.

        Raises:
            LinkClosedError: this side closed the link.
            LinkBrokenError: the peer closed it or the network broke it.
            LocalProtocolError: the frame is larger than the link's frame limit.
        """
        ...

    async def receive(self) -> bytes:
        """Wait for the next frame from the peer.

        Raises:
            LinkClosedError: this side closed the link.
            LinkBrokenError: the peer closed it (after every frame it sent was received)
                or the network broke it.
            FrameTooLargeError: the peer sent a frame above the link's frame limit.
        """
        ...

    async def aclose(self, reason: str = "") -> None:
        """Close both directions; idempotent, never raises.

        Every pending or later ``send``/``receive`` on this side raises `LinkClosedError`.
        The peer receives what this side had already sent, then `LinkBrokenError` whose
        message carries ``reason`` (a websocket truncates it to 123 bytes of UTF-8).
        """
        ...

    def statistics(self) -> LinkStatistics:
        """Frames, bytes and busy seconds per direction since the link opened."""
        ...

    def last_received(self) -> float:
        """Clock time the last bytes from the peer arrived, a part of a frame included
        (``-inf`` before any): a watchdog's sign of life while a large frame is still
        arriving."""
        ...

    def times_the_wire(self) -> bool:
        """Whether the time a send takes (inside ``send``, or its `WireSpan`) is the
        frame's time on the wire: memory links; websockets shaped on this side, or timed
        by acknowledgements (Linux). Elsewhere an unshaped websocket's ``send`` returns
        once the OS has buffered the frame, which can hide hundreds of kilobytes of a
        slow link."""
        ...

    def reshape(self, spec: LinkSpec) -> None:
        """Shape this end's sends at ``spec`` from now on (an unshaped spec: unshaped).

        Each link does what it can emulate: a memory link changes its outgoing
        direction's bandwidth and latency, exactly; a websocket paces its sends at the
        bandwidth on this side (sender-side shaping: latency is not emulated, and the
        real network stays as it is). A device that emulates a slow uplink
        (``shape_uplink``) calls it on every link it sends on.

        Raises:
            ConfigError: ``spec`` is not a `LinkSpec`.
        """
        ...
