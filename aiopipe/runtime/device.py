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
import random
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from functools import partial
from typing import TypeAlias, cast

import torch

from aiopipe import data as datasets
from aiopipe.clock import Clock, SystemClock
from aiopipe.config import RunConfig
from aiopipe.errors import (
    LinkBrokenError,
    NeighbourFaultError,
    ProtocolError,
    RemoteProtocolError,
    TrainingError,
    TransportError,
)
from aiopipe.metrics.trace import MAX_REPORT_SLICES, Recorder
from aiopipe.protocol import (
    MAX_REASON_CHARS,
    PROTOCOL_VERSION,
    Accusation,
    Activation,
    Bye,
    ErrorMessage,
    EvalRequest,
    Gradient,
    GroupGradient,
    Heartbeat,
    Hello,
    Message,
    Plan,
    Probe,
    Profile,
    ProfileRequest,
    Ready,
    RoundReport,
    RoundResult,
    RoundStalled,
    RoundStart,
)
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.compute import Compute, resolve_torch_device, warm_up_torch
from aiopipe.runtime.delivery import Delivery
from aiopipe.runtime.device_half import DeviceHalf, Handler
from aiopipe.runtime.executor import Inbox
from aiopipe.runtime.holdings import Holdings
from aiopipe.runtime.judge import ArrivalJudge
from aiopipe.runtime.liveness import Liveness
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.peer_links import PeerLinks, PeerRoute
from aiopipe.runtime.plan import measure_planning_costs
from aiopipe.runtime.profiling import answer_request
from aiopipe.runtime.stage import StageWork
from aiopipe.runtime.stage_round import COORDINATOR
from aiopipe.runtime.systems import system_class
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.costs import CostTable
from aiopipe.transport import Link, LinkSpec
from aiopipe.transport.fabric import Endpoint
from aiopipe.wording import plural

__all__ = ["COORDINATOR", "Connector", "DeviceSummary", "run_device"]

log = logging.getLogger("aiopipe.device")


@dataclass(frozen=True, slots=True)
class DeviceSummary:
    """What a device did in a run."""

    device_id: int
    rounds: int
    samples: int
    reason: str


#: Opens a new link to the server (an async context manager that closes it).
Connector: TypeAlias = Callable[[], AbstractAsyncContextManager[Link]]


async def run_device(server: Link | Connector, device_id: int, *, clock: Clock | None = None,
                     cost_table: CostTable | None = None, clock_offset: float | None = None,
                     model: torch.nn.Sequential | None = None,
                     max_frame_bytes: int | None = None,
                     shape_uplink: bool = False,
                     endpoint: Endpoint | None = None,
                     dataset: datasets.Dataset | None = None,
                     profile: bool = True, torch_device: str = "cpu",
                     held_out: datasets.Dataset | None = None) -> DeviceSummary:
    """Run device ``device_id`` until the server says Bye.

    Args:
        server: an open link to the server, or a connector (a callable returning an async
            context manager that opens a new link) so that the device can reconnect
            with backoff when a link breaks or goes silent ([Note: reconnection]).
        device_id: this device's id, 0..K-1.
        clock: defaults to the system clock.
        cost_table: charge compute from this table (virtual-time simulation).
        clock_offset: server clock minus this clock; estimated from the handshake when
            None.
        model: the user's own model when the config names "custom".
        max_frame_bytes: refuse larger frames from the server.
        shape_uplink: pace a websocket uplink, and the websocket links to peer devices,
            at the plan's network rate for this device's uplink (sender-side shaping, to
            emulate a slow link on one machine).
        endpoint: where this device listens for peer devices, for runs that link devices
            directly (a pipeline); its address goes to the server in the Hello.
        dataset: this device's own training data; None: its shard of the run's
            ``dataset`` as ``data_partition`` splits it (an emulated fleet).
        profile: time its own compute and links when the coordinator asks
            (aiopipe.runtime.profiling [Note: device profiles]); False for a device that
            shares the coordinator's machine and cost table (a simulation), which then
            answers with none.
        torch_device: where its stage computes: "auto", "cpu", "cuda" or "cuda:N"
            (`aiopipe.runtime.compute.resolve_torch_device`).
        held_out: this device's own held-out data: it evaluates each epoch's global
            model on it when the coordinator asks (`EvalRequest`).

    Raises:
        TrainingError: the server refused us, the conversation broke down, a peer link
            failed, or the device could not reconnect.
        TransportError: the link failed and there is no connector to reconnect with.
    """
    warm_up_torch()
    node = _DeviceNode(server, device_id, clock or SystemClock(), cost_table, clock_offset, model,
                       max_frame_bytes, endpoint)
    node.own_data = dataset
    node.profiles = profile and cost_table is None
    node.torch_device = resolve_torch_device(torch_device)
    node.held_out = held_out
    node.shape_uplink = shape_uplink
    try:
        return await node.run()
    finally:
        if node.half is not None:
            node.half.close()
        node.compute.close()


