"""Liveness of one link: heartbeats out, silence watched in (DESIGN §7).

Every link the runtime keeps open (a device's link to the coordinator, the server's side
of it, a device's link to a peer device) runs the same two loops:
- `Liveness.beat` sends a `Heartbeat` every ``interval`` seconds, between (never inside)
  other frames;
- `Liveness.watch` gives the link up when nothing has arrived for ``timeout`` seconds; a
  large frame still arriving is not silence (`Link.last_received` moves with its parts).
Whoever receives on the link calls `heard` for every message.
"""

from __future__ import annotations

from typing import NoReturn

from aiopipe.clock import Clock
from aiopipe.errors import LinkBrokenError
from aiopipe.protocol import Heartbeat
from aiopipe.runtime.peer import Peer

__all__ = ["Liveness"]


class Liveness:
    """Heartbeats and a silence watchdog for one link (see the module docstring).

    Args:
        clock: the node's clock.
        interval: seconds between heartbeats.
        timeout: seconds of silence after which the link is given up.
    """

    def __init__(self, clock: Clock, *, interval: float, timeout: float) -> None:
        self.clock = clock
        self.interval = interval
        self.timeout = timeout
        self.last_heard = clock.now()
        #: why `watch` gave the link up (None while it has not)
        self.gave_up: LinkBrokenError | None = None

    def heard(self) -> None:
        """A message arrived."""
        self.last_heard = self.clock.now()

    def restart(self) -> None:
        """A new connection: nothing heard on it is missing yet, and no reason to give
        up on it is known."""
        self.gave_up = None
        self.heard()

    async def beat(self, peer: Peer) -> NoReturn:
        """Send a heartbeat every ``interval`` seconds, for ever.

        Raises:
            TransportError: the link failed.
        """
        seq = 0
        while True:
            await self.clock.sleep(self.interval)
            seq += 1
            await peer.send(Heartbeat(seq))

    async def watch(self, peer: Peer, who: str) -> NoReturn:
        """Once the link has been silent for ``timeout`` seconds, close it and raise.

        The receive loop then fails too, with a less telling error, and may do so first:
        whoever runs both loops reports `gave_up` when it is set.

        Raises:
            LinkBrokenError: "<who> was silent for ... s".
        """
        while True:
            silent = self.clock.now() - max(self.last_heard, peer.link.last_received())
            # a relative tolerance: sleeping the float remainder could advance no time
            if silent >= self.timeout * (1 - 1e-9):
                self.gave_up = LinkBrokenError(f"{who} was silent for {silent:.1f} s")
                await peer.link.aclose("silent for too long")
                raise self.gave_up
            await self.clock.sleep(self.timeout - silent)
