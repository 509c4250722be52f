"""A stolen or replayed token cannot displace the honest device (issue: hold against
hostile peers; [Note: a session is bound to its connection]). A second connection that
authenticates as device 1 while device 1 trains is refused as busy each time, and the
run computes exactly what an undisturbed run computes."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from fleet import COSTS, WIRE, suite_fleet
from test_runtime_faults import CONFIG

from aiopipe import VirtualClock, simulate
from aiopipe.errors import AiopipeError
from aiopipe.protocol import PROTOCOL_VERSION, ErrorMessage, Hello, Plan, decode, encode
from aiopipe.testing import Fleet
from aiopipe.transport import open_memory_link_pair


async def _replay(fleet: Fleet, device_id: int, session: int) -> object:
    """Open a connection authenticated as ``device_id`` (as its token would) and say its
    hello with ``session``; what the server answers."""
    mine, server_end = open_memory_link_pair(fleet.clock, a_to_b=WIRE, b_to_a=WIRE)

    async def serve() -> None:
        with contextlib.suppress(AiopipeError):
            await fleet.node.serve_link(server_end, device_id=device_id)

    fleet.spawn(serve())
    await mine.send(encode(Hello(PROTOCOL_VERSION, device_id, session, "")))
    answer = decode(await mine.receive())
    await mine.aclose()
    return answer

@pytest.mark.slow
async def test_ten_token_replays_while_the_device_trains_change_nothing() -> None:
    clock = VirtualClock()
    answers: list[object] = []
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(CONFIG, clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        for i in range(10):
            round_no = 2 + i // 2  # from the run's second round (rounds count from 1)
            seen = i % 2
            await fleet.until(lambda r=round_no, n=seen: fleet.activations_in(1, r) > n)  # type: ignore[misc]
            answers.append(await _replay(fleet, 1, session=i))  # no secret, or a wrong one
        result = await training
    await clock.aclose()
    assert all(isinstance(a, ErrorMessage) and a.code == "busy" for a in answers), answers
    assert [e.device_samples for e in result.epochs] == [(80, 80, 80)] * 3
    assert [e.devices_lost for e in result.epochs] == [(), (), ()]
    undisturbed = await simulate(CONFIG, clock=VirtualClock(), cost_table=COSTS)
    got, want = result.model.state_dict(), undisturbed.model.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)

async def test_a_hello_with_the_sessions_secret_takes_the_session_over() -> None:
    """The device's own reconnection (it holds the secret) supersedes a stalled link."""
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(CONFIG.replace(epochs=1), clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: fleet.activations_in(1, 1) > 0)
        secret = fleet.node.sessions[1].nonce
        answer = await _replay(fleet, 1, session=secret)
        assert isinstance(answer, Plan)
        assert answer.session == secret
        # that connection is gone now: the device loses its link and comes back
        result = await training
    await clock.aclose()
    assert [e.device_samples for e in result.epochs] == [(80, 80, 80)]
