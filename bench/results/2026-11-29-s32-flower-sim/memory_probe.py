"""Memory of aiopipe's FL simulation: K devices, 10% a round, bench/flower_sim.py's config
(vgg5, 40 samples a device, B = 20, uniform costs, virtual clock). Run from a checkout's
root, with ``PROBE=bench/results/2026-11-29-s32-flower-sim/memory_probe.py``:

    PYTHONPATH=. .venv/bin/python $PROBE rounds 1000
    PYTHONPATH=. .venv/bin/python $PROBE peak 300

``rounds``: RSS and peak RSS (VmRSS, VmHWM) after each of 10 rounds. ``peak``: one round,
the largest sum of live tensor storage (distinct storages) sampled every 10th compute
item, with its breakdown by (shape, dtype, requires_grad).
"""
import argparse
import asyncio
import collections
import gc
import sys
import time
from typing import Any

sys.path.insert(0, "bench")
import flower_sim
import scale
import torch

import aiopipe
from aiopipe.clock import VirtualClock
from aiopipe.runtime import compute as compute_mod


def status(field: str) -> float:
    """A /proc/self/status figure in MiB."""
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def census() -> tuple[int, collections.Counter[Any]]:
    """Bytes of the distinct live tensor storages, and by the first tensor seen of each."""
    storages: dict[int, int] = {}
    kinds: collections.Counter[Any] = collections.Counter()
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                storage = o.untyped_storage()
            except RuntimeError:
                continue
            if storage.data_ptr() not in storages:
                storages[storage.data_ptr()] = storage.nbytes()
                kinds[(tuple(o.shape), str(o.dtype), o.requires_grad)] += storage.nbytes()
    return sum(storages.values()), kinds


def rounds(config: Any, costs: Any) -> None:
    """RSS after each round."""
    done = []
    started = time.perf_counter()

    def progress(epoch: object) -> None:
        gc.collect()
        done.append(1)
        print(f"round {len(done)} rss {status('VmRSS'):.0f} MiB, peak {status('VmHWM'):.0f}, "
              f"{time.perf_counter() - started:.1f} s", flush=True)

    print(f"start rss {status('VmRSS'):.0f}")
    asyncio.run(aiopipe.simulate(config, clock=VirtualClock(), cost_table=costs,
                                 progress=progress))
    print(f"done {time.perf_counter() - started:.1f} s, rss {status('VmRSS'):.0f}, "
          f"peak {status('VmHWM'):.0f}")


def peak(config: Any, costs: Any) -> None:
    """The largest live tensor storage within one round, and what it was."""
    best: list[Any] = [0, collections.Counter(), 0.0]
    calls = [0]
    real_run = compute_mod.Compute.run

    async def run(self: compute_mod.Compute, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] % 10 == 0:
            total, kinds = census()
            if total > best[0]:
                best[:] = [total, kinds, status("VmRSS")]
        return await real_run(self, *args, **kwargs)

    compute_mod.Compute.run = run  # type: ignore[method-assign]
    asyncio.run(aiopipe.simulate(config, clock=VirtualClock(), cost_table=costs))
    print(f"compute items {calls[0]}, max live tensor storage {best[0] / 2**20:.0f} MiB "
          f"at RSS {best[2]:.0f}, peak RSS {status('VmHWM'):.0f}")
    for key, size in best[1].most_common(12):
        print(f"  {key}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    what, devices = sys.argv[1], int(sys.argv[2])
    ns = argparse.Namespace(samples_per_device=40, batch_size=20,
                            rounds=10 if what == "rounds" else 1, fraction=0.1)
    torch.set_num_threads(1)
    {"rounds": rounds, "peak": peak}[what](flower_sim.run_config(ns, devices),
                                          scale.cost_table(flower_sim.scale_args(ns, devices)))
