"""The stage executor: runs one stage's action list, iteration after iteration.

Theory of operation
-------------------
A stage's schedule is data (`aiopipe.scheduler.schedule`): one iteration's actions, e.g.
PiPar's device ``0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0STEP``. The
executor walks the list in order, exactly as the generic estimator
(`aiopipe.scheduler.critical_path`) models it:

- a compute action (F, B, FB, STEP) runs on the node's `Compute` (one FIFO queue per
  node, shared by every stage the node hosts); the executor waits for it;
- SEND_F / SEND_B post the activation or gradient that the compute before made to the
  neighbour's `Route` (a send queue, drained by the link's send loop) and go on at once;
- RECV_F / RECV_B wait in the `Inbox` until the matching message has arrived;
- REDUCE (a data-parallel group's member, right before its STEP) hands over to the
  node's ``reduce``: the all-reduce of the stage's gradients within the group
  (`aiopipe.runtime.groups`), which runs its compute on the same queue.

[Note: a whole model's step] A stage that is the whole model (FL's device: ``0FB0
0STEP``) runs its STEP in the same compute item as the FB before it: nothing can come
between them (no transfer, no other stage on the device), and as an item of its own the
step costs more CPU than at the end of the backward (a hand-over of its own, which a
slowed device pays ``slowdown`` times). Its slice keeps the FB's name; in virtual time
it is charged both actions' costs, so it ends when the two would have.

The executor computes and posts; it never touches a link (STYLE item 3). Whoever owns
the links (a device node, the server's session of a device, a device's peer links)
validates each arriving message against the plan and puts it in the inbox, and its
`Route` decides what a posted message needs besides the send queue (a device keeps its
activations to re-send them after a reconnection; the server keeps its gradients).

Each message is stage-addressed (`aiopipe.protocol.Activation`): run, sending stage,
epoch, iteration, micro-batch, the version of the weights (optimizer steps taken in the
run: ``version`` at the round's first iteration, one more per iteration), source and
destination node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch

from aiopipe.errors import TrainingError
from aiopipe.protocol import (
    Activation,
    Gradient,
    leaves_from_wire,
    leaves_to_wire,
    to_tensor_data,
    to_torch,
)
from aiopipe.runtime.compute import Compute
from aiopipe.runtime.stage import Sent, StageWork
from aiopipe.scheduler.actions import Action

__all__ = ["SLICE_NAMES", "Identity", "Inbox", "Route", "StageExecutor"]

#: Trace slice names of the actions (PiPar's f, u, s, d, b, step).
SLICE_NAMES: Mapping[str, str] = {"F": "f", "B": "b", "FB": "s", "STEP": "step",
                                  "SEND_F": "u", "SEND_B": "d"}

#: What a stage waits for: ("F" or "B", epoch, iteration, micro-batch); a group's
#: all-reduce waits for ("R", epoch, iteration, 0).
Key = tuple[str, int, int, int]


class Route(Protocol):
    """Where messages to one neighbouring stage go."""

    @property
    def node(self) -> str:
        """The neighbour's node name (the messages' destination)."""
        ...

    def send(self, message: Activation | Gradient, name: str, *,
             ready_at: float | None) -> None:
        """Post ``message`` to the neighbour (``name``: its trace slice)."""
        ...


class Inbox:
    """Received activations ("F") and gradients ("B") that a stage waits for, by key.

    `put` may come before or after the executor's `wait` for the same key. `close`
    fails every wait, present and future (the round is over or the run ended).
    """

    def __init__(self) -> None:
        self._futures: dict[Key, asyncio.Future[Any]] = {}
        self._closed: BaseException | None = None
        self._seen: set[Key] = set()  # delivered since `reopen`

    def _future(self, key: Key) -> asyncio.Future[Any]:
        future = self._futures.get(key)
        if future is None:
            future = self._futures[key] = asyncio.get_running_loop().create_future()
            if self._closed is not None:
                future.set_exception(self._closed)
                future.exception()  # retrieved: a closed inbox's futures may go unawaited
        return future

    def put(self, key: Key, message: object) -> None:
        """Deliver ``message`` for ``key`` (a second delivery of a key is ignored)."""
        self._seen.add(key)
        future = self._future(key)
        if not future.done():
            future.set_result(message)

    def seen(self, key: Key) -> bool:
        """Whether a message for ``key`` was delivered since the last `reopen`."""
        return key in self._seen

    def held(self) -> int:
        """Messages delivered and not yet taken by a `wait`."""
        return sum(1 for f in self._futures.values() if f.done() and not f.cancelled()
                   and f.exception() is None)

    def pending(self) -> frozenset[Key]:
        """The keys waited for that have not arrived."""
        return frozenset(k for k, f in self._futures.items() if not f.done())

    def arrived(self, key: Key) -> bool:
        """Whether the message for ``key`` is here."""
        future = self._futures.get(key)
        return future is not None and future.done() and not future.cancelled() and (
            future.exception() is None)

    def ready(self, key: Key) -> bool:
        """Whether waiting for ``key`` would return at once."""
        future = self._futures.get(key)
        return future is not None and future.done()

    async def wait(self, key: Key) -> Any:
        """The message for ``key``, once it has arrived.

        Raises:
            BaseException: what `close` was given.
        """
        future = self._future(key)
        try:
            return await asyncio.shield(future)
        finally:
            if future.done():
                del self._futures[key]

    def close(self, reason: BaseException) -> None:
        """Fail every wait with ``reason`` from now on."""
        self._closed = reason
        for future in self._futures.values():
            if not future.done():
                future.set_exception(reason)
                future.exception()

    def reopen(self) -> None:
        """Accept waits again (a new round) and forget what was left."""
        self._closed = None
        self._futures.clear()
        self._seen.clear()


@dataclass(frozen=True, slots=True)
class Identity:
    """Who sends: the run and this node's name."""

    run_id: int
    node: str


