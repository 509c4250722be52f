"""Per-round draws of devices, and the acknowledgement a device not drawn again gets.

A device keeps its last round's result and report until the coordinator acknowledges
them, to send them again after a reconnection ([Note: reconnection] in
aiopipe.runtime.session); the result shares the trained stage's memory, a whole model's
weights. The next `RoundStart` acknowledges them. With ``devices_per_round`` ([Note:
sampling per round]) a device may not get one for many rounds: `Draws` tells each device
drawn for a round and not for the next that its round is held (`RoundAccepted`), so that
what a waiting device holds does not grow with the devices that have ever trained
([Note: a round's local optimizer] in aiopipe.runtime.systems.star.keeping). It goes on
that device's own link, which no one else's round uses: the drawn devices' rounds take
the time they did. In a simulation the link then rests until the device is drawn again
([Note: idle links rest] in aiopipe.runtime.liveness).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from aiopipe.config import RunConfig
from aiopipe.protocol import RoundAccepted
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.sampling import sampled_devices

__all__ = ["Draws"]


class _Session(Protocol):
    """What `Draws` uses of a device's session (aiopipe.runtime.session)."""

    last_round_done: int
    ended: bool
    peer: Peer

    def rest(self) -> None:
        """Rest the link while nothing is expected of the device ([Note: idle links
        rest] in aiopipe.runtime.liveness)."""
        ...


class Draws:
    """The draws of a run that samples devices per round, over ``sessions`` (the
    coordinator's, by device)."""

    def __init__(self, config: RunConfig, sessions: Mapping[int, Any]) -> None:
        self.config = config
        self.sessions = sessions
        self.waiting: set[int] = set()  # drawn for the last round: not yet acknowledged

    def draw(self, epoch: int, round_index: int, alive: Sequence[int],
             tally: dict[str, Any]) -> list[int]:
        """The devices drawn for the round (`sampled_devices`), noted in the epoch's
        ``tally``; those of the last round not among them are told their round is held."""
        drawn = sampled_devices(self.config.seed, epoch, round_index, alive,
                                self.config.round_size(len(alive)))
        tally.setdefault("sampled", []).append(drawn)
        for k in sorted(self.waiting.difference(drawn)):
            session: _Session | None = self.sessions.get(k)
            if session is not None and not session.ended and session.last_round_done >= 0:
                session.peer.post(RoundAccepted(session.last_round_done), "accepted")
                session.rest()  # (a simulation's: until it is drawn again)
        self.waiting = set(drawn)
        return drawn
