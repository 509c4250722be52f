"""The coordinator's side of one device: its connection, its rounds, and the stage the
coordinator runs for it (PiPar Algorithm 2, per device k).

A session lives as long as its device takes part in the run; connections come and go
under it. While a connection is attached, `DeviceSession.serve` runs:
- the receive loop, which checks every message against the device's round and routes
  it: activations to the stage the coordinator runs for this device (the split modes'
  server half), round results and reports to the round;
- the sending (`Peer.send_in`), which moves gradients and models over the downlink;
- heartbeats to the device, and a watchdog that gives up on a connection that has been
  silent for ``device_timeout`` (`Liveness`).
The coordinator's stage for the device (when the system has one) runs for the whole
round, across connections: a `StageExecutor` on the coordinator's shared compute queue
walks the stage's actions (PiPar's server: ``1RECV_F0 1FB0 1SEND_B0 1RECV_F1 ... 1STEP``:
each activation's forward, loss and backward as one ``s`` slice, its gradient posted at
once, the replica stepped after the N-th). The round itself and the checks of the
device's result and report are `RoundWindow`'s module (round_window.py); what the
coordinator asks the device outside its rounds waits in `Questions` (session_questions.py).

[Note: reconnection] When a connection breaks or goes silent, the session detaches and
waits up to ``reconnect_grace`` for the device to connect again (the coordinator's
admission re-attaches it). Its queues, its stage and its round survive. What was in
flight is sent again: the coordinator re-posts the round's `RoundStart` (and a pending
`Bye`); the device re-sends the activations whose gradients it lacks and an
unacknowledged round result. Work is never done twice: a re-sent activation that was
already computed gets its cached gradient again, one still waiting is ignored; a repeated
round result is ignored. On one connection, by contrast, a repeated activation is a
protocol error (a replay). A message that breaks the contract ends the session at once,
with an `ErrorMessage` naming the problem; other devices are unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from collections.abc import Mapping
from typing import Protocol

from aiopipe.clock import Clock, wait_for
from aiopipe.config import RunConfig
from aiopipe.errors import (
    DeviceLostError,
    ProtocolError,
    RefusedError,
    RemoteProtocolError,
    RoundStalledError,
    TransportError,
)
from aiopipe.light_event import LightEvent
from aiopipe.metrics.trace import Recorder, device_of
from aiopipe.protocol import (
    Accusation,
    Activation,
    Bye,
    ErrorMessage,
    EvalRequest,
    EvalResult,
    Gradient,
    Heartbeat,
    Message,
    Probe,
    Profile,
    Ready,
    Replica,
    ReplicaRequest,
    Rest,
    RoundReport,
    RoundResult,
    RoundStalled,
    RoundStart,
    SecAggReply,
    TensorData,
)
from aiopipe.runtime.arrivals import ArrivalRules, Verdict
from aiopipe.runtime.assignment import Assignment, check_data_message
from aiopipe.runtime.compute import Compute
from aiopipe.runtime.device_route import DeviceRoute
from aiopipe.runtime.executor import Identity, Inbox, StageExecutor
from aiopipe.runtime.liveness import Liveness
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.round_window import RoundWindow, check_result, report_count, report_slices
from aiopipe.runtime.session_questions import Questions
from aiopipe.runtime.stage import ServerStage
from aiopipe.transport import Link

__all__ = ["DeviceSession", "SessionHost"]

log = logging.getLogger("aiopipe.server")

Key = tuple[int, int, int]  # (epoch, iteration, micro-batch)


class SessionHost(Protocol):
    """What a session needs from the coordinator."""

    clock: Clock
    recorder: Recorder
    compute: Compute
    run_id: int

    @property
    def config(self) -> RunConfig:
        """The run's config."""
        ...

    def server_failed(self, device_id: int, error: BaseException) -> None:
        """The coordinator's own work for ``device_id`` failed ([Note: server faults])."""
        ...

    def accuse(self, accuser: int, culprit: int, reason: str) -> None:
        """Device ``accuser`` refused what its neighbour ``culprit`` sent this round
        ([Note: judging arrivals])."""
        ...

    def judge_data(self, device_id: int, message: Activation | Gradient,
                   assignment: Assignment) -> None:
        """Judge the values device ``device_id`` sent the coordinator's stage (a refusal
        excludes it: [Note: judging arrivals]).

        Raises:
            PoisonedValueError: out of range, or not finite.
        """
        ...

    def unasked_replica(self, device_id: int, replica: Replica,
                        start: RoundStart | None) -> None:
        """Device ``device_id`` sent a replica nobody asked for, in the round ``start``
        began (None: none under way): the system's to judge.

        Raises:
            RemoteProtocolError: the system does not take it.
        """
        ...

    def announce(self, device_id: int, ready: Ready) -> None:
        """Device ``device_id`` has set up and holds what ``ready`` says.

        Raises:
            RefusedError: that does not fit the run.
        """
        ...


