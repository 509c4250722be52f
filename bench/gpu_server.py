"""PiPar's server on a GPU against the same server on this machine's CPU, in virtual
time (issue 27): the devices charged from this machine's table times ``--slowdown``, the
server's passes from either the same table (a server of this CPU) or a GPU's table
measured by `bench/gpu_costs.py` (``--gpu-costs``); everything else alike. "auto" plans
(the planner plans the server with its own table). Reported per server: the epoch's
seconds, each resource's busy seconds (device and links: means over devices), and the
plans chosen.

    .venv/bin/python bench/gpu_server.py --gpu-costs bench/results/.../costs-cuda.json \\
        [--cpu-costs bench/results/.../costs-cpu-this-host.json] [--model vgg5]
        [--devices 100] [--samples 500] [--slowdown 10] [--network 4g] [--epochs 1]
        [--servers cpu,gpu] [--torch-threads 1] [--compute-on cpu] [--out DIR]

Honest about itself: in virtual time every pass is computed here (the weights are
real), and charged from the tables; the GPU's figures are its measured passes at each
batch size, one replica at a time (the server's compute queue runs one pass after
another); the global model and its aggregation stay on the CPU, charged from this
machine's table.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from pathlib import Path
from typing import Any

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.runtime.compute import resolve_torch_device
from aiopipe.runtime.plan import build_model, measure_planning_costs, train_dataset
from aiopipe.runtime.systems.base import planning_batch_sizes


def config_for(args: argparse.Namespace) -> RunConfig:
    """The fleet of the run."""
    return RunConfig(mode="pipar", model=args.model, devices=args.devices,
                     samples_per_device=args.samples, batch_size=100, epochs=args.epochs,
                     split_point="auto", parallel_batches="auto",
                     device_slowdown=args.slowdown, network=args.network, test_samples=0,
                     heartbeat_interval=30.0, device_timeout=600.0,
                     torch_threads=args.torch_threads)


def run(config: RunConfig, devices: CostTable, server: CostTable, compute_on: str
        ) -> dict[str, Any]:
    """One virtual-time run, its passes computed on ``compute_on``; its figures."""
    started = time.perf_counter()
    result = asyncio.run(simulate(config, clock=VirtualClock(), cost_table=devices,
                                  server_cost_table=server, torch_device=compute_on))
    epochs = result.epochs
    plans = collections.Counter(f"P{p['split_point']}N{p['parallel_batches']}"
                                for p in epochs[-1].plan)
    return {"epoch_s": [round(e.time_s, 3) for e in epochs],
            **{f"{what}_busy_s": [round(e.busy_s[what], 3) for e in epochs]
               for what in ("server", "device", "uplink", "downlink")},
            "plans": dict(plans.most_common()), "wall_s": round(time.perf_counter() - started)}


def main() -> None:
    """Measure this machine's table, run both servers, print (and write)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-costs", type=Path, required=True)
    parser.add_argument("--cpu-costs", type=Path,
                        help="the CPU's tables (bench/gpu_costs.py --device cpu) instead of "
                             "measuring this machine's: e.g. to run where memory allows")
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--slowdown", type=float, default=10.0)
    parser.add_argument("--network", default="4g")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--servers", default="cpu,gpu",
                        help="which servers to run, of cpu,gpu (one each for separate "
                             "processes side by side, e.g. where memory allows only one)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="threads that compute the passes here; the virtual time "
                             "charged is the tables', whatever this is")
    parser.add_argument("--compute-on", default="cpu",
                        help="where every node's passes are computed (cpu, cuda): only "
                             "the wall time of the run changes, not the time charged")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    servers = args.servers.split(",")
    if not servers or set(servers) - {"cpu", "gpu"}:
        parser.error(f"--servers: of cpu,gpu, not {args.servers!r}")
    try:
        resolve_torch_device(args.compute_on)
    except ConfigError as exc:
        parser.error(f"--compute-on: {exc}")
    config = config_for(args)
    measured = json.loads(args.gpu_costs.read_text())[args.model]
    gpu = CostTable.from_mapping(measured["table"])
    if args.cpu_costs is not None:
        cpu = CostTable.from_mapping(json.loads(args.cpu_costs.read_text())[args.model]["table"])
    else:
        dataset = train_dataset(config.replace(devices=1))
        model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
        cpu = measure_planning_costs(config, model, dataset.in_shape, dataset,
                                     sizes=planning_batch_sizes(config))
    rows = {}
    for kind, name, server in (("cpu", "CPU server (this machine)", cpu),
                               ("gpu", f"GPU server ({measured['device']})", gpu)):
        if kind in servers:
            rows[name] = run(config, cpu, server, args.compute_on)
            print(f"{name}: {rows[name]}", flush=True)
    title = (f"{args.model}, {args.devices} devices x {args.samples} samples, B = 100, "
             f"devices {args.slowdown:g}x this machine's CPU, {args.network}, pipar auto")
    lines = [title, "", "| server | epoch s | busy s: server | device | uplink | downlink "
             "(means over devices) | plans |", "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        busy = " | ".join(f"{row[f'{what}_busy_s'][-1]:.2f}"
                          for what in ("server", "device", "uplink", "downlink"))
        lines.append(f"| {name} | {row['epoch_s'][-1]:.2f} | {busy} | "
                     f"{', '.join(f'{k} ×{v}' for k, v in row['plans'].items())} |")
    if len(rows) == 2:
        (cpu_row, gpu_row) = rows.values()
        lines.append("")
        lines.append(f"CPU server ÷ GPU server, epoch time: "
                     f"{cpu_row['epoch_s'][-1] / gpu_row['epoch_s'][-1]:.2f}×")
    print("\n".join(lines))
    if args.out is not None:
        which = "" if len(rows) == 2 else f"-{servers[0]}"
        write_table(args.out, f"gpu-server-{args.model}-k{args.devices}-{args.network}{which}",
                    lines, rows)


def write_table(out: Path, stem: str, lines: list[str], rows: Any) -> None:
    """``out/stem.md`` (the table's ``lines``) and ``out/stem.json`` (the raw ``rows``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
