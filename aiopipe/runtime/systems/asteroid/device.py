"""The device half of Asteroid (§3): a stage run alone or by a data-parallel group
whose members all-reduce their gradients before each step (REDUCE, [Note: direct
all-reduce] in aiopipe.runtime.groups), backups of the stage at backup points sent
to its backup node (topology-driven replication, §3.4, [Note: stage backups]), and
a round played again from a backup point or from its start after a fault."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import ClassVar

import torch

from aiopipe.errors import NeighbourFaultError, PoisonedValueError
from aiopipe.models import without_frozen
from aiopipe.protocol import GroupGradient, Replica, RoundStart, state_to_wire, to_torch
from aiopipe.runtime.arrivals import ArrivalRules
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.device_half import StageRules
from aiopipe.runtime.groups import gradients_of, sum_gradients
from aiopipe.runtime.judge import scale_of
from aiopipe.runtime.momentum import stage_snapshot
from aiopipe.runtime.peer_links import PeerRoute
from aiopipe.runtime.stage import StageWork
from aiopipe.runtime.systems.asteroid.options import AsteroidOptions
from aiopipe.runtime.systems.ftpipehd.chain import ChainReplicas, backup_node
from aiopipe.runtime.systems.ftpipehd.device import ChainDevice

__all__ = ["AsteroidDevice"]


class AsteroidDevice(ChainDevice):
    """Asteroid's device (module docstring); it holds backups when the run takes them
    (``chain_replication_every``)."""

    #: a replay's versions lie above every earlier attempt's, at any iteration
    arrivals: ClassVar[ArrivalRules] = ArrivalRules(replayed=True)

    @property
    def stage_rules(self) -> StageRules:
        return StageRules(keeps_weights=True, replays=True, measures_memory=True,
                          wraps_epoch=True)

    def upload_state(self, work: StageWork, round_no: int) -> dict[str, torch.Tensor]:
        """The trained stage less its frozen parameters: the coordinator sent none
        ([Note: frozen bases] in aiopipe/runtime/systems/star/coordinator.py)."""
        return without_frozen(work.trained_state(), work.module)

    def keeps_replicas(self) -> bool:
        return bool(self.node.config.options_as(AsteroidOptions).chain_replication_every)

    def accept(self, sender: str, replica: Replica) -> None:
        assert self.chain is not None
        self.chain.accept_backup(sender, replica, self.node.assignment)

    def own_backup(self, start: RoundStart) -> Replica | None:
        """A replay from a backup point: our own snapshot of the stage ``start`` keeps
        (sent no weights), after its first iteration, taken in the attempt we last
        worked on; None when we hold none."""
        previous = self.node.assignment
        if (self.chain is None or start.tensors or previous is None
                or start.epoch != previous.epoch):
            return None
        return self.chain.own(start.stage, start.first_iteration, previous.round)

    async def after_iteration(self, work: StageWork, assignment: Assignment,
                              iteration: int) -> None:
        if self.chain is not None:
            await self._back_up(self.chain, work, assignment, iteration + 1)

    async def _back_up(self, chain: ChainReplicas, work: StageWork, assignment: Assignment,
                       batches: int) -> None:
        """At a backup point (every ``chain_replication_every`` batches of the epoch, the
        round's last but one at most) keep our stage's state and, when we are its only
        device, send it to its backup node, in the link's idle time
        (aiopipe.runtime.peer [Note: background sends])."""
        end = assignment.first_iteration + assignment.iterations
        if batches % chain.every or batches >= end:
            return
        momentum = chain.momentum
        tensors = await self.node.compute.call(
            lambda: state_to_wire(stage_snapshot(work, momentum=momentum)))
        replica = Replica(assignment.round, assignment.stage, batches, float(work.loss_sum),
                          float(work.correct), tensors)
        chain.keep(replica)
        node = backup_node(assignment)
        if node is not None:
            route = await self.node.peer_route(assignment, node, dial=True)
            route.peer.post(replica, "backup", epoch=assignment.epoch, background=True)

    def reducer(self, work: StageWork, assignment: Assignment, group: Mapping[str, PeerRoute]
                ) -> Callable[[int, int, int], Awaitable[None]] | None:
        return partial(self._reduce, work, assignment, group)

    async def _reduce(self, work: StageWork, assignment: Assignment,
                      group: Mapping[str, PeerRoute], epoch: int, iteration: int,
                      version: int) -> None:
        """A data-parallel group's all-reduce: send our accumulated gradients to every
        other member, then set the sum of all members' (in row order) as the stage's."""
        node = self.node
        free = 0.0 if node.costs is not None else None  # (virtual time: the sum is free)
        mine = await node.compute.run("r", partial(gradients_of, work.module), cost=free,
                                      epoch=epoch, iteration=iteration)
        for name, route in group.items():
            route.peer.post(GroupGradient(node.run_id, assignment.stage, epoch, iteration,
                                          version, node.name, name, mine),
                            "g", epoch=epoch, iteration=iteration)
        received = await node.inbox.wait(("R", epoch, iteration, 0))
        own = max((scale_of(to_torch(tensor)) for tensor in mine.values()), default=0.0)
        for member, message in received.items():  # against our own: [Note: judging arrivals]
            try:
                node.judge.judge_tensors(member, "group gradient", message.tensors, own=own,
                                         what=f"group gradient {(epoch, iteration)}")
            except PoisonedValueError as exc:
                raise NeighbourFaultError(member, exc) from None
        members = [m for m, _ in assignment.members_at(assignment.stage)]
        await node.compute.run("r", partial(sum_gradients, work.module, mine, members,
                                            node.name, received),
                               cost=free, epoch=epoch, iteration=iteration)
