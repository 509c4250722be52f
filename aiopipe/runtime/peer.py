"""A `Link` plus the codec: typed messages in and out, with a serial, traced send queue.

Sends that belong to the pipeline (activations, gradients, models) are *posted*: they go
into a FIFO queue that one send loop drains, so compute never waits for the wire and the
wire is a serial resource (DESIGN §4). Each transmission is recorded as a slice on the
link's trace track, e.g. ``u`` for an activation on ``device0/uplink``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiopipe.clock import Clock, ready_time
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import Message, decode, encode
from aiopipe.transport import Link

__all__ = ["Peer"]


@dataclass(frozen=True, slots=True)
class _Posted:
    message: Message
    name: str
    epoch: int
    iteration: int
    micro_batch: int
    sent: asyncio.Future[None]
    posted_at: float  # clock time: the frame is ready from then on


class Peer:
    """Messages over a link; a send queue drained by `send_loop`.

    The queue outlives a link: after a reconnection, set `link` to the new one and start
    a new send loop; what was still queued goes out on it. The message being sent when a
    link broke is lost; the protocol re-sends what matters (see the session's
    [Note: reconnection]).
    """

    def __init__(self, link: Link, clock: Clock, recorder: Recorder, track: str, *,
                 max_frame_bytes: int | None) -> None:
        self.link = link
        self.track = track
        self.max_frame_bytes = max_frame_bytes
        self._clock = clock
        self._recorder = recorder
        self._queue: asyncio.Queue[_Posted | None] = asyncio.Queue()

    async def receive(self) -> Message:
        """Next message from the peer.

        Raises:
            RemoteProtocolError: the frame is not a valid message.
            TransportError: the link is closed or broken.
        """
        return decode(await self.link.receive(), max_frame_bytes=self.max_frame_bytes)

    async def send(self, message: Message) -> None:
        """Send at once, outside the queue (handshake and control messages).

        Raises:
            TransportError: the link is closed or broken.
        """
        await self.link.send(encode(message))

    def post(self, message: Message, name: str, *, epoch: int = -1, iteration: int = -1,
             micro_batch: int = -1, ready_at: float | None = None) -> asyncio.Future[None]:
        """Queue a message for the send loop; the slice ``name`` records its transfer.

        ``ready_at``: the clock time the message was ready, when before now (an emulated
        slow device's item ended then and woke its caller late); by default, now. A
        shaped link starts its wire slot no earlier (see `Link.send`).

        Returns a future that resolves once the message has been sent (awaiting it is
        optional; it stays pending if the send failed).
        """
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Posted(message, name, epoch, iteration, micro_batch, sent,
                                       ready_time(self._clock, ready_at)))
        return sent

    def clear(self) -> None:
        """Drop everything still queued (before re-posting it after a reconnection)."""
        while not self._queue.empty():
            self._queue.get_nowait()

    def finish(self) -> None:
        """Let the send loop end after what is already queued."""
        self._queue.put_nowait(None)

    async def send_loop(self) -> None:
        """Send posted messages in order until `finish` is called.

        Raises:
            TransportError: the link is closed or broken.
        """
        while (item := await self._queue.get()) is not None:
            frame = encode(item.message)
            start = self._clock.now()
            # a shaped link's wire slot may start when the frame was posted, not after
            # the previous send's late wake-up (memory.py, [Note: wire slots do not
            # drift]); a failed send loses this item: see the class
            await self.link.send(frame, ready_at=item.posted_at)
            self._recorder.add(self.track, item.name, start, self._clock.now(),
                               epoch=item.epoch, iteration=item.iteration,
                               micro_batch=item.micro_batch)
            if not item.sent.done():
                item.sent.set_result(None)
