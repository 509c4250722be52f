"""Schedules as data: the order of a device's actions in one iteration.

An `Action` is a small value that prints as ``F0`` (forward of micro-batch 0), ``B3``
(backward of micro-batch 3) or ``STEP``; a schedule is a tuple of them. Generators make
schedules (`pipar_order`, `one_f_one_b`), `check_schedule` validates one, and the device
executor runs whatever schedule it is given. Transfers are not actions here: a forward's
activation is posted to the uplink as soon as it exists and a backward waits for its
gradient (DESIGN §4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from aiopipe.errors import ConfigError

__all__ = ["Action", "check_schedule", "one_f_one_b", "pipar_order"]


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a device's iteration: forward, backward or the optimizer step."""

    kind: Literal["F", "B", "STEP"]
    micro_batch: int = -1

    def __str__(self) -> str:
        return "STEP" if self.kind == "STEP" else f"{self.kind}{self.micro_batch}"


def pipar_order(micro_batches: int) -> tuple[Action, ...]:
    """PiPar (pipar.txt Fig. 2b): all N forwards, then N backwards in order, then a step."""
    n = _check_count(micro_batches)
    return (*(Action("F", i) for i in range(n)), *(Action("B", i) for i in range(n)),
            Action("STEP"))


def one_f_one_b(micro_batches: int, warmup: int) -> tuple[Action, ...]:
    """1F1B: ``warmup`` forwards, then alternate backward and forward, then a step.

    Keeps at most ``warmup`` activations alive instead of N.

    Raises:
        ConfigError: ``warmup`` is not in 1..N.
    """
    n = _check_count(micro_batches)
    if not 1 <= warmup <= n:
        raise ConfigError(f"1F1B warm-up must be in 1..{n}, got {warmup}")
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(n):
        actions.append(Action("B", i))
        if warmup + i < n:
            actions.append(Action("F", warmup + i))
    return (*actions, Action("STEP"))


def check_schedule(actions: tuple[Action, ...], micro_batches: int) -> None:
    """Every micro-batch is forwarded once, then backwarded once; one step at the end.

    Raises:
        ConfigError: naming the first action that breaks the rule.
    """
    forwarded: set[int] = set()
    backwarded: set[int] = set()
    for position, action in enumerate(actions):
        if action.kind == "STEP":
            if position != len(actions) - 1:
                raise ConfigError(f"STEP at position {position} is not the last action")
            continue
        mb = action.micro_batch
        if not 0 <= mb < micro_batches:
            raise ConfigError(f"{action} names a micro-batch outside 0..{micro_batches - 1}")
        if action.kind == "F":
            if mb in forwarded:
                raise ConfigError(f"{action} at position {position} repeats a forward")
            forwarded.add(mb)
        else:
            if mb not in forwarded or mb in backwarded:
                raise ConfigError(f"{action} at position {position} has no forward to undo "
                                  "or repeats a backward")
            backwarded.add(mb)
    if len(backwarded) != micro_batches or not actions or actions[-1].kind != "STEP":
        raise ConfigError(f"schedule {' '.join(map(str, actions))} does not forward and "
                          f"backward all {micro_batches} micro-batches and end with STEP")


def _check_count(micro_batches: int) -> int:
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ConfigError(f"a schedule needs at least one micro-batch, got {micro_batches!r}")
    return micro_batches
