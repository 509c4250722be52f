"""Learning parity (PiPar Table 5 in spirit): reordering stages does not cost accuracy.

PiPar computes the same gradients as FL (see test_runtime_equivalence), so after the same
epochs on the same data the two reach about the same test accuracy; they differ only in
where the per-device model halves are averaged.
"""

from __future__ import annotations

import pytest

from aiopipe import RunConfig, VirtualClock, simulate


@pytest.mark.slow
async def test_pipar_and_fl_reach_the_same_accuracy() -> None:
    base = RunConfig(model="vgg5", dataset="synthetic-cifar10", devices=2,
                     samples_per_device=2000, batch_size=50, epochs=3, split_point=2,
                     parallel_batches=5, learning_rate=0.02, momentum=0.9,
                     test_samples=1000, seed=3)
    pipar = await simulate(base.replace(mode="pipar"), clock=VirtualClock())
    fl = await simulate(base.replace(mode="fl"), clock=VirtualClock())
    for result in (pipar, fl):
        losses = [e.loss for e in result.epochs]
        assert losses[-1] < losses[0]
        assert result.final.accuracy >= 0.5, result.final  # chance is 0.1
    assert abs(pipar.final.accuracy - fl.final.accuracy) <= 0.02, (
        pipar.final.accuracy, fl.final.accuracy)
