"""Placement: which nodes run which units of the model (pure).

A `Placement` is one or more pipelines; a pipeline is consecutive `Stage`\\ s; a stage is
a unit range run by one or more member nodes (several members: a data-parallel group,
each on its share of every micro-batch, Asteroid's device groups). The first stage's
members hold the data; the last stage computes the loss.

- PiPar, SFL and SL (`star`): K two-stage pipelines that share the server node: device k
  runs units 0..P_k - 1, the server the rest on device k's replica. FL is the case
  P_k = Q: one stage, the whole model on the device.
- A chain (`chain`): S stages on S nodes, stage 0 holding the data.
Units are 0-based and ranges stop-exclusive, as in `aiopipe.models.units_of`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from aiopipe.errors import ConfigError

__all__ = ["Pipeline", "Placement", "Stage", "chain", "star"]


@dataclass(frozen=True, slots=True)
class Stage:
    """Units ``first_unit .. stop_unit - 1`` on ``members`` (one node, or a group)."""

    first_unit: int
    stop_unit: int
    members: tuple[str, ...]

    def __post_init__(self) -> None:
        if not 0 <= self.first_unit < self.stop_unit:
            raise ConfigError(f"a stage needs units, got {self.first_unit}..{self.stop_unit - 1}")
        if not self.members or len(set(self.members)) != len(self.members):
            raise ConfigError(f"a stage needs distinct members, got {list(self.members)}")


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Consecutive stages that cover every unit: stage 0 from unit 0, each stage from
    where the previous one stopped, the last to the model's end."""

    stages: tuple[Stage, ...]

    def neighbours(self, node: str) -> list[tuple[int, str]]:
        """(stage, node) of every member of the stages next to ``node``'s."""
        index = self.stage_of(node)
        return [(p, member) for p in (index - 1, index + 1) if 0 <= p < len(self.stages)
                for member in self.stages[p].members]

    def stage_of(self, node: str) -> int:
        """The index of the stage ``node`` is a member of.

        Raises:
            ConfigError: it is in none.
        """
        for index, stage in enumerate(self.stages):
            if node in stage.members:
                return index
        raise ConfigError(f"{node} runs no stage of this pipeline")


@dataclass(frozen=True, slots=True)
class Placement:
    """The pipelines of a run over a model of ``units`` units.

    Raises:
        ConfigError: a pipeline is empty or does not cover the units in order.
    """

    units: int
    pipelines: tuple[Pipeline, ...]

    def __post_init__(self) -> None:
        for k, pipeline in enumerate(self.pipelines):
            bounds = [(s.first_unit, s.stop_unit) for s in pipeline.stages]
            if not bounds or bounds[0][0] != 0 or bounds[-1][1] != self.units or any(
                    a[1] != b[0] for a, b in itertools.pairwise(bounds)):
                raise ConfigError(f"pipeline {k}'s stages {bounds} do not cover units "
                                  f"0..{self.units - 1} in order")

    def nodes(self) -> list[str]:
        """Every node that runs a stage, in order of first appearance."""
        return list(dict.fromkeys(m for p in self.pipelines for s in p.stages
                                  for m in s.members))


def star(split_points: Sequence[int], units: int, *, server: str = "server") -> Placement:
    """PiPar's placement: device k runs units 0..P_k - 1, ``server`` the rest (one
    pipeline per device, all sharing the server); P_k = Q puts the whole model on the
    device (FL).

    Raises:
        ConfigError: a split point outside 1..Q.
    """
    pipelines = []
    for k, p in enumerate(split_points):
        if not 1 <= p <= units:
            raise ConfigError(f"device {k}'s split point {p} is outside 1..{units}")
        stages = [Stage(0, p, (f"device{k}",))]
        if p < units:
            stages.append(Stage(p, units, (server,)))
        pipelines.append(Pipeline(tuple(stages)))
    return Placement(units, tuple(pipelines))


def chain(cut_points: Sequence[int], units: int, nodes: Sequence[str]) -> Placement:
    """One pipeline: stage p, units cut[p-1]..cut[p]-1, on ``nodes[p]``.

    Raises:
        ConfigError: not one node more than cut points, or cut points that are not
            increasing in 1..Q-1.
    """
    if len(nodes) != len(cut_points) + 1:
        raise ConfigError(f"{len(cut_points)} cut points need {len(cut_points) + 1} nodes, "
                          f"got {len(nodes)}")
    bounds = [0, *cut_points, units]
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ConfigError(f"cut points {list(cut_points)} are not increasing in "
                          f"1..{units - 1}")
    stages = tuple(Stage(a, b, (node,)) for (a, b), node in
                   zip(itertools.pairwise(bounds), nodes, strict=True))
    return Placement(units, (Pipeline(stages),))
