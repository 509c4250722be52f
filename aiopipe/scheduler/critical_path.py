"""The critical path of action lists: an event-driven simulation with serial resources.

Pure: no I/O, no clock, no torch, no asyncio. `simulate` takes executors (one stage of
one pipeline each, as a node runs it) and the seconds of each action, and returns a
`Timeline`; `pipeline_executors` makes the executors of one pipeline from a `Schedule`.

Theory of operation
-------------------
The runtime is built to follow these rules exactly; the simulation is their definition.

1. Each executor walks its ``actions`` in order, ``iterations`` times back to back,
   from its ``start``.
2. A compute action (F, B, FB, STEP, REDUCE) is *requested* on the executor's node when
   the executor reaches it. A node runs one compute action at a time. When it is free it
   serves the waiting request made earliest; ties go to the executor that comes first
   in the ``executors`` list, then to the request made first. The executor moves on
   when its action ends.
3. SEND_F / SEND_B are *posted* when reached, and the executor moves on at once (sends
   do not block). The directed link from the sender's node to the receiver's node
   carries one message at a time, in post order (ties as for compute): a message's wire
   slot starts at max(posted, the end of the link's previous slot) and lasts its wire
   seconds; it arrives ``latency`` seconds after its slot ends. The receiver is the
   executor of the same pipeline at stage + 1 (SEND_F) or stage - 1 (SEND_B). When the
   sender and the receiver share a node the message arrives when posted, over no link.
4. RECV_F(n) / RECV_B(n) wait until the matching message of the same iteration (the
   sender's iteration equals the receiver's) has arrived.
5. If the simulation runs out of events with executors unfinished, they wait for
   messages that never come: `simulate` raises ConfigError naming each stuck executor's
   pipeline, stage, iteration and waiting action.

[Note: one instant at a time] Time advances instant by instant. Every event of an
instant is handled first (ends of compute and wire slots, arrivals, starts), including
the events they cause at that same instant (a message within a node arrives at once,
and its receiver requests its next compute action). Then the free links whose next
message takes no wire time carry it, and what that causes at this instant (an arrival
without latency) is handled in turn; only when nothing more happens at the instant
without a node's work are the free nodes (and the other links) handed to their earliest
waiting requests. So a request made at an instant by an event handled late in that
instant competes on equal terms with one made early, and only the rules of 2. and 3.
decide, never the order events happen to be handled in. What a zero-second compute
action causes is the exception: it can only compete with what is still waiting when it
ends, in a further round of the same instant. Each action costs O(1) heap operations:
O(A log A) for A actions in all.

[Note: PiPar as executors] With device k as executor (k, stage 0, node ``device{k}``)
running ``with_transfers(pipar(N))``'s stage 0, and its server side as executor (k,
stage 1, node ``server``), listed (0, 0), (0, 1), (1, 0), (1, 1), ..., the rules above
are those of `aiopipe.scheduler.chain.chained_schedule` ([Note: server order],
[Note: chained iterations]): the server serves the earliest request, ties by device;
a server pass is requested when its activation has arrived and the previous pass has
ended; and every time is formed by the same float operations (end = start + seconds,
arrival = slot end + latency), so the step ends are equal to the last bit
(tests/scheduler/test_scheduler_critical_path.py).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from aiopipe.errors import ConfigError
from aiopipe.scheduler.actions import Action, Schedule

__all__ = ["Executor", "Span", "Timeline", "pipeline_executors", "simulate"]


@dataclass(frozen=True, slots=True)
class Executor:
    """One stage of one pipeline, as a node runs it.

    ``node`` names the machine whose compute the stage uses (``"device0"``,
    ``"server"``); several executors may share a node. ``actions`` is one iteration of
    the stage, transfers included; it runs ``iterations`` times back to back from
    ``start`` seconds.

    Raises:
        ConfigError: pipeline or stage is not an int >= 0, node is not a non-empty
            string, actions is not a tuple of `Action`\\ s of this stage, iterations is
            not an int >= 1, or start is not a finite number >= 0.
    """

    pipeline: int
    stage: int
    node: str
    actions: tuple[Action, ...]
    iterations: int = 1
    start: float = 0.0

    def __post_init__(self) -> None:
        for name in ("pipeline", "stage"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ConfigError(f"Executor.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.node, str) or not self.node:
            raise ConfigError(f"Executor.node must be a non-empty string, got {self.node!r}")
        if not isinstance(self.actions, tuple):
            raise ConfigError(f"Executor.actions must be a tuple, got {type(self.actions)}")
        for position, action in enumerate(self.actions):
            if not isinstance(action, Action) or action.stage != self.stage:
                raise ConfigError(
                    f"executor (pipeline {self.pipeline}, stage {self.stage}): position "
                    f"{position} holds {action!s}, not an action of stage {self.stage}"
                )
        if not _is_int(self.iterations) or self.iterations < 1:
            raise ConfigError(f"Executor.iterations must be an int >= 1, got {self.iterations!r}")
        s = self.start
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or s < 0:
            raise ConfigError(f"Executor.start must be a finite number >= 0, got {s!r}")

    @property
    def key(self) -> tuple[int, int]:
        """(pipeline, stage): how a `Timeline` names this executor."""
        return (self.pipeline, self.stage)


@dataclass(frozen=True, slots=True)
class Span:
    """One action's time on one resource: a compute action on ``"{node}/compute"``, or a
    send's wire slot on ``"{sender node}->{receiver node}"`` (latency excluded)."""

    pipeline: int
    stage: int
    iteration: int
    action: Action
    resource: str
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Timeline:
    """What `simulate` found.

    ``spans``: every compute action and wire slot, in the order they started.
    ``step_ends[(pipeline, stage)]``: when that executor's STEP ended, per iteration.
    ``peak_live[(pipeline, stage)]``: the most micro-batches it had forwarded and not yet
    backwarded at once (an FB holds its micro-batch for its own duration).
    """

    spans: tuple[Span, ...]
    step_ends: Mapping[tuple[int, int], tuple[float, ...]]
    peak_live: Mapping[tuple[int, int], int]

    @property
    def makespan(self) -> float:
        """When the last span ends (0 when there is none)."""
        return max((s.end for s in self.spans), default=0.0)

    def busy(self) -> dict[str, float]:
        """Busy seconds per resource (latency is not busy time), in order of first use."""
        busy: dict[str, float] = {}
        for s in self.spans:
            busy[s.resource] = busy.get(s.resource, 0.0) + (s.end - s.start)
        return busy


