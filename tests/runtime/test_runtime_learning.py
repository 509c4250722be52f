"""Learning parity (PiPar Table 5 in spirit): reordering stages does not cost accuracy.

PiPar computes the same gradients as FL (see test_runtime_equivalence), so after the same
epochs on the same data the two reach about the same test accuracy; they differ only in
where the per-device model halves are averaged.

The task is small so that it runs in seconds: a 4-unit MLP on synthetic MNIST, 2 devices x
600 samples, 3 epochs. Both modes still learn clearly (about 0.7 test accuracy, chance is
0.1), and a wrong gradient anywhere in PiPar's pipeline (e.g. the server's gradient scaled
on its way back to a device) moves PiPar's loss and accuracy away from FL's.
"""

from __future__ import annotations

import pytest
from torch import nn

from aiopipe import CostTable, RunConfig, VirtualClock, simulate

# charged virtual time does not matter here: a fixed table spares measuring one
COSTS = CostTable.uniform(4, forward=0.01, backward=0.02, step=0.001, batch=10)


def mlp(num_classes: int, in_shape: tuple[int, int, int]) -> nn.Sequential:
    """4 split units: pool, flatten, 3 hidden layers of 64, the classifier."""
    c, h, w = in_shape
    return nn.Sequential(
        nn.Sequential(nn.AvgPool2d(2), nn.Flatten(), nn.Linear(c * (h // 2) * (w // 2), 64),
                      nn.ReLU()),
        nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
        nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
        nn.Linear(64, num_classes),
    )


@pytest.mark.slow
async def test_pipar_and_fl_reach_the_same_accuracy() -> None:
    base = RunConfig(model=mlp, dataset="synthetic-mnist", devices=2,
                     samples_per_device=600, batch_size=20, epochs=3, split_point=2,
                     parallel_batches=2, learning_rate=0.05, momentum=0.9,
                     test_samples=500, seed=3)
    pipar = await simulate(base.replace(mode="pipar"), clock=VirtualClock(), cost_table=COSTS)
    fl = await simulate(base.replace(mode="fl"), clock=VirtualClock(), cost_table=COSTS)
    for result in (pipar, fl):
        losses = [e.loss for e in result.epochs]
        assert losses[-1] < 0.6 * losses[0], losses
        assert result.final.accuracy >= 0.5, result.final  # chance is 0.1
    assert abs(pipar.final.loss - fl.final.loss) <= 0.01, (pipar.final.loss, fl.final.loss)
    assert abs(pipar.final.accuracy - fl.final.accuracy) <= 0.02, (
        pipar.final.accuracy, fl.final.accuracy)
