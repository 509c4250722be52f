"""Asteroid's HPP planner (aiopipe/scheduler/asteroid.py): how good its plans are and
how long it takes.

``--planner`` (the default):

- **Quality**: random small cases (1–5 devices with slowdowns 1–8x, memory budgets of
  8–64 MiB and links of 20–100 Mbit/s; 2–8 units with random compute, activations and
  weights, compute linear or sub-linear in the batch size), the dynamic program's plan
  against the best of every plan of the same shape (`exhaustive_plan`), both scored by
  the same estimate: the share of cases where it is the best, and the worst ratio. Run
  with the paper's one sub-pipeline per state (``keep = 1``) and with the default.
- **Planning time**: resnet101 (35 units) on 8 devices, its compute measured on this
  machine at a few batch sizes, its outputs and state from the model (the profile every
  planner shares, `aiopipe.runtime.plan.model_profile`).

The estimates are the planner's model (Eqs. 3–11 of the paper), not measured rounds.

    .venv/bin/python bench/asteroid.py [--cases 1000] [--seed 25]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "scheduler"))

from test_scheduler_asteroid import _random_case  # noqa: E402

from aiopipe import models  # noqa: E402
from aiopipe.runtime.plan import model_profile  # noqa: E402
from aiopipe.scheduler.asteroid import (  # noqa: E402
    KEEP,
    Device,
    HppModel,
    exhaustive_plan,
    plan,
)
from aiopipe.scheduler.costs import measure_costs  # noqa: E402

MIB = 2.0**20


def quality(cases: int, seed: int) -> None:
    """The dynamic program against every plan of its shape (module docstring)."""
    rng = random.Random(seed)
    drawn = []
    while len(drawn) < cases:
        model, fleet, m, b = _random_case(rng)
        best = exhaustive_plan(model, fleet, m, b)
        if best is not None:
            drawn.append((model, fleet, m, b, best.round_s))
    for keep in sorted({1, KEEP}):
        ratios = [best / plan(model, fleet, m, b, keep=keep).round_s
                  for model, fleet, m, b, best in drawn]
        optimal = sum(r >= 1 - 1e-9 for r in ratios)
        print(f"  keep {keep}: best of its shape in {optimal}/{cases} cases "
              f"({optimal / cases:.1%}); worst ratio {min(ratios):.3f}")


def planning_time(model_name: str, batch: int, micro_batches: int) -> None:
    """The planner on ``model_name`` over 8 devices (module docstring)."""
    model = models.build(model_name, num_classes=10, in_shape=(3, 32, 32))
    units = models.unit_count(model)
    started = time.perf_counter()
    costs = measure_costs(model, (3, 32, 32), [1, 4, batch], repeats=2, warmup=1)
    measured = time.perf_counter() - started
    profile = HppModel.of(model_profile(model, (3, 32, 32), costs))  # SGD with momentum
    fleet = [Device(s, m * MIB, 6.25e6) for s, m in
             zip([1, 2, 4, 4, 8, 1, 2, 2], [1024, 512, 512, 256, 256, 1024, 512, 256],
                 strict=True)]
    for keep in sorted({1, KEEP}):
        started = time.perf_counter()
        chosen = plan(profile, fleet, micro_batches, batch, keep=keep)
        seconds = time.perf_counter() - started
        stages = [(s.first, s.stop, s.devices) for s in chosen.stages]
        print(f"  {model_name} ({units} units) on 8 devices, keep {keep}: planned in "
              f"{seconds:.2f} s; {len(stages)} stages {stages}; estimated round "
              f"{chosen.round_s:.2f} s")
    print(f"  (measuring its compute at batch sizes 1, 4, {batch} took {measured:.0f} s)")


def main() -> None:
    """Run and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--model", default="resnet101")
    parser.add_argument("--batch", type=int, default=32, help="micro-batch size")
    parser.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args()
    print(f"Asteroid planner; load average {os.getloadavg()[0]:.2f}")
    print(f"quality over {args.cases} random small cases (seed {args.seed}):")
    quality(args.cases, args.seed)
    print("planning time:")
    planning_time(args.model, args.batch, args.micro_batches)


if __name__ == "__main__":
    main()
