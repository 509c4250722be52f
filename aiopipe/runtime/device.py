"""The device node: runs the stage the coordinator assigns it, on local data.

One event loop, one compute thread. While training, these tasks run:
- the train loop: per round, it takes the round's assignment (`RoundStart`: stage,
  units, micro-batches, one iteration's actions, peers), builds that stage, loads its
  weights, and runs the actions iteration after iteration with a `StageExecutor`
  (PiPar's device: forward N micro-batches back to back, posting each activation as soon
  as it exists; then, in micro-batch order, wait for each gradient and run its backward;
  then one optimizer step, Eq. 26); then it uploads the weights and a report;
- the link to the coordinator: a send loop (`Peer.send_loop`), a receive loop that
  checks each message against the round (a gradient from the coordinator's own stage in
  the split modes; `RoundStart`, `Bye`), heartbeats and a silence watchdog (`Liveness`);
  when that link breaks the device reconnects with backoff ([Note: reconnection] in
  aiopipe/runtime/session.py) and re-sends what may have been lost;
- links to peer devices, when the run has them (a pipeline): `PeerLinks`; a member of a
  data-parallel group (Asteroid) exchanges pieces of micro-batches with the members of
  the neighbouring stages and all-reduces its gradients with its own group's
  (`aiopipe.runtime.groups`).
The data never leaves the device: only activations, labels and the stage's weights do.
After its `Plan` the device opens its data (its own, or an emulated fleet's shard),
builds the run's model and announces both (`Ready`: samples, input shape, classes, the
model's digest); the coordinator plans from what the devices announce.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeAlias, cast

import torch

from aiopipe import data as datasets
from aiopipe.clock import Clock, SystemClock
from aiopipe.config import PIPELINE_MODES, STAR_MODES, RunConfig
from aiopipe.errors import (
    LinkBrokenError,
    NeighbourFaultError,
    PoisonedValueError,
    ProtocolError,
    RemoteProtocolError,
    TrainingError,
    TransportError,
)
from aiopipe.metrics.trace import MAX_REPORT_SLICES, Recorder
from aiopipe.protocol import (
    HEADER_SLACK_BYTES,
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
    Replica,
    ReplicaRequest,
    RingBypass,
    RingChunk,
    RingHandshake,
    RoundReport,
    RoundResult,
    RoundStalled,
    RoundStart,
    SyncedModel,
    TensorData,
    state_to_wire,
    to_torch,
)
from aiopipe.runtime.assignment import Assignment, check_data_message, data_frame_limit
from aiopipe.runtime.async_weights import AsyncStageWork
from aiopipe.runtime.chain import (
    ChainReplicas,
    backs_up_momentum,
    backup_node,
    stage_snapshot,
)
from aiopipe.runtime.compute import Compute, resolve_torch_device, warm_up_torch
from aiopipe.runtime.executor import Identity, Inbox, Key, Route, StageExecutor
from aiopipe.runtime.groups import (
    GroupRoute,
    Pieces,
    check_group_gradient,
    gradients_of,
    sum_gradients,
)
from aiopipe.runtime.holdings import Holdings
from aiopipe.runtime.judge import ArrivalJudge, scale_of
from aiopipe.runtime.liveness import Liveness
from aiopipe.runtime.partial_sync import PartialSync
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.peer_links import PeerLinks, PeerMessage, PeerRoute
from aiopipe.runtime.plan import measure_planning_costs
from aiopipe.runtime.privacy import noisy_batch, noisy_state, round_generator
from aiopipe.runtime.profiling import answer_request
from aiopipe.runtime.stage import Expected, StageInputError, StageWork, recomputable
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.costs import CostTable
from aiopipe.transport import Link, LinkSpec, WebSocketLink
from aiopipe.transport.fabric import Endpoint
from aiopipe.wording import plural

__all__ = ["COORDINATOR", "Connector", "DeviceSummary", "run_device"]

log = logging.getLogger("aiopipe.device")

#: The coordinator's node name (the destination of what a device sends to its stage).
COORDINATOR = "server"


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
        if node.sync is not None:
            node.sync.close()
        for task in node._linking:
            task.cancel()
        node.compute.close()


class _ServerRoute:
    """The coordinator's stage as a neighbour: posts on the coordinator link, keeping each
    activation until its gradient arrives, to re-send it after a reconnection."""

    node = COORDINATOR

    def __init__(self, owner: _DeviceNode) -> None:
        self.owner = owner

    def send(self, message: Activation | Gradient, name: str, *,
             ready_at: float | None) -> None:
        if isinstance(message, Activation):
            self.owner.sent_activations[_key(message)] = message
        self.owner.peer.post(message, name, epoch=message.epoch, iteration=message.iteration,
                             micro_batch=message.micro_batch, ready_at=ready_at)


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
        self.sent_activations: dict[tuple[int, int, int], Activation] = {}
        #: activations (and group gradients) from peers ahead of the round ([Note: early
        #: activations])
        self._early: dict[str, list[Activation | GroupGradient]] = {}
        #: what the round's messages from a data-parallel group are joined by, and the
        #: stage's parameters (names, dtypes, shapes) its group gradients must hold
        self.pieces: Pieces | None = None
        self.parameters: Expected = {}
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
        #: ftpipehd: what this device holds of the chain replication
        self.chain: ChainReplicas | None = None
        #: hadfl: the device's side of the partial synchronisation
        self.sync: PartialSync | None = None
        #: judges the values peers send ([Note: judging arrivals])
        self.judge = ArrivalJudge()
        self._linking: set[asyncio.Future[None]] = set()  # hadfl: links made ahead of need
        self._peer_bytes_reported = 0  # bytes sent to peers, as the last report said
        #: set when the server said Bye: the run is over, mid-round or not
        self.ended: TrainingError | None = None

    async def run(self) -> DeviceSummary:
        async with contextlib.AsyncExitStack() as links:
            self.plan = await self._connect(links)
            self.config = self._run_config(self.plan)  # cheap: heartbeats need it
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
                            deliver=self._deliver, failed=self._peer_failed,
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
            self._early.clear()  # activations of the old session's rounds
            self._drop_round()
            if self.peers is not None:
                self.peers.rekey(plan.peer_keys)
        self.server_session = plan.session
        self.run_id = plan.run_id
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
        for key, activation in self.sent_activations.items():
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
        if pace is not None and isinstance(self.peer.link, WebSocketLink):
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
                self._deliver(COORDINATOR, message)
            elif isinstance(message, RoundStart):
                if message.round <= self.last_round_received:
                    continue  # sent again after a reconnection: we have it already
                self.last_round_received = message.round
                self._drop_round()  # if still on an older one, the server gave up on it
                self.control.put_nowait(message)
            elif isinstance(message, EvalRequest):
                self.control.put_nowait(message)
            elif isinstance(message, ReplicaRequest):
                if self.config.mode not in ("ftpipehd", "asteroid"):
                    raise RemoteProtocolError(f"a replica request in mode {self.config.mode}")
                # (a process started afresh may be asked before it has set up: none held)
                for replica in (self.chain.answer(message) if self.chain is not None
                                else ChainReplicas.none_held(message)):
                    self.peer.post(replica, "replica")
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
                self.sent_activations.clear()
                return
            elif isinstance(message, ErrorMessage):
                if message.code == "refused":  # what we announced does not fit the run
                    raise TrainingError(f"server refused device {self.device_id}: "
                                        f"{message.message}")
                raise TrainingError(f"server error {message.code}: {message.message}")
            elif not isinstance(message, Heartbeat):
                raise RemoteProtocolError(f"a device does not accept {type(message).__name__}")

    def _deliver(self, sender: str, message: PeerMessage) -> None:
        """Check a data message from ``sender`` against the round and hand it to the stage.

        [Note: early activations] The coordinator starts a round on every device at
        once, but the `RoundStart`s travel separate links: the previous stage may start,
        and send its first activations, before this device has its own `RoundStart`.
        Such activations, ahead of the round this device knows, wait (`_early`) and are
        checked when their round starts. A stage sends at most N of them before it must
        wait for a gradient, so more than the batch size of them from one peer is a
        protocol error.

        Raises:
            RemoteProtocolError: it breaks the plan.
        """
        assignment = self.assignment
        if isinstance(message, RingChunk | RingBypass | RingHandshake | SyncedModel):
            if self.sync is None:
                raise RemoteProtocolError(f"{sender} sent HADFL's {type(message).__name__} "
                                          f"in mode {self.config.mode}")
            self.sync.deliver(sender, message)
            return
        if isinstance(message, Replica):
            if self.chain is None or sender == COORDINATOR:
                raise RemoteProtocolError(f"{sender} sent a replica outside the chain")
            self.judge.judge_tensors(sender, f"replica@{message.stage}", message.tensors,
                                     what=f"replica of stage {message.stage}")
            if self.config.mode == "asteroid":
                self.chain.accept_backup(sender, message, assignment)
            else:
                self.chain.accept(sender, message, assignment)
            return
        if isinstance(message, Gradient) and sender == COORDINATOR:
            if _key(message) not in self.sent_activations:
                return  # a gradient sent again after a reconnection; we have it already
            del self.sent_activations[_key(message)]
        running = self.round_task is not None and not self.round_task.done()
        # (a replay's versions lie above every attempt's before it, Asteroid's and a
        # synchronous pipeline's)
        replayed = self.config.mode in ("asteroid", "pipeline")
        if assignment is not None and _earlier_attempt(
                message, assignment, resumed=self.chain is not None, replayed=replayed):
            return  # of an attempt at the round that the coordinator gave up on
        if isinstance(message, Activation | GroupGradient) and sender != COORDINATOR and (
                not running or _after(message, assignment, replayed=replayed)
        ) and not _before(message, assignment):
            early = self._early.setdefault(sender, [])
            if len(early) >= self.config.batch_size:
                raise RemoteProtocolError(f"{sender} sent more activations ahead of the "
                                          "round than a round can have")
            early.append(message)
            return
        if assignment is None or not running:
            if isinstance(message, Gradient):
                return  # late: its round is over (or was dropped)
            raise RemoteProtocolError(f"{sender} sent an activation outside a round")
        key: Key
        whole: Activation | Gradient | dict[str, GroupGradient] | None
        assert self.pieces is not None  # (set with the assignment)
        if isinstance(message, GroupGradient):
            check_group_gradient(message, assignment, self.parameters, sender=sender,
                                 run_id=self.run_id)
            key = ("R", message.epoch, message.iteration, 0)
            self._check_once(sender, key)
            whole = self.pieces.gather(key, sender, message)
        else:
            check_data_message(message, assignment, sender=sender, run_id=self.run_id)
            if sender != COORDINATOR:
                self.judge.judge_data(sender, message, first_unit=assignment.first_unit,
                                      stop_unit=assignment.stop_unit)
            key = ("F" if isinstance(message, Activation) else "B", *_key(message))
            self._check_once(sender, key)
            whole = self.pieces.join(key, sender, message)
        if whole is None:
            return  # more pieces to come
        if self.inbox.held() >= 2 * assignment.parallel_batches + 2:
            # an honest neighbour is never more than an iteration ahead of us
            raise RemoteProtocolError(f"{sender} sent more than two iterations' messages "
                                      "ahead of the schedule")
        self.inbox.put(key, whole)

    def _check_once(self, sender: str, key: Key) -> None:
        """A peer sends each message once.

        Raises:
            RemoteProtocolError: ``sender`` sent ``key``'s again.
        """
        if sender != COORDINATOR and self.inbox.seen(key):
            raise RemoteProtocolError(f"{sender} sent {key[0]} {key[1:]} twice")

    async def _deliver_early(self) -> None:
        """Hand over the activations that came before this round started
        ([Note: early activations]); those for a later round wait on. One that breaks
        the plan is its sender's protocol error (which fails the round)."""
        early, self._early = self._early, {}
        for sender, messages in early.items():
            for message in messages:
                try:
                    self._deliver(sender, message)
                except RemoteProtocolError as exc:
                    if self.peers is not None:
                        await self.peers.reject(sender, exc)
                    raise NeighbourFaultError(sender, exc) from None

    def _peer_failed(self, name: str, error: Exception) -> None:
        """A peer link broke: the round in progress cannot finish (HADFL's ring
        bypasses the peer: aiopipe.runtime.partial_sync)."""
        fault = NeighbourFaultError(name, error) if isinstance(error, ProtocolError) else None
        if fault is not None:
            self._accuse(fault)
        if self.sync is not None:
            self.sync.peer_failed(name, error)
            return
        if self.ended is None and self.round_task is not None and not self.round_task.done():
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
        self.sent_activations.clear()
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
        if self.config.mode == "ftpipehd" or (self.config.mode == "asteroid"
                                              and self.config.chain_replication_every):
            self.chain = ChainReplicas(self.holdings.template.model,
                                       momentum=backs_up_momentum(self.config),
                                       every=self.config.chain_replication_every)
        if self.config.mode == "hadfl":
            self.sync = PartialSync(me=self.device_id, holdings=self.holdings,
                                    compute=self.compute, clock=self.clock, costs=self.costs,
                                    config=self.config, run_id=self.run_id,
                                    judge=self.judge)
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
            self.round_task = asyncio.create_task(self._run_round(message))
            try:
                done = await self.round_task
            except asyncio.CancelledError:
                if not self.round_dropped:
                    raise
                self.round_dropped = False
                continue
            except TrainingError as exc:
                culprit = exc.culprit if isinstance(exc, NeighbourFaultError) else ""
                if self.ended is not None or (not culprit and self.config.mode not in
                                              PIPELINE_MODES):
                    raise
                # the pipelines recover: the coordinator, told, plays the round
                # again (or ends the run); a neighbour's fault is the coordinator's to
                # judge in every mode ([Note: judging arrivals]): this device is fine
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

    async def _run_round(self, message: RoundStart) -> int:
        """Train the round's iterations, upload the weights, then the report; samples."""
        if self.sync is not None:
            return await self._run_sync_round(message)
        mark = len(self.recorder.slices)
        self.inbox.reopen()
        assignment, work = await self.compute.call(
            partial(self.holdings.assign, message, self.assignment, self.work,
                    self._own_backup(message)))
        if self.peers is not None and not self.judge.priors:
            # (before the assignment is taken: a neighbour's activations that come while
            # this awaits wait as early ones, not for `pieces` yet to be set)
            self.judge.set_cut_priors(await self.compute.call(partial(
                self.holdings.cut_scales, assignment.micro_batch_size)))
        self.assignment, self.work = assignment, work
        # [Note: recomputed activations]: in virtual time, memory is what runs short
        work.recompute = (self.costs is not None and not work.measure_memory
                          and work.device.type == "cpu" and recomputable(work.module)
                          and not isinstance(work, AsyncStageWork))
        self.pieces = Pieces(assignment)
        self.parameters = {name: (str(p.dtype).removeprefix("torch."), tuple(p.shape))
                           for name, p in work.module.named_parameters()}
        if self.peers is not None:
            # FTPipeHD re-partitions: a neighbour may send the next round's activations
            # (of another cut) before our RoundStart comes ([Note: early activations])
            backups = self.chain.frame_limit if self.chain is not None else 0
            self.peers.limit(max(data_frame_limit(self.holdings.activation_shapes,
                                                  assignment.micro_batch_size), backups)
                             if self.config.mode == "ftpipehd" else max(
                                 assignment.frame_limit(),
                                 _group_frame_limit(self.parameters), backups))
        await self._deliver_early()
        routes = await self._routes(assignment)
        group = await self._group_routes(assignment)
        micro, n = assignment.share, assignment.parallel_batches
        work.batch = self.holdings.batches(assignment)
        if self.config.privacy == "pixeldp" and assignment.stage == 0:
            work.batch = partial(noisy_batch, work.batch, self.config.privacy_noise,
                                 round_generator(self.config.seed, self.device_id,
                                                 message.round))
        executor = StageExecutor(
            work, self.compute, stage=assignment.stage, actions=assignment.actions,
            identity=Identity(self.run_id, self.name), inbox=self.inbox,
            previous=routes.get(assignment.stage - 1), next=routes.get(assignment.stage + 1),
            costs=assignment.charges(self.costs),
            after_backward=(partial(self._send_snapshots, work, assignment, routes)
                            if isinstance(work, AsyncStageWork) else None),
            reduce=partial(self._reduce, work, assignment, group) if group else None)
        timer = (asyncio.ensure_future(self._gradient_timer())
                 if self.config.mode == "ftpipehd" and assignment.stage == 0 else None)
        try:
            for iteration in range(message.first_iteration,
                                   message.first_iteration + message.iterations):
                if self.ended is not None:  # no gradient will come
                    raise self.ended
                try:
                    await executor.run(message.epoch, iteration,
                                       assignment.version_of(iteration))
                except StageInputError as exc:
                    raise _neighbour_fault(assignment, exc) from None
                self.sent_activations.clear()  # every gradient of the iteration has arrived
                if self.chain is not None and self.config.mode == "asteroid":
                    await self._back_up(work, assignment, iteration + 1)
        finally:
            if timer is not None:
                timer.cancel()
        samples = message.iterations * micro * n
        weights = await self.compute.call(partial(self._upload_state, work, message.round))
        result = RoundResult(message.round, samples, float(work.loss_sum), int(work.correct),
                             weights)
        await self._report(result, mark, work)
        return samples

    def _upload_state(self, work: StageWork, round_no: int) -> dict[str, TensorData]:
        """The trained stage as it leaves the device: with classic differential
        privacy, noised (aiopipe.runtime.privacy). Compute thread.

        In fl, sl, sfl and pipar the result shares the stage's memory on the CPU (no
        copy): it is kept until the next `RoundStart` (for re-sending), and only that
        round's weights, loaded after it, change the stage again; the other systems
        train on between rounds and upload a copy."""
        if self.config.mode in STAR_MODES:
            state = work.current_state()
        elif self.config.mode == "pipeline":  # its momentum goes back with the weights
            state = stage_snapshot(work, momentum=backs_up_momentum(self.config))
        else:
            state = work.trained_state()
        if self.config.privacy == "classic":
            state = noisy_state(state, self.config.privacy_noise, round_generator(
                self.config.seed, self.device_id, round_no))
        return state_to_wire(state)

    async def _report(self, result: RoundResult, mark: int, work: StageWork) -> None:
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

    async def _run_sync_round(self, message: RoundStart) -> int:
        """HADFL's round (aiopipe.runtime.partial_sync [Note: HADFL rounds]): local
        steps, the ring's average over peer links, then the result and report; samples.

        Raises:
            TrainingError: this device listens for no peers.
        """
        sync = self.sync
        assert sync is not None
        if self.peers is None:
            raise TrainingError(f"device {self.device_id} runs mode hadfl but listens for "
                                "no peers (start it with an endpoint: python -m "
                                "aiopipe.device --listen)")
        mark = len(self.recorder.slices)
        self.peers.limit(sync.frame_limit)
        peers = dict(message.peers)
        for name in peers:  # the side whose name sorts first dials
            if self.name < name:
                task = asyncio.ensure_future(self._link_quietly(name, peers))
                self._linking.add(task)
                task.add_done_callback(self._linking.discard)
        result = await sync.run_round(message, partial(self._sync_route, peers))
        await self._report(result, mark, sync.work)
        return result.samples

    async def _sync_route(self, peers: dict[str, Any], device: int) -> PeerRoute:
        """The link to ring peer ``device`` this round (see `PeerLinks.route`).

        Raises:
            TrainingError: it is not a peer of the round, or cannot be linked.
        """
        name = f"device{device}"
        if name not in peers or self.peers is None:
            raise TrainingError(f"device{device} is not a peer of {self.name}'s round")
        return await self.peers.route(name, str(peers[name].get("address", "")),
                                      dial=self.name < name)

    async def _link_quietly(self, name: str, peers: dict[str, Any]) -> None:
        """Link to ``name`` ahead of need; a peer that cannot be reached is the ring's
        business ([Note: HADFL bypass])."""
        try:
            await self._sync_route(peers, int(name.removeprefix("device")))
        except TrainingError as exc:
            log.info("device %d: %s", self.device_id, exc)

    def _send_snapshots(self, work: AsyncStageWork, assignment: Assignment,
                        routes: dict[int, Route]) -> None:
        """Chain replication (aiopipe.runtime.chain [Note: chain replication]): keep the
        stage's new snapshots and send them on, to the next stage's device (from the
        last stage, to the coordinator)."""
        assert self.chain is not None
        for batches, tensors, loss_sum, correct in work.take_snapshots():
            replica = Replica(assignment.version, assignment.stage, batches, loss_sum,
                              correct, tensors)
            self.chain.keep(replica)
            route = routes.get(assignment.stage + 1)
            link = route.peer if isinstance(route, PeerRoute) else self.peer  # (last stage)
            link.post(replica, "replica", epoch=assignment.epoch)

    def _own_backup(self, message: RoundStart) -> Replica | None:
        """Asteroid's replay from a backup point ([Note: stage backups]): our own
        snapshot of the stage ``message`` keeps (sent no weights), after its first
        iteration, taken in the attempt we last worked on; None when we hold none."""
        previous = self.assignment
        if (self.chain is None or message.tensors or previous is None
                or message.epoch != previous.epoch):
            return None
        return self.chain.own(message.stage, message.first_iteration, previous.round)

    async def _back_up(self, work: StageWork, assignment: Assignment, batches: int) -> None:
        """Asteroid's topology-driven replication ([Note: stage backups]): at a backup
        point (every ``chain_replication_every`` batches of the epoch, the round's last
        but one at most) keep our stage's state and, when we are its only device, send
        it to its backup node, in the link's idle time (aiopipe.runtime.peer [Note:
        background sends])."""
        assert self.chain is not None
        end = assignment.first_iteration + assignment.iterations
        if batches % self.chain.every or batches >= end:
            return
        momentum = self.chain.momentum
        tensors = await self.compute.call(
            lambda: state_to_wire(stage_snapshot(work, momentum=momentum)))
        replica = Replica(assignment.round, assignment.stage, batches, float(work.loss_sum),
                          int(work.correct), tensors)
        self.chain.keep(replica)
        node = backup_node(assignment)
        if node is not None:
            route = await self._peer_route(assignment, node, dial=True)
            route.peer.post(replica, "backup", epoch=assignment.epoch, background=True)

    async def _reduce(self, work: StageWork, assignment: Assignment,
                      group: dict[str, PeerRoute], epoch: int, iteration: int,
                      version: int) -> None:
        """A data-parallel group's all-reduce (aiopipe.runtime.groups [Note: direct
        all-reduce]): send our accumulated gradients to every other member, then set
        the sum of all members' (in row order) as the stage's."""
        free = 0.0 if self.costs is not None else None  # (virtual time: the sum is free)
        mine = await self.compute.run("r", partial(gradients_of, work.module), cost=free,
                                      epoch=epoch, iteration=iteration)
        for name, route in group.items():
            route.peer.post(GroupGradient(self.run_id, assignment.stage, epoch, iteration,
                                          version, self.name, name, mine),
                            "g", epoch=epoch, iteration=iteration)
        received = await self.inbox.wait(("R", epoch, iteration, 0))
        own = max((scale_of(to_torch(tensor)) for tensor in mine.values()), default=0.0)
        for member, message in received.items():  # against our own: [Note: judging arrivals]
            try:
                self.judge.judge_tensors(member, "group gradient", message.tensors, own=own,
                                         what=f"group gradient {(epoch, iteration)}")
            except PoisonedValueError as exc:
                raise NeighbourFaultError(member, exc) from None
        members = [m for m, _ in assignment.members_at(assignment.stage)]
        await self.compute.run("r", partial(sum_gradients, work.module, mine, members,
                                            self.name, received),
                               cost=free, epoch=epoch, iteration=iteration)

    async def _gradient_timer(self) -> None:
        """FTPipeHD's timer (§III-F), on the first stage: when the round has waited
        ``device_timeout`` seconds for the same gradients, it stops (and the coordinator
        is told: `RoundStalled`). Checked every eighth of that."""
        timeout = self.config.device_timeout
        waiting, since = frozenset[Key](), self.clock.now()
        while True:
            pending = self.inbox.pending()
            if not pending or pending != waiting:
                waiting, since = pending, self.clock.now()
            elif self.clock.now() - since >= timeout:
                batches = sorted(k[2] + k[3] + 1 for k in pending)  # (1-based, as logged)
                self.inbox.close(TrainingError(
                    f"no gradient came within {timeout:g} s (waiting for batch "
                    f"{', '.join(map(str, batches))} of the epoch)"))
                return
            await self.clock.sleep(timeout / 8)

    async def _routes(self, assignment: Assignment) -> dict[int, Route]:
        """The neighbouring stages: peers (linked now if need be) or the coordinator.

        Raises:
            TrainingError: a peer cannot be linked to, or the run needs peer links and
                this device has no endpoint.
        """
        routes: dict[int, Route] = {}
        for stage in (assignment.stage - 1, assignment.stage + 1):
            if not 0 <= stage < assignment.stages:
                continue
            members = [(name, assignment.rows_with(name))
                       for name, _ in assignment.members_at(stage)]
            if not members:
                routes[stage] = _ServerRoute(self)
                continue
            linked = [(await self._peer_route(assignment, name, dial=stage > assignment.stage),
                       rows) for name, rows in members if rows[0] < rows[1]]
            routes[stage] = linked[0][0] if len(linked) == 1 else GroupRoute(linked)
        return routes

    async def _group_routes(self, assignment: Assignment) -> dict[str, PeerRoute]:
        """The other members of our stage's data-parallel group (none: no group), linked
        (the member whose name sorts first dials)."""
        return {name: await self._peer_route(assignment, name, dial=self.name < name)
                for name, _ in assignment.members_at(assignment.stage) if name != self.name}

    async def _peer_route(self, assignment: Assignment, name: str, *, dial: bool) -> PeerRoute:
        """The link to peer ``name`` (see `PeerLinks.route`).

        Raises:
            TrainingError: it cannot be linked, or this device listens for no peers.
        """
        if self.peers is None:
            raise TrainingError(f"device {self.device_id} runs stage {assignment.stage} "
                                f"next to {name} but listens for no peers (start it "
                                "with an endpoint: python -m aiopipe.device --listen)")
        return await self.peers.route(name, assignment.peers[name]["address"], dial=dial)


