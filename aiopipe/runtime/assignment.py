"""A stage's assignment for one round, and the checks of what its neighbours send.

The coordinator tells a device what to compute in each `RoundStart`: its stage of a
pipeline, the units that stage holds, the micro-batches, one iteration's actions and its
peers. `Assignment` is that, checked against the run (the model's units, the batch
size) before anything is built; `check_data_message` checks an arriving activation or
gradient against it (DESIGN §7: every message validated against the plan). Pure: no
I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiopipe.errors import ConfigError, RemoteProtocolError
from aiopipe.protocol import HEADER_SLACK_BYTES, Activation, Gradient, RoundStart
from aiopipe.scheduler.actions import Action
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.schedule import check_stage_actions

__all__ = ["Assignment", "check_data_message"]


@dataclass(frozen=True, slots=True)
class Assignment:
    """What one node computes in a round (see `RoundStart`), checked.

    ``input_shape`` / ``output_shape``: per-sample shapes of the stage's input and output.
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
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]

    @classmethod
    def from_round_start(cls, message: RoundStart, *, units: int, batch_size: int,
                         activation_shapes: tuple[tuple[int, ...], ...],
                         me: str, whole_batches: bool = False) -> Assignment:
        """The assignment ``message`` gives node ``me`` in a run of a model of ``units``
        units (``activation_shapes[u]``: per-sample shape after unit u, the input at 0).
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
            raise RemoteProtocolError(f"round {message.round} asks for {problem}")
        try:
            actions = tuple(Action.parse(text) for text in message.actions.split())
            check_stage_actions(actions, stage, stages, n)
            if any(a.kind == "REDUCE" for a in actions):
                raise ConfigError("REDUCE (a data-parallel group) is not supported yet")
        except ConfigError as exc:
            raise RemoteProtocolError(f"round {message.round} has bad actions: {exc}"
                                      ) from None
        neighbours = [peer["stage"] for peer in message.peers.values()]
        if me in message.peers or any(abs(s - stage) != 1 for s in neighbours) or len(
                set(neighbours)) != len(neighbours):
            raise RemoteProtocolError(f"round {message.round} names peers {sorted(message.peers)} "
                                      f"that are not one per neighbouring stage of {me}")
        return cls(me, message.round, message.epoch, message.first_iteration,
                   message.iterations, stage, stages, first, stop, n, micro, message.version,
                   actions, dict(message.peers), activation_shapes[first],
                   activation_shapes[stop])

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
        """The peer device running ``stage``, or None (then the coordinator does)."""
        for name, peer in self.peers.items():
            if peer["stage"] == stage:
                return name
        return None

    def frame_limit(self) -> int:
        """The largest activation or gradient frame this stage's neighbours may send."""
        return data_frame_limit([self.input_shape, self.output_shape], self.micro_batch_size)

    def version_of(self, iteration: int) -> int:
        """The version of the weights in ``iteration`` (optimizer steps taken in the run)."""
        return self.version + iteration - self.first_iteration

    def charges(self, costs: CostTable | None) -> Callable[[Action], float] | None:
        """Seconds each compute action of this stage costs by ``costs`` (None: none)."""
        if costs is None:
            return None
        first, stop, micro = self.first_unit, self.stop_unit, self.micro_batch_size

        def charge(action: Action) -> float:
            kind = action.kind
            if kind == "F":
                return costs.forward_time(first, stop, micro)
            if kind == "B":
                return costs.backward_time(first, stop, micro)
            if kind == "FB":
                return costs.forward_time(first, stop, micro) + costs.backward_time(
                    first, stop, micro)
            if kind == "STEP":
                return costs.step_time(first, stop)
            return 0.0

        return charge


def data_frame_limit(shapes: Sequence[Sequence[int]], micro_batch_size: int) -> int:
    """The largest activation (with its labels) or gradient frame of a micro-batch of
    ``micro_batch_size`` samples whose per-sample tensor has one of ``shapes``."""
    largest = max(math.prod(shape) for shape in shapes)
    return 4 * micro_batch_size * largest + 8 * micro_batch_size + HEADER_SLACK_BYTES


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
            f"{kind} ids {key} outside round {a.round} (epoch {a.epoch}, iterations "
            f"{a.first_iteration}..{last}, {a.parallel_batches} micro-batches)")
    if message.version != a.version_of(message.iteration):
        raise RemoteProtocolError(f"{kind} {key} has weights of version {message.version}, "
                                  f"the plan says {a.version_of(message.iteration)}")
    shape = (a.micro_batch_size,
             *(a.input_shape if isinstance(message, Activation) else a.output_shape))
    if message.tensor.dtype != "float32" or message.tensor.shape != shape:
        raise RemoteProtocolError(f"{kind} {key} is {message.tensor.dtype} "
                                  f"{message.tensor.shape}, the plan says float32 {shape}")
    if isinstance(message, Activation) and (
            message.labels.dtype != "int64" or message.labels.shape != (a.micro_batch_size,)):
        raise RemoteProtocolError(
            f"labels {key} are {message.labels.dtype} {message.labels.shape}, the plan "
            f"says int64 ({a.micro_batch_size},)")
