"""A device's peer links (aiopipe.runtime.peer_links) shape every link they hold at their
``pace`` through `Link.reshape`, whatever kind of link the endpoint gives them: here
memory links, which are not websockets, dialed and accepted alike."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from aiopipe import VirtualClock
from aiopipe.auth import new_run_secret, pair_key
from aiopipe.config import RunConfig
from aiopipe.metrics.trace import Recorder
from aiopipe.runtime.peer_links import PeerLinks
from aiopipe.transport import LinkSpec, MemoryEndpoint, MemoryFabric, MemoryLink

pytestmark = pytest.mark.timeout(30)

FABRIC_SHAPE = LinkSpec(1e6, 0.01)


@contextlib.asynccontextmanager
async def _peer_links(fabric: MemoryFabric, endpoint: MemoryEndpoint, peer: str, key: str,
                      pace: LinkSpec | None) -> AsyncIterator[PeerLinks]:
    async with PeerLinks.open(endpoint, me=endpoint.name, keys={peer: key}, clock=fabric.clock,
                              recorder=Recorder(), config=RunConfig(),
                              deliver=lambda *_: None, failed=lambda *_: None,
                              pace=pace) as links:
        yield links


@pytest.mark.parametrize("pace", [LinkSpec(5e6), None], ids=["paced", "unpaced"])
async def test_pace_reshapes_dialed_and_accepted_links_of_any_kind(
        pace: LinkSpec | None) -> None:
    clock = VirtualClock()
    fabric = MemoryFabric(clock, default=FABRIC_SHAPE)
    key = pair_key(new_run_secret(), "device0", "device1").hex()
    at0, at1 = fabric.endpoint("device0"), fabric.endpoint("device1")
    async with (_peer_links(fabric, at0, "device1", key, pace) as links0,
                _peer_links(fabric, at1, "device0", key, pace) as links1):
        dialed, accepted = await asyncio.gather(
            links0.route("device1", at1.address, dial=True),
            links1.route("device0", at0.address, dial=False))
        for route in (dialed, accepted):
            link = route.peer.link
            assert isinstance(link, MemoryLink)  # not a websocket: reshaped all the same
            assert link.spec == (pace or FABRIC_SHAPE)
    await asyncio.gather(at0.aclose(), at1.aclose())
    await clock.aclose()