ComputeTime = Callable[[Executor, Action], float]
TransferTime = Callable[[Executor, Action], tuple[float, float]]


def simulate(
    executors: Sequence[Executor],
    *,
    compute_time: ComputeTime,
    transfer_time: TransferTime,
) -> Timeline:
    """Run the executors by the module's rules (theory of operation, 1.-5.).

    ``compute_time(executor, action)``: seconds of a compute action.
    ``transfer_time(sender, send_action)``: (wire seconds, latency seconds) of a send
    between different nodes (not asked for sends within a node).

    Raises:
        ConfigError: two executors with the same (pipeline, stage); a transfer with no
            executor at the neighbouring stage of its pipeline; a time that is negative
            or not a number; or executors stuck waiting for messages that never come
            (the message names each one's pipeline, stage, iteration and action).
    """
    run = _Run(executors, compute_time, transfer_time)
    run.run()
    return run.timeline()


def pipeline_executors(
    schedule: Schedule,
    nodes: Sequence[str],
    *,
    pipeline: int = 0,
    iterations: int = 1,
    starts: Sequence[float] | None = None,
) -> list[Executor]:
    """One executor per stage of ``schedule``: stage p runs on ``nodes[p]`` from
    ``starts[p]`` (default 0).

    Raises:
        ConfigError: a schedule without the transfers its stages need (add them with
            `with_transfers`), as many nodes or starts as stages not given, or bad
            executor fields (see `Executor`).
    """
    stages = schedule.stages
    # what `with_transfers` would add to: any F or B, and an FB past stage 0
    if stages > 1 and not schedule.has_transfers() and any(
            a.kind in ("F", "B") or (a.kind == "FB" and p > 0)
            for p, actions in enumerate(schedule.actions) for a in actions):
        raise ConfigError(
            f"schedule {schedule.name!r} has no transfers: pass with_transfers(schedule)"
        )
    if len(nodes) != stages:
        raise ConfigError(f"{len(nodes)} nodes for {stages} stages")
    if starts is None:
        starts = [0.0] * stages
    if len(starts) != stages:
        raise ConfigError(f"{len(starts)} starts for {stages} stages")
    return [
        Executor(pipeline, p, nodes[p], schedule.actions[p], iterations, starts[p])
        for p in range(stages)
    ]


# -- the simulation ------------------------------------------------------------------------

_START, _END, _FREE, _ARRIVE = range(4)

#: A message: (receiver's executor index, iteration, "F" activation or "B" gradient, mb).
_Message = tuple[int, int, Literal["F", "B"], int]
#: What events other than arrivals carry in place of a message.
_NO_MESSAGE: _Message = (-1, -1, "F", -1)


