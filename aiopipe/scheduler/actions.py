"""Actions: the vocabulary of schedules (torch pipelining's ``_Action``, for aiopipe).

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
            STEP (vocabulary only: no generator emits it yet)
SEND_F(n)   send micro-batch n's activation to stage + 1 (non-blocking)
RECV_F(n)   wait for micro-batch n's activation from stage - 1
SEND_B(n)   send the gradient w.r.t. this stage's input for micro-batch n to stage - 1
RECV_B(n)   wait for micro-batch n's gradient from stage + 1
==========  ================================================================================

F, B, FB, STEP and REDUCE are *compute* actions (they occupy the node's compute); the
four SEND/RECV kinds are *transfers*.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, cast, get_args

from aiopipe.errors import ConfigError

__all__ = ["COMPUTE_KINDS", "TRANSFER_KINDS", "Action", "ActionKind"]

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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
