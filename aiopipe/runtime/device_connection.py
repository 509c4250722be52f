"""A device's connection to the coordinator, across links: connecting with backoff, the
handshake (`Hello`, then the `Plan`), serving the link (a send loop, a receive loop,
heartbeats and a silence watchdog: `Liveness`), and reconnecting when the link breaks
or goes silent ([Note: reconnection] in aiopipe/runtime/session.py).

What the messages mean is the device node's (aiopipe.runtime.device): the connection
hands each one to it (`DeviceSide.receive`), tells it when the server has a new
session for it (its round is gone), and asks it to re-send what may have been lost
after a reconnection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypeAlias, cast

from aiopipe.clock import Clock
from aiopipe.errors import LinkBrokenError, RemoteProtocolError, TrainingError, TransportError
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import PROTOCOL_VERSION, Bye, ErrorMessage, Hello, Message, Plan, Rest
from aiopipe.runtime.liveness import Liveness
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.tasks import first_error
from aiopipe.transport import Link, LinkSpec

__all__ = ["Connector", "CoordinatorConnection", "DeviceSide"]

log = logging.getLogger("aiopipe.device")

#: Opens a new link to the server (an async context manager that closes it).
Connector: TypeAlias = Callable[[], AbstractAsyncContextManager[Link]]


class DeviceSide(Protocol):
    """What the connection asks of its device node."""

    def joined(self, plan: Plan, *, new_session: bool) -> None:
        """A handshake ended with ``plan``; with ``new_session`` the server restarted
        (or gave up on the device): it knows nothing of the device's round."""
        ...

    def resend(self, *, new_session: bool) -> None:
        """Re-post, in order, what may not have arrived before the link broke."""
        ...

    def receive(self, message: Message) -> bool:
        """Take a message from the coordinator; True when it ends the conversation."""
        ...


