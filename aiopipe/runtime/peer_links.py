"""A device's links to its peer devices (a pipeline's neighbouring stages).

Every device of a run that links devices directly listens on an `Endpoint` of the fabric
(`aiopipe.transport.fabric`) and announces its address in its Hello. In each round the
device dials the peer that runs the next stage and waits for the one running the stage
before to dial it; either way the two prove to each other that they hold their pair's
key (`dial_peer` / `accept_peer`; the keys come in the coordinator's `Plan`), so no
device-to-device link is unauthenticated and no device needs the server's secret.

A link, once up, stays up for the run. On it run the same loops as on the link to the
coordinator: a send loop, a receive loop that hands activations and gradients to the
device (which checks them against its round: `check_data_message`), heartbeats and a
silence watchdog (`Liveness`). A peer that breaks the contract gets an `ErrorMessage` and
a closed link. A link that fails or ends (a peer's `Bye`) fails the round in progress
(``failed``; the device's round task then raises, the device tells the coordinator
`RoundStalled`, and the pipeline's system plays the round again without the lost stage).
When its run ends, or fails, each device says `Bye` to its peers before it closes their
links, so no neighbour is left waiting for gradients that cannot come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from aiopipe.clock import Clock, wait_for
from aiopipe.config import RunConfig
from aiopipe.errors import (
    AiopipeError,
    LinkBrokenError,
    ProtocolError,
    RemoteProtocolError,
    TrainingError,
)
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import (
    Activation,
    Bye,
    ErrorMessage,
    Gradient,
    GroupGradient,
    Heartbeat,
    Message,
    Replica,
    RingBypass,
    RingChunk,
    RingHandshake,
    SyncedModel,
)
from aiopipe.runtime.liveness import Liveness
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.tasks import first_error
from aiopipe.transport import Link, LinkSpec
from aiopipe.transport.fabric import Endpoint
from aiopipe.transport.peering import accept_peer, dial_peer

__all__ = ["PeerLinks", "PeerMessage", "PeerRoute"]

log = logging.getLogger("aiopipe.device")

#: What peers send each other: a pipeline's data, replicas, HADFL's synchronisation.
PeerMessage = (Activation | Gradient | GroupGradient | Replica | RingChunk | RingBypass
               | RingHandshake | SyncedModel)
#: Hands a message from a peer to the device (which checks it).
Deliver = Callable[[str, PeerMessage], None]
#: Told that the link to a peer failed.
Failed = Callable[[str, Exception], None]


class PeerRoute:
    """Posts messages to one peer over its link (a `aiopipe.runtime.executor.Route`)."""

    def __init__(self, node: str, peer: Peer) -> None:
        self.node = node
        self.peer = peer

    def send(self, message: Activation | Gradient, name: str, *,
             ready_at: float | None) -> None:
        """Queue ``message`` on the peer link's send loop."""
        self.peer.post(message, name, epoch=message.epoch, iteration=message.iteration,
                       micro_batch=message.micro_batch, ready_at=ready_at)


