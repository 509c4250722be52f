"""Asteroid's coordinator half, its parts that hold no state of the run: what a
round's attempts given up on trained before the backup point a replay goes on from
(`CarriedResults`, Asteroid §3.4), and the fleet as its planner sees it (a device as
declared, or as it measured itself)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol

import torch

from aiopipe.config import RunConfig
from aiopipe.protocol import Replica, RoundResult
from aiopipe.scheduler.asteroid import Device
from aiopipe.scheduler.estimate import DeviceProfile

__all__ = ["UNLIMITED", "CarriedResults", "GroupPlan", "declared_device", "measured_device",
           "merged_stage",
           "parameter_names"]

#: The budget of a device without one (bytes): effectively unlimited.
UNLIMITED = float(1 << 60)


class GroupPlan(Protocol):
    """What `CarriedResults` reads of Asteroid's plan."""

    @property
    def parallel_batches(self) -> int: ...

    @property
    def micro_batch_size(self) -> int: ...

    @property
    def stages(self) -> int: ...

    @property
    def groups(self) -> Sequence[Sequence[int]]: ...

    @property
    def rows(self) -> Mapping[int, tuple[int, int]]: ...


class CarriedResults:
    """What a round's attempts given up on trained before the backup point the round
    goes on from: samples through the first stage and through the last (by device), and
    the last stage's loss and correct predictions."""

    def __init__(self) -> None:
        self.samples: dict[int, int] = {}
        self.last: dict[int, int] = {}  # the last stage's members' samples
        self.loss_sum, self.correct = 0.0, 0

    def add(self, point: tuple[int, dict[int, tuple[int, Replica]]], start: int,
            plan: GroupPlan) -> int:
        """Count the given-up attempt (from iteration ``start``, on ``plan`` as it was)
        up to ``point``; the point's batches. A group's last stage: the holder's share
        of the loss, scaled to the whole micro-batch (an estimate)."""
        batches, found = point
        n, micro = plan.parallel_batches, plan.micro_batch_size
        for group, kept in ((plan.groups[0], self.samples), (plan.groups[-1], self.last)):
            for d in group:
                first, stop = plan.rows[d]
                kept[d] = kept.get(d, 0) + (batches - start) * (stop - first) * n
        holder, replica = found[plan.stages - 1]
        first, stop = plan.rows.get(holder, (0, micro))
        scale = micro / (stop - first) if holder in plan.groups[-1] else 1.0
        self.loss_sum += replica.loss_sum * scale
        self.correct += round(replica.correct * scale)
        return batches

    def added_to(self, results: dict[int, RoundResult], groups: Sequence[Sequence[int]]
                 ) -> dict[int, RoundResult]:
        """``results`` with what came before counted in: each device's samples (those of
        one no longer in the first stage, whose samples count as the epoch's, by the
        first stage's first member; likewise the last stage's by its first member, so
        that it too counts each of the epoch's samples once: unless the plan now has one
        stage, whose members the first stage's count), the loss and correct by the last
        stage's first member."""
        if not self.samples and not self.loss_sum and not self.correct:
            return results
        results = dict(results)
        first, last = groups[0][0], groups[-1][0]
        moved = [(d if d in groups[0] else first, samples)
                 for d, samples in self.samples.items()]
        if len(groups) > 1:
            moved += [(d if d in groups[-1] else last, samples)
                      for d, samples in self.last.items()]
        for k, samples in moved:
            results[k] = replace(results[k], samples=results[k].samples + samples)
        results[last] = replace(results[last], loss_sum=results[last].loss_sum + self.loss_sum,
                                correct=results[last].correct + self.correct)
        return results


def declared_device(config: RunConfig, device: int) -> Device:
    """Device ``device`` as the config declares it: its ``device_slowdown`` times the
    coordinator's table, its ``device_memory_mb`` and its uplink."""
    return measured_device(config, device, None)


def measured_device(config: RunConfig, device: int, profile: DeviceProfile | None) -> Device:
    """Device ``device`` as it measured itself (``profile``: its own cost table and the
    rate of its uplink, where it could time it), within its ``device_memory_mb``; what
    it did not measure as declared (unshaped links: effectively unlimited)."""
    memory = float(config.device_memory_bytes_of(device) or UNLIMITED)
    uplink = profile.uplink if profile is not None else config.device_network(device).up
    bps = uplink.bandwidth_bps
    return Device(config.device_slowdown_of(device), memory, bps / 8 if bps else UNLIMITED,
                  profile.costs if profile is not None else None)


def parameter_names(state: Mapping[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    """The names in a stage's ``state`` that are parameters of the whole ``model`` (a
    stage's state keys are the model's own: units keep their indices)."""
    names = {name for name, _ in model.named_parameters()}
    return [name for name in state if name in names]


def merged_stage(states: Sequence[Mapping[str, torch.Tensor]], model: torch.nn.Module
                 ) -> dict[str, torch.Tensor]:
    """A stage's state from its members' ``states``: the first member's weights (the
    members' are the same), its floating-point buffers (each member's batch statistics)
    averaged over the members."""
    merged = dict(states[0])
    if len(states) > 1:
        parameters = set(parameter_names(states[0], model))
        for name, tensor in states[0].items():
            if name not in parameters and tensor.is_floating_point():
                merged[name] = torch.stack([s[name] for s in states]).mean(0)
    return merged
