"""What an idle device of a sampled fl simulation holds, and what wakes it.

    PYTHONPATH=.:bench python bench/results/2026-11-29-s31-scale/idle_breakdown.py K [ROUNDS]

Runs fl, vgg5 on synthetic-cifar10, K devices, 2 a round (uniform costs, as
bench/scale.py), and after round 1 and the last round prints: objects alive by type
per device (gc, against a baseline taken before `simulate`), tasks alive, sleepers on
the virtual clock, traced bytes per device (tracemalloc, by file), and the clock's
timed sleeps (wake-ups) per round.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import sys
import time
import tracemalloc
from typing import Any

import torch
from scale import CountingClock  # bench/scale.py (bench on the path)

import aiopipe
from aiopipe.scheduler.costs import CostTable


def counts() -> collections.Counter[str]:
    gc.collect()
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def main() -> None:
    k = int(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.set_num_threads(1)
    config = aiopipe.RunConfig(mode="fl", model="vgg5", dataset="synthetic-cifar10",
                               devices=k, samples_per_device=20, batch_size=20,
                               epochs=rounds, test_samples=100, network="4g", seed=0,
                               devices_per_round=2)
    costs = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.0001, batch=20)
    clock = CountingClock()
    base = counts()
    tracemalloc.start(1)
    snap0 = tracemalloc.take_snapshot()
    last = {"wakeups": 0, "t": time.perf_counter()}

    def note(epoch: Any) -> None:
        now = time.perf_counter()
        print(f"round {epoch.epoch}: wall {now - last['t']:.2f} s, clock sleeps "
              f"{clock.wakeups - last['wakeups']} ({(clock.wakeups - last['wakeups']) / k:.2f}"
              f" per device), virtual {epoch.time_s:.3f} s", flush=True)
        last["wakeups"], last["t"] = clock.wakeups, now
        if epoch.epoch not in (1, rounds):
            return
        now_counts = counts()
        diff = {t: n - base.get(t, 0) for t, n in now_counts.items()}
        top = sorted(diff.items(), key=lambda kv: -kv[1])[:40]
        print("  objects per device (top): " + ", ".join(
            f"{t} {n / k:.2f}" for t, n in top if n > 0))
        print(f"  total objects per device: {sum(diff.values()) / k:.1f}")
        tasks = asyncio.all_tasks()
        names = collections.Counter(
            (t.get_coro().__qualname__ if t.get_coro() is not None else "?")  # type: ignore[union-attr]
            for t in tasks)
        print(f"  tasks: {len(tasks)} ({len(tasks) / k:.2f} per device): "
              + ", ".join(f"{n} {c}" for n, c in names.most_common(15)))
        live = sum(1 for s in clock._sleepers if not s[2].done())
        print(f"  sleepers on the clock: {live} ({live / k:.2f} per device)")
        snap = tracemalloc.take_snapshot()
        stats = snap.compare_to(snap0, "filename")
        total = sum(s.size_diff for s in stats)
        print(f"  traced bytes per device: {total / k / 1024:.1f} KiB")
        for s in stats[:25]:
            print(f"    {s.size_diff / k:9.0f} B/dev  {s.count_diff / k:6.2f} blocks/dev  "
                  f"{s.traceback[0].filename.split('site-packages/')[-1]}")
        lines = [s for s in snap.compare_to(snap0, "lineno")
                 if "importlib" not in s.traceback[0].filename]
        print("  by line:")
        for s in lines[:40]:
            frame = s.traceback[0]
            print(f"    {s.size_diff / k:9.0f} B/dev  {s.count_diff / k:6.2f} blocks/dev  "
                  f"{frame.filename.split('/')[-1]}:{frame.lineno}")

    started = time.perf_counter()
    last["t"] = started
    asyncio.run(aiopipe.simulate(config, clock=clock, cost_table=costs, progress=note))
    print(f"total wall {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
