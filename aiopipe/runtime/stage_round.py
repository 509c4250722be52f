"""A device's default round: the stage its `RoundStart` assigns, run by the
`StageExecutor` iteration after iteration, then the trained stage uploaded with a
report (PiPar's device: forward N micro-batches back to back, posting each activation
as soon as it exists; then, in micro-batch order, wait for each gradient and run its
backward; then one optimizer step, Eq. 26).

Every system whose device runs a stage per round plays its rounds here; its device
half (aiopipe.runtime.device_half) adds what only it does through hooks: after a
backward, after an iteration, a watcher beside the round, a data-parallel group's
REDUCE, what the trained stage uploads.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Protocol

import torch

from aiopipe.errors import NeighbourFaultError
from aiopipe.protocol import (
    HEADER_SLACK_BYTES,
    Activation,
    Gradient,
    Replica,
    RoundResult,
    RoundStart,
    TensorData,
    state_to_wire,
)
from aiopipe.runtime.assignment import Assignment, data_frame_limit
from aiopipe.runtime.device_context import DeviceContext
from aiopipe.runtime.executor import Identity, Route, StageExecutor
from aiopipe.runtime.groups import GroupRoute, Pieces
from aiopipe.runtime.holdings import StageRules
from aiopipe.runtime.peer_links import PeerRoute
from aiopipe.runtime.stage import Batch, Expected, StageInputError, StageWork, recomputable

__all__ = ["COORDINATOR", "StageHooks", "StageRound", "group_frame_limit"]

#: The coordinator's node name (the destination of what a device sends to its stage).
COORDINATOR = "server"


class StageHooks(Protocol):
    """What a system adds to the default round (`aiopipe.runtime.device_half.DeviceHalf`
    documents each)."""

    @property
    def stage_rules(self) -> StageRules: ...

    def own_backup(self, start: RoundStart) -> Replica | None: ...

    def frame_limit(self, assignment: Assignment, default: int) -> int: ...

    def batches(self, batch: Batch, start: RoundStart, assignment: Assignment) -> Batch: ...

    def after_backward(self, work: StageWork, assignment: Assignment,
                       routes: Mapping[int, Route]) -> Callable[[], None] | None: ...

    def reducer(self, work: StageWork, assignment: Assignment, group: Mapping[str, PeerRoute]
                ) -> Callable[[int, int, int], Awaitable[None]] | None: ...

    async def after_iteration(self, work: StageWork, assignment: Assignment,
                              iteration: int) -> None: ...

    def watch(self, assignment: Assignment) -> Awaitable[None] | None: ...

    def upload_state(self, work: StageWork, round_no: int) -> dict[str, torch.Tensor]: ...


class StageRound:
    """One round of the stage ``start`` assigns on ``node``, with ``hooks``'s additions."""

    def __init__(self, node: DeviceContext, hooks: StageHooks, start: RoundStart) -> None:
        self.node, self.hooks, self.start = node, hooks, start

    async def run(self) -> int:
        """Train the round's iterations, upload the weights, then the report; samples.

        Raises:
            TrainingError: a neighbour or the coordinator failed the round (a
                `NeighbourFaultError` names a neighbour whose values the stage refused).
        """
        node, hooks, message = self.node, self.hooks, self.start
        mark = len(node.recorder.slices)
        node.inbox.reopen()
        rules = hooks.stage_rules
        assignment, work = await node.compute.call(
            partial(node.holdings.assign, message, node.assignment, node.work,
                    hooks.own_backup(message), rules))
        if node.peers is not None and not node.judge.priors:
            # (before the assignment is taken: a neighbour's activations that come while
            # this awaits wait as early ones, not for `pieces` yet to be set)
            node.judge.set_cut_priors(await node.compute.call(partial(
                node.holdings.cut_scales, assignment.micro_batch_size)))
        node.assignment, node.work = assignment, work
        # [Note: recomputed activations]: in virtual time, memory is what runs short
        work.recompute = (node.costs is not None and not work.measure_memory
                          and work.device.type == "cpu" and recomputable(work.module)
                          and not rules.whole_batches)
        node.delivery.start_round(assignment, Pieces(assignment), {
            name: (str(p.dtype).removeprefix("torch."), tuple(p.shape))
            for name, p in work.module.named_parameters() if p.requires_grad})
        if node.peers is not None:
            # a re-partition: a neighbour may send the next round's activations (of
            # another cut) before our RoundStart comes ([Note: early activations])
            default = (data_frame_limit(node.holdings.crossings,
                                        assignment.micro_batch_size)
                       if rules.whole_batches else max(
                           assignment.frame_limit(),
                           group_frame_limit(node.delivery.parameters)))
            node.peers.limit(hooks.frame_limit(assignment, default))
        await node.delivery.deliver_early(node.peers)
        routes = await self._routes(assignment)
        group = {name: await node.peer_route(assignment, name, dial=node.name < name)
                 for name, _ in assignment.members_at(assignment.stage) if name != node.name}
        work.batch = hooks.batches(node.holdings.batches(assignment, rules), message,
                                   assignment)
        executor = StageExecutor(
            work, node.compute, stage=assignment.stage, actions=assignment.actions,
            identity=Identity(node.run_id, node.name), inbox=node.inbox,
            previous=routes.get(assignment.stage - 1), next=routes.get(assignment.stage + 1),
            costs=assignment.charges(node.costs, update_each_batch=rules.whole_batches),
            after_backward=hooks.after_backward(work, assignment, routes),
            reduce=hooks.reducer(work, assignment, group) if group else None)
        watcher = hooks.watch(assignment)
        watching = asyncio.ensure_future(watcher) if watcher is not None else None
        try:
            for iteration in range(message.first_iteration,
                                   message.first_iteration + message.iterations):
                if node.ended is not None:  # no gradient will come
                    raise node.ended
                try:
                    await executor.run(message.epoch, iteration,
                                       assignment.version_of(iteration))
                except StageInputError as exc:
                    raise _neighbour_fault(assignment, exc) from None
                node.delivery.iteration_done()  # every gradient of the iteration is in
                await hooks.after_iteration(work, assignment, iteration)
        finally:
            if watching is not None:
                watching.cancel()
        samples = message.iterations * assignment.share * assignment.parallel_batches
        weights = await node.compute.call(partial(self._upload, work, message.round))
        result = RoundResult(message.round, samples, float(work.loss_sum), float(work.correct),
                             weights)
        await node.report(result, mark, work)
        return samples

    def _upload(self, work: StageWork, round_no: int) -> dict[str, TensorData]:
        return state_to_wire(self.hooks.upload_state(work, round_no))

    async def _routes(self, assignment: Assignment) -> dict[int, Route]:
        """The neighbouring stages: peers (linked now if need be) or the coordinator.

        Raises:
            TrainingError: a peer cannot be linked to, or the run needs peer links and
                this device has no endpoint.
        """
        node = self.node
        routes: dict[int, Route] = {}
        for stage in (assignment.stage - 1, assignment.stage + 1):
            if not 0 <= stage < assignment.stages:
                continue
            members = [(name, assignment.rows_with(name))
                       for name, _ in assignment.members_at(stage)]
            if not members:
                routes[stage] = _ServerRoute(node)
                continue
            linked = [(await node.peer_route(assignment, name, dial=stage > assignment.stage),
                       rows) for name, rows in members if rows[0] < rows[1]]
            routes[stage] = linked[0][0] if len(linked) == 1 else GroupRoute(linked)
        return routes