class _DeviceNode:
    def __init__(self, server: Link | Connector, device_id: int, clock: Clock,
                 cost_table: CostTable | None,
                 clock_offset: float | None, model: torch.nn.Sequential | None,
                 max_frame_bytes: int | None, endpoint: Endpoint | None) -> None:
        self.device_id = device_id
        self.name = f"device{device_id}"
        self.clock = clock
        self.costs = cost_table
        self.clock_offset = clock_offset
        self.custom_model = model
        self.endpoint = endpoint
        self.shape_uplink = False
        self.own_data: datasets.Dataset | None = None
        self.profiles = True  # answer a ProfileRequest with our own measurements
        self.torch_device = torch.device("cpu")  # where the stage computes
        self.held_out: datasets.Dataset | None = None  # evaluated on at EvalRequests
        self._probe: asyncio.Future[float] | None = None  # the downlink probe's delay
        self.ready: Ready | None = None  # what we announced, once set up
        self.recorder = Recorder()
        self.compute = Compute(clock, self.recorder, f"{self.name}/compute",
                               charge_costs=cost_table is not None)
        self.connector: Connector | None = None
        if hasattr(server, "receive"):
            link = cast(Link, server)
        else:
            self.connector, link = server, cast(Link, None)
        self.peer = Peer(link, clock, self.recorder, f"{self.name}/uplink",
                         max_frame_bytes=max_frame_bytes)
        self.control: asyncio.Queue[RoundStart | ProfileRequest | EvalRequest | Bye] = (
            asyncio.Queue())
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
        self.server_session: int | None = None
        self.unacked: list[RoundResult | RoundReport] = []  # until the next RoundStart
        self.result_sent = asyncio.Event()
        self.liveness: Liveness | None = None
        self.random = random.Random(device_id)
        self.peers: PeerLinks | None = None
        self._peer_bytes_reported = 0  # bytes sent to peers, as the last report said
        #: set when the server said Bye: the run is over, mid-round or not
        self.ended: TrainingError | None = None

    async def run(self) -> DeviceSummary:
        async with contextlib.AsyncExitStack() as links:
            self.plan = await self._connect(links)
            self.config = self._run_config(self.plan)  # cheap: heartbeats need it
            self._join_system()
            log.info("device %d: joined a %s run of %s, %s", self.device_id,
                     self.config.mode, plural(self.config.devices, "device"),
                     plural(self.config.epochs, "epoch"))
            self.liveness = Liveness(self.clock, interval=self.config.heartbeat_interval,
                                     timeout=self.config.device_timeout)
            self._shape_uplink()
            try:
                async with contextlib.AsyncExitStack() as stack:
                    if self.endpoint is not None and self.plan.peer_keys:  # the run links us
                        self.peers = await stack.enter_async_context(PeerLinks.open(
                            self.endpoint, me=self.name, keys=self.plan.peer_keys,
                            clock=self.clock, recorder=self.recorder, config=self.config,
                            deliver=self._dispatch, failed=self._peer_failed,
                            pace=self._uplink_pace()))
                    try:
                        training = await self._train_and_serve(links)
                    except BaseException as exc:
                        if self.peers is not None:  # they cannot go on without us
                            self.peers.goodbye = f"{self.name} failed: {exc}"
                        raise
            except BaseExceptionGroup as group:
                raise first_error(group) from None
            return training.result()

    async def _train_and_serve(self, links: contextlib.AsyncExitStack
                               ) -> asyncio.Task[DeviceSummary]:
        """Train while serving the link to the coordinator, reconnecting when it fails;
        the (finished) training task."""
        async with asyncio.TaskGroup() as tasks:
            training = tasks.create_task(self._train_loop())
            while True:
                try:
                    await self._serve_link(training)
                    break
                except TransportError as exc:
                    if self.connector is None:
                        raise
                    await links.aclose()
                    await self._reconnect(links, exc)
        return training

    async def _handshake(self) -> Plan:
        start = self.clock.now()
        address = self.endpoint.address if self.endpoint is not None else ""
        await self.peer.send(Hello(PROTOCOL_VERSION, self.device_id, self.server_session or 0,
                                   address))
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
        if self.server_session is not None and plan.session != self.server_session:
            # the server restarted (or gave up on us): it knows nothing of our round
            log.warning("device %d: the server has a new session for us; starting afresh",
                        self.device_id)
            self.last_round_received = -1
            self.unacked.clear()
            self.peer.clear()
            self.delivery.forget(early=True)  # activations of the old session's rounds
            self._drop_round()
            if self.peers is not None:
                self.peers.rekey(plan.peer_keys)
        self.server_session = plan.session
        self.run_id = self.delivery.run_id = plan.run_id
        return plan

    async def _serve_link(self, training: asyncio.Task[DeviceSummary]) -> None:
        """Move messages over the current link until training ends or the link fails."""
        assert self.liveness is not None
        self.liveness.restart()
        try:
            async with asyncio.TaskGroup() as tasks:
                sender = tasks.create_task(self.peer.send_loop())
                receiver = tasks.create_task(self._receive_loop())
                link_tasks = [receiver, tasks.create_task(self.liveness.beat(self.peer)),
                              tasks.create_task(self.liveness.watch(self.peer, "the server"))]
                await asyncio.wait([training, *link_tasks],
                                   return_when=asyncio.FIRST_COMPLETED)
                if receiver.done() and not receiver.cancelled() and not receiver.exception():
                    await asyncio.wait([training])  # Bye arrived: training ends now
                if training.done():
                    self.peer.finish()  # the send loop ends after the last queued message
                    for task in link_tasks:
                        task.cancel()
                else:
                    sender.cancel()
        except BaseExceptionGroup as group:
            raise self.liveness.gave_up or first_error(group) from None

    async def _connect(self, links: contextlib.AsyncExitStack, *,
                       patience: float = 60.0, first_delay: float = 0.0) -> Plan:
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

    async def _reconnect(self, links: contextlib.AsyncExitStack, cause: Exception) -> None:
        """Reconnect ([Note: reconnection]) and re-send what may have been lost.

        Raises:
            TrainingError: no connection within 5 x device_timeout, or refused.
        """
        log.warning("device %d: %s; reconnecting", self.device_id, cause)
        session = self.server_session
        await self._connect(links, patience=5 * self.config.device_timeout,
                            first_delay=0.1 * self.random.random())
        self._shape_uplink()
        self.peer.clear()  # re-post in order what may not have arrived, once
        if self.ready is not None and self.server_session != session:
            self.peer.post(self.ready, "ready")  # a new session: announce ourselves again
        for key, activation in self.delivery.sent_activations.items():
            self.peer.post(activation, "u", epoch=key[0], iteration=key[1],
                           micro_batch=key[2])
        for message in self.unacked:
            self._post_round_message(message)

    def _run_config(self, plan: Plan) -> RunConfig:
        run = dict(plan.run)
        if run.get("model") != "custom":
            return RunConfig.from_mapping(run)
        if self.custom_model is None:
            raise TrainingError("the server runs a custom model; pass model= to the device")
        return RunConfig.from_mapping({**run, "model": "vgg5", "initial_weights": "seed"}
                                      ).replace(model=self.custom_model,
                                                initial_weights=run.get("initial_weights",
                                                                        "seed"))

    def _uplink_pace(self) -> LinkSpec | None:
        """The rate to pace this device's websocket sends at (None: unpaced)."""
        if self.shape_uplink and self.config.shape_links:
            return self.config.device_network(self.device_id).up
        return None

    def _shape_uplink(self) -> None:
        """Pace a websocket uplink at the network's rate (sender-side shaping)."""
        pace = self._uplink_pace()
        if pace is not None:
            self.peer.link.reshape(pace)

    # -- loops ---------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        assert self.liveness is not None
        message: Message | None
        while True:
            message = None  # the last one (a round's weights) is not kept while we wait
            message = await self.peer.receive()
            self.liveness.heard()
            if isinstance(message, Activation | Gradient):
                self.delivery.deliver(COORDINATOR, message)
            elif isinstance(message, RoundStart):
                if message.round <= self.last_round_received:
                    continue  # sent again after a reconnection: we have it already
                self.last_round_received = message.round
                self._drop_round()  # if still on an older one, the server gave up on it
                self.control.put_nowait(message)
            elif isinstance(message, EvalRequest):
                self.control.put_nowait(message)
            elif isinstance(message, ProfileRequest):
                # its probe follows at once: how much later it arrives times the downlink
                asked_at = self.clock.now()
                self._probe = asyncio.get_running_loop().create_future()
                self._probe.add_done_callback(lambda f: f.cancelled() or f.exception())
                self._probe_asked_at = asked_at
                self.control.put_nowait(message)
            elif isinstance(message, Probe):
                if self._probe is None or self._probe.done():
                    raise RemoteProtocolError("a probe without a profile request")
                self._probe.set_result(self.clock.now() - self._probe_asked_at)
            elif isinstance(message, Bye):
                self.control.put_nowait(message)
                # the server may end the run mid-round (it failed): stop waiting, now and
                # for any micro-batch the round would still send
                self.ended = TrainingError(f"the server ended the run: {message.reason}")
                self.inbox.close(self.ended)
                self.delivery.forget()
                return
            elif isinstance(message, ErrorMessage):
                if message.code == "refused":  # what we announced does not fit the run
                    raise TrainingError(f"server refused device {self.device_id}: "
                                        f"{message.message}")
                raise TrainingError(f"server error {message.code}: {message.message}")
            elif type(message) in self._handlers:  # the system's own (a replica request)
                self._handlers[type(message)](COORDINATOR, message)
            elif not isinstance(message, Heartbeat):
                raise RemoteProtocolError(f"a device does not accept {type(message).__name__}")

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

    def _post_round_message(self, message: RoundResult | RoundReport) -> None:
        if isinstance(message, RoundResult):
            sent = self.peer.post(message, "m", epoch=self.epoch)
            sent.add_done_callback(lambda _: self.result_sent.set())
        else:
            self.peer.post(message, "report", epoch=self.epoch)

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
            self.unacked.clear()  # the next round (or goodbye) acknowledges the last
            if isinstance(message, Bye):
                return DeviceSummary(self.device_id, rounds, samples, message.reason)
            if isinstance(message, ProfileRequest):
                await self._answer_profile(message)
                continue
            if isinstance(message, EvalRequest):
                result = await self.compute.call(partial(self.holdings.evaluate, message))
                self.peer.post(result, "eval", epoch=message.epoch)
                continue
            self.round, self.epoch = message.round, message.epoch
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
            rounds += 1
            samples += done

    async def _answer_profile(self, request: ProfileRequest) -> None:
        """Answer the coordinator's profile request (aiopipe.runtime.profiling [Note:
        device profiles]); we do not time ourselves when we share its machine and table,
        or compute where the CPU profiler cannot time."""
        assert self._probe is not None

        async def measure(sizes: tuple[int, ...]) -> CostTable:
            held = self.holdings
            costs = await self.compute.call(partial(
                measure_planning_costs, self.config, held.model_copy(), self.plan.in_shape,
                held.dataset, sizes=sizes))
            log.info("device %d: profiled itself", self.device_id)
            return costs

        mine = self.profiles and self.torch_device.type == "cpu"
        for message in await answer_request(request, asyncio.shield(self._probe),
                                            clock=self.clock, measure=measure if mine else None):
            self.peer.post(message, "profile" if isinstance(message, Profile) else "probe")

    async def report(self, result: RoundResult, mark: int, work: StageWork) -> None:
        """Send the round's result, then, once it is sent, its report: the trace
        slices from ``mark`` on (so that it includes the result's upload)."""
        self.unacked = [result]
        self.result_sent.clear()
        self._post_round_message(result)
        await self.result_sent.wait()
        offset = self.clock_offset or 0.0
        slices = self.recorder.take(mark)
        if len(slices) > MAX_REPORT_SLICES:
            log.warning("device %d: round %d made %d trace slices; reporting the first %d",
                        self.device_id, result.round + 1, len(slices), MAX_REPORT_SLICES)
        sent = self.peers.bytes_sent() if self.peers is not None else 0
        report = RoundReport(result.round, {
            "slices": [s.shifted(offset).to_list() for s in slices[:MAX_REPORT_SLICES]],
            "peak_live": work.peak_live,
            "peak_memory_bytes": await self.compute.call(work.peak_memory),
            "peer_bytes": sent - self._peer_bytes_reported,
        })
        self._peer_bytes_reported = sent
        self.unacked.append(report)
        self._post_round_message(report)

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