class StageExecutor:
    """Runs one stage's action list per iteration (see the module docstring).

    Args:
        work: the stage's torch side.
        compute: the node's compute queue.
        actions: one iteration's actions of this stage (transfers included).
        identity: the run and this node, for the messages it sends.
        inbox: where the links put what this stage receives.
        previous: the route to stage - 1 (None on the first stage).
        next: the route to stage + 1 (None on the last stage).
        costs: seconds each compute action is charged (virtual time), or None to run on
            the real clock.
        after_backward: called after each backward (FTPipeHD's device sends the chain
            snapshots the update made, if any).
        reduce: runs a REDUCE action (epoch, iteration, version): a data-parallel
            group's all-reduce.
    """

    def __init__(self, work: StageWork, compute: Compute, *, stage: int,
                 actions: tuple[Action, ...], identity: Identity, inbox: Inbox,
                 previous: Route | None, next: Route | None,
                 costs: Callable[[Action], float] | None = None,
                 after_backward: Callable[[], None] | None = None,
                 reduce: Callable[[int, int, int], Awaitable[None]] | None = None) -> None:
        self.work = work
        self.compute = compute
        self.stage = stage
        self.actions = actions
        self.identity = identity
        self.inbox = inbox
        self.previous = previous
        self.next = next
        self.costs = costs
        self.after_backward = after_backward
        self.reduce = reduce

    async def run(self, epoch: int, iteration: int, version: int) -> None:
        """Run the actions of one iteration.

        Raises:
            RemoteProtocolError: a received input fails the stage's checks.
            TrainingError: the inbox was closed (the round or the run ended).
            Exception: whatever the stage's torch work raises.
        """
        received: dict[tuple[str, int], Any] = {}
        made: dict[tuple[str, int], Any] = {}
        computed = waited = False
        compute = self.compute
        whole = self.work.first and self.work.last  # [Note: a whole model's step]
        for index, action in enumerate(self.actions):
            kind, n = action.kind, action.micro_batch
            if whole and kind == "STEP" and index and self.actions[index - 1].kind == "FB":
                continue  # it ran with the FB before it
            if kind in ("RECV_F", "RECV_B"):
                key = (kind[-1], epoch, iteration, n)
                waited = not self.inbox.ready(key)
                received[(kind[-1], n)] = await self.inbox.wait(key)
                continue
            if kind == "SEND_F":
                activation, labels = made.pop(("F", n))
                self._route(self.next).send(Activation(
                    self.identity.run_id, self.stage, epoch, iteration, n, version,
                    self.identity.node, self._route(self.next).node,
                    leaves_to_wire(activation), to_tensor_data(labels)),
                    SLICE_NAMES[kind], ready_at=compute.last_end)
                continue
            if kind == "SEND_B":
                gradient = made.pop(("B", n))
                self._route(self.previous).send(Gradient(
                    self.identity.run_id, self.stage, epoch, iteration, n, version,
                    self.identity.node, self._route(self.previous).node,
                    leaves_to_wire(gradient)), SLICE_NAMES[kind], ready_at=compute.last_end)
                continue
            if kind == "REDUCE":
                if self.reduce is None:
                    raise TrainingError(f"stage {self.stage} is in no group to REDUCE with")
                await self.reduce(epoch, iteration, version)
                computed = waited = True  # the step's input came with the last member's
                continue
            # [Note: emulated slow devices] (runtime/compute.py): work whose input was at
            # hand was ready when the previous item ended, not at this late wake-up
            ready = compute.last_end if computed and not waited else None
            computed, waited = True, False
            work = self._work(kind, iteration, n, received)
            cost = self.costs(action) if self.costs is not None else None
            following = self.actions[index + 1] if index + 1 < len(self.actions) else None
            if whole and kind == "FB" and following is not None and following.kind == "STEP":
                work = partial(_then_step, work, self.work)
                if self.costs is not None:
                    cost = (cost or 0.0) + self.costs(following)
            result = await compute.run(
                SLICE_NAMES[kind], work, cost=cost,
                epoch=epoch, iteration=iteration, micro_batch=n, ready_at=ready)
            if kind == "F" and result is not None:
                made[("F", n)] = result
            elif kind in ("B", "FB") and result is not None:
                made[("B", n)] = result
            if kind in ("B", "FB") and self.after_backward is not None:
                self.after_backward()

    def _work(self, kind: str, iteration: int, n: int,
              received: dict[tuple[str, int], Any]) -> Callable[[], Any]:
        work = self.work
        if kind == "STEP":
            return work.step
        if kind == "B":
            gradient = received.pop(("B", n), None)
            return partial(_backward, work, iteration, n, gradient)
        inputs = received.pop(("F", n), None)
        if kind == "F":
            return partial(_forward, work, iteration, n, inputs)
        if kind == "FB":
            return partial(_forward_backward, work, iteration, n, inputs)
        raise TrainingError(f"stage {self.stage} cannot run a {kind} action")

    def _route(self, route: Route | None) -> Route:
        if route is None:
            raise TrainingError(f"stage {self.stage} has no neighbour to send to")
        return route


def _then_step(work: Callable[[], Any], stage: StageWork) -> Any:
    result = work()
    stage.step()
    return result


def _received(message: Activation | None) -> Sent | None:
    if message is None:
        return None
    return leaves_from_wire(message.tensors), to_torch(message.labels)


def _forward(work: StageWork, iteration: int, n: int, message: Activation | None
             ) -> Sent | None:
    return work.forward(iteration, n, _received(message))


def _backward(work: StageWork, iteration: int, n: int, message: Gradient | None
              ) -> tuple[torch.Tensor, ...] | None:
    return work.backward(iteration, n, leaves_from_wire(message.tensors) if message else None)


def _forward_backward(work: StageWork, iteration: int, n: int, message: Activation | None
                      ) -> tuple[torch.Tensor, ...] | None:
    return work.forward_backward(iteration, n, _received(message))
