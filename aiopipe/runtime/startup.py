"""How long a run took to start training, and where that time went.

[Note: startup figures] Before its first micro-batch a run waits for its devices to
join, asks them to profile themselves (with "auto" plans on real clocks: [Note: device
profiles] in aiopipe.runtime.profiling), and plans, measuring the server's own cost table
unless the cost cache holds it ([Note: cost cache]). `Startup` marks these phases on the
coordinator's clock and `Startup.stamp` puts them into the first epoch that the process
finishes (`EpochMetrics.startup`, a line of ``metrics.jsonl``): ``startup_s``, from the
coordinator's start to the end of the first micro-batch computed anywhere in the fleet
(the earliest end of a compute slice of a micro-batch in the trace: in PiPar a device's
first forward), and of it ``join_s``, ``profiling_s`` and ``planning_s``. What is left
(``startup_s`` minus the three) is the first round's start: weights sent, data loaded.
A device's slices are on the coordinator's clock once reported, so the first micro-batch
may be a device's. In virtual time, profiling and planning hold the clock still: their
figures are 0 there.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

from aiopipe.clock import Clock
from aiopipe.metrics.epoch import EpochMetrics
from aiopipe.metrics.trace import Slice

__all__ = ["Startup", "first_micro_batch_end"]

#: The phases `Startup` times, in the order they happen.
PHASES = ("join_s", "profiling_s", "planning_s")


def first_micro_batch_end(slices: Iterable[Slice]) -> float | None:
    """When the first micro-batch's computation ended: the earliest end of a compute
    slice (``…/compute``) that belongs to a micro-batch; else of any compute slice (a
    system whose work is not split in micro-batches); None without either."""
    computed = [s for s in slices if s.track.endswith("/compute")]
    of_micro_batches = [s.end for s in computed if s.micro_batch >= 0]
    ends = of_micro_batches or [s.end for s in computed]
    return min(ends) if ends else None


class Startup:
    """A run's start-up phases, timed on the coordinator's clock from its creation."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.started = clock.now()
        self.phases = dict.fromkeys(PHASES, 0.0)
        self._stamped = False

    def joined(self) -> None:
        """Every device has joined (the first time only counts)."""
        if not self.phases["join_s"]:
            self.phases["join_s"] = self.clock.now() - self.started

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the block's seconds to ``phase`` (one of `PHASES`)."""
        start = self.clock.now()
        try:
            yield
        finally:
            self.phases[phase] += self.clock.now() - start

    def figures(self, slices: Iterable[Slice]) -> dict[str, float]:
        """The startup figures ([Note: startup figures]); without a micro-batch in
        ``slices``, no ``startup_s``."""
        out = {name: round(seconds, 3) for name, seconds in self.phases.items()}
        first = first_micro_batch_end(slices)
        if first is not None:
            out = {"startup_s": round(first - self.started, 3), **out}
        return out

    def stamp(self, metrics: EpochMetrics, slices: Iterable[Slice]) -> EpochMetrics:
        """``metrics`` with the startup figures when it is the first epoch this process
        finished (a later one: as it is)."""
        if self._stamped:
            return metrics
        self._stamped = True
        return dataclasses.replace(metrics, startup=self.figures(slices))
