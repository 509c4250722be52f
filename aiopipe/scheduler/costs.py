"""Cost table: seconds per split unit for forward, backward and the optimizer step.

The cost table is what virtual-time simulation charges for compute (DESIGN §5), and the
input the planner's estimator uses. It is measured once per split unit and micro-batch
size (`measure_costs`, the only function here that touches torch timing) or supplied as
data (`CostTable.from_mapping`, e.g. from a JSON file). Times at a batch size that was not
measured are interpolated linearly between the nearest measured sizes (and extrapolated
proportionally beyond them): time is not linear in batch size (Asteroid §3.3), so
measuring the sizes a plan will use is better than scaling one.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aiopipe.errors import ConfigError

__all__ = ["CostTable", "measure_costs"]


@dataclass(frozen=True, slots=True)
class CostTable:
    """Per-unit compute seconds at measured batch sizes.

    ``forward[u][b]`` and ``backward[u][b]``: unit ``u`` (0-based) at batch size ``b``.
    ``step[u]``: optimizer step of unit ``u``'s parameters (batch independent).
    """

    forward: Mapping[int, Mapping[int, float]]
    backward: Mapping[int, Mapping[int, float]]
    step: Mapping[int, float]

    @property
    def units(self) -> int:
        """Number of units the table covers."""
        return len(self.forward)

    def forward_time(self, first: int, stop: int, batch: int) -> float:
        """Forward seconds of units ``first..stop-1`` at ``batch`` samples."""
        return sum(_at(self.forward[u], batch) for u in range(first, stop))

    def backward_time(self, first: int, stop: int, batch: int) -> float:
        """Backward seconds of units ``first..stop-1`` at ``batch`` samples."""
        return sum(_at(self.backward[u], batch) for u in range(first, stop))

    def step_time(self, first: int, stop: int) -> float:
        """Optimizer-step seconds of units ``first..stop-1``."""
        return sum(self.step[u] for u in range(first, stop))

    def scaled(self, factor: float) -> CostTable:
        """Every time multiplied by ``factor`` (a faster or slower machine)."""
        return CostTable(
            {u: {b: t * factor for b, t in row.items()} for u, row in self.forward.items()},
            {u: {b: t * factor for b, t in row.items()} for u, row in self.backward.items()},
            {u: t * factor for u, t in self.step.items()},
        )

    def to_mapping(self) -> dict[str, Any]:
        """Plain JSON-able form."""
        return {
            "forward": {str(u): {str(b): t for b, t in r.items()} for u, r in self.forward.items()},
            "backward": {str(u): {str(b): t for b, t in r.items()}
                         for u, r in self.backward.items()},
            "step": {str(u): t for u, t in self.step.items()},
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
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"invalid cost table: {exc!r}") from None
        if set(forward) != set(backward) or set(forward) != set(step) or not forward:
            raise ConfigError("invalid cost table: forward, backward and step must cover "
                              "the same units")
        return cls(forward, backward, step)

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


def measure_costs(model: nn.Sequential, in_shape: Sequence[int], batch_sizes: Sequence[int], *,
                  repeats: int = 3, learning_rate: float = 0.01) -> CostTable:
    """Time each unit's forward and backward at each batch size (median of ``repeats``).

    Runs on the calling thread with the current torch settings. The model's weights are
    not changed (the step is timed on a copy of the gradients' effect and undone).

    Raises:
        ConfigError: ``batch_sizes`` is empty or holds a size < 1.
    """
    if not batch_sizes or min(batch_sizes) < 1:
        raise ConfigError(f"batch sizes to profile must be >= 1, got {list(batch_sizes)}")
    units = list(model.children())
    forward: dict[int, dict[int, float]] = {u: {} for u in range(len(units))}
    backward: dict[int, dict[int, float]] = {u: {} for u in range(len(units))}
    step: dict[int, float] = {}
    was_training = model.training
    model.train()
    try:
        for batch in sorted(set(batch_sizes)):
            x = torch.randn(batch, *in_shape)
            for u, unit in enumerate(units):
                f_times, b_times = [], []
                for _ in range(max(1, repeats) + 1):  # first round warms up
                    inp = x.detach().requires_grad_(u > 0)
                    t0 = time.perf_counter()
                    out = unit(inp)
                    t1 = time.perf_counter()
                    grad = torch.ones_like(out)
                    t2 = time.perf_counter()
                    if out.requires_grad:
                        out.backward(grad)
                    t3 = time.perf_counter()
                    f_times.append(t1 - t0)
                    b_times.append(t3 - t2)
                unit.zero_grad(set_to_none=True)
                forward[u][batch] = sorted(f_times[1:])[len(f_times[1:]) // 2]
                backward[u][batch] = sorted(b_times[1:])[len(b_times[1:]) // 2]
                x = out.detach()
        for u, unit in enumerate(units):
            params = [p for p in unit.parameters() if p.requires_grad]
            if not params:
                step[u] = 0.0
                continue
            saved = [p.detach().clone() for p in params]
            for p in params:
                p.grad = torch.zeros_like(p)
            opt = torch.optim.SGD(params, lr=learning_rate)
            times = []
            for _ in range(max(1, repeats) + 1):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)
                    p.grad = None
            step[u] = sorted(times[1:])[len(times[1:]) // 2]
    finally:
        model.train(was_training)
    return CostTable(forward, backward, step)
