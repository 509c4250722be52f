"""FTPipeHD's chain replication (§III-E, DESIGN §FTPipeHD).

[Note: chain replication] Every ``chain_replication_every`` batches of a round but its
last, each stage snapshots its state as the round would have left it there (weights,
momentum, buffers: `aiopipe.runtime.async_weights` [Note: chain snapshots]), keeps it,
and sends it on: to the next stage's device, and from the last stage to the
coordinator. A device keeps the latest `KEPT` snapshots of its own stage and of the
previous one (`ChainReplicas`), for the round it last worked on.

When the round stops (a device lost, a stall), the coordinator gathers one state of
every stage after the same number of batches (`gather`): the last stage's it holds, the
others it asks of their own devices (`ReplicaRequest`), then, for the stages whose
device is gone or kept nothing, of the next stage's device. It tries the latest point
the last stage reached, then the one before (a stage applies a batch's update a few
batches after the stages behind it, so the first stage may not have reached the
latest). Found, the round is played again from there, so only the batches after it are
computed again; else from the round's start (the global replication).

Nothing a device sends here is trusted: a replica must come from where the plan says,
for the round and stage it names, and hold exactly the tensors of that stage's units,
finite (`check_tensors`); one that does not is a protocol error from a peer, and is
left out (as if not held) at the coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from torch import nn

from aiopipe import models
from aiopipe.errors import RemoteProtocolError
from aiopipe.protocol import (
    DTYPE_SIZES,
    HEADER_SLACK_BYTES,
    Replica,
    ReplicaRequest,
    TensorData,
)
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.async_weights import MOMENTUM
from aiopipe.runtime.stage import Expected, check_tensors

__all__ = ["KEPT", "ChainReplicas", "expected_tensors", "gather"]

#: How many snapshots of a stage a holder keeps (the latest ones).
KEPT = 2

log = logging.getLogger("aiopipe.runtime")

def expected_tensors(module: nn.Module, *, momentum: bool) -> Expected:
    """What a replica of ``module`` (a stage's units) holds: its state dict, and each
    parameter's momentum buffer when SGD has momentum."""
    expected = {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape))
                for name, t in module.state_dict().items()}
    if momentum:
        expected.update({MOMENTUM + name: (str(p.dtype).removeprefix("torch."),
                                           tuple(p.shape))
                         for name, p in module.named_parameters()})
    return expected


class ChainReplicas:
    """What a device holds of the chain replication of the round it works on: the latest
    `KEPT` snapshots of its own stage and of the previous stage (module docstring).

    Args:
        model: the whole model (what a stage's tensors must be is read from its units).
        momentum: whether SGD has momentum (replicas then hold the buffers).
        every: ``chain_replication_every``.
    """

    def __init__(self, model: nn.Sequential, *, momentum: bool, every: int) -> None:
        self.model, self.momentum, self.every = model, momentum, every
        self.round = -1
        self.held: dict[int, dict[int, Replica]] = {}  # stage -> batches -> replica
        #: the largest replica: the whole model's tensors
        whole = expected_tensors(model, momentum=momentum)
        self.frame_limit = HEADER_SLACK_BYTES + sum(
            256 + DTYPE_SIZES.get(dtype, 8) * math.prod(shape) for dtype, shape in whole.values())

    def keep(self, replica: Replica) -> None:
        """Hold ``replica`` (the holdings of an older round are dropped)."""
        if replica.round != self.round:
            self.round, self.held = replica.round, {}
        by_batches = self.held.setdefault(replica.stage, {})
        by_batches[replica.batches] = replica
        while len(by_batches) > KEPT:
            del by_batches[min(by_batches)]

    def accept(self, sender: str, replica: Replica, assignment: Assignment | None) -> None:
        """The previous stage's device sent its snapshot: check it against the round,
        then hold it (one of a round given up on is dropped).

        Raises:
            RemoteProtocolError: it breaks the plan.
        """
        if assignment is None or sender != assignment.peer_at(assignment.stage - 1):
            raise RemoteProtocolError(f"{sender} sent a replica but does not run the stage "
                                      "before ours")
        if replica.round < assignment.version:
            return
        what = f"{sender}'s replica"
        if replica.round > assignment.version or replica.stage != assignment.stage - 1:
            raise RemoteProtocolError(f"{what} is of stage {replica.stage} in round "
                                      f"{replica.round}, not of stage {assignment.stage - 1} "
                                      f"in round {assignment.version}")
        if not (0 < replica.batches < assignment.parallel_batches and self.every
                and replica.batches % self.every == 0):
            raise RemoteProtocolError(f"{what} after {replica.batches} batches is not at a "
                                      f"chain point of the round's {assignment.parallel_batches}")
        first = _first_unit(replica.tensors, assignment.first_unit)
        units = models.units_of(self.model, first, assignment.first_unit)
        check_tensors(replica.tensors, expected_tensors(units, momentum=self.momentum), what)
        self.keep(replica)

    def answer(self, request: ReplicaRequest) -> list[Replica]:
        """One `Replica` per stage asked: held after the batches asked, else without
        tensors (none held)."""
        nothing = self.none_held(request)
        if request.round != self.round:
            return nothing
        return [self.held.get(stage, {}).get(request.batches) or none
                for stage, none in zip(request.stages, nothing, strict=True)]

    @staticmethod
    def none_held(request: ReplicaRequest) -> list[Replica]:
        """The answer of a device that holds nothing ``request`` asks for."""
        return [Replica(request.round, stage, request.batches, 0.0, 0, {})
                for stage in request.stages]


