"""What the coordinator asks one device outside its rounds, and the answers it waits for:
its profile (aiopipe.runtime.profiling [Note: device profiles]), a held-out evaluation
of the global model, chain replicas (aiopipe.runtime.systems.ftpipehd.chain), a step
of secure aggregation (aiopipe.runtime.systems.star.secure).

`Questions` posts each question on the device's downlink and matches what comes back to
what was asked; an answer nobody asked for is a `RemoteProtocolError` (a replica is the
exception: the session hands an unasked one to the system). The device's session
(aiopipe.runtime.session) routes the answers here and fails the questions when the
device is lost.
"""

from __future__ import annotations

import asyncio

from aiopipe.clock import Clock
from aiopipe.errors import DeviceLostError, RemoteProtocolError
from aiopipe.protocol import (
    EvalRequest,
    EvalResult,
    Probe,
    Profile,
    ProfileRequest,
    Replica,
    ReplicaRequest,
    SecAggReply,
    SecAggRequest,
)
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.profiling import probe

__all__ = ["Questions"]


class Questions:
    """The questions put to the device over ``peer`` that wait for an answer."""

    def __init__(self, peer: Peer, clock: Clock) -> None:
        self.peer = peer
        self.clock = clock
        #: a profile asked for: the answer, when it came, and the uplink probe's delay
        #: after it
        self._profile: asyncio.Future[tuple[Profile, float]] | None = None
        self._answer: tuple[Profile, float] | None = None
        #: the held-out evaluation asked for (the device's answer)
        self._evaluation: asyncio.Future[EvalResult] | None = None
        #: the replicas asked for: the stages not answered yet, the answers
        self._asked: tuple[set[int], list[Replica], asyncio.Future[list[Replica]]] | None = None
        #: the secure aggregation step asked for: (round, step), the answer
        self._secagg: tuple[tuple[int, int], asyncio.Future[SecAggReply]] | None = None

    async def profile(self, batch_sizes: tuple[int, ...]) -> tuple[Profile, float]:
        """Ask the device to profile itself at ``batch_sizes`` (a probe follows the
        request); its answer and the delay of its probe after it (0 when the answer
        has no table: no probe follows).

        Raises:
            DeviceLostError: the device was lost meanwhile (`fail`).
        """
        self._answer = None
        future: asyncio.Future[tuple[Profile, float]] = (
            asyncio.get_running_loop().create_future())
        self._profile = future
        self.peer.post(ProfileRequest(batch_sizes), "m")
        self.peer.post(probe(), "probe")
        try:
            return await future
        finally:
            self._profile = None

    async def evaluate(self, request: EvalRequest) -> EvalResult:
        """Ask the device to evaluate ``request``'s global model on its held-out data.

        Raises:
            DeviceLostError: the device was lost meanwhile (`fail`).
        """
        future: asyncio.Future[EvalResult] = asyncio.get_running_loop().create_future()
        self._evaluation = future
        self.peer.post(request, "m", epoch=request.epoch)
        try:
            return await future
        finally:
            self._evaluation = None

    async def replicas(self, request: ReplicaRequest) -> list[Replica]:
        """Ask the device for the chain replicas ``request`` names; its answers, one per
        stage.

        Raises:
            DeviceLostError: the device was lost meanwhile (`fail`).
        """
        future: asyncio.Future[list[Replica]] = asyncio.get_running_loop().create_future()
        self._asked = (set(request.stages), [], future)
        self.peer.post(request, "m")
        try:
            return await future
        finally:
            self._asked = None

    async def secagg(self, request: SecAggRequest) -> SecAggReply:
        """Ask the device for step ``request.step`` of a secure aggregation round; its
        answer.

        Raises:
            DeviceLostError: the device was lost meanwhile (`fail`).
        """
        future: asyncio.Future[SecAggReply] = asyncio.get_running_loop().create_future()
        self._secagg = ((request.round, request.step), future)
        self.peer.post(request, "m")
        try:
            return await future
        finally:
            self._secagg = None

    def pending(self) -> bool:
        """Whether a question waits for its answer."""
        asked = self._asked[2] if self._asked is not None else None
        secagg = self._secagg[1] if self._secagg is not None else None
        return any(waiting is not None and not waiting.done()
                   for waiting in (self._profile, self._evaluation, asked, secagg))

    def take_secagg(self, message: SecAggReply) -> None:
        """The answer to the secure aggregation step asked for.

        Raises:
            RemoteProtocolError: none was asked for, or another step or round.
        """
        asked = self._secagg
        if asked is None or asked[0] != (message.round, message.step) or asked[1].done():
            raise RemoteProtocolError(f"a secure aggregation reply (round {message.round}, "
                                      f"step {message.step}) nobody asked for")
        asked[1].set_result(message)

    def take_replica(self, message: Replica) -> bool:
        """Whether ``message`` answers a `ReplicaRequest` (then it is taken)."""
        if self._asked is None or message.stage not in self._asked[0]:
            return False
        waiting, answers, future = self._asked
        waiting.discard(message.stage)
        answers.append(message)
        if not waiting and not future.done():
            future.set_result(answers)
        return True

    def take_evaluation(self, message: EvalResult) -> None:
        """The answer to the evaluation asked for.

        Raises:
            RemoteProtocolError: none was asked for.
        """
        future = self._evaluation
        if future is None or future.done():
            raise RemoteProtocolError("an evaluation result nobody asked for")
        future.set_result(message)

    def take_profile(self, message: Profile | Probe) -> None:
        """A profile asked for, then its probe.

        Raises:
            RemoteProtocolError: none was asked for, or they came out of order.
        """
        future, now = self._profile, self.clock.now()
        if future is None or future.done():
            raise RemoteProtocolError(f"a {type(message).__name__} nobody asked for")
        if isinstance(message, Profile):
            if self._answer is not None:
                raise RemoteProtocolError("a second profile")
            self._answer = (message, now)
            if not message.costs:  # a device without a table of its own sends no probe
                future.set_result((message, 0.0))
        elif self._answer is None:
            raise RemoteProtocolError("a probe before its profile")
        else:
            answer, at = self._answer
            future.set_result((answer, now - at))

    def fail(self, lost: DeviceLostError) -> None:
        """The device is gone: every question still waiting fails with ``lost``."""
        asked = self._asked[2] if self._asked is not None else None
        secagg = self._secagg[1] if self._secagg is not None else None
        for waiting in (self._profile, self._evaluation, asked, secagg):
            if waiting is not None and not waiting.done():
                waiting.set_exception(lost)
