"""The runtime's own costs per work item and per micro-batch, measured through its parts."""

from __future__ import annotations

import asyncio

import pytest

from aiopipe import RunConfig
from aiopipe.models.crossing import crossing_bytes, single
from aiopipe.runtime import plan as run_plan
from aiopipe.runtime.overheads import RuntimeOverheads, measure_runtime_overheads
from aiopipe.runtime.plan import build_model, measure_planning_costs, train_dataset
from aiopipe.runtime.systems.base import planning_batch_sizes


def test_overheads_are_measured_through_the_runtime_parts() -> None:
    overheads = measure_runtime_overheads((2, 4, 3, 3), repeats=20, warmup=2)
    # each is an event loop's round trip at least, and nowhere near a second
    assert 0 < overheads.handover < 0.5
    assert 0 < overheads.message < 0.5


async def test_overheads_can_be_measured_from_inside_a_running_loop() -> None:
    # the server profiles in its constructor, which runs inside the caller's loop
    overheads = measure_runtime_overheads((1, 8), repeats=5, warmup=1)
    assert overheads.message > 0
    await asyncio.sleep(0)


def test_planning_costs_charge_the_runtime_overheads(monkeypatch: pytest.MonkeyPatch) -> None:
    config = RunConfig(model="vgg5", dataset="synthetic-cifar10", devices=1,
                       samples_per_device=8, batch_size=2, parallel_batches=2,
                       split_point=1, epochs=1)
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    shapes: list[tuple[int, ...]] = []

    def fixed(shape: tuple[int, ...]) -> RuntimeOverheads:
        shapes.append(tuple(shape))
        return RuntimeOverheads(handover=0.5, message=2.0)

    monkeypatch.setattr(run_plan, "measure_runtime_overheads", fixed)
    costs = measure_planning_costs(config, model, dataset.in_shape, dataset, repeats=1,
                                   warmup=0, sizes=planning_batch_sizes(config))
    first = run_plan.unit_crossings(model, single(dataset.in_shape))[0]
    assert shapes == [(1, crossing_bytes(first) // 4)]
    last = costs.units - 1
    for b in costs.forward[0]:
        assert costs.forward[0][b] >= 1.0  # 0.5 + 2.0 / 4
        assert costs.backward[0][b] >= 1.0
        assert costs.backward[last][b] >= 1.5  # 0.5 + 2.0 / 2
    assert costs.step[0] >= 0.5
    assert costs.step[last] >= 0.5
