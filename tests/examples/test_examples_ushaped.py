"""`examples/ushaped.py`, U-shaped split learning as a system of the user's: it trains
what plain SGD on the devices' batches, in turn order, trains (in simulation), and it
runs as real processes from the launcher."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from plain_training import train_in_turns, train_one_epoch
from torch import nn

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.runtime.plan import build_model, train_dataset
from aiopipe.systems import Activation, Gradient, RoundStart, Sent, ServerStage, StageWork

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
BATCH = 20
LR = 0.1


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode names the example's module, as a user's run from examples/ does."""
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _config(**changes: object) -> RunConfig:
    base = RunConfig(mode="ushaped:UShaped", model="vgg5", dataset="synthetic-cifar10",
                     devices=3, samples_per_device=2 * BATCH, batch_size=BATCH, epochs=2,
                     split_point=2, parallel_batches=1, learning_rate=LR, momentum=0.0,
                     test_samples=20, seed=7)
    return base.replace(**changes)


def _plain_sgd(config: RunConfig, devices: Sequence[int] | None = None) -> nn.Sequential:
    """The whole model trained by plain SGD: per epoch, each device's batches in its
    epoch order, device after device (``devices``: those, by default all)."""
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    train_in_turns(model, optimizer, config,
                   range(config.devices) if devices is None else devices, BATCH)
    return model


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow)])
async def test_ushaped_trains_what_plain_sgd_in_turn_order_trains(n: int) -> None:
    config = _config(parallel_batches=n)
    result = await simulate(config, clock=VirtualClock())
    assert [e.samples for e in result.epochs] == [3 * 2 * BATCH] * 2
    want = _plain_sgd(config).state_dict()
    got = result.model.state_dict()
    initial = build_model(config, num_classes=10, in_shape=(3, 32, 32)).state_dict()
    assert list(got) == list(want)
    for key in want:
        diff, scale = (got[key] - want[key]).norm(), want[key].norm()
        assert diff <= 1e-5 * scale, f"{key}: relative difference {diff / scale:.2e}"
        # one micro-batch: the same operations in the same order, bit for bit
        assert n > 1 or torch.equal(got[key], want[key]), key
        assert not torch.equal(want[key], initial[key])  # every unit trained
    # the loss is the device's (the coordinator's middle stage computes none)
    assert all(e.loss > 0 for e in result.epochs)


async def test_the_parallel_schedule_trains_fedavg_of_each_devices_plain_sgd() -> None:
    """[Note: parallel schedule]: every device at once from the same model, then the
    average of the devices' whole models (equal samples: the plain mean), epoch by
    epoch."""
    config = _config(options={"schedule": "parallel"})
    result = await simulate(config, clock=VirtualClock())
    assert [e.samples for e in result.epochs] == [3 * 2 * BATCH] * 2
    model = build_model(config, num_classes=10, in_shape=(3, 32, 32))
    for epoch in range(config.epochs):
        states = []
        for k in range(config.devices):
            copy = build_model(config, num_classes=10, in_shape=(3, 32, 32))
            copy.load_state_dict(model.state_dict())
            optimizer = torch.optim.SGD(copy.parameters(), lr=config.learning_rate)
            train_one_epoch(copy, optimizer, config, k, epoch, BATCH)
            states.append(copy.state_dict())
        model.load_state_dict({key: sum(s[key] for s in states) / len(states)
                               for key in states[0]})
    want, got = model.state_dict(), result.model.state_dict()
    for key in want:
        diff, scale = (got[key] - want[key]).norm(), want[key].norm()
        assert diff <= 1e-5 * scale, f"{key}: relative difference {diff / scale:.2e}"


async def test_the_parallel_schedule_overlaps_the_devices_rounds() -> None:
    """Three devices' rounds at once take well under the time of three turns (virtual
    time: the same compute and transfers are charged), and train another model."""
    turns = await simulate(_config(epochs=1), clock=VirtualClock())
    parallel = await simulate(_config(epochs=1, options={"schedule": "parallel"}),
                              clock=VirtualClock())
    assert parallel.epochs[0].time_s < 0.6 * turns.epochs[0].time_s
    key = next(iter(turns.model.state_dict()))
    assert not torch.equal(turns.model.state_dict()[key], parallel.model.state_dict()[key])


@pytest.mark.slow
@pytest.mark.parametrize("momentum", [0.0, 0.9])
async def test_the_parallel_schedule_trains_what_pipar_trains(momentum: float) -> None:
    """Same cut, same data and order, FedAvg after each round, optimizer states kept on
    both sides: U-shaped in parallel is pipar with the classifier moved back to the
    device, and computes the same model."""
    config = _config(momentum=momentum, parallel_batches=2)
    ushaped = await simulate(config.replace(options={"schedule": "parallel"}),
                             clock=VirtualClock())
    pipar = await simulate(config.replace(mode="pipar", options={"local_optimizer": "kept"}),
                           clock=VirtualClock())  # (its default starts them fresh)
    want, got = pipar.model.state_dict(), ushaped.model.state_dict()
    assert list(got) == list(want)
    for key in want:
        diff, scale = (got[key] - want[key]).norm(), want[key].norm()
        assert diff <= 1e-5 * scale, f"{key}: relative difference {diff / scale:.2e}"


async def test_an_unknown_schedule_is_refused() -> None:
    with pytest.raises(ConfigError, match="'schedule'"):
        await simulate(_config(options={"schedule": "1f1b"}), clock=VirtualClock())