class PeerLinks:
    """A device's authenticated links to its peers (see the module docstring).

    Build it with `open`.
    """

    def __init__(self, endpoint: Endpoint, *, me: str, keys: Mapping[str, Any], clock: Clock,
                 recorder: Recorder, config: RunConfig, deliver: Deliver,
                 failed: Failed, pace: LinkSpec | None = None) -> None:
        self.endpoint = endpoint
        self.me = me
        self.clock = clock
        self.recorder = recorder
        self.config = config
        self.deliver = deliver
        self.failed = failed
        #: shape sends to peers at this rate (`Link.reshape`; None: leave links as they are)
        self.pace = pace
        self.keys: dict[str, bytes] = {}
        self.rekey(keys)
        #: decoding limit for what peers send (None: the link's own; see `limit`)
        self.max_frame_bytes: int | None = None
        #: what the peers are told when the links close
        self.goodbye = "the run is over"
        self._routes: dict[str, PeerRoute] = {}
        self._closed_sent = 0  # bytes sent over links that have ended
        self._linked = asyncio.Event()  # set whenever a link comes up
        self._stack = contextlib.AsyncExitStack()
        self._tasks: asyncio.TaskGroup | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, endpoint: Endpoint, **options: Any) -> AsyncIterator[PeerLinks]:
        """Accept peers on ``endpoint`` until the context ends, then say goodbye to every
        peer and close the links (options: as the class)."""
        links = cls(endpoint, **options)
        async with asyncio.TaskGroup() as tasks:
            links._tasks = tasks
            accepting = tasks.create_task(links._accept_loop())
            try:
                yield links
            finally:
                accepting.cancel()
                await links._close()

    def rekey(self, keys: Mapping[str, Any]) -> None:
        """Use these pair keys (name -> 64 hex digits) from now on (a new `Plan`)."""
        self.keys = {name: bytes.fromhex(key) for name, key in keys.items()}

    async def route(self, name: str, address: str, *, dial: bool) -> PeerRoute:
        """The route to peer ``name``: linked already, dialled now at ``address``
        (``dial``), or once it has dialled us.

        Raises:
            TrainingError: no key for ``name``, or no link within ``device_timeout``.
        """
        found = self._routes.get(name)
        if found is not None:
            return found
        key = self.keys.get(name)
        if key is None:
            raise TrainingError(f"{self.me} has no key for its peer {name}")
        timeout = self.config.device_timeout
        try:
            if dial:
                link = await self._stack.enter_async_context(dial_peer(
                    self.endpoint, address, me=self.me, peer=name, key=key, clock=self.clock,
                    timeout=timeout))
                return self._start(name, link)
            await wait_for(self.clock, self._accepted(name), timeout)
        except (AiopipeError, TimeoutError) as exc:
            raise TrainingError(f"{self.me} could not link to its peer {name}: "
                                f"{exc or 'no link within device_timeout'}") from None
        return self._routes[name]

    async def _accepted(self, name: str) -> None:
        while name not in self._routes:
            self._linked.clear()
            await self._linked.wait()

    async def _accept_loop(self) -> None:
        while True:
            name, link = await accept_peer(self.endpoint, me=self.me, keys=self.keys,
                                           clock=self.clock,
                                           timeout=self.config.device_timeout)
            if name in self._routes:
                log.warning("%s: %s linked again; keeping the first link", self.me, name)
                await link.aclose("already linked")
                continue
            self._stack.push_async_callback(link.aclose)
            self._start(name, link)

    def _start(self, name: str, link: Link) -> PeerRoute:
        if self.pace is not None:
            link.reshape(self.pace)
        peer = Peer(link, self.clock, self.recorder, f"{self.me}->{name}",
                    max_frame_bytes=self.max_frame_bytes)
        route = self._routes[name] = PeerRoute(name, peer)
        assert self._tasks is not None
        self._tasks.create_task(self._serve(name, peer))
        self._linked.set()
        return route

    async def _serve(self, name: str, peer: Peer) -> None:
        """Run one peer link's loops until it ends; however it ends (a failure, or the
        peer's goodbye), the round in progress cannot finish: ``failed`` is told, and
        the link is forgotten."""
        config = self.config
        liveness = Liveness(self.clock, interval=config.heartbeat_interval,
                            timeout=config.device_timeout)
        try:
            try:
                async with asyncio.TaskGroup() as tasks:
                    sender = tasks.create_task(peer.send_loop())
                    others = [tasks.create_task(liveness.beat(peer)),
                              tasks.create_task(liveness.watch(peer, name))]
                    try:
                        reason = await self._receive_loop(name, peer, liveness)
                    finally:
                        for task in others:
                            task.cancel()
                        sender.cancel()
            except BaseExceptionGroup as group:
                raise liveness.gave_up or first_error(group) from None
        except ProtocolError as exc:
            self.failed(name, exc)  # first: the round stops, and says why, at once
            await self.reject(name, exc)
        except AiopipeError as exc:
            self.failed(name, exc)
        else:
            self.failed(name, LinkBrokenError(f"{name} left: {reason}"))
        finally:
            self._closed_sent += peer.link.statistics().sent.bytes
            if self._routes.get(name) is not None and self._routes[name].peer is peer:
                del self._routes[name]

    def bytes_sent(self) -> int:
        """Bytes sent to peers so far, over every link (those that ended too)."""
        return self._closed_sent + sum(route.peer.link.statistics().sent.bytes
                                       for route in self._routes.values())

    async def reject(self, name: str, error: Exception) -> None:
        """``name`` broke the protocol: tell it why and close its link (which ends the
        link's loops, and so the round)."""
        route = self._routes.get(name)
        if route is None:
            return
        log.warning("%s: %s broke the protocol: %s", self.me, name, error)
        with contextlib.suppress(AiopipeError):
            await route.peer.send(ErrorMessage("protocol", str(error)))
        await route.peer.link.aclose(str(error)[:100])

    def limit(self, max_frame_bytes: int) -> None:
        """Refuse frames above ``max_frame_bytes`` from peers from now on (the round's
        activations and gradients)."""
        self.max_frame_bytes = max_frame_bytes
        for route in self._routes.values():
            route.peer.max_frame_bytes = max_frame_bytes

    async def _receive_loop(self, name: str, peer: Peer, liveness: Liveness) -> str:
        """Route the peer's messages until it says goodbye; its reason."""
        message: Message | None
        while True:
            message = None  # the last one is not kept while we wait
            message = await peer.receive()
            liveness.heard()
            if isinstance(message, Activation | Gradient | GroupGradient | Replica | RingChunk
                          | RingBypass | RingHandshake | SyncedModel):
                self.deliver(name, message)
            elif isinstance(message, Bye):
                return message.reason
            elif isinstance(message, ErrorMessage):
                raise TrainingError(f"{name} refused us: {message.message}")
            elif not isinstance(message, Heartbeat):
                raise RemoteProtocolError(f"{name} sent a {type(message).__name__}; peers "
                                          "exchange activations, gradients (their group's "
                                          "too), replicas and HADFL's ring messages only")

    async def _close(self) -> None:
        for route in list(self._routes.values()):
            with contextlib.suppress(AiopipeError):
                await route.peer.send(Bye(self.goodbye))
        await self._stack.aclose()


