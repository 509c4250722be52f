"""Memory probes of a sampled fl simulation (vgg5 on synthetic-cifar10, 20 samples a
device, B = 20, uniform costs, virtual clock), one process each:

    PYTHONPATH=<package root> python probes.py rounds K [D]   # RSS and peak after each
        of 4 rounds, D devices a round (2 by default: nearly all idle devices)
    PYTHONPATH=<package root> python probes.py end K          # ... and once `simulate`
        has returned (2 rounds, 2 a round): what the run's end adds
    PYTHONPATH=<package root> python probes.py trained K      # what a device that has
        trained holds more than one that has not: tracemalloc by line, after round 2
        against after round 22 (100 a round), per device that trained in between
"""

import asyncio
import gc
import sys
import time
import tracemalloc
from collections.abc import Callable

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


def simulate(devices: int, per_round: int, rounds: int,
             note: Callable[[aiopipe.EpochMetrics], None]) -> None:
    """The probes' simulation, ``note`` called after each round."""
    torch.set_num_threads(1)
    config = aiopipe.RunConfig(mode="fl", model="vgg5", dataset="synthetic-cifar10",
                               devices=devices, samples_per_device=20, batch_size=20,
                               epochs=rounds, test_samples=100, network="4g", seed=0,
                               devices_per_round=per_round)
    costs = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.0001, batch=20)
    asyncio.run(aiopipe.simulate(config, clock=VirtualClock(), cost_table=costs,
                                 progress=note))


def rounds(devices: int, per_round: int, count: int = 4) -> None:
    """RSS and peak RSS after each round."""
    base, started = status("VmRSS"), time.perf_counter()

    def note(epoch: aiopipe.EpochMetrics) -> None:
        print(f"K={devices} round {epoch.epoch}: wall {time.perf_counter() - started:.1f} s "
              f"RSS {status('VmRSS'):.0f} MiB HWM {status('VmHWM'):.0f} MiB "
              f"base {base:.0f}", flush=True)

    simulate(devices, per_round, count, note)


def trained(devices: int) -> None:
    """Traced growth between rounds 2 and 22, per device that first trained between."""
    snapshots: dict[int, tuple[tracemalloc.Snapshot, int]] = {}
    seen: set[int] = set()

    def note(epoch: aiopipe.EpochMetrics) -> None:
        for drawn in epoch.sampled:
            seen.update(drawn)
        if epoch.epoch in (2, 22):
            gc.collect()
            snapshots[epoch.epoch] = (tracemalloc.take_snapshot(), len(seen))

    tracemalloc.start(1)
    simulate(devices, 100, 22, note)
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


def main() -> None:
    what, devices = sys.argv[1], int(sys.argv[2])
    if what == "rounds":
        rounds(devices, int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    elif what == "end":
        rounds(devices, 2, 2)
        print(f"end: RSS {status('VmRSS'):.0f} HWM {status('VmHWM'):.0f}")
    elif what == "trained":
        trained(devices)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