def _neighbour_fault(assignment: Assignment, error: StageInputError) -> Exception:
    """What a stage's refusal of its input means: the neighbour that sent it is at
    fault (a `NeighbourFaultError` naming it) when that is one device; the error as it
    is when it is the coordinator (a star's server half) or a group of several."""
    members = assignment.members_at(assignment.stage + (1 if error.from_next else -1))
    if len(members) != 1:
        return error
    return NeighbourFaultError(members[0][0], error)


def _key(message: Activation | Gradient) -> tuple[int, int, int]:
    return (message.epoch, message.iteration, message.micro_batch)


def _group_frame_limit(parameters: Expected) -> int:
    """The largest `GroupGradient` a stage of these parameters can be sent."""
    return sum(4 * math.prod(shape) + 256 for _, shape in parameters.values()
               ) + HEADER_SLACK_BYTES


def _after(message: Activation | GroupGradient, assignment: Assignment | None, *,
           replayed: bool = False) -> bool:
    """Whether ``message`` belongs to an iteration after ``assignment``'s round (with
    ``replayed``, Asteroid's: to a later attempt, or round, whose versions lie above)."""
    if assignment is None:
        return True
    last = assignment.first_iteration + assignment.iterations - 1
    if replayed:
        return message.version > assignment.version_of(last)
    return (message.epoch, message.iteration, message.version) > (
        assignment.epoch, last, assignment.version_of(last))


def _earlier_attempt(message: Activation | Gradient | GroupGradient,
                     assignment: Assignment, *, resumed: bool,
                     replayed: bool = False) -> bool:
    """Whether ``message`` is of an earlier attempt at ``assignment``'s round (FTPipeHD
    plays a round again after a fault; each attempt's weights have their own version,
    `Assignment.version`). With ``resumed`` (FTPipeHD's chain replication) an attempt
    may start after the batch an earlier one started at. With ``replayed`` (Asteroid) a
    replay's versions lie above every earlier attempt's, at any iteration."""
    if replayed:
        return message.version < assignment.version
    if (message.epoch, message.iteration) != (assignment.epoch, assignment.first_iteration
                                              ) and not (
            resumed and message.epoch == assignment.epoch
            and message.iteration < assignment.first_iteration):
        return False
    return message.version < assignment.version


def _before(message: Activation | GroupGradient, assignment: Assignment | None) -> bool:
    """Whether ``message`` belongs to an iteration before ``assignment``'s round."""
    return assignment is not None and (message.epoch, message.iteration) < (
        assignment.epoch, assignment.first_iteration)
