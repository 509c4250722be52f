"""RSS and peak RSS (VmRSS, VmHWM) of aiopipe's FL simulation after each round: K devices
(default 1,000), 10% a round, 10 rounds, bench/flower_sim.py's config (vgg5, 40 samples a
device, B = 20, uniform costs, virtual clock). Run from a checkout's root:

    PYTHONPATH=. .venv/bin/python bench/results/2026-11-29-s32-flower-sim/memlight.py 1000
"""
import argparse
import asyncio
import gc
import sys
import time

sys.path.insert(0, "bench")
import flower_sim
import scale
import torch

import aiopipe
from aiopipe.clock import VirtualClock

K = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
ns = argparse.Namespace(samples_per_device=40, batch_size=20, rounds=10, fraction=0.1)
torch.set_num_threads(1)
config = flower_sim.run_config(ns, K)
costs = scale.cost_table(flower_sim.scale_args(ns, K))


def status(field: str) -> float:
    """A /proc/self/status figure in MiB."""
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


rounds = []


def progress(epoch: object) -> None:
    gc.collect()
    rounds.append(1)
    print(f"round {len(rounds)} rss {status('VmRSS'):.0f} MiB, peak {status('VmHWM'):.0f}, "
          f"{time.perf_counter() - t0:.1f} s", flush=True)


t0 = time.perf_counter()
print(f"start rss {status('VmRSS'):.0f}")
asyncio.run(aiopipe.simulate(config, clock=VirtualClock(), cost_table=costs, progress=progress))
print(f"done {time.perf_counter() - t0:.1f} s, rss {status('VmRSS'):.0f}, "
      f"peak {status('VmHWM'):.0f}")