class _ServerRoute:
    """The coordinator's stage as a neighbour: posts on the coordinator link, keeping each
    activation until its gradient arrives, to re-send it after a reconnection."""

    node = COORDINATOR

    def __init__(self, owner: DeviceContext) -> None:
        self.owner = owner

    def send(self, message: Activation | Gradient, name: str, *,
             ready_at: float | None) -> None:
        if isinstance(message, Activation):
            self.owner.delivery.sent(message)
        self.owner.peer.post(message, name, epoch=message.epoch, iteration=message.iteration,
                             micro_batch=message.micro_batch, ready_at=ready_at)


def _neighbour_fault(assignment: Assignment, error: StageInputError) -> Exception:
    """What a stage's refusal of its input means: the neighbour that sent it is at
    fault (a `NeighbourFaultError` naming it) when that is one device; the error as it
    is when it is the coordinator (a star's server half) or a group of several."""
    members = assignment.members_at(assignment.stage + (1 if error.from_next else -1))
    if len(members) != 1:
        return error
    return NeighbourFaultError(members[0][0], error)


def group_frame_limit(parameters: Expected) -> int:
    """The largest `GroupGradient` a stage of these parameters can be sent."""
    return sum(4 * math.prod(shape) + 256 for _, shape in parameters.values()
               ) + HEADER_SLACK_BYTES

