"""FTPipeHD's chain replication (§III-E, DESIGN §FTPipeHD).

[Note: chain replication] Every ``chain_replication_every`` batches of a round but its
last, each stage snapshots its state as the round would have left it there (weights,
momentum, buffers: [Note: chain snapshots] in `async_weights`), keeps it,
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

[Note: stage backups] Asteroid's topology-driven replication (§3.4) on the same
parts: every ``chain_replication_every`` batches of an epoch (the round's last but one
at most), after the step, every device keeps its stage's state (weights, buffers and,
with SGD, momentum: `stage_snapshot`) and, when it is its stage's only device, sends it
to the stage's backup node: the first member of the next stage, the last stage's to
the first's (`backup_node`; the backup node checks it: `ChainReplicas.accept_backup`).
A group's members need no backup node: each keeps its own, and the members are the same.
When a round stops, the coordinator asks each stage's members alive, then its backup
node, for the stage's state at the latest backup point of the given-up attempt, down to
its start (`gather_from`; a holder that lacks a point says the latest it has below it,
and the points between are skipped); found whole, the round is played again from there: a device
that keeps its stage and answered with its own snapshot starts from it (no weights
sent: `Holdings.assign`), the others get their stage's weights and momentum from the
coordinator, which loaded the point. What the attempt trained before the point is
counted in its epoch (samples; the last stage's loss, scaled from the answering
member's rows when that stage is a group).

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
from aiopipe.runtime.momentum import MOMENTUM
from aiopipe.runtime.stage import Expected, check_tensors
from aiopipe.wording import plural

__all__ = [
    "KEPT",
    "ChainReplicas",
    "backed_up_by",
    "backup_node",
    "expected_tensors",
    "gather",
    "gather_from",
]

#: How many snapshots of a stage a holder keeps (the latest ones).
KEPT = 2

log = logging.getLogger("aiopipe.runtime")

def expected_tensors(module: nn.Module, *, momentum: bool) -> Expected:
    """What a replica of ``module`` (a stage's units) holds: its state dict less its
    frozen parameters (they never change and every device holds them: [Note: frozen
    bases] in aiopipe/runtime/systems/star/coordinator.py), and each trainable
    parameter's momentum buffer when SGD has momentum."""
    expected = {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape))
                for name, t in models.without_frozen(module.state_dict(), module).items()}
    if momentum:
        expected.update({MOMENTUM + name: (str(p.dtype).removeprefix("torch."),
                                           tuple(p.shape))
                         for name, p in module.named_parameters() if p.requires_grad})
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
                                      f"{replica.round + 1}, not of stage "
                                      f"{assignment.stage - 1} in round "
                                      f"{assignment.version + 1}")
        if not (0 < replica.batches < assignment.parallel_batches and self.every
                and replica.batches % self.every == 0):
            raise RemoteProtocolError(f"{what} after {replica.batches} batches is not at a "
                                      f"chain point of the round's {assignment.parallel_batches}")
        first = _first_unit(replica.tensors, assignment.first_unit)
        units = models.units_of(self.model, first, assignment.first_unit)
        check_tensors(replica.tensors, expected_tensors(units, momentum=self.momentum), what)
        self.keep(replica)

    def accept_backup(self, sender: str, replica: Replica, assignment: Assignment | None
                      ) -> None:
        """Asteroid: ``sender``, the only device of the stage before ours (the last
        stage's, when ours is the first), backed its stage up to us, its stage's backup
        node ([Note: stage backups]): check it against the round, then hold it (one of an
        attempt given up on, or of one we have not started yet, is dropped).

        Raises:
            RemoteProtocolError: it breaks the plan.
        """
        if assignment is None or sender != backed_up_by(assignment):
            raise RemoteProtocolError(f"{sender} sent a stage backup but we are not its "
                                      "backup node")
        if replica.round != assignment.round:
            return
        stage = (assignment.stage - 1) % assignment.stages
        what = f"{sender}'s backup"
        start, stop = assignment.first_iteration, (assignment.first_iteration
                                                   + assignment.iterations)
        if replica.stage != stage or not (
                start < replica.batches < stop and replica.batches % self.every == 0):
            raise RemoteProtocolError(f"{what} is of stage {replica.stage} after "
                                      f"{replica.batches} batches, not of stage {stage} at "
                                      f"a backup point of batches {start}..{stop - 1}")
        last = models.unit_count(self.model)
        stop_unit = assignment.first_unit if stage < assignment.stage else last
        units = models.units_of(self.model, _first_unit(replica.tensors, stop_unit), stop_unit)
        check_tensors(replica.tensors, expected_tensors(units, momentum=self.momentum), what)
        self.keep(replica)

    def own(self, stage: int, batches: int, round_no: int) -> Replica | None:
        """Our snapshot of ``stage`` after ``batches`` batches of round ``round_no``, if
        we hold it."""
        if round_no != self.round:
            return None
        return self.held.get(stage, {}).get(batches)

    def answer(self, request: ReplicaRequest) -> list[Replica]:
        """One `Replica` per stage asked: held after the batches asked, else without
        tensors, its ``batches`` the latest point held below the one asked (0: none), so
        the coordinator need not ask for the points between."""
        if request.round != self.round:
            return self.none_held(request)
        answers = []
        for stage in request.stages:
            held = self.held.get(stage, {})
            below = max((b for b in held if b < request.batches), default=0)
            answers.append(held.get(request.batches) or Replica(
                request.round, stage, below, 0.0, 0, {}))
        return answers

    @staticmethod
    def none_held(request: ReplicaRequest) -> list[Replica]:
        """The answer of a device that holds nothing of the round ``request`` asks
        about."""
        return [Replica(request.round, stage, 0, 0.0, 0, {}) for stage in request.stages]


