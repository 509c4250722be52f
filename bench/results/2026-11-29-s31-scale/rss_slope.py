"""RSS of a sampled fl simulation after each round (2 devices a round, vgg5, uniform
costs): run it at two population sizes and divide the difference by the devices added,
to get what a device in no round holds.

    PYTHONPATH=<package root> python rss_slope.py K
"""

import asyncio
import sys
import time

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
    k = int(sys.argv[1])
    torch.set_num_threads(1)
    config = aiopipe.RunConfig(mode="fl", model="vgg5", dataset="synthetic-cifar10",
                               devices=k, samples_per_device=20, batch_size=20, epochs=2,
                               test_samples=100, network="4g", seed=0, devices_per_round=2)
    costs = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.0001, batch=20)
    base, started = status("VmRSS"), time.perf_counter()

    def note(epoch: object) -> None:
        print(f"K={k} round {epoch.epoch}: wall {time.perf_counter() - started:.1f} s "  # type: ignore[attr-defined]
              f"RSS {status('VmRSS'):.0f} MiB HWM {status('VmHWM'):.0f} MiB base {base:.0f}",
              flush=True)

    asyncio.run(aiopipe.simulate(config, clock=VirtualClock(), cost_table=costs,
                                 progress=note))


if __name__ == "__main__":
    main()