class CoordinatorConnection:
    """Device ``device_id``'s connection to the coordinator (module docstring):
    ``server`` is an open link, or a connector to open one (and to reconnect with);
    ``address``: where the device listens for peers ("" when it does not)."""

    def __init__(self, server: Link | Connector, *, device_id: int, clock: Clock,
                 recorder: Recorder, side: DeviceSide, address: str,
                 max_frame_bytes: int | None, clock_offset: float | None) -> None:
        self.device_id = device_id
        self.clock = clock
        self.side = side
        self.address = address
        self.connector: Connector | None = None
        if hasattr(server, "receive"):
            link = cast(Link, server)
        else:
            self.connector, link = server, cast(Link, None)
        self.peer = Peer(link, clock, recorder, f"device{device_id}/uplink",
                         max_frame_bytes=max_frame_bytes)
        #: server clock minus this clock (estimated from the first handshake when None)
        self.clock_offset = clock_offset
        self.session: int | None = None  # the server's session for us, once joined
        #: the link starts at rest: a `Rest` came before the `Plan` ([Note: idle links
        #: rest] in aiopipe.runtime.liveness)
        self.rests = False
        self.liveness: Liveness | None = None  # once the run's config is known
        #: the rate to pace a websocket uplink at (sender-side shaping), if any
        self.pace: LinkSpec | None = None
        self._random: random.Random | None = None

    @property
    def random(self) -> random.Random:
        """Backoff jitter, seeded with the device's id: made when first needed (its
        state is 2.5 KB, and a simulated device that never reconnects needs none)."""
        if self._random is None:
            self._random = random.Random(self.device_id)
        return self._random

    async def connect(self, links: contextlib.AsyncExitStack, *, patience: float = 60.0,
                      first_delay: float = 0.0) -> Plan:
        """Connect and say hello, retrying with exponential backoff and jitter while the
        server is unreachable or still holds our previous connection.

        Raises:
            TrainingError: no connection within ``patience`` seconds, or refused.
            TransportError: the link failed and there is no connector to retry with.
        """
        if self.connector is None:
            return await self._handshake()
        deadline = self.clock.now() + patience
        delay = 0.2
        await self.clock.sleep(first_delay)
        while True:
            try:
                self.peer.link = await links.enter_async_context(self.connector())
                return await self._handshake()
            except TransportError as exc:
                await links.aclose()
                if self.clock.now() >= deadline:
                    raise TrainingError(f"device {self.device_id} could not connect within "
                                        f"{patience:g} s: {exc}") from None
                log.info("device %d: %s; retrying", self.device_id, exc)
            await self.clock.sleep(delay * (0.5 + self.random.random()))
            delay = min(delay * 2, 5.0)

    async def _handshake(self) -> Plan:
        start = self.clock.now()
        await self.peer.send(Hello(PROTOCOL_VERSION, self.device_id, self.session or 0,
                                   self.address))
        plan = await self.peer.receive()
        rests = isinstance(plan, Rest)
        if rests:  # a run whose links rest: this one starts at rest
            plan = await self.peer.receive()
        if isinstance(plan, ErrorMessage) and plan.code == "busy" and self.connector:
            # our old connection is still open on the server side: try again shortly
            raise LinkBrokenError(f"server busy: {plan.message}")
        if isinstance(plan, ErrorMessage):
            raise TrainingError(f"server refused device {self.device_id}: {plan.message}")
        if not isinstance(plan, Plan) or plan.device_id != self.device_id:
            raise RemoteProtocolError(f"expected a Plan for device {self.device_id}, "
                                      f"got {type(plan).__name__}")
        if self.clock_offset is None:
            self.clock_offset = plan.server_time - (start + self.clock.now()) / 2
        if self.liveness is not None:
            self.liveness.heard()
        new_session = self.session is not None and plan.session != self.session
        if new_session:
            log.warning("device %d: the server has a new session for us; starting afresh",
                        self.device_id)
            self.peer.clear()
        self.session = plan.session
        self.rests = rests
        self.side.joined(plan, new_session=new_session)
        return plan

    def shape(self) -> None:
        """Pace the uplink at ``pace`` (sender-side shaping), when set."""
        if self.pace is not None:
            self.peer.link.reshape(self.pace)

    async def serve(self, links: contextlib.AsyncExitStack,
                    training: asyncio.Task[object], *, device_timeout: float) -> None:
        """Serve the link to the coordinator until ``training`` ends, reconnecting when
        the link fails.

        Raises:
            TrainingError: the device could not reconnect, or the server refused it.
            TransportError: the link failed and there is no connector to reconnect with.
        """
        while True:
            try:
                await self._serve_link(training)
                return
            except TransportError as exc:
                if self.connector is None:
                    raise
                await links.aclose()
                await self._reconnect(links, exc, device_timeout=device_timeout)

    async def _serve_link(self, training: asyncio.Task[object]) -> None:
        """Move messages over the current link until training ends or the link fails."""
        assert self.liveness is not None
        self.liveness.restart(resting=self.rests)
        try:
            async with asyncio.TaskGroup() as tasks:
                self.peer.send_in(tasks)  # (a task only while something is queued)
                receiver = tasks.create_task(self._receive_loop())
                # heartbeats and the watchdog, unless the link rests ([Note: idle links
                # rest]); a watchdog that gives up fails the group, and so this wait
                self.liveness.attach(tasks, self.peer, "the server")
                await asyncio.wait([training, receiver], return_when=asyncio.FIRST_COMPLETED)
                if receiver.done() and not receiver.cancelled() and not receiver.exception():
                    await asyncio.wait([training])  # Bye arrived: training ends now
                if training.done():
                    self.peer.finish()  # the send loop ends after the last queued message
                    receiver.cancel()
                    self.liveness.detach()
                else:
                    self.peer.stop_sending()
        except BaseExceptionGroup as group:
            raise self.liveness.gave_up or first_error(group) from None
        finally:
            self.peer.stop_sending()
            self.liveness.detach()

    async def _receive_loop(self) -> None:
        assert self.liveness is not None
        message: Message | None
        while True:
            message = None  # the last one (a round's weights) is not kept while we wait
            message = await self.peer.receive()
            self.liveness.heard()
            if isinstance(message, Rest):  # [Note: idle links rest]
                self.liveness.rest()
                continue
            if not isinstance(message, Bye):  # (the conversation ends: nothing to watch)
                self.liveness.wake()  # (a no-op unless resting)
            if self.side.receive(message):
                return

    async def _reconnect(self, links: contextlib.AsyncExitStack, cause: Exception, *,
                         device_timeout: float) -> None:
        """Reconnect ([Note: reconnection]) and re-send what may have been lost.

        Raises:
            TrainingError: no connection within 5 x device_timeout, or refused.
        """
        log.warning("device %d: %s; reconnecting", self.device_id, cause)
        session = self.session
        await self.connect(links, patience=5 * device_timeout,
                           first_delay=0.1 * self.random.random())
        self.shape()
        self.peer.clear()  # re-post in order what may not have arrived, once
        self.side.resend(new_session=self.session != session)
