"""A stage's assignment for one round, and the checks of what its neighbours send.

The coordinator tells a device what to compute in each `RoundStart`: its stage of a
pipeline, the units that stage holds, the micro-batches, one iteration's actions and its
peers. `Assignment` is that, checked against the run (the model's units, the batch
size) before anything is built; `check_data_message` checks an arriving activation or
gradient against it (DESIGN §7: every message validated against the plan). Pure: no
I/O, no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiopipe.errors import ConfigError, RemoteProtocolError
from aiopipe.models.crossing import Crossing, Leaf, crossing_bytes, gradient_leaves
from aiopipe.protocol import HEADER_SLACK_BYTES, Activation, Gradient, RoundStart
from aiopipe.scheduler.actions import Action
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.schedule import check_stage_actions

__all__ = ["Assignment", "check_data_message"]


@dataclass(frozen=True, slots=True)
class Assignment:
    """What one node computes in a round (see `RoundStart`), checked.

    ``input`` / ``output``: what crosses the stage's first and last cut, per sample
    (`aiopipe.models.crossing`)
    """

    me: str
    round: int
    epoch: int
    first_iteration: int
    iterations: int
    stage: int
    stages: int
    first_unit: int
    stop_unit: int
    parallel_batches: int
    micro_batch_size: int
    version: int
    actions: tuple[Action, ...]
    peers: Mapping[str, Mapping[str, Any]]
    input: Crossing
    output: Crossing
    #: the rows of every micro-batch this node computes (its share in a data-parallel
    #: group); the default (0, 0) stands for all of them
    rows: tuple[int, int] = (0, 0)
    #: a sample's target, as the run's kind of data says (`aiopipe.data.DataKind`)
    target: Leaf = ("int64", ())

    def __post_init__(self) -> None:
        if self.rows == (0, 0):
            object.__setattr__(self, "rows", (0, self.micro_batch_size))

    @classmethod
    def from_round_start(cls, message: RoundStart, *, units: int, batch_size: int,
                         crossings: Sequence[Crossing], me: str,
                         target: Leaf = ("int64", ()), whole_batches: bool = False
                         ) -> Assignment:
        """The assignment ``message`` gives node ``me`` in a run of a model of ``units``
        units (``crossings[u]``: what crosses after unit u per sample, the input
        at 0; ``target``: a sample's target).
        ``whole_batches``: each micro-batch is a whole batch (FTPipeHD streams an epoch's
        batches as one iteration's micro-batches).

        Raises:
            RemoteProtocolError: it cannot be this run's (the message says why).
        """
        stage, stages = message.stage, message.stages
        first, stop = message.first_unit, message.stop_unit
        n, micro = message.parallel_batches, message.micro_batch_size
        problem = ""
        if stop > units or (stage == 0) != (first == 0) or (
                stage == stages - 1) != (stop == units):
            problem = (f"units {first}..{stop - 1} cannot be stage {stage} of {stages} of "
                       f"a model of {units} units")
        elif whole_batches and micro != batch_size:
            problem = f"batches of {micro}, not the run's batch size {batch_size}"
        elif not whole_batches and (n > batch_size or micro != batch_size // n):
            problem = (f"{n} micro-batches of {micro} do not make the run's batch size "
                       f"{batch_size}")
        if problem:
            raise RemoteProtocolError(f"round {message.round + 1} asks for {problem}")
        rows = (message.rows[0], message.rows[1]) if message.rows else (0, micro)
        _check_groups(message, me, rows)
        grouped = any(peer["stage"] == stage for peer in message.peers.values())
        try:
            actions = tuple(Action.parse(text) for text in message.actions.split())
            check_stage_actions(actions, stage, stages, n)
            if grouped != any(a.kind == "REDUCE" for a in actions):
                raise ConfigError("a data-parallel group's members all-reduce (REDUCE) "
                                  "before their STEP, and only they do")
        except ConfigError as exc:
            raise RemoteProtocolError(f"round {message.round + 1} has bad actions: {exc}"
                                      ) from None
        return cls(me, message.round, message.epoch, message.first_iteration,
                   message.iterations, stage, stages, first, stop, n, micro, message.version,
                   actions, dict(message.peers), crossings[first],
                   crossings[stop], rows, target)

    @property
    def last(self) -> bool:
        """Whether this is the pipeline's last stage (it computes the loss)."""
        return self.stage == self.stages - 1

    def same_stage(self, other: Assignment, *, whole_batches: bool = False) -> bool:
        """Whether ``other`` runs the same units on micro-batches of the same size (so
        the stage built for it can be reused); with ``whole_batches`` (FTPipeHD, whose
        stage does not depend on a round's batch count) the same units are enough."""
        return (self.stage, self.stages, self.first_unit, self.stop_unit) == (
            other.stage, other.stages, other.first_unit, other.stop_unit) and (
            whole_batches or self.parallel_batches == other.parallel_batches)

    def peer_at(self, stage: int) -> str | None:
        """The (first) peer device running ``stage``, or None (then the coordinator
        does)."""
        members = [m for m in self.members_at(stage) if m[0] != self.me]
        return members[0][0] if members else None

    def members_at(self, stage: int) -> list[tuple[str, tuple[int, int]]]:
        """The nodes that run ``stage`` with the rows of each micro-batch each computes,
        in row order: this node among them for its own stage, the peers for the others
        (none: the coordinator runs it)."""
        found = [(name, _rows_of(peer, self.micro_batch_size))
                 for name, peer in self.peers.items() if peer["stage"] == stage]
        if stage == self.stage:
            found.append((self.me, self.rows))
        return sorted(found, key=lambda member: member[1])

    @property
    def share(self) -> int:
        """How many rows of each micro-batch this node computes."""
        return self.rows[1] - self.rows[0]

    def rows_with(self, peer: str) -> tuple[int, int]:
        """The rows of each micro-batch this node exchanges with ``peer`` (of a
        neighbouring stage), relative to its own first row: empty when none."""
        first, stop = overlap(self.rows, _rows_of(self.peers[peer], self.micro_batch_size))
        return first - self.rows[0], max(first, stop) - self.rows[0]

    def frame_limit(self) -> int:
        """The largest activation or gradient frame this stage's neighbours may send."""
        return data_frame_limit([self.input, self.output], self.micro_batch_size)

    def version_of(self, iteration: int) -> int:
        """The version of the weights in ``iteration`` (optimizer steps taken in the run)."""
        return self.version + iteration - self.first_iteration

    def charges(self, costs: CostTable | None, *, update_each_batch: bool = False
                ) -> Callable[[Action], float] | None:
        """Seconds each compute action of this stage costs by ``costs`` (None: none).

        ``update_each_batch``: every backward also applies its batch's update (FTPipeHD's
        weights versioned per batch), so each is charged the step as well, and the
        iteration's closing STEP, which only installs the latest weights, nothing. Without
        it a 10-batch round of FTPipeHD was charged one step where it takes ten.
        """
        if costs is None:
            return None
        first, stop, micro = self.first_unit, self.stop_unit, self.share
        accumulate = costs.accumulate_time(first, stop)
        update = costs.step_time(first, stop) if update_each_batch else 0.0

        def charge(action: Action) -> float:
            kind = action.kind
            if kind == "F":
                return costs.forward_time(first, stop, micro)
            # [Note: accumulated gradients] every backward but an iteration's first
            added = (accumulate if action.micro_batch > 0 else 0.0) + update
            if kind == "B":
                return costs.backward_time(first, stop, micro) + added
            if kind == "FB":
                return costs.forward_time(first, stop, micro) + costs.backward_time(
                    first, stop, micro) + added
            if kind == "STEP":
                return 0.0 if update_each_batch else costs.step_time(first, stop)
            return 0.0

        return charge


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The rows two ranges share (start >= stop: none)."""
    return max(a[0], b[0]), min(a[1], b[1])


def _rows_of(peer: Mapping[str, Any], micro: int) -> tuple[int, int]:
    rows = peer.get("rows")
    return (int(rows[0]), int(rows[1])) if rows else (0, micro)


def _check_groups(message: RoundStart, me: str, rows: tuple[int, int]) -> None:
    """The peers are members of this stage or the next to it (the first and the last
    stages are next to each other too: Asteroid's stage backups,
    aiopipe.runtime.systems.ftpipehd.chain),
    and each such stage's members' rows split every micro-batch exactly.

    Raises:
        RemoteProtocolError: they do not.
    """
    stage, micro = message.stage, message.micro_batch_size
    members: dict[int, list[tuple[int, int]]] = {stage: [rows]}
    for name, peer in message.peers.items():
        if name == me or (abs(peer["stage"] - stage) > 1
                          and {peer["stage"], stage} != {0, message.stages - 1}):
            raise RemoteProtocolError(
                f"round {message.round + 1} names peers {sorted(message.peers)} that are not "
                f"members of {me}'s stage or of those next to it")
        members.setdefault(peer["stage"], []).append(_rows_of(peer, micro))
    for p, ranges in members.items():
        bounds = sorted(ranges)
        if bounds[0][0] != 0 or bounds[-1][1] != micro or any(
                a[1] != b[0] for a, b in itertools.pairwise(bounds)):
            raise RemoteProtocolError(
                f"round {message.round + 1}: stage {p}'s members compute rows "
                f"{[list(r) for r in bounds]}, which do not split a micro-batch of {micro}")


def data_frame_limit(crossings: Sequence[Crossing], micro_batch_size: int) -> int:
    """The largest activation (with its labels) or gradient frame of a micro-batch of
    ``micro_batch_size`` samples across a cut of one of ``crossings``."""
    largest = max(crossing_bytes(c) for c in crossings)
    return micro_batch_size * (largest + 8) + HEADER_SLACK_BYTES


def check_data_message(message: Activation | Gradient, assignment: Assignment, *,
                       sender: str, run_id: int) -> None:
    """Check an activation (from the previous stage) or gradient (from the next) that
    ``sender`` sent against the stage's assignment.

    Raises:
        RemoteProtocolError: naming the first field that breaks the plan.
    """
    a = assignment
    kind = "activation" if isinstance(message, Activation) else "gradient"
    key = (message.epoch, message.iteration, message.micro_batch)
    from_stage = a.stage - 1 if isinstance(message, Activation) else a.stage + 1
    if message.run_id != run_id:
        raise RemoteProtocolError(f"{kind} {key} is for another run")
    if message.stage != from_stage or message.source != sender or message.destination != a.me:
        raise RemoteProtocolError(
            f"{kind} {key} is addressed from stage {message.stage} ({message.source}) to "
            f"{message.destination}; the plan says stage {from_stage} ({sender}) to {a.me}")
    last = a.first_iteration + a.iterations - 1
    if message.epoch != a.epoch or not (
            a.first_iteration <= message.iteration <= last
    ) or message.micro_batch >= a.parallel_batches:
        raise RemoteProtocolError(
            f"{kind} ids {key} outside round {a.round + 1} (epoch {a.epoch + 1}, iterations "
            f"{a.first_iteration + 1}..{last + 1}, {a.parallel_batches} micro-batches)")
    if message.version != a.version_of(message.iteration):
        raise RemoteProtocolError(f"{kind} {key} has weights of version {message.version}, "
                                  f"the plan says {a.version_of(message.iteration)}")
    first, stop = a.rows_with(sender) if sender in a.peers else (0, a.share)
    rows = stop - first
    crossing = a.input if isinstance(message, Activation) else gradient_leaves(a.output)
    sent = tuple((t.dtype, t.shape) for t in message.tensors)
    planned = tuple((dtype, (rows, *shape)) for dtype, shape in crossing)
    if sent != planned:
        raise RemoteProtocolError(f"{kind} {key} is {_leaves_text(sent)}, the plan says "
                                  f"{_leaves_text(planned)}")
    dtype, shape = a.target
    if isinstance(message, Activation) and (
            message.labels.dtype != dtype or message.labels.shape != (rows, *shape)):
        raise RemoteProtocolError(
            f"labels {key} are {message.labels.dtype} {message.labels.shape}, the plan "
            f"says {dtype} {(rows, *shape)}")


def _leaves_text(leaves: Sequence[tuple[str, tuple[int, ...]]]) -> str:
    """Leaves as an error message names them: ``float32 (4, 8)`` or a list of several."""
    text = [f"{dtype} {shape}" for dtype, shape in leaves]
    return text[0] if len(text) == 1 else f"[{', '.join(text)}]"
