"""Plan selection speed and quality for 10 / 100 devices x 5 / 35 units, batch 100.

Times `select_plans` (median of ``--repeat`` runs) on a seeded heterogeneous fleet
(slowdown 1-8, the 4g / 4g+ / wifi presets with 0-20 ms latency, 500-2000 samples) and a
synthetic model whose activations shrink and weights grow along the units. Side by side
in one run: the estimated epoch of the selected plans, of every device's alone-best plan
(step 1 of the search), of the SFL-like plan P = 1, N = 1 for all, and of the search
with a 10x larger work budget (how much the budget leaves on the table), plus the time
of one fleet `estimate_iteration`.

Run: ``.venv/bin/python bench/planner.py [--repeat N]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import torch

from aiopipe.scheduler import (
    CostTable,
    DeviceProfile,
    ModelProfile,
    estimate_epoch,
    estimate_iteration,
    select_plans,
)
from aiopipe.scheduler import select as select_module
from aiopipe.transport.network import NETWORK_PRESETS, LinkSpec

BATCH = 100
T = TypeVar("T")


def model_profile(units: int, rng: random.Random) -> ModelProfile:
    forward = {u: {BATCH: rng.uniform(0.002, 0.02)} for u in range(units)}
    backward = {u: {BATCH: 2 * forward[u][BATCH]} for u in range(units)}
    step = {u: rng.uniform(0.0, 0.002) for u in range(units)}
    activation = tuple(int(4 * 64 * 32 * 32 / 2 ** (4 * u / units)) for u in range(units))
    state = tuple(int(4 * 2_000 * 2 ** (8 * u / units)) for u in range(units))
    return ModelProfile(CostTable(forward, backward, step), activation, state, frame_overhead=112)


def fleet(devices: int, rng: random.Random) -> list[DeviceProfile]:
    out = []
    for _ in range(devices):
        net = NETWORK_PRESETS[rng.choice(["4g", "4g+", "wifi"])]
        latency = rng.choice([0.0, 0.005, 0.02])
        out.append(
            DeviceProfile(
                rng.uniform(1.0, 8.0),
                LinkSpec(net.up.bandwidth_bps, latency),
                LinkSpec(net.down.bandwidth_bps, latency),
                rng.choice([500, 1000, 2000]),
            )
        )
    return out


def timed(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    print(
        f"{'devices':>7} {'units':>5} {'select s':>9} {'1 estimate ms':>13} "
        f"{'epoch s':>9} {'alone/sel':>9} {'sfl/sel':>8} {'10x budget/sel':>14} "
        f"{'10x budget s':>12}"
    )
    for devices in (10, 100):
        for units in (5, 35):
            rng = random.Random(devices * 1000 + units)
            model, fleet_ = model_profile(units, rng), fleet(devices, rng)
            seconds, plans = timed(partial(select_plans, model, fleet_, BATCH), args.repeat)
            one, _ = timed(partial(estimate_iteration, model, fleet_, plans, BATCH), args.repeat)
            epoch = estimate_epoch(model, fleet_, plans, BATCH)
            alone = [select_plans(model, [d], BATCH)[0] for d in fleet_]
            sfl = [(1, 1)] * devices
            budget = select_module.WORK_BUDGET
            select_module.WORK_BUDGET = 10 * budget
            try:
                big_s, big = timed(partial(select_plans, model, fleet_, BATCH), 1)
            finally:
                select_module.WORK_BUDGET = budget
            print(
                f"{devices:>7} {units:>5} {seconds:>9.3f} {one * 1e3:>13.2f} {epoch:>9.1f} "
                f"{estimate_epoch(model, fleet_, alone, BATCH) / epoch:>9.3f} "
                f"{estimate_epoch(model, fleet_, sfl, BATCH) / epoch:>8.3f} "
                f"{estimate_epoch(model, fleet_, big, BATCH) / epoch:>14.3f} {big_s:>12.3f}"
            )


if __name__ == "__main__":
    main()
