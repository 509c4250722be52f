"""The device half of FTPipeHD (§III): an asynchronous stage of whole batches whose
weights are versioned per batch (`AsyncStageWork`), chain replication of each stage's
snapshots to the next stage's device (§III-E, [Note: chain replication]), and the
first stage's gradient timer (§III-F). A round's error waits for the coordinator's
recovery: it plays the round again from the chain's replicas.

`ChainDevice` is what every system whose devices hold replicas of stages shares
(FTPipeHD's chain, Asteroid's backups): answering the coordinator's replica requests
and judging the replicas peers send.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar

import torch

from aiopipe.errors import RemoteProtocolError, TrainingError
from aiopipe.protocol import Message, Replica, ReplicaRequest
from aiopipe.runtime.arrivals import ArrivalRules
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.device_half import DeviceHalf, Handler, StageRules
from aiopipe.runtime.executor import Key, Route
from aiopipe.runtime.holdings import Holdings
from aiopipe.runtime.momentum import backs_up_momentum
from aiopipe.runtime.peer_links import PeerRoute
from aiopipe.runtime.stage import StageWork
from aiopipe.runtime.stage_round import COORDINATOR
from aiopipe.runtime.systems.ftpipehd.async_weights import AsyncStageWork
from aiopipe.runtime.systems.ftpipehd.chain import ChainReplicas
from aiopipe.runtime.systems.ftpipehd.options import FTPipeHDOptions, chain_options

__all__ = ["STAGE_RULES", "ChainDevice", "FTPipeHDDevice"]


class ChainDevice(DeviceHalf):
    """A device that holds replicas of stages (module docstring); ``chain`` is None
    when the run keeps none."""

    recovers_rounds: ClassVar[bool] = True
    chain: ChainReplicas | None = None

    def keeps_replicas(self) -> bool:
        """Whether this run's devices hold replicas."""
        return True

    def set_up(self) -> None:
        config = self.node.config
        if self.keeps_replicas():
            self.chain = ChainReplicas(self.node.holdings.template.model,
                                       momentum=backs_up_momentum(config),
                                       every=chain_options(config).chain_replication_every)

    def handlers(self) -> Mapping[type[Message], Handler]:
        return {ReplicaRequest: self._answer, Replica: self._replica}

    def _answer(self, sender: str, request: ReplicaRequest) -> None:
        """The coordinator asks for the replicas this device holds (a process started
        afresh may be asked before it has set up: it holds none)."""
        if sender != COORDINATOR:
            raise RemoteProtocolError(f"{sender} sent a replica request")
        for replica in (self.chain.answer(request) if self.chain is not None
                        else ChainReplicas.none_held(request)):
            self.node.peer.post(replica, "replica")

    def _replica(self, sender: str, replica: Replica) -> None:
        """A peer's replica, its tensors judged before they are kept."""
        if self.chain is None or sender == COORDINATOR:
            raise RemoteProtocolError(f"{sender} sent a replica outside the chain")
        self.node.judge.judge_tensors(sender, f"replica@{replica.stage}", replica.tensors,
                                      what=f"replica of stage {replica.stage}")
        self.accept(sender, replica)

    def accept(self, sender: str, replica: Replica) -> None:
        """Keep a judged replica from peer ``sender``."""
        assert self.chain is not None
        self.chain.accept(sender, replica, self.node.assignment)

    def frame_limit(self, assignment: Assignment, default: int) -> int:
        return max(default, self.chain.frame_limit if self.chain is not None else 0)


class FTPipeHDDevice(ChainDevice):
    """FTPipeHD's device (module docstring)."""

    #: an attempt may start after the batch an earlier one started at (from a replica)
    arrivals: ClassVar[ArrivalRules] = ArrivalRules(resumed=True)

    @property
    def stage_rules(self) -> StageRules:
        return STAGE_RULES

    def after_backward(self, work: StageWork, assignment: Assignment,
                       routes: Mapping[int, Route]) -> Callable[[], None] | None:
        """Chain replication ([Note: chain replication]): keep the stage's new snapshots
        and send them on, to the next stage's device (from the last stage, to the
        coordinator)."""
        chain = self.chain
        assert chain is not None
        assert isinstance(work, AsyncStageWork)

        def send_snapshots() -> None:
            for batches, tensors, loss_sum, correct in work.take_snapshots():
                replica = Replica(assignment.version, assignment.stage, batches, loss_sum,
                                  correct, tensors)
                chain.keep(replica)
                route = routes.get(assignment.stage + 1)
                link = route.peer if isinstance(route, PeerRoute) else self.node.peer
                link.post(replica, "replica", epoch=assignment.epoch)
        return send_snapshots

    def watch(self, assignment: Assignment) -> Awaitable[None] | None:
        """The first stage's gradient timer (§III-F)."""
        return self._gradient_timer() if assignment.stage == 0 else None

    async def _gradient_timer(self) -> None:
        """When the round has waited ``device_timeout`` seconds for the same gradients,
        it stops (and the coordinator is told: `RoundStalled`). Checked every eighth of
        that."""
        node = self.node
        timeout = node.config.device_timeout
        waiting, since = frozenset[Key](), node.clock.now()
        while True:
            pending = node.inbox.pending()
            if not pending or pending != waiting:
                waiting, since = pending, node.clock.now()
            elif node.clock.now() - since >= timeout:
                batches = sorted(k[2] + k[3] + 1 for k in pending)  # (1-based, as logged)
                node.inbox.close(TrainingError(
                    f"no gradient came within {timeout:g} s (waiting for batch "
                    f"{', '.join(map(str, batches))} of the epoch)"))
                return
            await node.clock.sleep(timeout / 8)


def _new_work(module: torch.nn.Sequential, assignment: Assignment,
              holdings: Holdings) -> StageWork:
    """An asynchronous stage of whole batches, its weights versioned per batch."""
    config = holdings.config
    return AsyncStageWork(
        module, first=assignment.stage == 0, last=assignment.last,
        num_classes=holdings.plan.num_classes, loss=holdings.loss, metric=holdings.metric,
        stages=assignment.stages, stage=assignment.stage,
        lr=config.learning_rate, momentum=config.momentum,
        aggregate_every=config.options_as(FTPipeHDOptions).version_aggregation,
        chain_every=config.options_as(FTPipeHDOptions).chain_replication_every)


def _prepare(work: StageWork, assignment: Assignment, momentum: Mapping[str, Any],
             kept: bool) -> None:
    """Ready an asynchronous stage for a round: its snapshots' batches, and the momentum
    sent with its weights (none when it kept them)."""
    assert isinstance(work, AsyncStageWork)
    work.plan_snapshots(assignment.parallel_batches)
    if not kept:
        work.load_momentum(momentum)


#: What FTPipeHD's stage keeps between rounds: its weights and momentum when sent none
#: ([Note: kept weights] in aiopipe.runtime.holdings).
STAGE_RULES = StageRules(whole_batches=True, keeps_weights=True, new_work=_new_work,
                         prepare=_prepare)
