"""The send queue: posted frames keep a shaped link busy at its bandwidth."""

from __future__ import annotations

import asyncio

import pytest
from late_clock import LateClock

from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import Heartbeat, encode
from aiopipe.runtime.peer import Peer
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
