"""Liveness of one link: heartbeats out, silence watched in (DESIGN §7).

Every link the runtime keeps open (a device's link to the coordinator, the server's side
of it, a device's link to a peer device) runs the same two loops:
- `Liveness.beat` sends a `Heartbeat` every ``interval`` seconds, between (never inside)
  other frames;
- `Liveness.watch` gives the link up when nothing has arrived for ``timeout`` seconds; a
  large frame still arriving is not silence (`Link.last_received` moves with its parts).
Whoever receives on the link calls `heard` for every message. A connection starts both
loops in its task group (`attach`), and they end with it (`detach`), or while the link
rests (`rest`, `wake`: [Note: idle links rest]).

[Note: idle links rest] In a simulation whose rounds draw a few devices of a large
population (``devices_per_round``), a device that is in no round waits, and its link
carries nothing but heartbeats: two loops and two timers at each end, and a wake-up of
both ends every ``heartbeat_interval``, for each of the population's devices. So the
coordinator tells such a device `Rest` (before its `Plan`, so that a link starts at
rest, and with `RoundAccepted` after its round, [Note: sampling per round]) and stops
its own end's loops; the device stops its own on receiving it. Neither end then beats
or watches: a resting device costs no timer and no wake-up. The coordinator's next
message but a `Bye` (the conversation's end) wakes both ends: its own
when it posts the message (the watchdog counts silence from when that message has left,
so that a large `RoundStart` still crossing a slow link is not the device's silence),
the device's when it receives it. Choice: the coordinator decides, since it alone knows
whom it will draw; it rests a device only while it expects nothing of it (no round,
no question pending), so detection is unchanged wherever it matters: a device lost
while resting is found lost in the round it is drawn for (a `device_timeout` later, as
one lost just after its draw), and a link that closes or breaks is still seen at once
by the receive loops, which never rest. Only `aiopipe.simulate` rests links (where no
network can silently fail an idle link); a `Server` over websockets keeps every link's
heartbeats, whose absence would let a middlebox drop an idle connection and would find
a dead device only once drawn. Price: a resting device's link carries no heartbeats,
so a drawn device's heartbeats start from its wake-up, not on the grid they had since
it joined; where one of those used to take the wire just before the device's frame, the
frame now goes a heartbeat's wire time (microseconds) earlier or later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, NoReturn

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
        #: neither loop runs: nothing is expected on the link ([Note: idle links rest])
        self.resting = False
        self._tasks: asyncio.TaskGroup | None = None  # the connection's, while attached
        self._peer: Peer | None = None
        self._who = ""
        self._watch_first = False
        self._beat: asyncio.Task[NoReturn] | None = None
        self._watch: asyncio.Task[NoReturn] | None = None
        self._waking: asyncio.Future[None] | None = None  # the message `wake` waits for

    def heard(self) -> None:
        """A message arrived."""
        self.last_heard = self.clock.now()

    def restart(self, *, resting: bool = False) -> None:
        """A new connection: nothing heard on it is missing yet, no reason to give up on
        it is known, and it rests or not (a resting run's links start at rest)."""
        self.gave_up = None
        self.resting = resting
        self.heard()

    def attach(self, tasks: asyncio.TaskGroup, peer: Peer, who: str, *,
               watch_first: bool = False) -> None:
        """Beat and watch ``peer``'s link (``who``: the far end, as `watch` names it) in
        ``tasks``, a connection's task group, until `detach`; not while resting.
        ``watch_first``: start the watchdog before the heartbeats (the order of the
        loops' first steps: a run's timing follows it)."""
        self._tasks, self._peer, self._who, self._watch_first = tasks, peer, who, watch_first
        if not self.resting:
            self._start(watch=True)

    def detach(self) -> None:
        """The connection ends: stop both loops."""
        self._stop()
        self._tasks = self._peer = None

    def rest(self) -> None:
        """Nothing is expected on the link until the next message: stop both loops
        ([Note: idle links rest])."""
        self.resting = True
        self._stop()

    def wake(self, sent: asyncio.Future[None] | None = None) -> None:
        """Something is expected again: restart both loops (no-op unless resting);
        ``sent``: the message that wakes the far end, still to leave: silence counts from
        when it has."""
        if not self.resting:
            return
        self.restart(resting=False)
        if sent is None or sent.done():
            self._start(watch=True)
            return
        self._start(watch=False)
        self._waking = sent
        sent.add_done_callback(self._watch_from_now)

    def _watch_from_now(self, sent: asyncio.Future[None]) -> None:
        if sent is not self._waking or self.resting or self._tasks is None or (
                self._watch is not None):
            return  # (rested again, or woken since by a later message)
        self._waking = None
        self.heard()
        self._start(watch=True)

    def _start(self, *, watch: bool) -> None:
        peer = self._peer
        if peer is None:
            return  # not attached: `attach` starts them
        if watch and self._watch_first:
            self._watch = self._spawn(self.watch(peer, self._who))
        if self._beat is None:
            self._beat = self._spawn(self.beat(peer))
        if watch and self._watch is None:
            self._watch = self._spawn(self.watch(peer, self._who))

    def _spawn(self, loop: Coroutine[Any, Any, NoReturn]) -> asyncio.Task[NoReturn] | None:
        """``loop`` as a task of the connection's group; None when the group is ending
        (its connection failed: nothing is left to beat or watch)."""
        try:
            assert self._tasks is not None
            return self._tasks.create_task(loop)
        except RuntimeError:
            loop.close()
            return None

    def _stop(self) -> None:
        loops = (self._watch, self._beat) if self._watch_first else (self._beat, self._watch)
        for task in loops:
            if task is not None:
                task.cancel()
        self._beat = self._watch = None

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
