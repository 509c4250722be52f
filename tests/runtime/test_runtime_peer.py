"""The send queue: posted frames keep a shaped link busy at its bandwidth; background
frames go in parts in the link's idle time."""

from __future__ import annotations

import asyncio

import pytest
import torch
from late_clock import LateClock

from aiopipe import VirtualClock
from aiopipe.errors import RemoteProtocolError
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import FramePart, Heartbeat, Probe, encode, to_tensor_data
from aiopipe.runtime.peer import PART_BYTES, Peer
from aiopipe.transport import LinkSpec, open_memory_link_pair

pytestmark = pytest.mark.timeout(30)


async def test_posted_frames_go_out_back_to_back_despite_late_wake_ups() -> None:
    # [Note: wire slots do not drift]: the send loop tells the link when each frame was
    # posted, so a queue of frames leaves at the link's bandwidth even though every
    # send returns late
    clock = LateClock(late=0.01)
    size = len(encode(Heartbeat(0)))
    spec = LinkSpec(size * 8 / 0.1)  # 0.1 s on the wire per frame
    a, _ = open_memory_link_pair(clock, a_to_b=spec, b_to_a=spec)
    recorder = Recorder()
    peer = Peer(a, clock, recorder, "device0/uplink", max_frame_bytes=None)
    sent = [peer.post(Heartbeat(0), "u", micro_batch=n) for n in range(4)]
    peer.finish()
    await peer.send_loop()
    await asyncio.gather(*sent)
    ends = [s.end for s in recorder.slices]
    assert ends == pytest.approx([0.11, 0.21, 0.31, 0.41])


async def test_a_message_ready_before_it_was_posted_starts_on_the_wire_then() -> None:
    # an emulated slow device posts its activation after a late wake-up; the wire slot
    # starts when the forward ended (ready_at), not when the device got to posting
    clock = LateClock(late=0.01)
    size = len(encode(Heartbeat(0)))
    spec = LinkSpec(size * 8 / 0.1)
    a, _ = open_memory_link_pair(clock, a_to_b=spec, b_to_a=spec)
    recorder = Recorder()
    peer = Peer(a, clock, recorder, "device0/uplink", max_frame_bytes=None)
    await clock.sleep(0.49)  # now 0.5
    sent = peer.post(Heartbeat(0), "u", ready_at=0.45)
    peer.finish()
    await peer.send_loop()
    await sent
    assert [s.end for s in recorder.slices] == pytest.approx([0.56])  # 0.45 + 0.1, woken late


def _probe(size: int) -> Probe:
    return Probe(to_tensor_data(torch.arange(size, dtype=torch.int64).to(torch.uint8)))


async def test_background_frames_go_in_parts_between_pipeline_messages() -> None:
    """[Note: background sends]: a background frame goes in parts of at most PART_BYTES,
    only while nothing else is queued, and the receiver joins them into the message."""
    clock = VirtualClock()
    spec = LinkSpec(8 * PART_BYTES / 0.01)  # a part: 10 ms on the wire
    a, b = open_memory_link_pair(clock, a_to_b=spec, b_to_a=spec)
    sender = Peer(a, clock, Recorder(), "device0/uplink", max_frame_bytes=None)
    receiver = Peer(b, clock, Recorder(), "device1/downlink", max_frame_bytes=None)
    big = _probe(5 * PART_BYTES // 2)  # three parts
    done = sender.post(big, "backup", background=True)
    sender.post(Heartbeat(1), "u")
    loop = asyncio.create_task(sender.send_loop())
    first = await receiver.receive()
    assert first == Heartbeat(1)  # posted after, sent first: the background waits
    await clock.sleep(0.015)  # one part is on the wire
    sender.post(Heartbeat(2), "u")
    assert await receiver.receive() == Heartbeat(2)  # between the parts
    joined = await receiver.receive()
    assert isinstance(joined, Probe)
    assert bytes(joined.data.data) == bytes(big.data.data)
    await done
    sender.finish()
    await loop
    await clock.aclose()


async def test_a_newer_background_frame_replaces_the_unsent_parts_of_an_older_one() -> None:
    clock = VirtualClock()
    a, b = open_memory_link_pair(clock)
    sender = Peer(a, clock, Recorder(), "device0/uplink", max_frame_bytes=None)
    receiver = Peer(b, clock, Recorder(), "device1/downlink", max_frame_bytes=None)
    sender.post(_probe(3 * PART_BYTES), "backup", background=True)
    newer = _probe(PART_BYTES // 2)
    sender.post(newer, "backup", background=True)
    loop = asyncio.create_task(sender.send_loop())
    joined = await receiver.receive()  # the older one's parts went first: not this
    assert isinstance(joined, Probe)
    assert bytes(joined.data.data) == bytes(newer.data.data)
    sender.finish()
    await loop
    await clock.aclose()


@pytest.mark.parametrize(("parts", "match"), [
    ([(1, 3)], "frame part 1 of 3 after 0 parts"),
    ([(0, 3), (2, 3)], "frame part 2 of 3 after 1 parts"),
    ([(0, 40), (1, 40), (2, 40)], "frame parts of over"),
])
async def test_frame_parts_out_of_order_or_too_large_are_refused(
        parts: list[tuple[int, int]], match: str) -> None:
    clock = VirtualClock()
    a, b = open_memory_link_pair(clock)
    receiver = Peer(b, clock, Recorder(), "device1/downlink", max_frame_bytes=2 * PART_BYTES)
    data = to_tensor_data(torch.zeros(PART_BYTES, dtype=torch.uint8))
    for index, count in parts:
        await a.send(encode(FramePart(index, count, data)))
    with pytest.raises(RemoteProtocolError, match=match):
        await _receive_all(receiver)
    await clock.aclose()


async def _receive_all(peer: Peer) -> None:
    while True:
        await peer.receive()


async def test_send_in_runs_a_task_only_while_something_is_queued() -> None:
    """`Peer.send_in`: no task while the queue is empty; a post makes one that sends,
    in order, what is queued and ends; `finish` ends the sending, later posts wait."""
    clock = VirtualClock()
    a, b = open_memory_link_pair(clock, a_to_b=LinkSpec(1e6), b_to_a=LinkSpec(1e6))
    peer = Peer(a, clock, Recorder(), "device0/uplink", max_frame_bytes=None)

    def senders() -> int:
        return sum(1 for task in asyncio.all_tasks()
                   if task.get_coro().__qualname__ == "Peer._drain")  # type: ignore[union-attr]

    async with asyncio.TaskGroup() as tasks:
        peer.send_in(tasks)
        await asyncio.sleep(0)
        assert senders() == 0
        sent = [peer.post(Heartbeat(n), "u") for n in range(3)]
        assert senders() == 1
        await asyncio.gather(*sent)
        await asyncio.sleep(0)
        assert senders() == 0
        got = [await b.receive() for _ in range(3)]
        assert got == [encode(Heartbeat(n)) for n in range(3)]
        peer.finish()
        await asyncio.sleep(0)
        late = peer.post(Heartbeat(9), "u")  # after finish: not sent over this link
        await clock.sleep(1.0)
        assert not late.done()
        assert senders() == 0
    await clock.aclose()