def replica_check(model: nn.Sequential, bounds: Sequence[tuple[int, int]], round_no: int,
                  micro_batch_size: int, *, momentum: bool, what: str
                  ) -> Callable[[int, Replica], bool]:
    """Whether a replica of stage p (units ``bounds[p]`` of ``model``) is sound for
    `gather_from`: of round ``round_no``, claiming no more right than its batches hold,
    holding exactly the stage's tensors, finite; one that is not is logged (``what``:
    "replica" or "backup") and left out."""
    expected = [expected_tensors(models.units_of(model, a, b), momentum=momentum)
                for a, b in bounds]

    def sound(stage: int, replica: Replica) -> bool:
        try:
            if (replica.round != round_no
                    or replica.correct > replica.batches * micro_batch_size):
                raise RemoteProtocolError(f"it claims {replica.correct} right after "
                                          f"{replica.batches} batches of round "
                                          f"{replica.round + 1}")
            check_tensors(replica.tensors, expected[stage], f"the {what} of stage {stage}")
        except RemoteProtocolError as exc:
            log.warning("round %d: left out a %s of stage %d: %s", round_no + 1, what, stage,
                        exc)
            return False
        return True

    return sound


def backup_node(assignment: Assignment) -> str | None:
    """Asteroid's topology-driven replication ([Note: stage backups]): where this
    device sends its stage's backups: the first member of the next stage (the last
    stage's: of the first), when ours is its only device; else None (a group's members
    back each other up; a one-stage plan has nowhere to go)."""
    if assignment.stages < 2 or len(assignment.members_at(assignment.stage)) > 1:
        return None
    members = assignment.members_at((assignment.stage + 1) % assignment.stages)
    return members[0][0] if members else None


def backed_up_by(assignment: Assignment) -> str | None:
    """The device whose stage this one is the backup node of (`backup_node`), if any."""
    if assignment.stages < 2 or assignment.members_at(assignment.stage)[0][0] != assignment.me:
        return None
    members = assignment.members_at((assignment.stage - 1) % assignment.stages)
    return members[0][0] if len(members) == 1 else None


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


class ReplicaHolders(Protocol):
    """What `gather_from` asks of the coordinator."""

    async def replicas(self, device_id: int, request: ReplicaRequest) -> list[Replica]:
        """Device ``device_id``'s answer to ``request`` (empty when it was lost)."""
        ...


class ReplicaSource(ReplicaHolders, Protocol):
    """What `gather` asks: the devices' replicas, and the last stage's that FTPipeHD's
    coordinator half keeps."""

    def chained(self, round_no: int) -> Mapping[int, Replica]:
        """The last stage's replicas of round ``round_no``, by batches."""
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
    holders = [[workers[p], workers[p + 1]] if p + 1 < stages else [workers[p]]
               for p in range(stages)]
    found = await gather_from(
        source, round_no, sorted(last, reverse=True)[:KEPT], holders, alive, check,
        held=lambda batches: ({stages - 1: last[batches]}
                              if check(stages - 1, last[batches]) else {}))
    if found is None:
        return None
    batches, replicas = found
    return batches, [replicas[p][1] for p in range(stages)]


async def gather_from(source: ReplicaHolders, round_no: int, points: Sequence[int],
                      holders: Sequence[Sequence[int]], alive: Sequence[int],
                      check: Callable[[int, Replica], bool],
                      held: Callable[[int], Mapping[int, Replica]] | None = None
                      ) -> tuple[int, dict[int, tuple[int, Replica]]] | None:
    """Every stage's replica after the same batches of round ``round_no``: the first of
    ``points`` (batches, in the order to try) for which one survived of every stage,
    asking stage p's ``holders[p]`` that are ``alive``, one after the other (each
    holder's turn asks every stage still missing at once); ``held(batches)``: the
    replicas the coordinator holds itself. A holder that lacks a point says the latest
    it holds below it (`ChainReplicas.answer`): the points above the lowest of the
    missing stages' best are skipped. (batches, by stage: the device that held it (-1:
    the coordinator) and its replica), or None when no point survived whole."""
    stages = len(holders)
    bound = math.inf  # no point above this one can be whole
    for batches in points:
        if batches > bound:
            continue
        found = {p: (-1, r) for p, r in (held(batches) if held else {}).items()}
        best: dict[int, int] = {}  # per missing stage, the latest point a holder has below
        for turn in range(max(map(len, holders), default=0)):
            asked: dict[int, list[int]] = {}
            for p in range(stages):
                holder = holders[p][turn] if turn < len(holders[p]) else None
                if p not in found and holder is not None and holder in alive:
                    asked.setdefault(holder, []).append(p)
            answers = await asyncio.gather(*(
                source.replicas(d, ReplicaRequest(round_no, batches, tuple(ps)))
                for d, ps in asked.items()))
            for (d, ps), replies in zip(asked.items(), answers, strict=True):
                for replica in replies:
                    if replica.stage not in ps:
                        continue
                    if not replica.tensors and replica.batches < batches:
                        best[replica.stage] = max(best.get(replica.stage, 0), replica.batches)
                    elif (replica.tensors and replica.batches == batches
                          and replica.stage not in found and check(replica.stage, replica)):
                        found[replica.stage] = (d, replica)
        if len(found) == stages:
            return batches, found
        missing = set(range(stages)) - set(found)
        bound = min(best.get(p, 0) for p in missing) if all(
            p in best for p in missing) else batches - 1
        log.info("round %d: no whole state after %s (stages %s missing)",
                 round_no + 1, plural(batches, "batch"), sorted(set(range(stages)) - set(found)))
    return None
