"""Memory links: exact timing in virtual time, closing, breaking, reshaping, holding."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from conformance import queued_send_returns
from late_clock import LateClock

from aiopipe.clock import SystemClock, VirtualClock, wait_for
from aiopipe.errors import ConfigError, LinkBrokenError, LinkClosedError, LocalProtocolError
from aiopipe.transport import LinkSpec, MemoryLink, open_memory_link_pair

pytestmark = pytest.mark.timeout(30)

MB_1_25 = 1_250_000  # 10 Mbit: one second at 10 Mbit/s, 0.4 s at 25 Mbit/s


@pytest.fixture
async def clock() -> AsyncIterator[VirtualClock]:
    virtual = VirtualClock()
    yield virtual
    await virtual.aclose()


def four_g(clock: VirtualClock) -> tuple[MemoryLink, MemoryLink]:
    """a = device, b = server on a 4G-like network with 20 ms latency each way."""
    return open_memory_link_pair(
        clock, a_to_b=LinkSpec(10e6, 0.02), b_to_a=LinkSpec(25e6, 0.02), max_frame_bytes=10**8
    )


async def test_frame_arrives_after_wire_time_plus_latency(clock: VirtualClock) -> None:
    a, b = four_g(clock)

    async def send() -> float:
        await a.send(bytes(MB_1_25))
        return clock.now()

    async def receive() -> float:
        assert len(await b.receive()) == MB_1_25
        return clock.now()

    sent_at, received_at = await asyncio.gather(send(), receive())
    assert sent_at == 1.0
    assert received_at == 1.02
    assert a.statistics().sent.busy_s == 1.0
    assert b.statistics().received.busy_s == 1.0
    assert a.times_the_wire()  # a send lasts the frame's wire time
    assert b.times_the_wire()


async def test_concurrent_sends_share_the_wire_in_call_order(clock: VirtualClock) -> None:
    a, b = four_g(clock)
    sent: dict[str, float] = {}

    async def send(tag: bytes) -> None:
        await a.send(tag * MB_1_25)
        sent[tag.decode()] = clock.now()

    async def receive_all() -> list[tuple[bytes, float]]:
        return [((await b.receive())[:1], clock.now()) for _ in range(3)]

    async with asyncio.TaskGroup() as tg:
        for tag in (b"x", b"y", b"z"):
            tg.create_task(send(tag))
        received = tg.create_task(receive_all())
    assert sent == {"x": 1.0, "y": 2.0, "z": 3.0}
    # Latency overlaps the next frame's transmission: 1.02, 2.02, 3.02 (not 2.04, ...).
    assert received.result() == [(b"x", 1.02), (b"y", 2.02), (b"z", 3.02)]
    assert a.statistics().sent.busy_s == 3.0


async def test_late_wake_ups_do_not_slow_a_busy_link() -> None:
    # [Note: wire slots do not drift]: each frame's slot starts when the previous one
    # ended, not when its sender woke (late) to release the wire
    clock = LateClock(late=0.01)
    a, _ = open_memory_link_pair(clock, a_to_b=LinkSpec(1e6), b_to_a=LinkSpec(1e6))
    returned = await queued_send_returns(a, clock, frames=4, frame_bytes=12_500)  # 0.1 s
    assert returned == pytest.approx([0.11, 0.21, 0.31, 0.41])
    # one sender, frames that were ready together: the same schedule
    clock = LateClock(late=0.01)
    a, _ = open_memory_link_pair(clock, a_to_b=LinkSpec(1e6), b_to_a=LinkSpec(1e6))
    returned = await queued_send_returns(a, clock, frames=4, frame_bytes=12_500,
                                         one_by_one=True)
    assert returned == pytest.approx([0.11, 0.21, 0.31, 0.41])


async def test_back_to_back_sends_from_one_task_pipeline_latency(clock: VirtualClock) -> None:
    a, b = four_g(clock)

    async def send_two() -> None:
        await a.send(bytes(MB_1_25))
        await a.send(bytes(MB_1_25 // 2))

    async def receive_two() -> list[float]:
        times = []
        for _ in range(2):
            await b.receive()
            times.append(clock.now())
        return times

    _, times = await asyncio.gather(send_two(), receive_two())
    assert times == [1.02, pytest.approx(1.52, abs=1e-12)]


async def test_directions_are_independent(clock: VirtualClock) -> None:
    a, b = four_g(clock)

    async def one_way(sender: MemoryLink, receiver: MemoryLink) -> float:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(sender.send(bytes(MB_1_25)))
            got = tg.create_task(receiver.receive())
        assert len(got.result()) == MB_1_25
        return clock.now()

    up, down = await asyncio.gather(one_way(a, b), one_way(b, a))
    assert up == 1.02
    assert down == pytest.approx(0.42, abs=1e-12)


async def test_idle_wire_starts_the_next_frame_at_once(clock: VirtualClock) -> None:
    a, b = four_g(clock)
    await a.send(bytes(125_000))  # 0.1 s
    await clock.sleep(5.0)
    start = clock.now()
    await a.send(bytes(125_000))
    assert clock.now() - start == pytest.approx(0.1, abs=1e-12)
    await b.receive()
    await b.receive()
    assert clock.now() == pytest.approx(5.2 + 0.02, abs=1e-12)


async def test_unshaped_direction_charges_only_latency(clock: VirtualClock) -> None:
    a, b = open_memory_link_pair(clock, a_to_b=LinkSpec(None, 0.05), b_to_a=LinkSpec(None))
    await a.send(bytes(10**6))
    assert clock.now() == 0.0
    assert len(await b.receive()) == 10**6
    assert clock.now() == 0.05
    await b.send(b"back")
    assert await a.receive() == b"back"
    assert clock.now() == 0.05
    assert a.statistics().sent.busy_s == 0.0


async def test_receive_timed_out_while_a_frame_travels_keeps_it(clock: VirtualClock) -> None:
    a, b = four_g(clock)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.send(b"p" * MB_1_25))
        with pytest.raises(TimeoutError):
            await wait_for(clock, b.receive(), 0.5)
        assert clock.now() == 0.5
        with pytest.raises(TimeoutError):
            await wait_for(clock, b.receive(), 0.51)  # the frame is on the wire till 1.02
        assert (await b.receive())[:1] == b"p"
        assert clock.now() == 1.02


async def test_sender_on_the_wire_fails_when_the_peer_closes(clock: VirtualClock) -> None:
    a, b = four_g(clock)

    async def close_later() -> None:
        await clock.sleep(0.3)
        await b.aclose("going away")

    async with asyncio.TaskGroup() as tg:
        tg.create_task(close_later())
        with pytest.raises(LinkBrokenError, match="going away"):
            await a.send(bytes(MB_1_25))
        assert clock.now() == 0.3  # at once, not at the end of the wire slot


async def test_senders_fail_when_their_own_side_closes(clock: VirtualClock) -> None:
    a, _ = four_g(clock)

    async def close_later() -> None:
        await clock.sleep(0.3)
        await a.aclose()

    async def send_expecting_closed() -> float:
        with pytest.raises(LinkClosedError):
            await a.send(bytes(MB_1_25))
        return clock.now()

    async with asyncio.TaskGroup() as tg:
        on_wire = tg.create_task(send_expecting_closed())
        queued = tg.create_task(send_expecting_closed())  # waits for the wire
        tg.create_task(close_later())
    assert on_wire.result() == 0.3
    assert queued.result() == 0.3


async def test_frames_in_flight_reach_the_peer_after_close(clock: VirtualClock) -> None:
    a, b = four_g(clock)
    await a.send(b"last" * 1000)
    await a.aclose("done")
    assert await b.receive() == b"last" * 1000
    assert clock.now() == pytest.approx(0.0032 + 0.02, abs=1e-12)
    with pytest.raises(LinkBrokenError, match="done"):
        await b.receive()
    with pytest.raises(LinkBrokenError, match="done"):
        await b.send(b"reply")


async def test_frames_towards_a_closing_side_are_dropped(clock: VirtualClock) -> None:
    a, b = four_g(clock)
    await a.send(b"unread")
    await b.aclose()
    with pytest.raises(LinkClosedError):
        await b.receive()
    with pytest.raises(LinkBrokenError):
        await a.send(b"more")


async def test_break_fails_both_sides_and_loses_frames_in_flight(clock: VirtualClock) -> None:
    a, b = four_g(clock)

    async def cut_later() -> None:
        await clock.sleep(1.01)  # the frame is sent (1.0) but not delivered (1.02)
        a.break_("cable cut")

    async def receive_at_a() -> float:
        with pytest.raises(LinkBrokenError, match="cable cut"):
            await a.receive()
        return clock.now()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(cut_later())
        pending_at_a = tg.create_task(receive_at_a())
        await a.send(bytes(MB_1_25))
        with pytest.raises(LinkBrokenError, match="cable cut"):
            await b.receive()
        assert clock.now() == 1.01
    assert pending_at_a.result() == 1.01
    for end in (a, b):
        with pytest.raises(LinkBrokenError):
            await end.send(b"x")
        with pytest.raises(LinkBrokenError):
            await end.receive()
    a.break_()  # idempotent
    await a.aclose()
    with pytest.raises(LinkClosedError):  # closed by us takes precedence over broken
        await a.send(b"x")
    assert b.statistics().received.frames == 0


async def test_reshape_slows_the_next_frames(clock: VirtualClock) -> None:
    a, b = four_g(clock)

    async def receive_times() -> list[float]:
        times = []
        for _ in range(2):
            await b.receive()
            times.append(clock.now())
        return times

    async with asyncio.TaskGroup() as tg:
        received = tg.create_task(receive_times())
        await a.send(bytes(125_000))  # 0.1 s at 10 Mbit/s
        a.reshape(LinkSpec(1e6, 0.5))
        start = clock.now()
        await a.send(bytes(125_000))  # 1 s at 1 Mbit/s
        assert clock.now() - start == pytest.approx(1.0, abs=1e-12)
    # The first frame keeps the old latency; the second gets the new one.
    assert received.result() == pytest.approx([0.12, 1.6], abs=1e-12)
    with pytest.raises(ConfigError):
        a.reshape("4g")  # type: ignore[arg-type]


async def test_a_temporary_shape_ends_on_its_own(clock: VirtualClock) -> None:
    a, b = four_g(clock)
    a.reshape(LinkSpec(1e6, 0.5), seconds=1.5)
    assert a.spec == LinkSpec(1e6, 0.5)
    received: list[float] = []

    async def receive(n: int) -> None:
        for _ in range(n):
            await b.receive()
            received.append(clock.now())

    sent: list[float] = []
    async with asyncio.TaskGroup() as tg:
        tg.create_task(receive(3))
        for _ in range(3):  # 1 s at 1 Mbit/s, slots from 0 and 1; 0.1 s at 10, from 2
            await a.send(bytes(125_000))
            sent.append(clock.now())
    assert sent == pytest.approx([1.0, 2.0, 2.1], abs=1e-12)
    # the third frame arrives at 2.12 but, in order, after the second (0.5 s latency)
    assert received == pytest.approx([1.5, 2.5, 2.5], abs=1e-12)
    assert a.spec == LinkSpec(10e6, 0.02)  # back to what it was
    a.reshape(LinkSpec(1e6), seconds=10)
    a.reshape(LinkSpec(2e6))  # a lasting shape ends the temporary one
    assert a.spec == LinkSpec(2e6)
    for bad in (-1, float("inf"), True):
        with pytest.raises(ConfigError, match="seconds"):
            a.reshape(LinkSpec(1e6), seconds=bad)


async def test_a_hold_delivers_every_frame_in_order_when_it_ends(clock: VirtualClock) -> None:
    a, b = four_g(clock)
    await a.send(b"before")  # arrives at 0.02, before the hold: not held (6 bytes: ~0)
    await clock.sleep(0.5)
    a.hold(2.0)  # from 0.5 to 2.5
    b.hold(0.1)  # the other direction's hold is its own
    received: list[tuple[bytes, float]] = []

    async def receive(n: int) -> None:
        for _ in range(n):
            received.append((await b.receive(), clock.now()))

    async def watch() -> float:
        await clock.sleep(1.0)
        return b.last_received()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(receive(4))
        seen = tg.create_task(watch())
        for tag in (b"x", b"y"):
            await a.send(tag * 125_000)  # 0.1 s each: they arrive at 0.62 and 0.72
        await clock.sleep(2.0)  # 2.7: after the hold
        await a.send(b"z")
    assert [data[:1] for data, _ in received] == [b"b", b"x", b"y", b"z"]
    assert [at for _, at in received] == pytest.approx([0.5, 2.5, 2.5, 2.72], abs=1e-4)
    assert seen.result() == pytest.approx(0.02, abs=1e-4)  # nothing arrived while held
    assert a.statistics().sent.frames == b.statistics().received.frames == 4


async def test_a_hold_until_released(clock: VirtualClock) -> None:
    a, b = four_g(clock)
    a.hold()
    await a.send(b"x")
    receiving = asyncio.ensure_future(b.receive())
    await clock.sleep(100.0)
    assert not receiving.done()
    a.release()
    assert await receiving == b"x"
    assert clock.now() == pytest.approx(100.0, abs=1e-4)
    a.release()  # none under way: nothing happens
    a.hold()
    b.break_("cut while held")
    with pytest.raises(LinkBrokenError, match="cut while held"):
        await b.receive()
    with pytest.raises(ConfigError, match="seconds"):
        a.hold(-1.0)


async def test_a_hold_on_the_system_clock() -> None:
    clock = SystemClock()
    a, b = open_memory_link_pair(clock)
    start = clock.now()
    a.hold(0.05)
    await a.send(b"x")
    assert await b.receive() == b"x"
    assert clock.now() - start >= 0.049  # asyncio may wake 1 ns early
    a.hold()
    await a.send(b"y")
    receiving = asyncio.ensure_future(b.receive())
    await asyncio.sleep(0.02)
    assert not receiving.done()
    a.release()
    assert await wait_for(clock, receiving, 1.0) == b"y"
    await a.aclose()
    await b.aclose()


async def test_bytes_like_frames_are_copied(clock: VirtualClock) -> None:
    a, b = four_g(clock)
    frame = bytearray(b"original")
    await a.send(frame)  # type: ignore[arg-type]
    frame[:] = b"mutated!"
    received = await b.receive()
    assert received == b"original"
    assert type(received) is bytes


async def test_frame_at_the_limit_passes_and_one_more_byte_is_refused(clock: VirtualClock) -> None:
    a, b = open_memory_link_pair(clock, max_frame_bytes=100)
    await a.send(bytes(100))
    assert len(await b.receive()) == 100
    with pytest.raises(LocalProtocolError, match="101 bytes"):
        await a.send(bytes(101))


def test_invalid_arguments_raise_config_error() -> None:
    clock = SystemClock()
    with pytest.raises(ConfigError):
        open_memory_link_pair(clock, a_to_b=10e6)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        open_memory_link_pair(clock, max_frame_bytes=-1)


async def test_shaping_on_the_system_clock_waits_at_least_the_wire_time() -> None:
    clock = SystemClock()
    a, b = open_memory_link_pair(clock, a_to_b=LinkSpec(8e6, 0.01))
    start = clock.now()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.send(bytes(100_000)))  # 0.1 s on the wire
        received = tg.create_task(b.receive())
    assert len(received.result()) == 100_000
    assert clock.now() - start >= 0.099  # a lower bound on sleeps (asyncio may wake 1 ns early)
    await a.aclose()
    await b.aclose()
