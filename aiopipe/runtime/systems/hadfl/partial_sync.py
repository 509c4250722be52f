"""HADFL on a device (§III-C, §III-D): local steps on the whole model, the partial
synchronisation of a ring of devices over peer links, the bypass of a dead member, and
the non-blocking merge of the ring's average into the devices the round left out.

[Note: HADFL rounds] Each round's `RoundStart` says (``sync``, `SyncPlan`) how many
local steps this device trains (``iterations``: E_i, by its speed), at which learning
rate, which devices form the round's ring (in ring order: each sends to the next), which
of them sends the average to the devices left out, and whether that sender also returns
it to the coordinator (the model manager's backup). A round:

1. the device trains its E_i steps on its own data, one mini-batch after another, going
   round its data in epochs (its data order is its own: step s is batch s mod b of epoch
   s // b, b its batches per epoch); its model's *version* grows by 1/b per step. With
   steps by capacity the round also has a time budget (``budget_s``: E_i times its
   seconds per step, as the negotiation measured, about the period): a device does not
   start a step that would end (lasting as long as its last) past `PERIOD_SLACK` times
   that (one step at least), so a device slower than it was reaches a lower version
   instead of holding its ring up (§III-B: what Holt's prediction follows);
2. a ring member averages its model (its floating-point state but the frozen
   parameters, the same everywhere, and its version, as one flat vector) with the
   others' by scatter-reduce and all-gather (`aiopipe.runtime.systems.hadfl.gossip.
   RingAverage`), chunks travelling device to device (`RingChunk`), version included;
3. the sender posts the average (`SyncedModel`) to every device left out, in the links'
   idle time (aiopipe.runtime.peer [Note: background sends]) and goes on; a device left
   out merges it, whenever it arrives, into its own model between two of its steps (or
   before its round's report): each floating-point tensor and the version become the
   mean of its own and the received (a choice: the paper says "integrate");
4. the device reports to the coordinator: samples, loss, its version, and no weights
   (the coordinator is off the data path), but for the sender of a backup round.

[Note: HADFL bypass] A member that hears nothing from its upstream within
``ring_timeout`` asks it (`RingHandshake`); an upstream that answers is alive and
waited for again; one that does not within ``ring_timeout`` more, whose link broke, or
that cannot be linked is dead: the member tells every other member the ring without it
(`RingBypass`), and the average starts again among the survivors, each from its own
model (partial sums that hold the dead member's chunks cannot be undone). A chunk of a
shorter ring than a member's is taken as the same news. The sender is the designated
one while it lives, else the first survivor of the ring.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from aiopipe import data as datasets
from aiopipe.clock import Clock, wait_for
from aiopipe.config import RunConfig
from aiopipe.errors import AiopipeError, RemoteProtocolError
from aiopipe.metrics.trace import device_of
from aiopipe.models import without_frozen
from aiopipe.models.crossing import Value
from aiopipe.protocol import (
    HEADER_SLACK_BYTES,
    RingBypass,
    RingChunk,
    RingHandshake,
    RoundResult,
    RoundStart,
    SyncedModel,
    TensorData,
    state_from_wire,
    state_to_wire,
    to_tensor_data,
    to_torch,
)
from aiopipe.runtime.compute import Compute
from aiopipe.runtime.factories import make_optimizer
from aiopipe.runtime.holdings import Holdings, load_stage_state
from aiopipe.runtime.judge import ArrivalJudge, scale_of
from aiopipe.runtime.peer_links import PeerRoute
from aiopipe.runtime.stage import StageWork, check_tensors, expected_of
from aiopipe.runtime.systems.hadfl.gossip import RingAverage, chunk_bounds, chunk_sent
from aiopipe.runtime.systems.hadfl.options import HADFLOptions
from aiopipe.scheduler.costs import CostTable

__all__ = ["PartialSync", "SyncMessage", "SyncPlan", "flat_state", "load_flat"]

log = logging.getLogger("aiopipe.device")

#: Local training stops once it has lasted this many times its budget (a device
#: slower than it measured in the negotiation reaches a lower version instead of
#: holding its ring up: [Note: HADFL rounds]).
PERIOD_SLACK = 1.1

#: What peers send each other for HADFL.
SyncMessage = RingChunk | RingBypass | RingHandshake | SyncedModel
#: The route to a peer device by id (linked now if need be).
RouteTo = Callable[[int], Awaitable[PeerRoute]]


@dataclass(frozen=True, slots=True)
class SyncPlan:
    """A round's synchronisation, from `RoundStart.sync` ([Note: HADFL rounds])."""

    ring: tuple[int, ...]
    sender: int
    receivers: tuple[int, ...]
    learning_rate: float
    version: float
    backup: bool
    #: the seconds the negotiation expects the local steps to take: local training
    #: stops once it lasted `PERIOD_SLACK` times that; 0: no end (the negotiation,
    #: fixed local steps)
    budget_s: float = 0.0

    @classmethod
    def of(cls, start: RoundStart, devices: int) -> SyncPlan:
        """Read and check ``start.sync``.

        Raises:
            RemoteProtocolError: it is not a round's synchronisation of ``devices``.
        """
        sync = start.sync
        try:
            ring = tuple(int(d) for d in sync["ring"])
            receivers = tuple(int(d) for d in sync["receivers"])
            plan = cls(ring, int(sync["sender"]), receivers, float(sync["learning_rate"]),
                       float(sync["version"]), bool(sync["backup"]),
                       float(sync.get("budget_s", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"round {start.round + 1}'s sync is not HADFL's: "
                                      f"{exc!r}") from None
        every = (*ring, *receivers)
        if (not ring or len(set(every)) != len(every)
                or any(not 0 <= d < devices for d in every)
                or plan.sender not in ring or not plan.learning_rate > 0
                or not np.isfinite(plan.learning_rate) or not plan.version >= 0
                or not np.isfinite(plan.version) or not 0 <= plan.budget_s < np.inf):
            raise RemoteProtocolError(f"round {start.round + 1}'s sync is not a ring of the "
                                      f"run's devices: {dict(sync)!r}")
        return plan


def flat_state(model: torch.nn.Module, version: float) -> torch.Tensor:
    """The model's floating-point state that changes (trainable parameters and float
    buffers, in state order) and ``version``, as one float32 vector: a frozen parameter
    is the same on every device, so the ring does not average it ([Note: frozen bases]
    in aiopipe/runtime/systems/star/coordinator.py)."""
    parts = [v.detach().reshape(-1).to("cpu", torch.float32)
             for v in _float_state(model, copy=False).values()]
    return torch.cat([*parts, torch.tensor([version], dtype=torch.float32)])


def load_flat(model: torch.nn.Module, vector: torch.Tensor) -> float:
    """Load a `flat_state` vector into ``model``; the version it holds."""
    offset = 0
    with torch.no_grad():
        for value in _float_state(model, copy=False).values():
            n = value.numel()
            value.copy_(vector[offset:offset + n].reshape(value.shape))
            offset += n
    return float(vector[offset])


def _float_state(model: torch.nn.Module, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """The model's floating-point state less its frozen parameters (what HADFL moves
    between nodes), on the CPU (``copy``: a copy; else the model's own tensors)."""
    state = without_frozen(model.state_dict(), model)
    if not copy:
        return {k: v for k, v in state.items() if v.is_floating_point()}
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()
            if v.is_floating_point()}


class _Restart(Exception):
    """The ring changed: the average starts again among the new ring."""


class PartialSync:
    """One device's side of HADFL (module docstring). The device node hands it its
    rounds (`run_round`), its peers' HADFL messages (`deliver`) and its broken peer
    links (`peer_failed`).

    Args:
        me: this device's id.
        holdings: its data and model (the whole model trains here).
        compute: its compute resource.
        clock: its clock.
        costs: charge compute from this table (virtual time), or None.
        config: the run's.
        run_id: the run's (every peer message carries it).
    """

    def __init__(self, *, me: int, holdings: Holdings, compute: Compute, clock: Clock,
                 costs: CostTable | None, config: RunConfig, run_id: int,
                 judge: ArrivalJudge | None = None) -> None:
        self.me, self.name = me, f"device{me}"
        #: judges the chunks and averages peers send ([Note: judging arrivals])
        self.judge = judge if judge is not None else ArrivalJudge(
            limit=config.scale_limit)
        self._own_scale: tuple[int, float] = (-1, 0.0)  # (round, our state's scale)
        self.holdings, self.compute, self.clock = holdings, compute, clock
        self.costs, self.config, self.run_id = costs, config, run_id
        model = holdings.model_copy()
        self.work = StageWork(model, make_optimizer(model, config), first=True, last=True,
                              parallel_batches=1, num_classes=holdings.plan.num_classes,
                              loss=holdings.loss, metric=holdings.metric)
        self.batch_size = config.batch_size
        self.batches = len(holdings.dataset) // self.batch_size
        if self.batches < 1:
            raise RemoteProtocolError(f"{self.name} holds {len(holdings.dataset)} samples, "
                                      f"fewer than a mini-batch ({self.batch_size})")
        self.work.batch = self._batch
        self.steps = 0  # local steps so far: where the data order stands
        self.version = 0.0  # the model's version, in epochs ([Note: HADFL rounds])
        self._orders: dict[int, np.ndarray] = {}
        #: the averages sent to us, newest round: (round, sender, version, state)
        self._synced: tuple[int, str, float, dict[str, torch.Tensor]] | None = None
        self._merged_round = -1
        #: rounds' rings, to check who may send us their average (the last few)
        self._rings: dict[int, tuple[int, ...]] = {}
        self._round = -1
        self._ring: tuple[int, ...] = ()  # the current attempt's ring ((): none)
        self._chunks: dict[tuple[int, tuple[int, ...], int], RingChunk] = {}
        #: per round, the shortest ring heard of ([Note: HADFL bypass])
        self._news: dict[int, tuple[int, ...]] = {}
        self._flat_size = int(flat_state(model, 0.0).numel())
        #: the largest frame a peer may send us: the model's state (an average)
        self.frame_limit = sum(t.numel() * t.element_size() + 256
                               for t in model.state_dict().values()) + HEADER_SLACK_BYTES
        self._replied: set[tuple[int, int]] = set()  # (round, upstream) that answered
        self._dead: set[int] = set()  # peers whose link broke
        self._wake = asyncio.Event()
        self._route: RouteTo | None = None
        self._outboxes: dict[int, asyncio.Queue[tuple[Any, str, bool]]] = {}
        self._senders: list[asyncio.Task[None]] = []

    # -- a round ----------------------------------------------------------------------

    async def run_round(self, start: RoundStart, route: RouteTo) -> RoundResult:
        """Train, synchronise and report round ``start`` ([Note: HADFL rounds]);
        ``route``: the link to a peer by id.

        Raises:
            RemoteProtocolError: the round's sync or weights break the plan.
        """
        plan = SyncPlan.of(start, self.config.devices)
        self._route = route
        self._round = start.round
        self._rings[start.round] = plan.ring
        for old in [r for r in self._rings if r < start.round - 2]:
            del self._rings[old]
        self._chunks = {k: v for k, v in self._chunks.items() if k[0] >= start.round}
        self._news = {r: ring for r, ring in self._news.items() if r >= start.round}
        self._dead.clear()  # the coordinator saw them alive: their links may come back
        if start.tensors:  # a device that rejoined: the coordinator's backup
            await self.compute.call(partial(self._load_backup, start.tensors, plan.version))
        for group in self.work.optimizer.param_groups:
            group["lr"] = plan.learning_rate
        self.work.reset_totals()
        cost = self._step_cost()
        deadline = self.clock.now() + PERIOD_SLACK * plan.budget_s if plan.budget_s else None
        trained, step_s = 0, 0.0
        for _ in range(start.iterations):
            if deadline is not None and trained and self.clock.now() + step_s > deadline:
                log.info("%s: the period ended after %d of round %d's %d local steps",
                         self.name, trained, start.round + 1, start.iterations)
                break
            await self._merge_pending(start.epoch)
            step, began = self.steps, self.clock.now()
            await self.compute.run("FB", partial(self._train_step, step), cost=cost,
                                   epoch=start.epoch, iteration=step)
            step_s = self.clock.now() - began
            self.steps += 1
            trained += 1
            self.version += 1 / self.batches
        await self._merge_pending(start.epoch)
        tensors: Mapping[str, TensorData] = {}
        if self.me in plan.ring:
            ring = await self._average(plan, start.epoch)
            sender = plan.sender if plan.sender in ring else ring[0]
            if sender == self.me:
                await self._broadcast(start, plan.receivers)
                if plan.backup and sender == plan.sender:
                    tensors = await self.compute.call(lambda: state_to_wire(
                        {k: v.detach().to("cpu", copy=True) for k, v in without_frozen(
                            self.work.module.state_dict(), self.work.module).items()}))
        samples = trained * self.batch_size
        return RoundResult(start.round, samples, float(self.work.loss_sum),
                           float(self.work.correct), tensors, version=float(self.version))

    def _batch(self, step: int, _: int) -> tuple[Value, torch.Tensor]:
        """Local step ``step``'s mini-batch ([Note: HADFL rounds])."""
        epoch, k = divmod(step, self.batches)
        order = self._orders.get(epoch)
        if order is None:
            order = datasets.epoch_order(np.arange(len(self.holdings.dataset)), epoch=epoch,
                                         seed=self.config.seed)
            self._orders = {epoch: order}
        return self.holdings.dataset.batch(order[k * self.batch_size:
                                                 (k + 1) * self.batch_size])

    def _train_step(self, step: int) -> None:
        self.work.forward_backward(step, 0)
        self.work.step()

    def _step_cost(self) -> float | None:
        """A local step's seconds by the cost table (virtual time), else None."""
        if self.costs is None:
            return None
        units, b = self.holdings.units, self.batch_size
        return (self.costs.forward_time(0, units, b) + self.costs.backward_time(0, units, b)
                + self.costs.step_time(0, units))

    def _load_backup(self, tensors: Mapping[str, TensorData], version: float) -> None:
        """Start again from the coordinator's backup, which holds no frozen parameter
        (ours are the same) (compute thread).

        Raises:
            RemoteProtocolError: it is not this model's state.
        """
        model = self.work.module
        check_tensors(tensors, expected_of(state_to_wire(
            without_frozen(model.state_dict(), model))), "backup")
        load_stage_state(model, state_from_wire(tensors), "the coordinator's backup")
        self.work.optimizer = make_optimizer(model, self.config)
        self.version = version
        log.info("%s: starts from the coordinator's backup (version %.3g)", self.name,
                 version)

    # -- the merge of an average sent to us ------------------------------------------

    async def _merge_pending(self, epoch: int) -> None:
        synced, self._synced = self._synced, None
        if synced is None or synced[0] <= self._merged_round:
            return
        round_no, sender, version, state = synced
        free = 0.0 if self.costs is not None else None
        await self.compute.run("merge", partial(self._merge, state), cost=free, epoch=epoch)
        self.version = (self.version + version) / 2
        self._merged_round = round_no
        log.debug("%s: merged round %d's average from %s", self.name, round_no + 1, sender)

    def _merge(self, state: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in self.work.module.state_dict().items():
                if name in state:
                    value.copy_((value + state[name].to(value.device)) / 2)

    # -- the ring average -------------------------------------------------------------

    async def _average(self, plan: SyncPlan, epoch: int) -> tuple[int, ...]:
        """Average with the ring's members, bypassing dead ones; the ring that did."""
        own = await self.compute.call(partial(flat_state, self.work.module, self.version))
        heard = self._news.get(self._round, plan.ring)
        self._ring = tuple(d for d in heard if d not in self._dead)
        if self._ring != heard and self.me in self._ring:  # we know of a death first
            log.warning("%s: ring member(s) %s left before round %d's average; bypassing",
                        self.name, sorted(set(heard) - set(self._ring)), self._round + 1)
            self._news[self._round] = self._ring
            self._announce(self._ring)
        while True:
            ring = self._ring
            try:
                vector = await self._ring_steps(ring, own, epoch)
            except _Restart:
                continue
            self.version = await self.compute.call(partial(load_flat, self.work.module,
                                                           vector))
            self._ring = ()
            return ring

    def _announce(self, ring: tuple[int, ...]) -> None:
        """Tell the other members of ``ring`` that the average goes on among it."""
        for d in ring:
            if d != self.me:
                self._send(d, RingBypass(self.run_id, self._round, ring), "bypass")

    async def _ring_steps(self, ring: tuple[int, ...], own: torch.Tensor,
                          epoch: int) -> torch.Tensor:
        """One attempt at the average among ``ring``.

        Raises:
            _Restart: the ring changed meanwhile.
        """
        if self.me not in ring:  # the others took us for dead: keep our own model
            return own
        position, n = ring.index(self.me), len(ring)
        average = RingAverage(own, position, n)
        downstream, upstream = ring[(position + 1) % n], ring[position - 1]
        for step in range(average.steps):
            chunk, values = average.outgoing()
            self._send(downstream, RingChunk(self.run_id, self._round, ring, step, chunk,
                                             to_tensor_data(values)), "ring")
            message = await self._receive(ring, step, upstream)
            free = 0.0 if self.costs is not None else None
            await self.compute.run("sum", partial(average.incoming, message.chunk,
                                                  to_torch(message.values)),
                                   cost=free, epoch=epoch, iteration=step)
        return average.average()

    async def _receive(self, ring: tuple[int, ...], step: int, upstream: int) -> RingChunk:
        """Step ``step``'s chunk from ``upstream``, handshaking it when it is silent
        ([Note: HADFL bypass]).

        Raises:
            _Restart: the ring changed (we or another member bypassed a dead one).
        """
        timeout = self.config.options_as(HADFLOptions).ring_timeout
        waited_from = self.clock.now()
        deadline, asked = waited_from + timeout, False
        while True:
            found = self._chunks.pop((self._round, ring, step), None)
            if found is not None:
                return found
            if self._ring != ring:
                raise _Restart
            if upstream in self._dead or (asked and self.clock.now() >= deadline):
                self._bypass(upstream, waited_from)
                raise _Restart
            if self.clock.now() >= deadline:  # silent: ask it
                self._send(upstream, RingHandshake(self.run_id, self._round, 0), "handshake")
                asked, deadline = True, self.clock.now() + timeout
            if asked and (self._round, upstream) in self._replied:
                self._replied.discard((self._round, upstream))
                asked, deadline = False, self.clock.now() + timeout
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await wait_for(self.clock, self._wake.wait(),
                               max(0.0, deadline - self.clock.now()))

    def _bypass(self, dead: int, since: float) -> None:
        """``dead`` is gone: the ring goes on without it, and the others are told."""
        ring = tuple(d for d in self._ring if d != dead)
        log.warning("%s: ring member device%d is dead; bypassing it (round %d, %.3g s "
                    "after the wait began)", self.name, dead, self._round + 1,
                    self.clock.now() - since)
        self._dead.add(dead)
        self._news[self._round] = self._ring = ring
        self._announce(ring)
        # the dead one too, in case it lives on: a member left out keeps its own model
        self._send(dead, RingBypass(self.run_id, self._round, ring), "bypass")

    async def _broadcast(self, start: RoundStart, receivers: tuple[int, ...]) -> None:
        """Post the average to the devices the round left out, in the background."""
        left_out = [d for d in receivers if d not in self._dead]
        if not left_out:
            return
        tensors = await self.compute.call(lambda: state_to_wire(_float_state(self.work.module)))
        message = SyncedModel(self.run_id, start.round, float(self.version), tensors)
        for d in left_out:
            self._send(d, message, "synced", background=True)

    # -- messages ---------------------------------------------------------------------

    def _send(self, device: int, message: Any, name: str, *, background: bool = False) -> None:
        """Queue ``message`` to ``device`` (linked first if need be), in order."""
        queue = self._outboxes.get(device)
        if queue is None:
            queue = self._outboxes[device] = asyncio.Queue()
            self._senders.append(asyncio.ensure_future(self._drain(device, queue)))
        queue.put_nowait((message, name, background))

    async def _drain(self, device: int, queue: asyncio.Queue[tuple[Any, str, bool]]) -> None:
        while True:
            message, name, background = await queue.get()
            if device in self._dead or self._route is None:
                continue
            try:
                route = await self._route(device)
            except AiopipeError as exc:
                log.warning("%s: cannot reach device%d: %s", self.name, device, exc)
                self.peer_failed(f"device{device}", exc)
                continue
            route.peer.post(message, name, epoch=self._round, background=background)

    def close(self) -> None:
        """Stop the send tasks (the run is over)."""
        for task in self._senders:
            task.cancel()

    def peer_failed(self, name: str, error: Exception) -> None:
        """The link to peer ``name`` broke: a ring member waiting for it bypasses it."""
        device = device_of(name)
        if device is not None:
            self._dead.add(device)
            self._wake.set()

    def deliver(self, sender: str, message: SyncMessage) -> None:
        """A peer's HADFL message, checked against the rounds this device knows.

        Raises:
            RemoteProtocolError: it breaks the plan.
        """
        source = device_of(sender)
        if source is None or message.run_id != self.run_id:
            raise RemoteProtocolError(f"{sender} sent a message of another run")
        self._dead.discard(source)  # (it is alive after all)
        if isinstance(message, SyncedModel):
            self._accept_synced(source, sender, message)
        elif isinstance(message, RingHandshake):
            if message.reply == 0 and message.round == self._round and self._ring and (
                    source not in self._ring):  # we bypassed it: it must hear so
                self._send(source, RingBypass(self.run_id, self._round, self._ring), "bypass")
            elif message.reply == 0:
                self._send(source, RingHandshake(self.run_id, message.round, 1), "handshake")
            else:
                self._replied.add((message.round, source))
        elif isinstance(message, RingBypass):
            if message.round >= self._round:
                self._heard_ring(source, message.round, message.ring, sender)
        else:
            self._accept_chunk(source, message, sender)
        self._wake.set()

    def _heard_ring(self, source: int, round_no: int, ring: tuple[int, ...],
                    sender: str) -> bool:
        """A member of round ``round_no`` works with ``ring``: keep it as news when it
        is shorter than the ring we know ([Note: HADFL bypass]); whether ``source``'s
        messages of that ring are of the attempt under way (or a later one).

        Raises:
            RemoteProtocolError: ``ring`` is not part of the round's ring, or lacks
                ``source``.
        """
        full = self._rings.get(round_no)
        if source not in ring or (full is not None and tuple(d for d in full if d in ring)
                                  != ring):
            raise RemoteProtocolError(f"{sender} sent a ring {list(ring)} that is not "
                                      f"part of round {round_no + 1}'s {list(full or ring)}")
        known = self._news.get(round_no, full)
        if known is None or set(ring) < set(known):
            self._adopt(round_no, ring)
            return True
        if set(ring) == set(known):
            return True
        if not set(ring) >= set(known):  # two deaths heard apart: neither ring is final
            self._adopt(round_no, tuple(d for d in known if d in ring))
            if round_no == self._round and self.me in self._news[round_no]:
                self._announce(self._news[round_no])
        return False

    def _adopt(self, round_no: int, ring: tuple[int, ...]) -> None:
        self._news[round_no] = ring
        if round_no == self._round and self._ring:  # averaging now: start again
            self._dead |= set(self._ring) - set(ring)
            self._ring = ring

    def _accept_chunk(self, source: int, message: RingChunk, sender: str) -> None:
        ring, step = message.ring, message.step
        if message.round < self._round or not self._heard_ring(source, message.round, ring,
                                                               sender):
            return  # of a round that is over, or an attempt given up on
        if self.me not in ring or ring[ring.index(self.me) - 1] != source:
            raise RemoteProtocolError(f"{sender} is not our upstream in ring {list(ring)}")
        n = len(ring)
        if step >= 2 * (n - 1):
            raise RemoteProtocolError(f"{sender} sent ring step {step} of a ring of {n}")
        expected = (chunk_sent(ring.index(self.me), n, step) - 1) % n
        a, b = chunk_bounds(self._flat_size, n)[expected]
        values = message.values
        if message.chunk != expected or values.dtype != "float32" or values.shape != (b - a,):
            raise RemoteProtocolError(f"{sender} sent ring step {step} as chunk "
                                      f"{message.chunk} of {values.shape} {values.dtype}, "
                                      f"expected chunk {expected} of {(b - a,)} float32")
        if len(self._chunks) > 4 * self.config.devices:
            raise RemoteProtocolError(f"{sender} sent more ring chunks than a ring has")
        key = (message.round, ring, step)
        if key in self._chunks:
            raise RemoteProtocolError(f"{sender} sent ring step {step} twice")
        # a chunk sums at most a ring's models: at most len(ring) times our own scale
        self.judge.judge_against(sender, to_torch(values),
                                 len(ring) * self._state_scale(message.round),
                                 what=f"ring step {step}'s chunk")
        self._chunks[key] = message

    def _state_scale(self, round_no: int) -> float:
        """The largest magnitude of our own state and version, once per round."""
        if self._own_scale[0] != round_no:
            scale = max((scale_of(v) for v in self.work.module.state_dict().values()
                         if v.is_floating_point()), default=0.0)
            self._own_scale = (round_no, max(scale, self.version, 1e-12))
        return self._own_scale[1]

    def _accept_synced(self, source: int, sender: str, message: SyncedModel) -> None:
        ring = self._rings.get(message.round)
        if ring is None or message.round <= self._merged_round:
            return  # too old to matter, or of a round not begun here: not to be checked
        if source not in ring or self.me in ring:
            raise RemoteProtocolError(f"{sender} sent round {message.round + 1}'s average, "
                                      "which it does not send to us")
        state = self.work.module.state_dict()
        expected = {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape))
                    for k, v in _float_state(self.work.module, copy=False).items()}
        check_tensors(message.tensors, expected, "synced model")
        self.judge.judge_tensors(sender, "synced model", message.tensors,
                                 what=f"round {message.round + 1}'s average", own=state)
        tensors = state_from_wire(message.tensors)
        if self._synced is None or self._synced[0] < message.round:
            self._synced = (message.round, sender, message.version, dict(tensors))

