"""`CostTable`: seconds per split unit for forward, backward and the optimizer step.

The cost table is what virtual-time simulation charges for compute (DESIGN §5), and the
input the planner's estimator uses. It is measured once per split unit and micro-batch
size (`aiopipe.scheduler.costs.measure_costs`, which times torch) or supplied as data
(`CostTable.from_mapping`, e.g. from a JSON file). Times at a batch size that was not
measured are interpolated linearly between the nearest measured sizes (and extrapolated
proportionally beyond them): time is not linear in batch size (Asteroid §3.3), so
measuring the sizes a plan will use is better than scaling one.

A unit that cannot run at a batch size costs ``math.inf`` there ([Note: infeasible
sizes] in costs.py); `to_mapping` then holds ``inf``, which Python's json writes as
``Infinity``.

Pure data: no torch, no clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiopipe.errors import ConfigError

__all__ = ["CostTable"]


@dataclass(frozen=True, slots=True)
class CostTable:
    """Per-unit compute seconds at measured batch sizes.

    ``forward[u][b]`` and ``backward[u][b]``: unit ``u`` (0-based) at batch size ``b``.
    ``step[u]``: optimizer step of unit ``u``'s parameters (batch independent).
    ``aggregate``: the server's seconds to aggregate a round, fixed and per device
    (`aggregate_time`); (0, 0) when not measured.
    ``accumulate[u]``: what a backward of unit ``u`` costs beyond ``backward[u][b]`` when
    its gradients already hold an earlier micro-batch's ([Note: accumulated gradients]
    in costs.py; batch independent; units left out cost 0).
    """

    forward: Mapping[int, Mapping[int, float]]
    backward: Mapping[int, Mapping[int, float]]
    step: Mapping[int, float]
    aggregate: tuple[float, float] = (0.0, 0.0)
    accumulate: Mapping[int, float] = field(default_factory=dict)

    @property
    def units(self) -> int:
        """Number of units the table covers."""
        return len(self.forward)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes measured (every unit's), ascending; other sizes are
        interpolated."""
        return tuple(sorted({b for row in self.forward.values() for b in row}))

    def forward_time(self, first: int, stop: int, batch: int) -> float:
        """Forward seconds of units ``first..stop-1`` at ``batch`` samples."""
        return sum(_at(self.forward[u], batch) for u in range(first, stop))

    def backward_time(self, first: int, stop: int, batch: int) -> float:
        """Backward seconds of units ``first..stop-1`` at ``batch`` samples."""
        return sum(_at(self.backward[u], batch) for u in range(first, stop))

    def step_time(self, first: int, stop: int) -> float:
        """Optimizer-step seconds of units ``first..stop-1``."""
        return sum(self.step[u] for u in range(first, stop))

    def accumulate_time(self, first: int, stop: int) -> float:
        """Seconds a backward of units ``first..stop-1`` adds when it accumulates into an
        earlier micro-batch's gradients ([Note: accumulated gradients])."""
        return sum(self.accumulate.get(u, 0.0) for u in range(first, stop))

    def aggregate_time(self, devices: int) -> float:
        """Server seconds to aggregate one round of ``devices`` devices' models (FedAvg
        and loading the result): fixed + per device x ``devices``."""
        fixed, per_device = self.aggregate
        return fixed + per_device * devices

    def scaled(self, factor: float) -> CostTable:
        """Every time multiplied by ``factor`` (a faster or slower machine)."""
        return CostTable(
            {u: {b: t * factor for b, t in row.items()} for u, row in self.forward.items()},
            {u: {b: t * factor for b, t in row.items()} for u, row in self.backward.items()},
            {u: t * factor for u, t in self.step.items()},
            (self.aggregate[0] * factor, self.aggregate[1] * factor),
            {u: t * factor for u, t in self.accumulate.items()},
        )

    def to_mapping(self) -> dict[str, Any]:
        """Plain JSON-able form."""
        return {
            "forward": {str(u): {str(b): t for b, t in r.items()} for u, r in self.forward.items()},
            "backward": {str(u): {str(b): t for b, t in r.items()}
                         for u, r in self.backward.items()},
            "step": {str(u): t for u, t in self.step.items()},
            "aggregate": {"fixed": self.aggregate[0], "per_device": self.aggregate[1]},
            "accumulate": {str(u): t for u, t in self.accumulate.items()},
        }

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> CostTable:
        """Inverse of `to_mapping`.

        Raises:
            ConfigError: keys or values are missing or not numbers.
        """
        try:
            forward = {int(u): {int(b): float(t) for b, t in r.items()}
                       for u, r in data["forward"].items()}
            backward = {int(u): {int(b): float(t) for b, t in r.items()}
                        for u, r in data["backward"].items()}
            step = {int(u): float(t) for u, t in data["step"].items()}
            agg = data.get("aggregate", {})  # optional: tables saved before it existed
            aggregate = (float(agg.get("fixed", 0.0)), float(agg.get("per_device", 0.0)))
            # optional too: tables saved before it existed charge no accumulation
            accumulate = {int(u): float(t) for u, t in data.get("accumulate", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"invalid cost table: {exc!r}") from None
        if set(forward) != set(backward) or set(forward) != set(step) or not forward:
            raise ConfigError("invalid cost table: forward, backward and step must cover "
                              "the same units")
        if not all(math.isfinite(t) and t >= 0 for t in aggregate):
            raise ConfigError(f"invalid cost table: aggregate times must be finite and >= 0, "
                              f"got {aggregate}")
        if not set(accumulate) <= set(step) or not all(
                math.isfinite(t) and t >= 0 for t in accumulate.values()):
            raise ConfigError(f"invalid cost table: accumulate times must be finite, >= 0 "
                              f"and of the table's units, got {accumulate}")
        return cls(forward, backward, step, aggregate, accumulate)

    @classmethod
    def uniform(cls, units: int, *, forward: float, backward: float, step: float = 0.0,
                batch: int = 1) -> CostTable:
        """Every unit costs the same, proportional to batch size (for tests and sketches)."""
        return cls({u: {batch: forward} for u in range(units)},
                   {u: {batch: backward} for u in range(units)},
                   {u: step for u in range(units)})


def _at(row: Mapping[int, float], batch: int) -> float:
    sizes = sorted(row)
    if batch in row:
        return row[batch]
    if len(sizes) == 1 or batch < sizes[0]:
        return row[sizes[0]] * batch / sizes[0]
    if batch > sizes[-1]:
        return row[sizes[-1]] * batch / sizes[-1]
    i = bisect.bisect_left(sizes, batch)
    lo, hi = sizes[i - 1], sizes[i]
    w = (batch - lo) / (hi - lo)
    return row[lo] * (1 - w) + row[hi] * w
