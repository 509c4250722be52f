"""Data-parallel groups on a device: a stage run by several devices (Asteroid §3.2).

Each member of a group computes fixed rows of every micro-batch (`Assignment.rows`,
from the coordinator's allocation). What flows between two stages is cut and joined by
rows:

- `GroupRoute` sends a stage's activation (or input gradient) on as pieces: to each
  member of the neighbouring stage, the rows the two have in common;
- `Pieces` joins what arrives: once every member of the neighbouring stage whose rows
  overlap ours has sent its piece of a micro-batch, the pieces in row order are the
  micro-batch's input (or output gradient) for our rows. Rows are the leading dimension
  of a C-ordered tensor, so cutting and joining are byte slices: no torch, no copy to
  cut, one to join;
- the all-reduce before the step: each member sends the gradients it accumulated over
  the iteration to every other member (`GroupGradient`) and sums all members' in row
  order (`sum_gradients`), so every member steps from the same bits.

[Note: direct all-reduce] The all-reduce sends each member's whole gradient to every
other member: (g - 1) stage weights out and in per member, against a ring's
2 (g - 1) / g. The two are equal for g = 2 and Asteroid's plans rarely make larger
groups on the fleets it targets; the direct exchange takes one step instead of
2 (g - 1), and every member sums the same tensors in the same order, which makes the
members' weights bit-identical without a broadcast. The planner charges a ring's
traffic (Eq. 5), so for g >= 3 the estimate is optimistic by (g / 2) times that
phase's wire time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from aiopipe.errors import RemoteProtocolError
from aiopipe.protocol import (
    DTYPE_SIZES,
    Activation,
    Gradient,
    GroupGradient,
    TensorData,
    to_tensor_data,
    to_torch,
)
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.executor import Key, Route
from aiopipe.runtime.stage import Expected, check_tensors

__all__ = ["GroupRoute", "Pieces", "check_group_gradient", "gradients_of", "rows_of",
           "sum_gradients"]


#: What `Pieces` collects.
_Part = Activation | Gradient | GroupGradient


def rows_of(tensor: TensorData, first: int, stop: int) -> TensorData:
    """Rows ``first..stop-1`` of ``tensor`` (its leading dimension), without a copy."""
    row = math.prod(tensor.shape[1:]) * DTYPE_SIZES[tensor.dtype]
    data = memoryview(tensor.data).cast("B")[first * row:stop * row]
    return TensorData(tensor.dtype, (stop - first, *tensor.shape[1:]), data)


def _joined(parts: Sequence[TensorData]) -> TensorData:
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    return TensorData(first.dtype, (rows, *first.shape[1:]),
                      b"".join(memoryview(p.data).cast("B") for p in parts))


class GroupRoute:
    """Posts each message to the members of a neighbouring stage, cut by rows (a
    `aiopipe.runtime.executor.Route`).

    ``members``: (route, (first, stop)) per member whose rows overlap ours, the rows
    relative to our own first row, in row order.
    """

    def __init__(self, members: Sequence[tuple[Route, tuple[int, int]]]) -> None:
        self.members = list(members)

    @property
    def node(self) -> str:
        """The first member (each piece is addressed to its own)."""
        return self.members[0][0].node

    def send(self, message: Activation | Gradient, name: str, *,
             ready_at: float | None) -> None:
        """Post to each member its rows of ``message``."""
        for route, (first, stop) in self.members:
            tensors = tuple(rows_of(t, first, stop) for t in message.tensors)
            if isinstance(message, Activation):
                piece: Activation | Gradient = dataclasses.replace(
                    message, destination=route.node, tensors=tensors,
                    labels=rows_of(message.labels, first, stop))
            else:
                piece = dataclasses.replace(message, destination=route.node, tensors=tensors)
            route.send(piece, name, ready_at=ready_at)


class Pieces:
    """Joins the pieces of each micro-batch that the members of a neighbouring stage
    send, and collects the group's gradients of each iteration (module docstring).

    Messages reach `add` already checked against the plan (`check_data_message`,
    `check_group_gradient`): from whom, which ids, what shape.
    """

    def __init__(self, assignment: Assignment) -> None:
        self.assignment = assignment
        #: the senders each kind waits for, in row order
        self._senders = {
            "F": self._overlapping(assignment.stage - 1),
            "B": self._overlapping(assignment.stage + 1),
            "R": [m for m, _ in assignment.members_at(assignment.stage) if m != assignment.me],
        }
        self._waiting: dict[Key, dict[str, _Part]] = {}

    def _overlapping(self, stage: int) -> list[str]:
        a = self.assignment
        return [name for name, _ in a.members_at(stage) if name != a.me
                and a.rows_with(name)[0] < a.rows_with(name)[1]]

    def waits_for(self, kind: str) -> int:
        """How many senders a message of ``kind`` ("F", "B", "R") is joined from."""
        return len(self._senders[kind])

    def join(self, key: Key, sender: str, message: Activation | Gradient
             ) -> Activation | Gradient | None:
        """Keep ``message``; once ``key`` has every sender's piece, the pieces joined in
        row order (None until then).

        Raises:
            RemoteProtocolError: as `_collect`.
        """
        if len(self._senders[key[0]]) <= 1:
            return message  # one sender (or the coordinator): its piece is all our rows
        parts = self._collect(key, sender, message)
        if parts is None:
            return None
        pieces = [p for p in parts if isinstance(p, Activation | Gradient)]
        tensors = tuple(_joined([p.tensors[i] for p in pieces])
                        for i in range(len(pieces[0].tensors)))
        first = pieces[0]
        if isinstance(first, Activation):
            labels = _joined([p.labels for p in pieces if isinstance(p, Activation)])
            return dataclasses.replace(first, tensors=tensors, labels=labels)
        return dataclasses.replace(first, tensors=tensors)

    def gather(self, key: Key, sender: str, message: GroupGradient
               ) -> dict[str, GroupGradient] | None:
        """Keep ``message``; once every other member of the group has sent its
        gradients for ``key``, them by member (None until then).

        Raises:
            RemoteProtocolError: as `_collect`.
        """
        parts = self._collect(key, sender, message)
        if parts is None:
            return None
        return dict(zip(self._senders["R"], parts, strict=True))  # type: ignore[arg-type]

    def _collect(self, key: Key, sender: str, message: _Part) -> list[_Part] | None:
        """The senders' messages for ``key`` in row order, once all are here.

        Raises:
            RemoteProtocolError: ``sender`` sent this piece already, or keeps more
                micro-batches unfinished than the schedule allows.
        """
        senders = self._senders[key[0]]
        waiting = self._waiting.get(key)
        if waiting is None:
            if len(self._waiting) >= 4 * self.assignment.parallel_batches + 2:
                raise RemoteProtocolError(f"{sender} sent pieces of more micro-batches than "
                                          "the schedule keeps in flight")
            waiting = self._waiting[key] = {}
        if sender in waiting:
            raise RemoteProtocolError(f"{sender} sent its piece of {key[0]} {key[1:]} twice")
        waiting[sender] = message
        if len(waiting) < len(senders):
            return None
        del self._waiting[key]
        return [waiting[name] for name in senders]

    def clear(self) -> None:
        """Forget unfinished pieces (a new round)."""
        self._waiting.clear()


def gradients_of(module: torch.nn.Module) -> dict[str, TensorData]:
    """The gradients ``module``'s trainable parameters accumulated (zeros where none),
    for a `GroupGradient` (compute thread); a frozen parameter has none to share
    ([Note: frozen bases] in aiopipe/runtime/systems/star/coordinator.py)."""
    return {name: to_tensor_data(p.grad.detach().cpu() if p.grad is not None
                                 else torch.zeros_like(p, device="cpu"))
            for name, p in module.named_parameters() if p.requires_grad}


def sum_gradients(module: torch.nn.Module, mine: Mapping[str, TensorData],
                  members: Sequence[str], me: str,
                  received: Mapping[str, GroupGradient]) -> None:
    """Set each trainable parameter's gradient to the sum of every member's, added in
    ``members``' order (ours is ``mine``), so that every member gets the same bits
    (compute thread); a frozen one keeps none, so the optimizer holds no state for it."""
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        total: torch.Tensor | None = None
        for member in members:
            part = to_torch(mine[name] if member == me else received[member].tensors[name])
            total = part.clone() if total is None else total.add_(part)
        assert total is not None
        p.grad = total.to(p.device)


def check_group_gradient(message: GroupGradient, assignment: Assignment, mine: Expected, *,
                         sender: str, run_id: int) -> None:
    """Check a `GroupGradient` from ``sender`` against the stage's assignment: from a
    member of the group, to us, for an iteration of the round at its version, with
    exactly the stage's parameters (``mine``: names, dtypes and shapes), finite.

    Raises:
        RemoteProtocolError: naming what breaks the plan.
    """
    a = assignment
    key = (message.epoch, message.iteration)
    members = [m for m, _ in a.members_at(a.stage)]
    if message.run_id != run_id:
        raise RemoteProtocolError(f"group gradients {key} are for another run")
    if sender not in members or sender == a.me or message.source != sender or (
            message.destination != a.me or message.stage != a.stage):
        raise RemoteProtocolError(
            f"group gradients {key} are addressed from stage {message.stage} "
            f"({message.source}) to {message.destination}; {sender} is not a member of "
            f"{a.me}'s group of stage {a.stage}")
    last = a.first_iteration + a.iterations - 1
    if message.epoch != a.epoch or not a.first_iteration <= message.iteration <= last:
        raise RemoteProtocolError(f"group gradients {key} are outside round {a.round + 1}")
    if message.version != a.version_of(message.iteration):
        raise RemoteProtocolError(f"group gradients {key} have weights of version "
                                  f"{message.version}, the plan says "
                                  f"{a.version_of(message.iteration)}")
    check_tensors(message.tensors, mine, f"group gradients {key} from {sender}")
