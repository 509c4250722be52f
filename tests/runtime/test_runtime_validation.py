"""Every message from a device is checked against its plan; a violation ends that
device's connection with an ErrorMessage naming the problem (DESIGN §7), and the run
goes on without it: its round is excluded from aggregation, the others are unaffected."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math

import pytest
import torch

from aiopipe import CostTable, RunConfig, VirtualClock
from aiopipe.errors import AiopipeError, LinkBrokenError
from aiopipe.protocol import (
    PROTOCOL_VERSION,
    Activation,
    ErrorMessage,
    Hello,
    Plan,
    RoundStart,
    TensorData,
    decode,
    encode,
)
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.device import run_device
from aiopipe.testing import ready_for
from aiopipe.transport import LinkSpec, MemoryLink, open_memory_link_pair

CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=40, batch_size=20, epochs=1,
                   split_point=2, parallel_batches=2, test_samples=20)
COSTS = CostTable.uniform(5, forward=0.001, backward=0.001)
MICRO = 10
SHAPE = (MICRO, 64, 8, 8)  # vgg5's activation after unit 2 at micro-batch 10


def _tensor(shape: tuple[int, ...], dtype: str = "float32", fill: float = 0.0) -> TensorData:
    import torch

    t = torch.full(shape, fill, dtype=getattr(torch, dtype))
    return TensorData(dtype, shape, t.numpy().tobytes())


def _labels(values: list[int] | None = None) -> TensorData:
    import torch

    t = torch.tensor(values if values is not None else [0] * MICRO, dtype=torch.int64)
    return TensorData("int64", tuple(t.shape), t.numpy().tobytes())


def _activation(epoch: int, iteration: int, micro_batch: int, tensor: TensorData,
                labels: TensorData) -> Activation:
    """Device 1's activation (`misbehave` sets the run's id) made by the weights of the
    iteration's version (round 0 starts at version 0)."""
    return Activation(0, 0, epoch, iteration, micro_batch, iteration, "device1", "server",
                      (tensor,), labels)


BAD = {
    "wrong shape": (_activation(0, 0, 0, _tensor((MICRO, 64, 8, 7)), _labels()),
                    "the plan says float32 (10, 64, 8, 8)"),
    "wrong dtype": (_activation(0, 0, 0, _tensor(SHAPE, "float64"), _labels()),
                    "is float64"),
    "micro-batch outside plan": (_activation(0, 0, 2, _tensor(SHAPE), _labels()),
                                 "outside round"),
    "iteration outside round": (_activation(0, 5, 0, _tensor(SHAPE), _labels()),
                                "outside round"),
    "wrong epoch": (_activation(3, 0, 0, _tensor(SHAPE), _labels()), "outside round"),
    "labels out of range": (_activation(0, 0, 0, _tensor(SHAPE), _labels([10] * MICRO)),
                            "labels outside 0..9"),
    "NaN activation": (_activation(0, 0, 0, _tensor(SHAPE, fill=math.nan), _labels()),
                       "NaN or Inf"),
    "short labels": (_activation(0, 0, 0, _tensor((3, 64, 8, 8)), _labels([0, 1, 2])),
                     "the plan says"),
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_a_bad_activation_is_refused_with_its_reason(case: str) -> None:
    message, reason = BAD[case]
    await _refused_and_the_run_goes_on(CONFIG, [message], reason)


async def test_a_device_far_ahead_of_the_servers_stage_is_refused() -> None:
    """Valid activations, all at once: more than two iterations' worth would be memory
    the server holds for a device that does not wait for its gradients."""
    config = CONFIG.replace(samples_per_device=60)  # 3 iterations x 2 micro-batches
    flood = [_activation(0, i, m, _tensor(SHAPE), _labels()) for i in range(3)
             for m in range(2)]
    await _refused_and_the_run_goes_on(config, flood, "more than two iterations' "
                                       "activations ahead of the server's stage")


async def _refused_and_the_run_goes_on(config: RunConfig, messages: list[Activation],
                                       reason: str) -> None:
    """Device 1 sends ``messages`` after its first RoundStart: it gets one ErrorMessage
    with ``reason`` and a closed link; device 0 trains its whole epoch."""
    samples = config.samples_per_device
    clock = VirtualClock()
    node = Coordinator(config, clock=clock, cost_table=COSTS)
    unshaped = LinkSpec(None)
    good_device, good_server = open_memory_link_pair(clock, a_to_b=unshaped, b_to_a=unshaped)
    bad_device, bad_server = open_memory_link_pair(clock, a_to_b=unshaped, b_to_a=unshaped)
    answers: list[object] = []

    async def serve(link: MemoryLink) -> None:
        with contextlib.suppress(AiopipeError):
            await node.serve_link(link)

    async def good() -> None:
        summary = await run_device(good_device, 0, clock=clock, cost_table=COSTS,
                                   clock_offset=0.0)
        assert summary.samples == samples
        assert summary.reason == "training finished"

    async def misbehave() -> None:
        await bad_device.send(encode(Hello(PROTOCOL_VERSION, 1)))
        plan = decode(await bad_device.receive())
        assert isinstance(plan, Plan)
        await bad_device.send(encode(ready_for(plan, samples)))
        assert isinstance(decode(await bad_device.receive()), RoundStart)
        for message in messages:
            await bad_device.send(encode(dataclasses.replace(message, run_id=plan.run_id)))
        with contextlib.suppress(LinkBrokenError):
            while True:  # gradients for what was accepted, then the refusal
                answer = decode(await bad_device.receive())
                if isinstance(answer, ErrorMessage):
                    answers.append(answer)

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(serve(good_server))
        tasks.create_task(serve(bad_server))
        tasks.create_task(good())
        tasks.create_task(misbehave())
        result = await node.train()
    assert result.final.devices_lost == (1,)
    assert result.final.device_samples == (samples, 0)
    assert result.final.samples == samples
    for value in result.model.state_dict().values():
        assert torch.isfinite(value).all()
    (answer,) = answers
    assert isinstance(answer, ErrorMessage)
    assert answer.code == "protocol"
    assert reason in answer.message
    await clock.aclose()


def test_finite_activations_too_large_for_the_model_are_refused_before_they_train() -> None:
    from aiopipe.errors import RemoteProtocolError
    from aiopipe.runtime.plan import build_model
    from aiopipe.runtime.stage import StageWork

    config = RunConfig(mode="pipar", devices=2, samples_per_device=40, batch_size=20,
                       split_point=2, parallel_batches=2)
    replica = build_model(config, num_classes=10, in_shape=(3, 32, 32))[2:]
    stage = StageWork(replica, torch.optim.SGD(replica.parameters(), lr=0.1), first=False,
                      last=True, parallel_batches=2, num_classes=10)
    labels = torch.arange(10) % 10
    huge = torch.full((10, 64, 8, 8), 3e38)
    with pytest.raises(RemoteProtocolError, match="NaN or Inf loss: its values are out of range"):
        stage.forward_backward(0, 0, ((huge,), labels))
    assert all(p.grad is None for p in replica.parameters())  # nothing reached the weights
    large = torch.full((10, 64, 8, 8), 1e10)
    gradient = stage.forward_backward(0, 1, ((large,), labels))  # large, computable: accepted
    assert gradient is not None
    assert torch.isfinite(gradient[0]).all()
