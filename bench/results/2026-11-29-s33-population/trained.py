"""What a device that has trained holds more than one that has not: tracemalloc by
line, after round 2 against after round 22 (K devices, 100 a round, fl, vgg5, uniform
costs), per device that trained in between.

    PYTHONPATH=<package root> python trained.py K
"""

import asyncio
import gc
import sys
import tracemalloc

import torch

import aiopipe
from aiopipe.clock import VirtualClock
from aiopipe.scheduler.costs import CostTable


def main() -> None:
    torch.set_num_threads(1)
    config = aiopipe.RunConfig(mode="fl", model="vgg5", dataset="synthetic-cifar10",
                               devices=int(sys.argv[1]), samples_per_device=20,
                               batch_size=20, epochs=22, test_samples=100, network="4g",
                               seed=0, devices_per_round=100)
    costs = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.0001, batch=20)
    snapshots: dict[int, tuple[tracemalloc.Snapshot, int]] = {}
    trained: set[int] = set()

    def note(epoch: aiopipe.EpochMetrics) -> None:
        for drawn in epoch.sampled:
            trained.update(drawn)
        if epoch.epoch in (2, 22):
            gc.collect()
            snapshots[epoch.epoch] = (tracemalloc.take_snapshot(), len(trained))

    tracemalloc.start(1)
    asyncio.run(aiopipe.simulate(config, clock=VirtualClock(), cost_table=costs,
                                 progress=note))
    (before, had), (after, has) = snapshots[2], snapshots[22]
    new = has - had
    print(f"devices trained: {had} after round 2, {has} after round 22")
    stats = after.compare_to(before, "lineno")
    total = sum(s.size_diff for s in stats)
    print(f"traced growth: {total / 1024:.0f} KiB, {total / new:.0f} B per newly trained "
          "device")
    for stat in stats[:25]:
        print(f"  {stat.size_diff / new:8.0f} B/dev {stat.count_diff / new:6.2f} blocks/dev  "
              f"{stat.traceback}")


if __name__ == "__main__":
    main()
