"""A synchronous pipeline across devices (``mode = "pipeline"``), in virtual time.

- equivalence: the trained weights equal unsplit PyTorch training with gradient
  accumulation over the micro-batches, for S in {2, 3, 4}, GPipe and 1F1B, N in {1, 2, 4};
- timing: an iteration takes exactly the generic estimator's critical path over the
  stages' action lists (`aiopipe.scheduler.critical_path`);
- memory: the most activations a stage holds at once is K_p under 1F1B and N under GPipe.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe import data as datasets
from aiopipe.protocol import Activation, Gradient, TensorData, encode
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.device import run_device
from aiopipe.runtime.plan import build_model, device_indices, train_dataset
from aiopipe.scheduler.actions import Action
from aiopipe.scheduler.critical_path import Executor, pipeline_executors
from aiopipe.scheduler.critical_path import simulate as critical_path
from aiopipe.scheduler.placement import chain
from aiopipe.scheduler.schedule import gpipe, one_f_one_b, with_transfers
from aiopipe.transport import LinkSpec, open_memory_link_pair
from aiopipe.transport.fabric import MemoryFabric

BATCH = 8
LR = 0.05
CUTS = {2: [2], 3: [1, 3], 4: [1, 2, 4]}


def _config(stages: int, schedule: str, n: int, **changes: object) -> RunConfig:
    base = RunConfig(mode="pipeline", model="vgg5", devices=stages, samples_per_device=2 * BATCH,
                     batch_size=BATCH, epochs=1,
                     parallel_batches=n, learning_rate=LR, momentum=0.9, test_samples=20,
                     seed=3, options={"partition": CUTS[stages], "schedule": schedule})
    return base.replace(**changes)


def _reference(config: RunConfig, iterations: int) -> nn.Sequential:
    """Unsplit training: per iteration, N micro-batches' gradients of mean loss / N
    accumulated, then one SGD step with momentum; ``iterations`` per epoch, for every
    epoch of ``config`` (each in its own order)."""
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate,
                                momentum=config.momentum)
    n = config.parallel_batches
    assert isinstance(n, int)
    micro = config.batch_size // n
    for epoch in range(config.epochs):
        order = datasets.epoch_order(device_indices(config, dataset, 0), epoch=epoch,
                                     seed=config.seed)
        for i in range(iterations):
            for m in range(n):
                first = i * micro * n + m * micro
                x, y = dataset.batch(order[first:first + micro])
                (nn.functional.cross_entropy(model(x), y) / n).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("n", [1, 2, 4])
async def test_pipeline_training_equals_unsplit_training(stages: int, schedule: str,
                                                         n: int) -> None:
    config = _config(stages, schedule, n)
    result = await simulate(config, clock=VirtualClock())
    assert result.final.samples == 2 * BATCH
    want = _reference(config, iterations=2).state_dict()
    got = result.model.state_dict()
    initial = build_model(config, num_classes=10, in_shape=(3, 32, 32)).state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        difference = (got[key] - value).norm() / value.norm()
        assert difference <= 1e-5, f"{key}: relative difference {difference:.2e}"
        assert not torch.equal(value, initial[key])  # the weights really moved


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
async def test_a_stage_holds_k_p_activations_under_1f1b_and_n_under_gpipe(
        schedule: str) -> None:
    stages, n = 4, 8
    config = _config(stages, schedule, n, batch_size=16, samples_per_device=16)
    result = await simulate(config, clock=VirtualClock(),
                            cost_table=CostTable.uniform(5, forward=0.01, backward=0.02,
                                                         batch=2))
    peaks = [s["peak_live"] for s in result.final.stages]
    if schedule == "1f1b":
        assert peaks == [min(2 * (stages - p) - 1, n) for p in range(stages)] == [7, 5, 3, 1]
    else:
        assert peaks == [n] * stages


# -- timing --------------------------------------------------------------------------------

COSTS = CostTable.uniform(5, forward=0.004, backward=0.007, step=0.002, batch=2)
WIRE = LinkSpec(20e6, 0.003)  # every device-to-device direction


def _frame_bytes(config: RunConfig, node: Coordinator, cut: int, micro: int) -> tuple[int, int]:
    """One activation frame and one gradient frame across the cut after unit ``cut``."""
    model = build_model(config, num_classes=10, in_shape=(3, 32, 32))
    x = torch.zeros(micro, 3, 32, 32)
    for unit in list(model.children())[:cut]:
        x = unit(x)
    tensor = TensorData("float32", tuple(x.shape), bytes(x.numel() * 4))
    labels = TensorData("int64", (micro,), bytes(micro * 8))
    activation = Activation(node.run_id, 0, 0, 0, 0, 0, "device0", "device1", (tensor,), labels)
    gradient = Gradient(node.run_id, 1, 0, 0, 0, 0, "device1", "device0", (tensor,))
    return len(encode(activation)), len(encode(gradient))


@pytest.mark.parametrize(("stages", "schedule", "n", "slowdown"), [
    (3, "1f1b", 4, (1.0, 2.0, 1.5)), (3, "gpipe", 4, (1.0, 1.0, 1.0)),
    (4, "1f1b", 8, (1.0, 1.0, 3.0, 1.0)), (2, "gpipe", 2, (2.0, 1.0)),
])
async def test_an_iteration_takes_the_critical_path_of_the_action_lists(
        stages: int, schedule: str, n: int, slowdown: tuple[float, ...]) -> None:
    # two epochs: the second's round starts on every stage at once, its links already up
    config = _config(stages, schedule, n, samples_per_device=3 * BATCH, epochs=2,
                     device_slowdown=slowdown, heartbeat_interval=1000.0,
                     device_timeout=2000.0, reconnect_grace=1000.0)
    clock = VirtualClock()
    node = Coordinator(config, clock=clock, cost_table=COSTS)
    fabric = MemoryFabric(clock, default=WIRE)
    unshaped = LinkSpec(None)  # the coordinator's links: every stage starts at once

    async def device(k: int) -> None:
        device_end, server_end = open_memory_link_pair(clock, a_to_b=unshaped, b_to_a=unshaped)
        endpoint = fabric.endpoint(f"device{k}")
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(node.serve_link(server_end))
            await run_device(device_end, k, clock=clock, cost_table=COSTS, clock_offset=0.0,
                             endpoint=endpoint)
        await endpoint.aclose()

    async with asyncio.TaskGroup() as tasks:
        for k in range(stages):
            tasks.create_task(device(k))
        result = await node.train()
    await clock.aclose()

    micro = BATCH // n
    bounds = [(s.first_unit, s.stop_unit) for s in
              chain(CUTS[stages], 5, [f"device{p}" for p in range(stages)]).pipelines[0].stages]
    made = with_transfers(one_f_one_b(stages, n) if schedule == "1f1b" else gpipe(stages, n))
    frames = [_frame_bytes(config, node, b, micro) for _, b in bounds[:-1]]

    def compute_time(executor: Executor, action: Action) -> float:
        a, b = bounds[executor.stage]
        seconds = {"F": COSTS.forward_time(a, b, micro), "B": COSTS.backward_time(a, b, micro),
                   "FB": COSTS.forward_time(a, b, micro) + COSTS.backward_time(a, b, micro),
                   "STEP": COSTS.step_time(a, b)}[action.kind]
        return seconds * slowdown[executor.stage]

    def transfer_time(executor: Executor, action: Action) -> tuple[float, float]:
        p = executor.stage
        size = frames[p][0] if action.kind == "SEND_F" else frames[p - 1][1]
        return WIRE.wire_time(size), WIRE.latency_s

    iterations = 3
    timeline = critical_path(
        pipeline_executors(made, [f"device{p}" for p in range(stages)], iterations=iterations),
        compute_time=compute_time, transfer_time=transfer_time)
    second = [s for s in result.trace if s.epoch == 1]
    steps = {p: sorted(s.end for s in second
                       if s.track == f"device{p}/compute" and s.name == "step")
             for p in range(stages)}
    origin = min(s.start for s in second if s.track == "device0/compute")
    for p in range(stages):
        want = [origin + t for t in timeline.step_ends[(0, p)]]
        assert steps[p] == pytest.approx(want, rel=1e-12, abs=1e-9), f"stage {p}"
    assert len(steps[0]) == iterations


async def test_activations_that_come_before_their_round_wait_for_it() -> None:
    """Device 1's RoundStart comes 0.3 s after device 0's (a slower link to the
    coordinator): device 0's first activations reach device 1 before its round has
    started. They wait for it ([Note: early activations]), and training is exact."""
    config = _config(3, "gpipe", 4, epochs=2)
    clock = VirtualClock()
    node = Coordinator(config, clock=clock)
    fabric = MemoryFabric(clock)

    async def device(k: int) -> None:
        late = LinkSpec(None, 0.3 if k == 1 else 0.0)
        device_end, server_end = open_memory_link_pair(clock, a_to_b=late, b_to_a=late)
        endpoint = fabric.endpoint(f"device{k}")
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(node.serve_link(server_end))
            await run_device(device_end, k, clock=clock, clock_offset=0.0, endpoint=endpoint)
        await endpoint.aclose()

    async with asyncio.TaskGroup() as tasks:
        for k in range(3):
            tasks.create_task(device(k))
        result = await node.train()
    await clock.aclose()
    first_f = {p: min(s.start for s in result.trace
                      if s.track == f"device{p}/compute" and s.epoch == 1) for p in range(2)}
    assert first_f[1] >= first_f[0] + 0.3  # device 1 started the round late
    want = _reference(config, iterations=2).state_dict()
    for key, value in result.model.state_dict().items():
        assert (value - want[key]).norm() <= 1e-5 * want[key].norm(), key