class _Watching(StageWork):
    """The coordinator's middle stage, keeping the labels of what it receives."""

    labels: ClassVar[list[torch.Tensor]] = []

    def forward(self, iteration: int, micro_batch: int, received: Sent | None = None
                ) -> Sent | None:
        if received is not None:
            _Watching.labels.append(received[1].clone())
        return super().forward(iteration, micro_batch, received)


def _watching_system() -> type:
    from ushaped import UShaped  # (importable: the fixture)

    class Watched(UShaped):
        def _server_stage(self, k: int, start: RoundStart) -> ServerStage:
            stage = super()._server_stage(k, start)
            work = stage.work
            return dataclasses.replace(stage, work=_Watching(
                work.module, work.optimizer, first=False, last=False,
                parallel_batches=work.parallel_batches, num_classes=work.num_classes))

    return Watched


async def test_the_labels_never_leave_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "Watched", _watching_system(), raising=False)
    _Watching.labels = []
    config = _config(mode=f"{__name__}:Watched", epochs=1)
    result = await simulate(config, clock=VirtualClock())
    assert len(_Watching.labels) == 3 * 2  # devices x iterations, one micro-batch each
    assert all(labels.shape == (BATCH,) and not labels.any() for labels in _Watching.labels)
    # the devices computed the loss on their true labels: the equivalence test above
    assert result.epochs[0].loss > 0


async def test_a_gradient_sent_twice_loses_the_device_and_its_turn_is_undone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator refuses a device's gradient that comes twice ([Note: middle
    stages]); the run goes on without the device, and what its turn did to the
    coordinator's middle is undone: the model is the other devices' turns alone."""
    import ushaped

    class Doubling(ushaped._ToCoordinator):  # device 0 sends each gradient twice
        def send(self, message: Activation | Gradient, name: str, *,
                 ready_at: float | None) -> None:
            super().send(message, name, ready_at=ready_at)
            if isinstance(message, Gradient) and self.half.node.device_id == 0:
                super().send(message, name, ready_at=ready_at)

    monkeypatch.setattr(ushaped, "_ToCoordinator", Doubling)
    config = _config(epochs=1)
    result = await simulate(config, clock=VirtualClock())
    assert [(e.device_samples, e.devices_lost) for e in result.epochs] == [
        ((0, 2 * BATCH, 2 * BATCH), (0,))]
    want = _plain_sgd(config, devices=[1, 2]).state_dict()
    got = result.model.state_dict()
    assert all(torch.equal(got[key], want[key]) for key in want)


async def test_a_gradient_scaled_x1e6_excludes_the_device_and_its_turn_is_undone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator judges the values of the gradients its middle stage takes against
    the cut's scale in the initial model ([Note: judging arrivals]): device 0's x1e6
    gradient is refused at once, the device excluded, and what its turn did undone."""
    import ushaped

    from aiopipe.protocol import to_tensor_data, to_torch

    class Scaling(ushaped._ToCoordinator):  # device 0's gradients x1e6
        def send(self, message: Activation | Gradient, name: str, *,
                 ready_at: float | None) -> None:
            if isinstance(message, Gradient) and self.half.node.device_id == 0:
                message = dataclasses.replace(
                    message, tensors=(to_tensor_data(to_torch(message.tensors[0]) * 1e6),))
            super().send(message, name, ready_at=ready_at)

    monkeypatch.setattr(ushaped, "_ToCoordinator", Scaling)
    config = _config(epochs=1)
    result = await simulate(config, clock=VirtualClock())
    assert [(e.device_samples, e.devices_excluded) for e in result.epochs] == [
        ((0, 2 * BATCH, 2 * BATCH), (0,))]
    want = _plain_sgd(config, devices=[1, 2]).state_dict()
    got = result.model.state_dict()
    assert all(torch.equal(got[key], want[key]) for key in want)


def test_the_example_imports_only_the_public_api() -> None:
    tree = ast.parse((EXAMPLES / "ushaped.py").read_text(encoding="utf-8"))
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    modules |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    assert {m for m in modules if m and m.split(".")[0] == "aiopipe"} == {
        "aiopipe", "aiopipe.systems"}


async def test_a_split_that_leaves_no_middle_is_refused() -> None:
    with pytest.raises(ConfigError, match="leaves no middle"):
        # vgg5 has 5 units and the device keeps the 5th: units 4..3 would be the middle
        await simulate(_config(split_point=4), clock=VirtualClock())


#: An epoch's row of the launcher's table: epoch, time, loss, ...
EPOCH_ROW = re.compile(r"^\s+(\d+)\s+[\d.]+\s+([\d.]+)\s", re.MULTILINE)


@pytest.mark.slow
def test_ushaped_runs_as_real_processes_from_the_launcher(tmp_path: Path) -> None:
    """``python -m aiopipe --mode ushaped:UShaped --devices 3`` from examples/: the
    devices' processes find the system too, and the loss falls."""
    path = [str(ROOT), str(ROOT / "tests" / "no_pictures"), os.environ.get("PYTHONPATH")]
    process = subprocess.run(
        [sys.executable, "-m", "aiopipe", "--mode", "ushaped:UShaped", "--devices", "3",
         "--epochs", "3", "--samples-per-device", "96", "--batch-size", "16",
         "--test-samples", "64", "--out-dir", str(tmp_path / "results")],
        cwd=EXAMPLES, capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))})
    output = process.stdout + process.stderr
    assert process.returncode == 0, output[-3000:]
    losses = [float(loss) for _, loss in EPOCH_ROW.findall(process.stdout)]
    assert len(losses) == 3, output[-3000:]
    assert losses[-1] < losses[0], output[-3000:]
