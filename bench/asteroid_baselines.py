"""Asteroid against the baselines its paper compares with (§5.2-5.3), on the paper's
fleet shapes, in virtual time.

Each fleet is one of the paper's edge environments (Table 6: A 5 Nano; B 3 NX, 2 TX2;
C 1 NX, 2 TX2, 3 Nano; D 1 TX2, 3 Nano), declared fastest first. A device's compute is
this host's cost table times its slowdown: NX 1, TX2 1.3, Nano 3.6 (CUDA cores times
clock: 384 x 1.1 GHz, 256 x 1.3 GHz, 128 x 0.92 GHz), times ``--scale``. Its memory
budget binds: a Nano holds the whole model's weights, gradients and momentum and the
activations of half a micro-batch (one in flight, Eq. 3); a TX2 or an NX twice that
(the paper's 4 GB and 8 GB); ``--unlimited``: no budgets. Every link runs at ``--mbps``
both ways, 2 ms (the paper's 100 and 1000 Mbit/s). Batches of 64 in 4 micro-batches
(the paper's 2048 would take this host too long), one epoch of ``--samples`` a device.

The runs, all on the same runtime but pure pipeline parallelism (each its own plan):

- **asteroid**: Asteroid's planner (``[asteroid] planner = "asteroid"``);
- **equal-groups**: the hybrid baseline (Dapple / PipeDream-like HPP,
  `aiopipe.scheduler.hpp_baseline`): equal groups in the declared order, equal rows,
  cuts by compute, memory ignored, the best of its plans that fits the budgets run
  (its first choice, and whether it would overflow a budget, is reported too);
- **equal-groups-by-speed**: the same with rows and cuts by each device's speed;
- **data parallel**: one stage on every device, rows by Algorithm 1 (the paper's DP
  "with heterogeneous workload balancing");
- **pipeline parallel**: ``mode = "pipeline"``, one device a stage, cut by compute and
  slowdowns, 1F1B (the paper's PP); its memory is not planned (Eq. 3 is reported).

Throughput: samples per second of virtual time in steady training, a batch over the
time one more batch adds (an epoch of all and one of half the samples: what a round
costs once, its weights sent down and its stages up, left out; epochs differ in
batches, as the first stage's members hold the data). Each device's memory by Eq. 3
against its budget. One cost table is measured at the start and charged to every run.

    .venv/bin/python bench/asteroid_baselines.py [--fleet B --fleet C] [--mbps 100]
        [--model mobilenetv3-small] [--scale 10] [--samples 640] [--unlimited] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.runtime.plan import build_model, measure_planning_costs, model_profile, train_dataset
from aiopipe.runtime.systems.asteroid.replay import declared_device
from aiopipe.scheduler.asteroid import HppModel
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.hpp_baseline import equal_groups_plans, over_budget

MIB = 2.0**20
#: the paper's Table 6, each fleet fastest first
FLEETS = {"A": ("nano",) * 5, "B": ("nx",) * 3 + ("tx2",) * 2,
          "C": ("nx", "tx2", "tx2", "nano", "nano", "nano"), "D": ("tx2", "nano", "nano", "nano")}
SLOWDOWN = {"nx": 1.0, "tx2": 1.3, "nano": 3.6}
#: each kind's budget in Nano budgets (8, 8 and 4 GB)
MEMORY = {"nx": 2.0, "tx2": 2.0, "nano": 1.0}
BATCH, MICRO_BATCHES = 64, 4
RUNS: dict[str, dict[str, Any]] = {
    "asteroid": {},
    "equal-groups": {"options": {"planner": "equal-groups"}},
    "equal-groups-by-speed": {"options": {"planner": "equal-groups-by-speed"}},
    "data parallel": {},  # one stage on every device: `run_config`
    "pipeline parallel": {"mode": "pipeline", "device_memory_mb": 0.0},
}


def fleet_config(fleet: str, model: str, scale: float, mbps: float, samples: int,
                 budgets: tuple[float, ...] | None) -> RunConfig:
    """The run of Asteroid's own planner on ``fleet`` (module docstring)."""
    kinds = FLEETS[fleet]
    return RunConfig(mode="asteroid", model=model, devices=len(kinds),
                     samples_per_device=samples, batch_size=BATCH,
                     parallel_batches=MICRO_BATCHES, epochs=1,
                     device_slowdown=tuple(scale * SLOWDOWN[k] for k in kinds),
                     device_memory_mb=budgets or 0.0,
                     network={"up_mbps": mbps, "down_mbps": mbps, "latency_ms": 2},
                     test_samples=0, seed=1, learning_rate=0.02)


