"""RSS after each round of a sampled fl simulation, and the peak once it has returned
(what the run's end adds): K devices, 2 a round, 2 rounds (vgg5, uniform costs).

    PYTHONPATH=<package root> python endpeak.py K
"""

import asyncio
import sys

import torch

import aiopipe
from aiopipe.clock import VirtualClock
from aiopipe.scheduler.costs import CostTable


def status(key: str) -> float:
    """``key``'s value in /proc/self/status, in MiB."""
    for line in open("/proc/self/status"):  # noqa: SIM115
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    torch.set_num_threads(1)
    config = aiopipe.RunConfig(mode="fl", model="vgg5", dataset="synthetic-cifar10",
                               devices=int(sys.argv[1]), samples_per_device=20,
                               batch_size=20, epochs=2, test_samples=100, network="4g",
                               seed=0, devices_per_round=2)
    costs = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.0001, batch=20)

    def note(epoch: aiopipe.EpochMetrics) -> None:
        print(f"round {epoch.epoch}: RSS {status('VmRSS'):.0f} HWM {status('VmHWM'):.0f}",
              flush=True)

    asyncio.run(aiopipe.simulate(config, clock=VirtualClock(), cost_table=costs,
                                 progress=note))
    print(f"end: RSS {status('VmRSS'):.0f} HWM {status('VmHWM'):.0f}")


if __name__ == "__main__":
    main()
