"""The device half of HADFL (§3): local steps, then the ring's partial
synchronisation over peer links ([Note: HADFL rounds] in
aiopipe.runtime.systems.hadfl.partial_sync); the ring's messages go to the device's
`PartialSync`, and a broken peer link is bypassed ([Note: HADFL bypass]) rather than
failing the round."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from functools import partial
from typing import Any

from aiopipe.errors import TrainingError
from aiopipe.protocol import (
    Message,
    RingBypass,
    RingChunk,
    RingHandshake,
    RoundStart,
    SyncedModel,
)
from aiopipe.runtime.device_half import DeviceHalf, Handler
from aiopipe.runtime.peer_links import PeerRoute
from aiopipe.runtime.systems.hadfl.partial_sync import PartialSync

__all__ = ["HADFLDevice"]

log = logging.getLogger("aiopipe.device")


class HADFLDevice(DeviceHalf):
    """HADFL's device (module docstring)."""

    sync: PartialSync | None = None

    def set_up(self) -> None:
        node = self.node
        self.sync = PartialSync(me=node.device_id, holdings=node.holdings,
                                compute=node.compute, clock=node.clock, costs=node.costs,
                                config=node.config, run_id=node.run_id, judge=node.judge)
        self._linking: set[asyncio.Future[None]] = set()  # links made ahead of need

    def handlers(self) -> Mapping[type[Message], Handler]:
        def ring(sender: str, message: Any) -> None:
            assert self.sync is not None  # (set up before the first round's messages)
            self.sync.deliver(sender, message)
        return dict.fromkeys((RingChunk, RingBypass, RingHandshake, SyncedModel), ring)

    def peer_failed(self, name: str, error: Exception) -> bool:
        if self.sync is not None:
            self.sync.peer_failed(name, error)
        return True

    async def run_round(self, start: RoundStart) -> int:
        """Local steps, the ring's average over peer links, then the result and report;
        samples.

        Raises:
            TrainingError: this device listens for no peers.
        """
        node, sync = self.node, self.sync
        assert sync is not None
        if node.peers is None:
            raise TrainingError(f"device {node.device_id} runs mode hadfl but listens for "
                                "no peers (start it with an endpoint: python -m "
                                "aiopipe.device --listen)")
        mark = len(node.recorder.slices)
        node.peers.limit(sync.frame_limit)
        peers = dict(start.peers)
        for name in peers:  # the side whose name sorts first dials
            if node.name < name:
                task = asyncio.ensure_future(self._link_quietly(name, peers))
                self._linking.add(task)
                task.add_done_callback(self._linking.discard)
        result = await sync.run_round(start, partial(self._route, peers))
        await node.report(result, mark, sync.work)
        return result.samples

    async def _route(self, peers: dict[str, Any], device: int) -> PeerRoute:
        """The link to ring peer ``device`` this round (see `PeerLinks.route`).

        Raises:
            TrainingError: it is not a peer of the round, or cannot be linked.
        """
        node = self.node
        name = f"device{device}"
        if name not in peers or node.peers is None:
            raise TrainingError(f"device{device} is not a peer of {node.name}'s round")
        return await node.peers.route(name, str(peers[name].get("address", "")),
                                      dial=node.name < name)

    async def _link_quietly(self, name: str, peers: dict[str, Any]) -> None:
        """Link to ``name`` ahead of need; a peer that cannot be reached is the ring's
        business ([Note: HADFL bypass])."""
        try:
            await self._route(peers, int(name.removeprefix("device")))
        except TrainingError as exc:
            log.info("device %d: %s", self.node.device_id, exc)

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        for task in getattr(self, "_linking", ()):
            task.cancel()