class _Send(NamedTuple):
    """A posted send waiting for its link."""

    message: _Message
    wire: float
    latency: float
    iteration: int
    action: Action


class _Resource:
    """A node's compute or a directed link: serial, with a queue of waiting requests
    ordered by (made at, executor index, request number) ([Note: one instant at a time]);
    a compute request carries no send."""

    __slots__ = ("busy", "name", "number", "queue")

    def __init__(self, name: str, number: int) -> None:
        self.name = name
        self.number = number
        self.busy = False
        self.queue: list[tuple[float, int, int, _Send | None]] = []


class _Run:
    """One simulation's state; `simulate` is its only user."""

    def __init__(self, executors: Sequence[Executor], compute_time: ComputeTime,
                 transfer_time: TransferTime) -> None:
        self.executors = list(executors)
        self.compute_time = compute_time
        self.transfer_time = transfer_time
        self.index: dict[tuple[int, int], int] = {}
        for i, e in enumerate(self.executors):
            if not isinstance(e, Executor):
                raise ConfigError(f"executors[{i}] is not an Executor: {e!r}")
            if e.key in self.index:
                raise ConfigError(f"two executors for pipeline {e.pipeline}, stage {e.stage}")
            self.index[e.key] = i
        self.peers = [self._peers(e) for e in self.executors]
        count = len(self.executors)
        self.position = [0] * count
        self.iteration = [0] * count
        self.waiting: list[_Message | None] = [None] * count
        self.mailbox: dict[_Message, int] = {}
        self.resources: dict[str, _Resource] = {}
        self.by_number: list[_Resource] = []
        self.compute = [self._resource(f"{e.node}/compute") for e in self.executors]
        self.dirty: dict[str, _Resource] = {}  # insertion-ordered: deterministic dispatch
        # (time, event number, code, executor index or resource number, message of an arrival)
        self.events: list[tuple[float, int, int, int, _Message]] = []
        self.counter = itertools.count()
        self.spans: list[Span] = []
        self.step_ends: list[list[float]] = [[] for _ in range(count)]
        self.live: list[set[tuple[int, int]]] = [set() for _ in range(count)]
        self.peak = [0] * count
        for i, e in enumerate(self.executors):
            self._push(e.start, _START, i)

    def _peers(self, e: Executor) -> tuple[int, int]:
        """Indices of the executors at stage - 1 and stage + 1 (-1: none), checked
        against the transfers the executor makes."""
        before = self.index.get((e.pipeline, e.stage - 1), -1)
        after = self.index.get((e.pipeline, e.stage + 1), -1)
        for position, a in enumerate(e.actions):
            upstream = a.kind in ("RECV_F", "SEND_B")
            if (a.is_transfer and (before if upstream else after) < 0):
                neighbour = e.stage - 1 if upstream else e.stage + 1
                raise ConfigError(
                    f"executor (pipeline {e.pipeline}, stage {e.stage}): {a} at position "
                    f"{position} needs an executor at stage {neighbour}, and there is none"
                )
        return before, after

    def _resource(self, name: str) -> _Resource:
        found = self.resources.get(name)
        if found is None:
            found = self.resources[name] = _Resource(name, len(self.resources))
            self.by_number.append(found)
        return found

    def _push(self, time: float, code: int, x: int, message: _Message = _NO_MESSAGE) -> None:
        heapq.heappush(self.events, (time, next(self.counter), code, x, message))

    def _request(self, resource: _Resource, now: float, i: int, send: _Send | None) -> None:
        heapq.heappush(resource.queue, (now, i, next(self.counter), send))
        self.dirty[resource.name] = resource

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        events = self.events
        while events:
            now = events[0][0]
            while events and events[0][0] == now:
                _, _, code, x, message = heapq.heappop(events)
                self._handle(now, code, x, message)
            if not self._dispatch(now, wireless=True):
                self._dispatch(now, wireless=False)
        stuck = [i for i, e in enumerate(self.executors) if self.iteration[i] < e.iterations]
        if stuck:
            raise ConfigError("executors wait for messages that never come: " + "; ".join(
                f"pipeline {self.executors[i].pipeline} stage {self.executors[i].stage} "
                f"iteration {self.iteration[i]} waits at position {self.position[i]} on "
                f"{self.executors[i].actions[self.position[i]]}"
                for i in stuck))

    def _handle(self, now: float, code: int, x: int, message: _Message) -> None:
        """One event: x is an executor's index, or a resource's number (free)."""
        if code == _START:
            self._advance(x, now)
        elif code == _END:
            self._mark_free(self.compute[x])
            self._ended(x, now)
            self.position[x] += 1
            self._advance(x, now)
        elif code == _FREE:
            self._mark_free(self.by_number[x])
        else:
            j = message[0]
            if self.waiting[j] == message:
                self.waiting[j] = None
                self.position[j] += 1
                self._advance(j, now)
            else:
                self.mailbox[message] = self.mailbox.get(message, 0) + 1

    def _mark_free(self, resource: _Resource) -> None:
        resource.busy = False
        self.dirty[resource.name] = resource

    def _ended(self, i: int, now: float) -> None:
        """Book-keeping of executor i's compute action that just ended."""
        a = self.executors[i].actions[self.position[i]]
        live = self.live[i]
        if a.kind == "F":
            live.add((self.iteration[i], a.micro_batch))
            self.peak[i] = max(self.peak[i], len(live))
        elif a.kind == "B":
            live.discard((self.iteration[i], a.micro_batch))
        elif a.kind == "FB":
            self.peak[i] = max(self.peak[i], len(live) + 1)
        elif a.kind == "STEP":
            self.step_ends[i].append(now)

    def _advance(self, i: int, now: float) -> None:
        """Walk executor i from its position until it must wait (rules 1-4)."""
        e = self.executors[i]
        actions = e.actions
        while True:
            if self.position[i] == len(actions):
                self.position[i] = 0
                self.iteration[i] += 1
                if self.iteration[i] == e.iterations:
                    return
                continue
            a = actions[self.position[i]]
            if a.is_compute:
                self._request(self.compute[i], now, i, None)
                return
            if a.kind in ("SEND_F", "SEND_B"):
                self._post(i, a, now)
            else:
                message = self._message(i, a)
                count = self.mailbox.get(message, 0)
                if count == 0:
                    self.waiting[i] = message
                    return
                if count == 1:
                    del self.mailbox[message]
                else:
                    self.mailbox[message] = count - 1
            self.position[i] += 1

    def _message(self, i: int, a: Action) -> _Message:
        """The message executor i's transfer ``a`` sends or waits for, keyed by its
        receiver."""
        before, after = self.peers[i]
        if a.kind == "SEND_F":
            return (after, self.iteration[i], "F", a.micro_batch)
        if a.kind == "SEND_B":
            return (before, self.iteration[i], "B", a.micro_batch)
        return (i, self.iteration[i], "F" if a.kind == "RECV_F" else "B", a.micro_batch)

    def _post(self, i: int, a: Action, now: float) -> None:
        e = self.executors[i]
        message = self._message(i, a)
        receiver = self.executors[message[0]]
        if receiver.node == e.node:
            self._push(now, _ARRIVE, message[0], message)
            return
        wire, latency = self.transfer_time(e, a)
        wire = _seconds(wire, f"wire time of {a}")
        latency = _seconds(latency, f"latency of {a}")
        link = self._resource(f"{e.node}->{receiver.node}")
        self._request(link, now, i, _Send(message, wire, latency, self.iteration[i], a))

    def _dispatch(self, now: float, *, wireless: bool) -> bool:
        """Hand each free resource touched this instant to its earliest request; with
        ``wireless``, only links whose next message takes no wire time ([Note: one instant
        at a time]). Whether anything was handed out."""
        dirty = self.dirty
        if not wireless:
            self.dirty = {}
        handed = False
        for resource in list(dirty.values()):
            if resource.busy or not resource.queue:
                continue
            _, i, _, send = resource.queue[0]
            if wireless:
                if send is None or send.wire != 0:
                    continue
                del dirty[resource.name]  # its FREE, at this instant, marks it again
            heapq.heappop(resource.queue)
            resource.busy = handed = True
            e = self.executors[i]
            if send is None:
                a = e.actions[self.position[i]]
                end = now + _seconds(self.compute_time(e, a), f"compute time of {a}")
                self.spans.append(Span(e.pipeline, e.stage, self.iteration[i], a,
                                       resource.name, now, end))
                self._push(end, _END, i)
                continue
            end = now + send.wire
            self.spans.append(Span(e.pipeline, e.stage, send.iteration, send.action,
                                   resource.name, now, end))
            self._push(end, _FREE, resource.number)
            self._push(end + send.latency, _ARRIVE, send.message[0], send.message)
        return handed

    def timeline(self) -> Timeline:
        keys = [e.key for e in self.executors]
        return Timeline(
            spans=tuple(self.spans),
            step_ends={k: tuple(ends) for k, ends in zip(keys, self.step_ends, strict=True)},
            peak_live=dict(zip(keys, self.peak, strict=True)),
        )


def _seconds(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"{what} must be a number >= 0, got {value!r}")
    return float(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
