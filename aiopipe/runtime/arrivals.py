"""When a data message may be used: the arrival rules of activations, gradients and
group gradients, as one pure object (no I/O, no state of its own: h11's style).

A device and the coordinator's sessions ask the same `ArrivalRules` what to do with a
data message, given the round being worked on; it answers with a `Verdict`:

- ``DELIVER``: it belongs to the round under way: check it and hand it to the stage;
- ``HOLD``: it is ahead of the round this node knows ([Note: early activations] in
  aiopipe.runtime.delivery): keep it until its round starts;
- ``DROP``: it is harmless and of no use: of an attempt the coordinator gave up on, a
  gradient for a round that is over, a late re-send;
- ``REFUSE``: no honest sender sends it: the sender broke the protocol.

What the rules tell apart depends on the system's rounds, declared by its device half:
``replayed`` (a round played again takes versions above every earlier attempt's, at
any iteration: Asteroid's and a synchronous pipeline's replays) and ``resumed`` (an
attempt may start after the batch an earlier one started at: FTPipeHD's chain
replication).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from aiopipe.protocol import Activation, Gradient, GroupGradient
from aiopipe.runtime.assignment import Assignment

__all__ = ["ArrivalRules", "Verdict"]

#: The data messages the rules judge.
DataMessage = Activation | Gradient | GroupGradient


class Verdict(enum.Enum):
    """What to do with an arriving data message (module docstring)."""

    DELIVER = "deliver"
    HOLD = "hold"
    DROP = "drop"
    REFUSE = "refuse"


@dataclass(frozen=True, slots=True)
class ArrivalRules:
    """The arrival rules of one system's rounds (module docstring)."""

    #: a replay's versions lie above every earlier attempt's, at any iteration
    replayed: bool = False
    #: an attempt may start after the batch an earlier attempt started at
    resumed: bool = False

    def verdict(self, message: DataMessage, assignment: Assignment | None, *,
                running: bool, from_peer: bool) -> Verdict:
        """What a node working on ``assignment``'s round (``running``: its round is
        under way) does with ``message``, and why when it refuses. ``from_peer``: it
        came from a device's peer (another device), which may run ahead of the round
        this node knows; the coordinator's stage and a device's own coordinator link
        never do. ``REFUSE`` here means: a message outside a round."""
        if assignment is not None and self.earlier_attempt(message, assignment):
            return Verdict.DROP
        if (from_peer and isinstance(message, Activation | GroupGradient)
                and (not running or self.after(message, assignment))
                and not before(message, assignment)):
            return Verdict.HOLD
        if assignment is None or not running:
            if isinstance(message, Gradient):
                return Verdict.DROP  # late: its round is over (or was dropped)
            return Verdict.REFUSE
        return Verdict.DELIVER

    def after(self, message: Activation | GroupGradient, assignment: Assignment | None
              ) -> bool:
        """Whether ``message`` belongs to an iteration after ``assignment``'s round
        (replayed: to a later attempt, or round, whose versions lie above)."""
        if assignment is None:
            return True
        last = assignment.first_iteration + assignment.iterations - 1
        if self.replayed:
            return message.version > assignment.version_of(last)
        return (message.epoch, message.iteration, message.version) > (
            assignment.epoch, last, assignment.version_of(last))

    def earlier_attempt(self, message: DataMessage, assignment: Assignment) -> bool:
        """Whether ``message`` is of an earlier attempt at ``assignment``'s round (a
        round played again after a fault: each attempt's weights have their own
        version, `Assignment.version`)."""
        if self.replayed:
            return message.version < assignment.version
        if (message.epoch, message.iteration) != (
                assignment.epoch, assignment.first_iteration) and not (
                self.resumed and message.epoch == assignment.epoch
                and message.iteration < assignment.first_iteration):
            return False
        return message.version < assignment.version

    @staticmethod
    def too_far_ahead(held: int, assignment: Assignment, *, slack: int) -> bool:
        """Whether ``held`` delivered messages not yet used are more than an honest
        neighbour sends ahead of the schedule: two iterations' micro-batches and
        ``slack``."""
        return held >= 2 * assignment.parallel_batches + slack

    @staticmethod
    def within(key: tuple[int, int, int], assignment: Assignment) -> bool:
        """Whether micro-batch ``key`` (epoch, iteration, micro-batch) is one of
        ``assignment``'s round (a late re-send for a round that just ended)."""
        epoch, iteration, micro_batch = key
        return (epoch == assignment.epoch and micro_batch < assignment.parallel_batches
                and 0 <= iteration - assignment.first_iteration < assignment.iterations)


def before(message: Activation | GroupGradient, assignment: Assignment | None) -> bool:
    """Whether ``message`` belongs to an iteration before ``assignment``'s round."""
    return assignment is not None and (message.epoch, message.iteration) < (
        assignment.epoch, assignment.first_iteration)
