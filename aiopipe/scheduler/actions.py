"""Actions and schedules as values (torch pipelining's ``_Action``, for aiopipe).

An `Action` is a small frozen value: a stage of a pipeline does one thing with one
micro-batch. It prints as torch prints its actions, stage first (``0F3``, ``1B2``,
``3FB0``, ``2SEND_F1``, ``1RECV_B0``, ``0STEP``, ``1REDUCE``) and `Action.parse` reads
that text back. What the kinds mean:

==========  ================================================================================
F(n)        forward of micro-batch n through the stage (on the last stage with the loss)
B(n)        backward of micro-batch n through the stage
FB(n)       forward, loss and backward of micro-batch n on the LAST stage as one compute
            item (PiPar's server pass)
STEP        the optimizer step after the iteration
REDUCE      all-reduce of the stage's gradients within a data-parallel group, right before
            STEP (added by the ``with_reductions`` pass)
SEND_F(n)   send micro-batch n's activation to stage + 1 (non-blocking)
RECV_F(n)   wait for micro-batch n's activation from stage - 1
SEND_B(n)   send the gradient w.r.t. this stage's input for micro-batch n to stage - 1
RECV_B(n)   wait for micro-batch n's gradient from stage + 1
==========  ================================================================================

F, B, FB, STEP and REDUCE are *compute* actions (they occupy the node's compute); the
four SEND/RECV kinds are *transfers*.

A `Schedule` is one iteration of every stage: a tuple of actions per stage. It lives here,
beside its actions, so that both the passes over schedules (`aiopipe.scheduler.schedule`)
and the simulation that runs them (`aiopipe.scheduler.critical_path`) can import it
without importing each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, cast, get_args

from aiopipe.errors import ConfigError

__all__ = ["COMPUTE_KINDS", "TRANSFER_KINDS", "Action", "ActionKind", "Schedule"]

ActionKind = Literal["F", "B", "FB", "STEP", "REDUCE", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]

#: Kinds that occupy the stage's compute.
COMPUTE_KINDS: tuple[ActionKind, ...] = ("F", "B", "FB", "STEP", "REDUCE")
#: Kinds that move a tensor between neighbouring stages.
TRANSFER_KINDS: tuple[ActionKind, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")

#: Kinds that belong to the whole iteration rather than to one micro-batch.
_ITERATION_KINDS = frozenset({"STEP", "REDUCE"})
_KINDS = frozenset(get_args(ActionKind))
# Longest kinds first, so that "FB" is not read as "F" followed by "B...".
_TEXT = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|REDUCE|STEP|FB|F|B)(\d*)")


@dataclass(frozen=True, slots=True)
class Action:
    """One thing one stage does in one iteration.

    ``stage``: the stage's index within its pipeline (0 = the first, holding the data).
    ``micro_batch``: 0-based; -1 (the default) for STEP and REDUCE, which have none.

    Raises:
        ConfigError: ``stage`` is not an int >= 0, ``kind`` is not an `ActionKind`, or
            ``micro_batch`` is not -1 for STEP/REDUCE and an int >= 0 otherwise.
    """

    stage: int
    kind: ActionKind
    micro_batch: int = -1

    def __post_init__(self) -> None:
        if not _is_int(self.stage) or self.stage < 0:
            raise ConfigError(f"an action's stage must be an int >= 0, got {self.stage!r}")
        if self.kind not in _KINDS:
            raise ConfigError(
                f"unknown action kind {self.kind!r}; expected one of {sorted(_KINDS)}"
            )
        mb = self.micro_batch
        if self.kind in _ITERATION_KINDS:
            if not _is_int(mb) or mb != -1:
                raise ConfigError(f"{self.kind} has no micro-batch (-1), got {mb!r}")
        elif not _is_int(mb) or mb < 0:
            raise ConfigError(f"{self.kind} needs a micro-batch >= 0, got {mb!r}")

    def __str__(self) -> str:
        if self.kind in _ITERATION_KINDS:
            return f"{self.stage}{self.kind}"
        return f"{self.stage}{self.kind}{self.micro_batch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action that prints as ``text`` (the inverse of ``str``).

        Raises:
            ConfigError: ``text`` is not an action's text.
        """
        found = _TEXT.fullmatch(text) if isinstance(text, str) else None
        if found is None:
            raise ConfigError(f"{text!r} is not an action (e.g. '0F3', '1FB0', '0STEP')")
        stage, kind, mb = found.groups()
        if (kind in _ITERATION_KINDS) != (mb == ""):
            raise ConfigError(
                f"{text!r} is not an action: {kind} "
                + ("takes no micro-batch" if kind in _ITERATION_KINDS else "needs a micro-batch")
            )
        return cls(int(stage), cast(ActionKind, kind), int(mb) if mb else -1)

    @property
    def is_compute(self) -> bool:
        """Whether the action occupies the stage's compute (F, B, FB, STEP, REDUCE)."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_transfer(self) -> bool:
        """Whether the action sends or waits for a tensor (SEND_*/RECV_*)."""
        return self.kind in TRANSFER_KINDS


@dataclass(frozen=True, slots=True)
class Schedule:
    """One iteration of every stage of a pipeline: ``actions[p]`` is stage p's, in order.

    ``name``: what made it (``"pipar"``, ``"gpipe"``, ``"1f1b"``, or a user's name).
    ``micro_batches``: N, the micro-batches per iteration.

    Construction checks only the types; `aiopipe.scheduler.schedule.check_schedule` checks
    the rules.

    Raises:
        ConfigError: name is not a non-empty string, micro_batches is not an int >= 1,
            or actions is not a non-empty tuple of tuples of `Action`\\ s.
    """

    name: str
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a schedule's name must be a non-empty string, got {self.name!r}")
        if not _is_int(self.micro_batches) or self.micro_batches < 1:
            raise ConfigError(f"a schedule needs at least one micro-batch, got "
                              f"{self.micro_batches!r}")
        if not isinstance(self.actions, tuple) or not self.actions:
            raise ConfigError(f"schedule {self.name!r} needs a tuple of at least one stage")
        for p, stage in enumerate(self.actions):
            if not isinstance(stage, tuple) or not all(isinstance(a, Action) for a in stage):
                raise ConfigError(
                    f"schedule {self.name!r}: stage {p} is not a tuple of Actions: {stage!r}"
                )

    @property
    def stages(self) -> int:
        """S, the number of stages."""
        return len(self.actions)

    def compute_only(self) -> Schedule:
        """The same schedule with its transfers stripped."""
        return Schedule(self.name, self.micro_batches,
                        tuple(tuple(a for a in stage if a.is_compute) for stage in self.actions))

    def has_transfers(self) -> bool:
        """Whether any stage has a SEND or RECV action."""
        return any(a.is_transfer for stage in self.actions for a in stage)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
