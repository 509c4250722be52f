"""RSS and peak RSS of a sampled fl simulation after each of 4 rounds (vgg5, uniform
costs, 20 samples a device, B = 20): K devices, D a round (2 by default). With D = 2
the figure is nearly all idle devices (session 31's rss_slope.py, with 4 rounds); with
D = 100 it adds what a round of 100 devices leaves.

    PYTHONPATH=<package root> python rss_round.py K [D]
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
    per_round = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    config = aiopipe.RunConfig(mode="fl", model="vgg5", dataset="synthetic-cifar10",
                               devices=k, samples_per_device=20, batch_size=20, epochs=4,
                               test_samples=100, network="4g", seed=0,
                               devices_per_round=per_round)
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
