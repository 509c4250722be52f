"""The device node: a shell that runs whichever system the coordinator's run names.

One event loop, one compute thread. The shell is the same for every system:
- the link to the coordinator: a send loop (`Peer.send_loop`), a receive loop that
  dispatches each message by its type (a table), heartbeats and a silence watchdog
  (`Liveness`); when that link breaks the device reconnects with backoff ([Note:
  reconnection] in aiopipe/runtime/session.py) and re-sends what may have been lost;
- links to peer devices, when the run's system links devices (`PeerLinks`);
- the data path: activations, gradients and a group's gradients, judged by the
  system's arrival rules before they reach the stage (aiopipe.runtime.delivery);
- the control loop: per `RoundStart`, the system's device half runs the round
  (aiopipe.runtime.device_half; by default the stage it assigns, run by the
  `StageExecutor`: aiopipe.runtime.stage_round); between rounds it answers profile and
  evaluation requests.
The data never leaves the device: only activations, labels and the stage's weights do.
After its `Plan` the device opens its data (its own, or an emulated fleet's shard),
builds the run's model and announces both (`Ready`: samples, input shape, classes, the
model's digest); the coordinator plans from what the devices announce.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from functools import partial

import torch

from aiopipe import data as datasets
from aiopipe.clock import Clock
from aiopipe.config import RunConfig
from aiopipe.errors import (
    NeighbourFaultError,
    ProtocolError,
    RemoteProtocolError,
    TrainingError,
)
from aiopipe.light_event import LightQueue
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import (
    MAX_REASON_CHARS,
    Accusation,
    Activation,
    Bye,
    ErrorMessage,
    EvalRequest,
    Gradient,
    GroupGradient,
    Heartbeat,
    Message,
    Plan,
    Probe,
    Profile,
    ProfileRequest,
    Ready,
    RoundAccepted,
    RoundResult,
    RoundStalled,
    RoundStart,
)
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.compute import Compute
from aiopipe.runtime.delivery import Delivery
from aiopipe.runtime.device_connection import Connector, CoordinatorConnection
from aiopipe.runtime.device_half import DeviceHalf, Handler
from aiopipe.runtime.device_reports import DeviceSummary, RoundReports
from aiopipe.runtime.executor import Inbox
from aiopipe.runtime.holdings import Holdings
from aiopipe.runtime.judge import ArrivalJudge
from aiopipe.runtime.liveness import Liveness
from aiopipe.runtime.peer_links import PeerLinks, PeerRoute
from aiopipe.runtime.plan import cached_planning_costs, device_run_config
from aiopipe.runtime.profiling import ProbeTimer, answer_request
from aiopipe.runtime.stage import StageWork
from aiopipe.runtime.stage_round import COORDINATOR
from aiopipe.runtime.systems.base import system_class
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.costs import CostTable
from aiopipe.transport import Link
from aiopipe.transport.fabric import Endpoint
from aiopipe.wording import plural

__all__ = ["COORDINATOR", "DeviceNode", "DeviceSummary"]

log = logging.getLogger("aiopipe.device")


class DeviceNode:
    """The device shell (module docstring); `aiopipe.runtime.device.run_device` runs one."""

    # (slots: a population holds 100,000 of these; the instance dict was 1.6 KB of ~33)
    __slots__ = ("_handlers", "assignment", "clock", "compute", "config", "connection",
                 "control", "costs", "custom_model", "delivery", "device_id", "ended",
                 "endpoint", "epoch", "half", "held_out", "holdings", "inbox", "judge",
                 "last_round_received", "name", "own_data", "peer", "peers", "plan", "probe",
                 "profiles", "ready", "recorder", "reports", "round", "round_dropped",
                 "round_task", "run_id", "shape_uplink", "torch_device", "work")

    def __init__(self, server: Link | Connector, device_id: int, clock: Clock,
                 cost_table: CostTable | None,
                 clock_offset: float | None, model: torch.nn.Sequential | None,
                 max_frame_bytes: int | None, endpoint: Endpoint | None) -> None:
        self.device_id, self.name = device_id, f"device{device_id}"
        self.clock = clock
        self.costs = cost_table
        self.custom_model = model
        self.endpoint = endpoint
        self.shape_uplink = False
        self.own_data: datasets.Dataset | None = None
        self.profiles = True  # answer a ProfileRequest with our own measurements
        self.torch_device = torch.device("cpu")  # where the stage computes
        self.held_out: datasets.Dataset | None = None  # evaluated on at EvalRequests
        self.probe = ProbeTimer(clock)  # times the downlink at a profile request
        self.ready: Ready | None = None  # what we announced, once set up
        self.recorder = Recorder()
        self.compute = Compute(clock, self.recorder, f"{self.name}/compute",
                               charge_costs=cost_table is not None)
        self.connection = CoordinatorConnection(
            server, device_id=device_id, clock=clock, recorder=self.recorder, side=self,
            address=endpoint.address if endpoint is not None else "",
            max_frame_bytes=max_frame_bytes, clock_offset=clock_offset)
        self.peer = self.connection.peer
        self.control: LightQueue[RoundStart | ProfileRequest | EvalRequest | Bye] = LightQueue()
        self.inbox = Inbox()
        #: judges the values peers send ([Note: judging arrivals])
        self.judge = ArrivalJudge()
        self.delivery = Delivery(self.inbox, coordinator=COORDINATOR,
                                 rules=DeviceHalf.arrivals, batch_size=1,
                                 running=self._running, judge=lambda: self.judge)
        #: the run's system's device half, and the messages it takes, once joined
        self.half: DeviceHalf | None = None
        self._handlers: dict[type[Message], Handler] = {}
        self.assignment: Assignment | None = None  # the round being worked on
        self.work: StageWork | None = None
        self.round = -1  # the round being worked on (or last finished)
        self.last_round_received = -1
        self.round_task: asyncio.Task[int] | None = None
        self.round_dropped = False
        self.peers: PeerLinks | None = None
        self.reports = RoundReports(
            device_id, self.peer, self.recorder, self.compute,
            clock_offset=lambda: self.connection.clock_offset or 0.0,
            peer_bytes=lambda: self.peers.bytes_sent() if self.peers is not None else 0)
        #: set when the server said Bye: the run is over, mid-round or not
        self.ended: TrainingError | None = None

    async def run(self) -> DeviceSummary:
        connection = self.connection
        async with contextlib.AsyncExitStack() as links:
            self.plan = await connection.connect(links)
            # cheap: heartbeats need it; the plan's tree of it is not kept
            self.config, self.plan = self._run_config(self.plan), replace(self.plan, run={})
            self._join_system()
            log.info("device %d: joined a %s run of %s, %s", self.device_id,
                     self.config.mode, plural(self.config.devices, "device"),
                     plural(self.config.epochs, "epoch"))
            connection.liveness = Liveness(self.clock, interval=self.config.heartbeat_interval,
                                           timeout=self.config.device_timeout)
            if self.shape_uplink and self.config.shape_links:  # sender-side shaping
                connection.pace = self.config.device_network(self.device_id).up
            connection.shape()
            # (no exit stack of its own when the run links no peers: an idle device of a
            # simulated population would hold one, 1 KB, for the whole run)
            endpoint = self.endpoint if self.plan.peer_keys else None  # the run links us
            try:
                async with (PeerLinks.open(
                        endpoint, me=self.name, keys=self.plan.peer_keys,
                        clock=self.clock, recorder=self.recorder, config=self.config,
                        deliver=self._dispatch, failed=self._peer_failed,
                        pace=connection.pace) if endpoint is not None
                            else contextlib.nullcontext()) as peers:
                    self.peers = peers
                    try:
                        async with asyncio.TaskGroup() as tasks:
                            training = tasks.create_task(self._train_loop())
                            await connection.serve(links, training,
                                                   device_timeout=self.config.device_timeout)
                    except BaseException as exc:
                        if self.peers is not None:  # they cannot go on without us
                            self.peers.goodbye = f"{self.name} failed: {exc}"
                        raise
            except BaseExceptionGroup as group:
                raise first_error(group) from None
            return training.result()

    def joined(self, plan: Plan, *, new_session: bool) -> None:
        """A handshake: with a new session, the server knows nothing of our round."""
        if new_session:
            self.last_round_received = -1
            self.reports.unacked.clear()
            self.delivery.forget(early=True)  # activations of the old session's rounds
            self._drop_round()
            if self.peers is not None:
                self.peers.rekey(plan.peer_keys)
        self.run_id = self.delivery.run_id = plan.run_id

    def resend(self, *, new_session: bool) -> None:
        """After a reconnection, re-post in order what may not have arrived, once."""
        if self.ready is not None and new_session:
            self.peer.post(self.ready, "ready")  # a new session: announce ourselves again
        for key, activation in self.delivery.sent_activations.items():
            self.peer.post(activation, "u", epoch=key[0], iteration=key[1],
                           micro_batch=key[2])
        self.reports.resend()

    def _run_config(self, plan: Plan) -> RunConfig:
        return device_run_config(plan.run, self.custom_model)

    def receive(self, message: Message) -> bool:
        """A message from the coordinator; True when it ends the conversation (Bye).

        Raises:
            TrainingError: the server refused us or reported an error.
            RemoteProtocolError: a device does not take it.
        """
        if isinstance(message, Activation | Gradient):  # the data path, unless the half
            # takes them (a device that runs stages on both sides of the coordinator's)
            self._handlers.get(type(message), self.delivery.deliver)(COORDINATOR, message)
        elif isinstance(message, RoundStart):
            if message.round <= self.last_round_received:
                return False  # sent again after a reconnection: we have it already
            self.last_round_received = message.round
            self._drop_round()  # if still on an older one, the server gave up on it
            self.control.put_nowait(message)
        elif isinstance(message, RoundAccepted):
            self.reports.accepted(message.round)
        elif isinstance(message, EvalRequest):
            self.control.put_nowait(message)
        elif isinstance(message, ProfileRequest):
            self.probe.asked()
            self.control.put_nowait(message)
        elif isinstance(message, Probe):
            self.probe.arrived()
        elif isinstance(message, Bye):
            self.control.put_nowait(message)
            # the server may end the run mid-round (it failed): stop waiting, now and
            # for any micro-batch the round would still send
            self.ended = TrainingError(f"the server ended the run: {message.reason}")
            self.inbox.close(self.ended)
            self.delivery.forget()
            return True
        elif isinstance(message, ErrorMessage):
            if message.code == "refused":  # what we announced does not fit the run
                raise TrainingError(f"server refused device {self.device_id}: "
                                    f"{message.message}")
            raise TrainingError(f"server error {message.code}: {message.message}")
        elif type(message) in self._handlers:  # the system's own (a replica request)
            self._handlers[type(message)](COORDINATOR, message)
        elif not isinstance(message, Heartbeat):
            raise RemoteProtocolError(f"a device does not accept {type(message).__name__}")
        return False

    def _join_system(self) -> None:
        """Take the device half of the run's system, its arrival rules and its messages."""
        half = system_class(self.config.mode).device_half(self)
        self.half = half
        self.delivery.rules, self.delivery.batch_size = half.arrivals, self.config.batch_size
        data: Handler = self.delivery.deliver
        self._handlers = {Activation: data, Gradient: data, GroupGradient: data,
                          **half.handlers()}

    def _running(self) -> bool:
        return self.round_task is not None and not self.round_task.done()

    def _dispatch(self, sender: str, message: Message) -> None:
        """A message from peer ``sender``: to the data path or the system's half.

        Raises:
            RemoteProtocolError: this run's system does not take it.
        """
        handler = self._handlers.get(type(message))
        if handler is None:
            raise RemoteProtocolError(f"{sender} sent {type(message).__name__}, which a "
                                      f"{self.config.mode} run does not use")
        handler(sender, message)

    def _peer_failed(self, name: str, error: Exception) -> None:
        """A peer link broke: the round in progress cannot finish, unless the system's
        half takes care of it (HADFL's ring bypasses the peer)."""
        fault = NeighbourFaultError(name, error) if isinstance(error, ProtocolError) else None
        if fault is not None:
            self._accuse(fault)
        if self.half is not None and self.half.peer_failed(name, error):
            return
        if self.ended is None and self._running():
            self.inbox.close(fault or TrainingError(f"the link to {name} failed: {error}"))

    def _accuse(self, fault: NeighbourFaultError) -> None:
        """Tell the coordinator which neighbour's values this device refused, at once:
        it may give the round up (the neighbour's end says the link broke) before the
        round task gets to say why; HADFL's round goes on without the neighbour."""
        if self.ended is None and self.round >= 0:
            self.peer.post(Accusation(self.round, fault.culprit,
                                      str(fault)[:MAX_REASON_CHARS]), "accusation",
                           epoch=self.epoch)

    def _drop_round(self) -> None:
        """Stop working on the current round (the server no longer waits for it)."""
        self.delivery.forget()
        if self.round_task is not None and not self.round_task.done():
            log.warning("device %d: dropping round %d", self.device_id, self.round + 1)
            self.round_dropped = True
            self.round_task.cancel()

    async def _train_loop(self) -> DeviceSummary:
        self.holdings = await self.compute.call(partial(
            Holdings.open, self.config, self.plan, self.own_data, self.torch_device,
            self.held_out))
        self.compute.slowdown = self.config.device_slowdown_of(self.device_id)
        self.ready = self.holdings.ready()
        self.judge = ArrivalJudge(limit=self.config.scale_limit)
        assert self.half is not None
        self.half.set_up()
        self.peer.post(self.ready, "ready")
        rounds = samples = 0
        while True:
            message = await self.control.get()
            self.reports.unacked.clear()  # the next round (or goodbye) acknowledges the last
            if isinstance(message, Bye):
                return DeviceSummary(self.device_id, rounds, samples, message.reason)
            if isinstance(message, ProfileRequest):
                await self._answer_profile(message)
                continue
            if isinstance(message, EvalRequest):
                result = await self.compute.call(partial(self.holdings.evaluate, message))
                self.peer.post(result, "eval", epoch=message.epoch)
                continue
            self.round = message.round
            self.epoch = self.reports.epoch = message.epoch
            self.round_task = asyncio.create_task(self.half.run_round(message))
            try:
                done = await self.round_task
            except asyncio.CancelledError:
                if not self.round_dropped:
                    raise
                self.round_dropped = False
                continue
            except TrainingError as exc:
                culprit = exc.culprit if isinstance(exc, NeighbourFaultError) else ""
                if self.ended is not None or not (culprit or self.half.recovers_rounds):
                    raise
                # the pipelines recover: the coordinator, told, plays the round
                # again (or ends the run); a neighbour's fault is the coordinator's to
                # judge in every system ([Note: judging arrivals]): this device is fine
                log.warning("device %d: round %d stopped (%s); waiting for the "
                            "coordinator's recovery", self.device_id, message.round + 1, exc)
                if isinstance(exc, NeighbourFaultError):
                    self._accuse(exc)
                self.peer.post(RoundStalled(message.round, str(exc)[:MAX_REASON_CHARS]),
                               "stalled", epoch=message.epoch)
                continue
            finally:
                if self.round_task.done():  # (its coroutine's frames: not kept while waiting)
                    self.round_task = None
            rounds, samples = rounds + 1, samples + done
            del message  # (a round's weights: not kept while the device waits for the next)

    async def _answer_profile(self, request: ProfileRequest) -> None:
        """Answer the coordinator's profile request (aiopipe.runtime.profiling [Note:
        device profiles]); we do not time ourselves when we share its machine and table,
        or compute where the CPU profiler cannot time."""
        assert self.probe.delay is not None

        async def measure(sizes: tuple[int, ...]) -> CostTable:
            # measured once per machine, model and sizes, then read from the cost cache
            # (its table is unscaled: the coordinator applies device_slowdown)
            held = self.holdings
            return await self.compute.call(partial(
                cached_planning_costs, self.config, held.model_copy(), self.plan.inputs,
                held.dataset, sizes=sizes, role="device",
                what=f"device {self.device_id}'s profile"))

        mine = self.profiles and self.torch_device.type == "cpu"
        for message in await answer_request(request, asyncio.shield(self.probe.delay),
                                            clock=self.clock, measure=measure if mine else None):
            self.peer.post(message, "profile" if isinstance(message, Profile) else "probe")

    async def report(self, result: RoundResult, mark: int, work: StageWork) -> None:
        """Send the round's result, then its report (`RoundReports.report`)."""
        await self.reports.report(result, mark, work)

    async def peer_route(self, assignment: Assignment, name: str, *, dial: bool
                         ) -> PeerRoute:
        """The link to peer ``name`` (see `PeerLinks.route`).

        Raises:
            TrainingError: it cannot be linked, or this device listens for no peers.
        """
        if self.peers is None:
            raise TrainingError(f"device {self.device_id} runs stage {assignment.stage} "
                                f"next to {name} but listens for no peers (start it "
                                "with an endpoint: python -m aiopipe.device --listen)")
        return await self.peers.route(name, assignment.peers[name]["address"], dial=dial)
