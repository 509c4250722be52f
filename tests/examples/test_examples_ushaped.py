"""`examples/ushaped.py`, U-shaped split learning as a system of the user's: it trains
what plain SGD on the devices' batches, in turn order, trains (in simulation), and it
runs as real processes from the launcher."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe import data as datasets
from aiopipe.errors import ConfigError
from aiopipe.runtime.plan import build_model, device_indices, train_dataset

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


def _plain_sgd(config: RunConfig) -> nn.Sequential:
    """The whole model trained by plain SGD: per epoch, each device's batches in its
    epoch order, device after device."""
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    for epoch in range(config.epochs):
        for k in range(config.devices):
            order = datasets.epoch_order(device_indices(config, dataset, k), epoch=epoch,
                                         seed=config.seed)
            for first in range(0, len(order) - BATCH + 1, BATCH):
                x, y = dataset.batch(order[first:first + BATCH])
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
    return model


@pytest.mark.parametrize("n", [1, 2])
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
