"""The round a coordinator's session plays with its device (`RoundWindow`), and the
checks of what the device says about it: its round result (`check_result`) and the
figures of its round report (`report_slices`, `report_count`).

The checks are functions of the message and the round: a message that breaks them is a
`RemoteProtocolError`, which ends the device's session (aiopipe.runtime.session).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiopipe.errors import RemoteProtocolError
from aiopipe.metrics.trace import Slice
from aiopipe.protocol import RoundResult, RoundStart, TensorData
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.stage import ServerStage, check_tensors, expected_of

__all__ = ["RoundWindow", "check_result", "report_count", "report_slices"]


@dataclass(slots=True)
class RoundWindow:
    """The round in progress (or last played): what the device was sent, and the
    coordinator's stage. When the round ends, what it held of tensors is let go (the
    stage's replica, the weights sent and expected back: [Note: replicas while training]
    in aiopipe.runtime.systems.star.replicas); what late messages are checked against stays."""

    round: int
    epoch: int
    first_iteration: int
    iterations: int
    start: RoundStart
    #: the coordinator's stage while the round runs (None after it, or with none)
    stage: ServerStage | None
    #: the tensors the device's result must hold (what ``start`` sent, unless told)
    returns: Mapping[str, TensorData]
    #: the coordinator's stage's assignment (None: it runs no stage for this device)
    assignment: Assignment | None = None

    def end(self) -> None:
        """The round is over: drop its tensors and the stage's torch side."""
        self.stage = None
        self.returns = {}
        self.start = dataclasses.replace(self.start, tensors={})


def check_result(message: RoundResult, window: RoundWindow, *, computed: int) -> None:
    """Check a round result against the round in progress; ``computed``: micro-batches
    the coordinator's stage took from the device this round.

    Raises:
        RemoteProtocolError: it is another round's, holds other tensors than the round
            returns, or claims other samples (or more correct answers) than the round has.
    """
    if message.round != window.round:
        raise RemoteProtocolError(f"result for round {message.round + 1}, expected "
                                  f"{window.round + 1}")
    # the device returns the stage it was sent (or kept), trained
    check_tensors(message.tensors, expected_of(window.returns), "round result")
    start = window.start
    rows = start.rows[1] - start.rows[0] if start.rows else start.micro_batch_size
    samples = window.iterations * rows * start.parallel_batches
    if window.assignment is not None and computed * start.micro_batch_size != samples:
        # exactly what the coordinator's stage computed with this device this round
        raise RemoteProtocolError(
            f"round result before the round's work was done ({computed} of "
            f"{window.iterations * start.parallel_batches} micro-batches)")
    timed = bool(start.sync.get("budget_s"))  # hadfl: up to the period's end
    if message.samples != samples and not (
            timed and message.samples <= samples
            and message.samples % start.micro_batch_size == 0):
        raise RemoteProtocolError(f"round result claims {message.samples} samples, the "
                                  f"round has {samples}")
    if message.correct > samples:
        raise RemoteProtocolError(f"round result claims {message.correct} correct of "
                                  f"{samples} samples")


def report_slices(report: Mapping[str, Any], name: str) -> list[Slice]:
    """The trace slices of a round report from device ``name`` (e.g. ``device2``).

    Raises:
        RemoteProtocolError: a slice is malformed, or names another device's resources.
    """
    try:
        slices = [Slice.from_list(s) for s in report.get("slices", ())]
    except (TypeError, ValueError, OverflowError) as exc:
        raise RemoteProtocolError(f"round report holds a bad slice: {exc}") from None
    mine = (f"{name}/", f"{name}->")
    if any(not s.track.startswith(mine) for s in slices):
        raise RemoteProtocolError("round report names another device's resources")
    return slices


def report_count(report: Mapping[str, Any], key: str) -> int:
    """A round report's count ``key`` (0 when it has none).

    Raises:
        RemoteProtocolError: it is not a count.
    """
    value = report.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RemoteProtocolError(f"round report's {key} is {value!r}, not a count")
    return value