#: The coordinator's stage's arrival rules (a star's rounds are never played again).
_RULES = ArrivalRules()


class DeviceSession:
    """The coordinator's side of device ``device_id``, across its connections."""

    def __init__(self, host: SessionHost, peer: Peer, device_id: int, *,
                 earlier_bytes: tuple[int, int] = (0, 0), rests: bool = False) -> None:
        self.host = host
        self.peer = peer
        self.rests = rests  # [Note: idle links rest] in aiopipe.runtime.liveness
        self.device_id = device_id
        self.name = f"device{device_id}"
        self.window: RoundWindow | None = None
        self.seen: set[Key] = set()  # activations accepted this round
        self.seen_on_link: set[Key] = set()  # ... on the current connection
        self.gradients: dict[Key, Gradient] = {}  # computed, for re-sending (one iteration)
        self.inbox = Inbox()
        self.result: asyncio.Future[RoundResult] | None = None
        self.round_result: RoundResult | None = None  # waiting for its RoundReport
        self.last_round_done = -1
        self.served = 0  # micro-batches the coordinator's stage computed this round
        #: most activations the device held at once in its last round (its report)
        self.peak_live = 0
        #: the most bytes its training held in its last round, measured (its report; 0:
        #: not measured)
        self.peak_memory = 0
        #: bytes the device said it sent to its peers, over the rounds it reported
        self.peer_bytes = 0
        self.closing = False  # we said goodbye: the connection may end
        self.bye: Bye | None = None  # what we said
        self.ended = False  # the session is over (goodbye, or the device was lost)
        self.attached = LightEvent()  # set when a connection is attached
        self.idle = LightEvent()  # set while no connection is attached
        self.idle.set()
        self.liveness = Liveness(host.clock, interval=host.config.heartbeat_interval,
                                 timeout=host.config.device_timeout)
        self.earlier_bytes = earlier_bytes  # (up, down) over connections that have ended
        self.nonce = secrets.randbits(62)  # `Plan.session`: who the device is talking to
        self._stage_failure: ProtocolError | None = None
        self._tasks: asyncio.TaskGroup | None = None  # the connection's, while served
        #: what the coordinator asked the device outside its rounds, waiting for answers
        self.questions = Questions(peer, host.clock)
        if rests:
            peer.on_post = self._posted

    def rest(self) -> None:
        """Unless the coordinator expects something of the device (a round, an answer) or
        the link does not rest: tell it `Rest`, and stop this end's heartbeats and
        watchdog until the next message to it."""
        if not self.rests or self.liveness.resting or self.ended or self.closing or (
                self.result is not None or self.questions.pending()):
            return
        self.peer.post(Rest(), "rest")
        self.liveness.rest()

    def _posted(self, message: Message, sent: asyncio.Future[None]) -> None:
        """Any message but `Rest` and `Bye` (the end) wakes a resting link; silence counts
        from when it has left."""
        if not isinstance(message, Rest | Bye):
            self.liveness.wake(sent)

    # -- driven by the coordinator -----------------------------------------------------

    async def run_round(self, start: RoundStart, stage: ServerStage | None, *,
                        returns: Mapping[str, TensorData] | None = None) -> RoundResult:
        """Send the round's weights and work, run the coordinator's ``stage`` for it, and
        return the device's result (with the stage's loss when the coordinator computed
        it).

        Raises:
            DeviceLostError: the device was lost before its result was complete.
        """
        self._check_not_gone()
        self.window = window = RoundWindow(
            start.round, start.epoch, start.first_iteration, start.iterations, start, stage,
            start.tensors if returns is None else returns,
            stage.assignment if stage is not None else None)
        self.seen.clear()
        self.gradients.clear()
        self.round_result = None  # of an attempt given up on, if any
        self.served = 0
        self.inbox.reopen()
        result: asyncio.Future[RoundResult] = asyncio.get_running_loop().create_future()
        self.result = result
        self.peer.post(start, "m", epoch=start.epoch)
        try:
            if stage is None:
                return await result
            serving = asyncio.ensure_future(self._serve_stage(window, stage))
            try:
                done = await result
            except BaseException:
                serving.cancel()
                await asyncio.wait([serving])
                raise
            # the result comes once every activation was served: what is left is the step
            await serving
            return done
        finally:
            window.end()
            self.gradients.clear()  # the device has them all, or the round is given up
            self.result = None  # (its weights are the caller's now)

    async def profile(self, batch_sizes: tuple[int, ...]) -> tuple[Profile, float]:
        """Ask the device to profile itself at ``batch_sizes`` (a probe follows the
        request); its answer and the delay of its probe after it (0 when the answer
        has no table: no probe follows).

        Raises:
            DeviceLostError: the device was lost meanwhile.
        """
        self._check_not_gone()
        return await self.questions.profile(batch_sizes)

    async def evaluate(self, request: EvalRequest) -> EvalResult:
        """Ask the device to evaluate ``request``'s global model on its held-out data.

        Raises:
            DeviceLostError: the device was lost meanwhile.
        """
        self._check_not_gone()
        return await self.questions.evaluate(request)

    async def replicas(self, request: ReplicaRequest) -> list[Replica]:
        """Ask the device for the chain replicas ``request`` names; its answers, one per
        stage (aiopipe.runtime.systems.ftpipehd.chain).

        Raises:
            DeviceLostError: the device was lost meanwhile.
        """
        self._check_not_gone()
        return await self.questions.replicas(request)

    def _check_not_gone(self) -> None:
        """Raises `DeviceLostError` when the session is over."""
        if self.ended:
            raise DeviceLostError(f"device {self.device_id} is gone")

    def _accept_replica(self, message: Replica) -> None:
        """An answer to a `ReplicaRequest`; any other replica is the system's to judge
        (`System.unasked_replica`: FTPipeHD's last stage sends its chain replicas here).

        Raises:
            RemoteProtocolError: nobody asked for it and the system does not take it.
        """
        if self.questions.take_replica(message):
            return
        window = self.window
        self.host.unasked_replica(self.device_id, message,
                                  window.start if window is not None else None)

    def link_bytes(self) -> tuple[int, int]:
        """Bytes received from and sent to the device over all its connections so far."""
        stats = self.peer.link.statistics()
        return (self.earlier_bytes[0] + stats.received.bytes,
                self.earlier_bytes[1] + stats.sent.bytes)

    def say_bye(self, reason: str) -> None:
        """End the conversation after everything already queued."""
        self.closing = True
        self.bye = Bye(reason)
        self.peer.post(self.bye, "bye")
        self.peer.finish()

    def dismiss(self, reason: str, bye: str) -> None:
        """Unless it has ended, end the session for ``reason`` and, unless we said
        goodbye already, tell the device ``bye``."""
        if self.ended:
            return
        self.end(reason)
        if not self.closing:
            self.say_bye(bye)

    def end(self, reason: str) -> None:
        """The device is gone for good: fail its round."""
        self.ended = True
        self.attached.set()  # a connection waiting to be re-attached stops waiting
        lost = DeviceLostError(f"device {self.device_id} was lost: {reason}")
        self.inbox.close(lost)
        if self.result is not None and not self.result.done():
            self.result.set_exception(lost)
        self.questions.fail(lost)

    # -- the coordinator's stage -----------------------------------------------------------

    async def _serve_stage(self, window: RoundWindow, stage: ServerStage) -> None:
        """Run the coordinator's stage for the round's iterations; route its failures."""
        host, assignment = self.host, stage.assignment
        executor = StageExecutor(
            stage.work, host.compute, stage=assignment.stage, actions=assignment.actions,
            identity=Identity(host.run_id, "server"), inbox=self.inbox,
            previous=DeviceRoute(self), next=None if assignment.last else DeviceRoute(self),
            costs=stage.costs)
        try:
            for iteration in range(window.first_iteration,
                                   window.first_iteration + window.iterations):
                await executor.run(window.epoch, iteration, assignment.version_of(iteration))
        except ProtocolError as exc:
            # the device's data broke the stage's checks: end its session as any other
            # protocol error does, through the connection that carried it (or the next)
            self._stage_failure = exc
            self._raise_stage_failure()
        except (DeviceLostError, asyncio.CancelledError):
            raise
        except Exception as exc:
            host.server_failed(self.device_id, exc)

    def _raise_stage_failure(self) -> None:
        """Fail the connection being served with the stage's failure (no task waits for
        one: an idle device's session holds none)."""
        if self._tasks is not None and self._stage_failure is not None:
            with contextlib.suppress(RuntimeError):  # (the group is ending already)
                self._tasks.create_task(_raise(self._stage_failure))

    # -- connections ---------------------------------------------------------------------

    def attach(self, link: Link, *, resumed: bool) -> None:
        """Serve the device over ``link`` from now on; re-post what may have been lost."""
        if link is not self.peer.link:  # count the bytes the old connection moved
            self.earlier_bytes = self.link_bytes()
        self.peer.link = link
        self.seen_on_link.clear()
        # a resting run's link starts at rest (a `Rest` went before the `Plan`), unless
        # something is expected of the device
        self.liveness.restart(resting=self.rests)
        if self.result is not None or self.questions.pending():
            self.liveness.wake()
        self.idle.clear()  # until `serve` of this connection returns
        self.attached.set()
        if not resumed:
            return
        if self.bye is not None:
            self.peer.post(self.bye, "bye")
            self.peer.finish()
        elif self.window is not None and self.result is not None and not self.result.done():
            self.peer.post(self.window.start, "m", epoch=self.window.epoch)

    async def wait_reattached(self, seconds: float) -> bool:
        """After a connection broke: whether the device came back within ``seconds``."""
        self.attached.clear()
        try:
            await wait_for(self.host.clock, self.attached.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def serve(self) -> None:
        """Serve the attached connection until it ends (see [Note: reconnection]).

        Raises:
            ProtocolError: the device broke the contract (it was told why).
            TransportError: the connection broke or went silent.
        """
        try:
            async with asyncio.TaskGroup() as tasks:
                self.peer.send_in(tasks)  # (a task only while something is queued)
                # the watchdog, then heartbeats, unless the link rests
                self.liveness.attach(tasks, self.peer, f"device {self.device_id}",
                                     watch_first=True)
                self._tasks = tasks
                self._raise_stage_failure()  # (one while no connection was served)
                try:
                    await self._receive_loop()
                finally:
                    self._tasks = None
                    self.liveness.detach()
                    if not self.closing:
                        self.peer.stop_sending()
        except* ProtocolError as group:
            problem = group.exceptions[0]
            code = "refused" if isinstance(problem, RefusedError) else "protocol"
            log.warning("refused device %d: %s" if code == "refused"
                        else "device %d broke the protocol: %s", self.device_id, problem)
            with contextlib.suppress(TransportError):
                await self.peer.send(ErrorMessage(code, str(problem)))
            await self.peer.link.aclose(str(problem)[:100])
            raise problem from None
        except* TransportError as group:
            if not self.closing:
                raise self.liveness.gave_up or group.exceptions[0] from None
        finally:
            self.idle.set()

    async def _receive_loop(self) -> None:
        message: Message | None
        while True:
            message = None  # the last one (a round's weights) is not kept while we wait
            try:
                message = await self.peer.receive()
            except TransportError:
                if self.closing:
                    return
                raise
            self.liveness.heard()
            if isinstance(message, Activation):
                self._accept_activation(message)
            elif isinstance(message, Gradient):
                self._accept_gradient(message)
            elif isinstance(message, RoundResult):
                self._accept_result(message)
            elif isinstance(message, RoundReport):
                self._complete_round(message)
            elif isinstance(message, RoundStalled):
                self._stalled(message)
            elif isinstance(message, Accusation):
                self._accusation(message)
            elif isinstance(message, Ready):
                self.host.announce(self.device_id, message)
            elif isinstance(message, Profile | Probe):
                self.questions.take_profile(message)
                self.rest()  # (once the profile and its probe are in)
            elif isinstance(message, EvalResult):
                self.questions.take_evaluation(message)
                self.rest()
            elif isinstance(message, Replica):
                self._accept_replica(message)
            elif isinstance(message, SecAggReply):
                self.questions.take_secagg(message)
            elif isinstance(message, Heartbeat):
                continue
            elif isinstance(message, Bye):
                if not self.closing:
                    raise RemoteProtocolError(f"device {self.device_id} left: {message.reason}")
                return
            else:
                raise RemoteProtocolError(f"the server does not accept {type(message).__name__} "
                                          "here")

    def _accept_activation(self, message: Activation) -> None:
        """Check an activation against the round and hand new work to the stage."""
        window = self.window
        key = (message.epoch, message.iteration, message.micro_batch)
        if key in self.seen_on_link:
            raise RemoteProtocolError(f"activation {key} sent twice")
        self.seen_on_link.add(key)
        if key in self.seen:  # re-sent after a reconnection
            if key in self.gradients:
                self.peer.post(self.gradients[key], "d", epoch=key[0], iteration=key[1],
                               micro_batch=key[2])
            return
        if window is not None and window.assignment is None:
            raise RemoteProtocolError("the server runs no stage for this device: it takes "
                                      "no activations")
        assignment = window.assignment if window is not None else None
        running = self.result is not None and not self.result.done()
        if not running and assignment is not None and ArrivalRules.within(key, assignment):
            return  # a late re-send for the round that just ended
        verdict = _RULES.verdict(message, assignment, running=running, from_peer=False)
        if verdict is Verdict.DROP:
            return
        if verdict is not Verdict.DELIVER or assignment is None:
            raise RemoteProtocolError("activation outside a round")
        check_data_message(message, assignment, sender=self.name, run_id=self.host.run_id)
        self.host.judge_data(self.device_id, message, assignment)
        if ArrivalRules.too_far_ahead(self.inbox.held(), assignment, slack=0):
            # an honest device is never more than an iteration ahead of the server
            raise RemoteProtocolError("more than two iterations' activations ahead of the "
                                      "server's stage")
        self.seen.add(key)
        self.inbox.put(("F", *key), message)

    def _accept_gradient(self, message: Gradient) -> None:
        """Check a gradient for the coordinator's stage against the round and hand it to
        the stage: only a stage before the last takes them ([Note: middle stages] in
        device_route.py).

        Raises:
            RemoteProtocolError: the coordinator's stage is the last, or the gradient is
                outside the round, breaks the plan, or came twice.
        """
        window = self.window
        assignment = window.assignment if window is not None else None
        if assignment is None or assignment.last:
            raise RemoteProtocolError("the server runs no middle stage for this device: it "
                                      "takes no gradients")
        key = (message.epoch, message.iteration, message.micro_batch)
        running = self.result is not None and not self.result.done()
        verdict = _RULES.verdict(message, assignment, running=running, from_peer=False)
        if verdict is Verdict.DROP:
            return  # late: its round is over
        if verdict is not Verdict.DELIVER:
            raise RemoteProtocolError("gradient outside a round")
        check_data_message(message, assignment, sender=self.name, run_id=self.host.run_id)
        if self.inbox.seen(("B", *key)):
            raise RemoteProtocolError(f"gradient {key} sent twice")
        self.host.judge_data(self.device_id, message, assignment)
        if ArrivalRules.too_far_ahead(self.inbox.held(), assignment, slack=0):
            raise RemoteProtocolError("more than two iterations' messages ahead of the "
                                      "server's stage")
        self.inbox.put(("B", *key), message)

    def _accept_result(self, message: RoundResult) -> None:
        if message.round <= self.last_round_done or (
                self.round_result is not None and self.round_result.round == message.round):
            return  # re-sent after a reconnection
        window = self.window
        if window is not None and message.round < window.round:
            return  # of a round the coordinator gave up on (a pipeline played it again)
        if window is None or self.result is None or self.result.done():
            raise RemoteProtocolError("round result outside a round")
        check_result(message, window, computed=len(self.seen))
        self.round_result = message

    def _accusation(self, message: Accusation) -> None:
        """The device refused what a neighbour sent in its round: the coordinator judges
        ([Note: whose word excludes]), when the culprit is a peer of that round. Taken
        even when the round was given up already: the culprit's end of the link may
        have said first that the link broke."""
        window = self.window
        culprit = device_of(message.culprit)
        if window is None or message.round != window.round or culprit is None or (
                message.culprit not in window.start.peers):
            return
        self.host.accuse(self.device_id, culprit, message.reason)

    def _stalled(self, message: RoundStalled) -> None:
        """The device's round cannot finish: fail the round's wait with a
        `RoundStalledError` (a stall of a round already over, or given up, is moot)."""
        window, result = self.window, self.result
        if window is None or result is None or result.done() or message.round != window.round:
            return
        result.set_exception(RoundStalledError(
            f"device {self.device_id}'s round {message.round + 1} stopped: {message.reason}"))

    def _complete_round(self, message: RoundReport) -> None:
        if message.round <= self.last_round_done:
            return  # re-sent after a reconnection
        if self.window is not None and message.round < self.window.round:
            return  # of a round the coordinator gave up on
        result, self.round_result = self.round_result, None
        window = self.window
        if result is None or window is None or self.result is None or self.result.done():
            raise RemoteProtocolError("round report without a round result")
        if message.round != result.round:
            raise RemoteProtocolError(f"report for round {message.round + 1}, expected "
                                      f"{result.round + 1}")
        slices = report_slices(message.report, self.name)
        self.peak_live = report_count(message.report, "peak_live")
        self.peak_memory = report_count(message.report, "peak_memory_bytes")
        self.peer_bytes += report_count(message.report, "peer_bytes")
        self.host.recorder.extend(slices)
        if window.stage is not None and window.stage.work.last:
            # the coordinator computed the loss, not the device
            work = window.stage.work
            result = dataclasses.replace(result, loss_sum=float(work.loss_sum),
                                         correct=float(work.correct))
        self.last_round_done = result.round
        self.result.set_result(result)


async def _raise(error: ProtocolError) -> None:
    raise error