def _first_unit(tensors: Mapping[str, TensorData], stop: int) -> int:
    """The first unit a stage ending before unit ``stop`` holds tensors of (the units'
    names are their indices: `aiopipe.models.partition` keeps them).

    Raises:
        RemoteProtocolError: a tensor's name is not of a unit before ``stop``.
    """
    units = set()
    for name in tensors:
        head = name.removeprefix(MOMENTUM).split(".", 1)[0]
        if not head.isdigit() or int(head) >= stop:
            raise RemoteProtocolError(f"a replica's tensor {name!r} is not of a unit before "
                                      f"unit {stop}")
        units.add(int(head))
    return min(units, default=stop)


class ReplicaSource(Protocol):
    """What `gather` asks of the coordinator."""

    def chained(self, round_no: int) -> Mapping[int, Replica]:
        """The last stage's replicas of round ``round_no``, by batches."""
        ...

    async def replicas(self, device_id: int, request: ReplicaRequest) -> list[Replica]:
        """Device ``device_id``'s answer to ``request`` (empty when it was lost)."""
        ...


async def gather(source: ReplicaSource, round_no: int, workers: Sequence[int],
                 alive: Sequence[int], check: Callable[[int, Replica], bool]
                 ) -> tuple[int, list[Replica]] | None:
    """Every stage's replica after the same batches of round ``round_no``, played by
    ``workers`` (stage p on ``workers[p]``), from the devices ``alive`` and the
    coordinator (module docstring); ``check(stage, replica)`` says whether one is sound.
    (batches, the replicas by stage), or None when no point survived."""
    stages = len(workers)
    last = source.chained(round_no)
    for batches in sorted(last, reverse=True)[:KEPT]:
        found = {stages - 1: last[batches]} if check(stages - 1, last[batches]) else {}
        for offset in (0, 1):  # the stage's own device, then the next stage's
            asked: dict[int, list[int]] = {}
            for p in range(stages):
                holder = workers[p + offset] if p + offset < stages else None
                if p not in found and holder is not None and holder in alive:
                    asked.setdefault(holder, []).append(p)
            answers = await asyncio.gather(*(
                source.replicas(d, ReplicaRequest(round_no, batches, tuple(ps)))
                for d, ps in asked.items()))
            for ps, replies in zip(asked.values(), answers, strict=True):
                for replica in replies:
                    if (replica.tensors and replica.stage in ps and replica.batches == batches
                            and replica.stage not in found and check(replica.stage, replica)):
                        found[replica.stage] = replica
        if len(found) == stages:
            return batches, [found[p] for p in range(stages)]
        log.info("round %d: no whole state after %d batches (stages %s missing)",
                 round_no + 1, batches, sorted(set(range(stages)) - set(found)))
    return None
