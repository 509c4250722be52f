"""A `Link` plus the codec: typed messages in and out, with a serial, traced send queue.

Sends that belong to the pipeline (activations, gradients, models) are *posted*: they go
into a FIFO queue that one send loop drains, so compute never waits for the wire and the
wire is a serial resource (DESIGN §4). Each transmission is recorded as a slice on the
link's trace track, e.g. ``u`` for an activation on ``device0/uplink``: the time the send
took, or, where the send returns before the bytes crossed (an unshaped websocket), the
frame's wire span the link reports once the peer acknowledged it (`Link.send`).

[Note: background sends] What the pipeline does not wait for (Asteroid's stage backups)
may be posted to the *background*: its frame is cut into `FramePart` messages of at most
`PART_BYTES`, queued in a second FIFO queue that the send loop drains only while the
first is empty, so such bytes travel in the link's idle time and delay a pipeline
message by at most one part's wire time (10 ms at 50 Mbit/s). A background frame
replaces the parts not yet sent of an earlier one of the same name (a newer backup
supersedes an older one the link had no time for). The receiving `Peer` joins
the parts (they arrive in order, other messages between them) and hands on the message
they make; a part out of order, or parts that outgrow the frame limit, are a protocol
error.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Callable
from dataclasses import dataclass

from aiopipe.clock import Clock, ready_time
from aiopipe.errors import RemoteProtocolError
from aiopipe.light_event import LightEvent
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import FramePart, Message, TensorData, decode, encode
from aiopipe.transport import Link

__all__ = ["PART_BYTES", "Peer"]

#: The most bytes of a frame one background part carries.
PART_BYTES = 64 * 1024


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
    """Messages over a link; a send queue drained by `send_loop`, or by tasks that run
    only while something is queued (`send_in`: a device that waits for its next round
    holds no sending task, [Note: idle links rest] in aiopipe.runtime.liveness).

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
        #: (lists: short, and an empty deque is 760 bytes; the background made when used)
        self._queue: list[_Posted | None] = []
        self._background: collections.deque[_Posted] | None = None
        self._posted = LightEvent()  # something was queued since the loop last looked
        self._tasks: asyncio.TaskGroup | None = None  # where `send_in` sends from
        self._sender: asyncio.Task[None] | None = None  # its task, while one runs
        self._joining: list[bytes] = []  # the parts of a background frame received so far
        self._joined = 0  # their bytes
        #: called with each message posted and its `post` future (a session wakes its
        #: resting link: aiopipe.runtime.liveness, [Note: idle links rest])
        self.on_post: Callable[[Message, asyncio.Future[None]], None] | None = None

    async def receive(self) -> Message:
        """Next message from the peer.

        Raises:
            RemoteProtocolError: the frame is not a valid message, or background parts
                break [Note: background sends].
            TransportError: the link is closed or broken.
        """
        while True:
            message = decode(await self.link.receive(), max_frame_bytes=self.max_frame_bytes)
            if not isinstance(message, FramePart):
                return message
            frame = self._join(message)
            if frame is not None:
                whole = decode(frame, max_frame_bytes=self.max_frame_bytes)
                if isinstance(whole, FramePart):
                    raise RemoteProtocolError("a frame part made of frame parts")
                return whole

    def _join(self, part: FramePart) -> bytes | None:
        """Add a background part; the whole frame once its last part came.

        Raises:
            RemoteProtocolError: out of order, or larger than the frame limit.
        """
        if part.index == 0:  # (a frame whose parts stopped coming, e.g. a dropped queue)
            self._joining, self._joined = [], 0
        elif part.index != len(self._joining):
            raise RemoteProtocolError(f"frame part {part.index} of {part.count} after "
                                      f"{len(self._joining)} parts")
        self._joining.append(bytes(part.data.data))
        self._joined += part.data.nbytes
        if self.max_frame_bytes is not None and self._joined > self.max_frame_bytes:
            self._joining, self._joined = [], 0
            raise RemoteProtocolError(f"frame parts of over {self.max_frame_bytes} bytes")
        if part.index + 1 < part.count:
            return None
        frame, self._joining, self._joined = b"".join(self._joining), [], 0
        return frame

    async def send(self, message: Message) -> None:
        """Send at once, outside the queue (handshake and control messages).

        Raises:
            TransportError: the link is closed or broken.
        """
        await self.link.send(encode(message))

    def post(self, message: Message, name: str, *, epoch: int = -1, iteration: int = -1,
             micro_batch: int = -1, ready_at: float | None = None,
             background: bool = False) -> asyncio.Future[None]:
        """Queue a message for the send loop; the slice ``name`` records its transfer.

        ``ready_at``: the clock time the message was ready, when before now (an emulated
        slow device's item ended then and woke its caller late); by default, now. A
        shaped link starts its wire slot no earlier (see `Link.send`). ``background``:
        send it only while nothing else is queued, in parts, instead of what is still
        queued of an earlier background ``name`` ([Note: background sends]).

        Returns a future that resolves once the message has been sent and its slice
        recorded: for a link that reports wire spans, once the peer acknowledged it
        (awaiting it is optional; it stays pending if the send failed).
        """
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ready = ready_time(self._clock, ready_at)
        if self.on_post is not None:
            self.on_post(message, sent)
        if not background:
            self._queue.append(_Posted(message, name, epoch, iteration, micro_batch, sent,
                                       ready))
            self._posted.set()
            self._send_queued()
            return sent
        parts = self._background = collections.deque(
            item for item in self._background or () if item.name != name)
        frame = memoryview(encode(message))
        count = max(1, -(-len(frame) // PART_BYTES))
        for k in range(count):
            piece = frame[k * PART_BYTES:(k + 1) * PART_BYTES]
            part = FramePart(k, count, TensorData("uint8", (len(piece),), piece))
            parts.append(_Posted(part, name, epoch, iteration, micro_batch,
                                 sent if k == count - 1 else _done(), ready))
        self._posted.set()
        self._send_queued()
        return sent

    def clear(self) -> None:
        """Drop everything still queued (before re-posting it after a reconnection)."""
        self._queue.clear()
        self._background = None

    def finish(self) -> None:
        """Let the send loop end after what is already queued."""
        self._queue.append(None)
        self._posted.set()
        self._send_queued()

    def send_in(self, tasks: asyncio.TaskGroup) -> None:
        """Send what is posted, in order, as `send_loop` does, from tasks of ``tasks``
        (a connection's task group), each running only while something is queued, until
        `finish`'s mark or `stop_sending`. A send's failure fails ``tasks``.

        The same scheduling as `send_loop`'s: a post makes the task that sends it where
        it would have woken the loop."""
        self._tasks = tasks
        self._send_queued()

    def stop_sending(self) -> None:
        """`send_in` no more: the send under way is cancelled (its message lost)."""
        self._tasks = None
        if self._sender is not None:
            self._sender.cancel()
            self._sender = None

    def _send_queued(self) -> None:
        """`send_in`'s: a task to send what is queued, unless one runs."""
        if self._tasks is None or (self._sender is not None and not self._sender.done()) or (
                not self._queue and not self._background):
            return
        sending = self._drain()
        try:
            self._sender = self._tasks.create_task(sending)
        except RuntimeError:  # the group is ending (its connection failed)
            sending.close()
            self._tasks = self._sender = None

    async def _drain(self) -> None:
        """Send what is queued, then end (`send_in`)."""
        while self._queue or self._background:
            item = self._pop()
            if item is None:  # `finish`: nothing more goes out over this connection
                self._tasks = None
                return
            await self._send(item)
            del item  # the message (a round's weights) is not kept

    async def send_loop(self) -> None:
        """Send posted messages in order until `finish` is called.

        Raises:
            TransportError: the link is closed or broken.
        """
        while (item := await self._next()) is not None:
            await self._send(item)
            del item  # the message (a round's weights) is not kept while we wait

    async def _send(self, item: _Posted) -> None:
        frame = encode(item.message)
        start = self._clock.now()
        # a shaped link's wire slot may start when the frame was posted, not after the
        # previous send's late wake-up (memory.py, [Note: wire slots do not drift]); a
        # failed send loses this item: see the class
        span = await self.link.send(frame, ready_at=item.posted_at)
        record = functools.partial(_record, self._recorder, self.track, item.name, item.epoch,
                                   item.iteration, item.micro_batch, item.sent)  # (no message)
        if span is None:  # the send lasted the frame's wire time
            record((start, self._clock.now()))
        else:  # its bytes are still crossing: recorded once the peer acknowledged them
            span.add_done_callback(lambda done: None if done.cancelled() else record(
                done.result()))

    async def _next(self) -> _Posted | None:
        """The next message to send: the queue's first, else the background's (module
        docstring); None once `finish` was called."""
        while not self._queue and not self._background:
            self._posted.clear()
            await self._posted.wait()
        return self._pop()

    def _pop(self) -> _Posted | None:
        if self._queue:
            return self._queue.pop(0)
        assert self._background is not None
        return self._background.popleft()


def _record(recorder: Recorder, track: str, name: str, epoch: int, iteration: int,
            micro_batch: int, sent: asyncio.Future[None], span: tuple[float, float]) -> None:
    """Record a transmission's slice, then say it was sent: who waits for ``sent`` (a
    device's report of its round) finds the slice recorded."""
    recorder.add(track, name, *span, epoch=epoch, iteration=iteration, micro_batch=micro_batch)
    if not sent.done():
        sent.set_result(None)


def _done() -> asyncio.Future[None]:
    """A future nobody awaits (a background part's but the last)."""
    return asyncio.get_running_loop().create_future()