def budgets_of(fleet: str, hpp: HppModel) -> tuple[float, ...]:
    """Each device's budget, MiB: a Nano's the whole model on half a micro-batch (Eq. 3,
    one in flight), a TX2's or NX's twice that."""
    nano = hpp.memory(0, hpp.units, BATCH // MICRO_BATCHES // 2, 1) / MIB
    return tuple(round(MEMORY[k] * nano, 2) for k in FLEETS[fleet])


def run_config(base: RunConfig, name: str) -> RunConfig:
    """``base`` changed for run ``name`` (`RUNS`)."""
    changes = dict(RUNS[name])
    if name == "data parallel":
        changes["options"] = {"partition": [], "stage_groups": [list(range(base.devices))]}
    return base.replace(**changes)


def memory_rows(hpp: HppModel, stages: list[dict[str, Any]],
                budgets: tuple[float, ...] | None) -> dict[int, tuple[float, float]]:
    """Per device of a run: Eq. 3 for its units and rows with 1F1B's micro-batches in
    flight, and its budget (MiB; 0: none)."""
    count = 1 + max(int(s["stage"]) for s in stages)
    out = {}
    for s in stages:
        rows = s.get("rows", [0, BATCH // MICRO_BATCHES])
        in_flight = min(2 * (count - int(s["stage"])) - 1, MICRO_BATCHES)
        need = hpp.memory(s["units"][0], s["units"][1], rows[1] - rows[0], in_flight) / MIB
        out[int(s["device"])] = (need, budgets[int(s["device"])] if budgets else 0.0)
    return out


async def one_run(config: RunConfig, costs: CostTable) -> dict[str, Any]:
    """One epoch in virtual time, and one of half the samples: samples, seconds, the
    seconds one more batch adds (the difference: what a round costs once, the weights
    sent down and the stages up, left out) and the samples/s that gives, the plan, the
    stages; or why the runtime refused the plan."""
    try:
        result = await simulate(config, clock=VirtualClock(), cost_table=costs)
        half = await simulate(config.replace(samples_per_device=config.device_samples_of(0)
                                             // 2), clock=VirtualClock(), cost_table=costs)
    except ConfigError as exc:
        return {"refused": str(exc)}
    epoch = result.final
    iteration_s = ((epoch.time_s - half.final.time_s)
                   / ((epoch.samples - half.final.samples) / BATCH))
    return {"samples": epoch.samples, "time_s": epoch.time_s, "iteration_s": iteration_s,
            "samples_per_s": BATCH / iteration_s, "plan": epoch.plan, "stages": epoch.stages}


def plan_text(row: dict[str, Any]) -> str:
    """A run's stages as ``units@devices`` (with each member's rows where split)."""
    if "refused" in row:
        return "refused"
    parts = []
    for p in sorted({int(s["stage"]) for s in row["stages"]}):
        members = [s for s in row["stages"] if int(s["stage"]) == p]
        first, stop = members[0]["units"]
        who = ",".join(f"{s['device']}" + (f"({s['rows'][1] - s['rows'][0]})"
                                          if len(members) > 1 else "") for s in members)
        parts.append(f"{first}-{stop - 1}@{who}")
    return "; ".join(parts)


def measured(model_name: str) -> tuple[CostTable, HppModel]:
    """The cost table every run is charged (measured here, once) and the model as
    Asteroid's planners see it."""
    config = fleet_config("A", model_name, 1.0, 100.0, BATCH, None)
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    costs = measure_planning_costs(config, model, dataset.in_shape, None,
                                   sizes=[1, 2, 4, 8, 16, 32, 64])
    return costs, HppModel.of(model_profile(model, dataset.in_shape, costs))


def bench_fleet(fleet: str, model_name: str, scale: float, mbps: float, samples: int,
                unlimited: bool, costs: CostTable, hpp: HppModel) -> dict[str, Any]:
    """Every run of `RUNS` on one fleet; the baseline's first choice (module docstring)."""
    budgets = None if unlimited else budgets_of(fleet, hpp)
    config = fleet_config(fleet, model_name, scale, mbps, samples, budgets)
    rows: dict[str, dict[str, Any]] = {}
    for name in RUNS:
        started = time.perf_counter()
        rows[name] = asyncio.run(one_run(run_config(config, name), costs))
        rows[name]["wall_s"] = time.perf_counter() - started
        if "stages" in rows[name]:
            rows[name]["memory"] = memory_rows(hpp, rows[name]["stages"], budgets)
    devices = [declared_device(config, k) for k in range(config.devices)]
    first = equal_groups_plans(hpp, devices, MICRO_BATCHES, BATCH // MICRO_BATCHES)[0]
    over = over_budget(hpp, devices, first.stages, MICRO_BATCHES)
    first_choice = {"stages": [[s.first, s.stop, list(s.devices), list(s.samples)]
                               for s in first.stages],
                    "estimate_s": first.round_s,
                    "over_budget": {d: [need / MIB, devices[d].memory / MIB]
                                    for d, need in over.items()}}
    return {"fleet": fleet, "kinds": FLEETS[fleet], "model": model_name, "mbps": mbps,
            "scale": scale, "budgets_mb": budgets, "runs": rows,
            "equal_groups_first_choice": first_choice}


def report(result: dict[str, Any]) -> list[str]:
    """One fleet's table (markdown lines)."""
    runs = result["runs"]
    ours = runs["asteroid"]["samples_per_s"]
    budgets = result["budgets_mb"]
    lines = [f"### Fleet {result['fleet']} ({', '.join(result['kinds'])}), "
             f"{result['mbps']:g} Mbit/s, {result['model']}, slowdowns x{result['scale']:g}",
             "", f"Budgets (MiB): {list(budgets) if budgets else 'none'}", "",
             "| run | plan (units@devices(rows)) | epoch samples | epoch s | s per batch | "
             "samples/s | Asteroid ÷ it | Eq. 3 ÷ budget, worst member |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in runs.items():
        if "refused" in row:
            lines.append(f"| {name} | refused: {row['refused'][:90]} | | | | | | |")
            continue
        worst = _worst(row)
        flag = " (over: OOM)" if worst > 1 else ""
        lines.append(f"| {name} | {plan_text(row)} | {row['samples']} | {row['time_s']:.2f} "
                     f"| {row['iteration_s']:.3f} | {row['samples_per_s']:.1f} | "
                     f"{ours / row['samples_per_s']:.2f} | {worst:.2f}{flag} |")
    first = result["equal_groups_first_choice"]
    shape = "; ".join(f"{a}-{b - 1}@{','.join(map(str, d))}" for a, b, d, _ in first["stages"])
    over = "; ".join(f"device {d}: {need:.1f} MiB > {budget:.1f}"
                     for d, (need, budget) in first["over_budget"].items())
    lines += ["", f"equal-groups' first choice: {shape} (estimated round "
              f"{first['estimate_s'] * 1e3:.0f} ms); "
              + (f"over budget ({over}): the paper's OOM, so its next plan that fits ran"
                 if over else "fits its budgets (it is what ran)"), ""]
    return lines


def _worst(row: dict[str, Any]) -> float:
    """A run's largest Eq. 3 ÷ budget over its members (0: no budgets)."""
    return max((need / budget for need, budget in row["memory"].values() if budget),
               default=0.0)


def summary(results: list[dict[str, Any]]) -> list[str]:
    """Asteroid's samples/s over every other run's, one line per fleet (†: the run's plan
    overflows a member's budget by Eq. 3: on a real device, out of memory)."""
    names = [n for n in RUNS if n != "asteroid"]
    lines = ["| fleet | Mbit/s | Asteroid samples/s | " + " | ".join(f"÷ {n}" for n in names)
             + " |", "|---|---|---|" + "---|" * len(names)]
    for result in results:
        runs = result["runs"]
        ours = runs["asteroid"]["samples_per_s"]
        cells = [f"{ours / runs[n]['samples_per_s']:.2f}" + ("†" if _worst(runs[n]) > 1 else "")
                 if "samples_per_s" in runs[n] else "refused" for n in names]
        lines.append(f"| {result['fleet']} | {result['mbps']:g} | {ours:.1f} | "
                     + " | ".join(cells) + " |")
    return lines


def main() -> None:
    """Run and print (and write, with ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", action="append", choices=list(FLEETS))
    parser.add_argument("--mbps", type=float, action="append")
    parser.add_argument("--model", default="mobilenetv3-small")
    parser.add_argument("--scale", type=float, default=10.0)
    parser.add_argument("--samples", type=int, default=640, help="samples per device")
    parser.add_argument("--unlimited", action="store_true", help="no memory budgets")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    print(f"Asteroid vs baselines, virtual time; load average {os.getloadavg()[0]:.2f}",
          flush=True)
    started = time.perf_counter()
    costs, hpp = measured(args.model)
    print(f"cost table of {args.model} measured in {time.perf_counter() - started:.0f} s",
          flush=True)
    results = []
    for fleet in args.fleet or ["B", "C", "D"]:
        for mbps in args.mbps or [100.0, 1000.0]:
            result = bench_fleet(fleet, args.model, args.scale, mbps, args.samples,
                                 args.unlimited, costs, hpp)
            results.append(result)
            print("\n".join(report(result)), flush=True)
    lines = summary(results)
    print("\n".join(lines))
    print(f"load average {os.getloadavg()[0]:.2f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = (f"{args.model}-x{args.scale:g}-{''.join(args.fleet or 'BCD')}-"
                f"{'-'.join(f'{m:g}' for m in args.mbps or [100, 1000])}mbps"
                + ("-unlimited" if args.unlimited else ""))
        text = [line for result in results for line in report(result)] + lines
        (args.out / f"{stem}.md").write_text("\n".join(text) + "\n")
        (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
