"""What the server's lanes buy (issue 27, item 2): the same PiPar run with
``server_lanes`` 1, 2, ... side by side, in virtual time (charged from a committed cost
table: the lanes as the planner models them) and on the real clock in this process (the
server's lanes are real threads; the devices are emulated here too, their compute a
``--slowdown`` x their CPU time, most of it a wait).

    .venv/bin/python bench/server_lanes.py [--model mobilenetv3-small] [--devices 8]
        [--samples 500] [--slowdown 124] [--network 4g] [--plan 2,2 | --plan auto]
        [--lanes 1,2] [--clocks virtual,real] [--epochs 2] [--out DIR]

Per run: the last epoch's seconds, the server's busy seconds (the union of its lanes'
slices) and the plan. On this 2-core host the real clock's server has at most 2 cores
(less what the emulated devices and the event loop take): 2 lanes can at best halve a
server-bound epoch's server part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from gpu_server import write_table  # bench/ is not a package: run from the repository

from aiopipe import CostTable, RunConfig, SystemClock, VirtualClock, simulate

COSTS = (Path(__file__).resolve().parent / "results" / "2026-11-26-s18-gpu-costs"
         / "costs-cpu-this-host.json")


def run(config: RunConfig, clock: str, table: CostTable) -> dict[str, Any]:
    """One run; its last epoch's figures."""
    started = time.perf_counter()
    if clock == "virtual":
        result = asyncio.run(simulate(config, clock=VirtualClock(), cost_table=table,
                                      progress=lambda metrics: None))
    else:
        result = asyncio.run(simulate(config, clock=SystemClock(),
                                      progress=lambda metrics: None))
    epoch = result.epochs[-1]
    plans = sorted({(p["split_point"], p["parallel_batches"]) for p in epoch.plan or []})
    return {"clock": clock, "lanes": config.options.server_lanes, "epoch_s": round(epoch.time_s, 3),
            "server_busy_s": round(epoch.busy_s["server"], 3),
            "device_busy_s": round(epoch.busy_s["device"], 3),
            "plans": [f"P{p}N{n}" for p, n in plans],
            "wall_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    """Run every (clock, lanes); print and write the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="mobilenetv3-small")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--slowdown", type=float, default=124.0)
    parser.add_argument("--network", default="4g")
    parser.add_argument("--plan", default="2,2", help='"P,N" or "auto"')
    parser.add_argument("--lanes", default="1,2")
    parser.add_argument("--clocks", default="virtual,real")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--costs", type=Path, default=COSTS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.plan == "auto":
        split: int | str = "auto"
        parallel: int | str = "auto"
    else:
        split, parallel = (int(v) for v in args.plan.split(","))
    base = RunConfig(mode="pipar", model=args.model, devices=args.devices,
                     samples_per_device=args.samples, batch_size=100, epochs=args.epochs,
                     split_point=split, parallel_batches=parallel,
                     device_slowdown=args.slowdown, network=args.network, test_samples=0,
                     heartbeat_interval=30.0, device_timeout=600.0)
    table = CostTable.from_mapping(json.loads(args.costs.read_text())[args.model]["table"])
    rows = []
    for clock in args.clocks.split(","):
        for lanes in (int(v) for v in args.lanes.split(",")):
            row = run(base.replace(options={"server_lanes": lanes}), clock, table)
            rows.append(row)
            print(row, flush=True)
    lines = [f"{args.model}, {args.devices} devices x {args.samples} samples, B = 100, "
             f"slowdown {args.slowdown:g}, {args.network}, plan {args.plan}; "
             f"{os.cpu_count()} CPUs, load before {os.getloadavg()[0]:.2f}", "",
             "| clock | server lanes | epoch s | server busy s | plan | epoch ÷ 1 lane's |",
             "|---|---|---:|---:|---|---:|"]
    for row in rows:
        first = next(r for r in rows if r["clock"] == row["clock"])
        lines.append(f"| {row['clock']} | {row['lanes']} | {row['epoch_s']:.2f} | "
                     f"{row['server_busy_s']:.2f} | {', '.join(row['plans'])} | "
                     f"{row['epoch_s'] / first['epoch_s']:.2f} |")
    print("\n".join(lines))
    if args.out is not None:
        plan = args.plan.replace(",", "n")
        write_table(args.out, f"lanes-{args.model}-k{args.devices}-{args.network}-{plan}"
                    f"-s{args.slowdown:g}",
                    lines, rows)


if __name__ == "__main__":
    main()
