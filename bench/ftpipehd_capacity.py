"""FTPipeHD's re-partitioning after a capacity change, between real processes (paper
§IV-D, Fig. 6).

``python -m aiopipe.server`` and four device processes train FTPipeHD's asynchronous
pipeline over real websockets, device to device, on this machine, every device declared
alike. Device 3 runs as ``python -m bench.slow_device``: from batch ``--at`` on, its
compute is ``--factor`` times slower (the runtime's own emulation: it waits on the clock
for ``factor - 1`` times each compute item). Two fresh runs, side by side:

- ``homogeneous cuts kept``: the cuts the planner gives for equal capacities, fixed
  (PipeDream's partition, no re-partitioning);
- ``FTPipeHD re-partitioning``: ``partition = "auto"``: the same cuts at first, then
  re-planned after the first ``first_repartition_after`` batches and at every global
  replication (every ``--every`` batches) from what each round measured.

It prints each run's epoch time and re-partitions, and the pipeline's throughput
(device 0's backward passes per second, from ``trace.json``) over windows of
``--every`` batches; ``--out`` draws them (like the paper's Fig. 6).

What it does not show: the four processes share 2 cores and loopback links (paced to
``--network`` at each sender; "lan": not paced), so a stage's compute is not a device's,
and the slowdown is a wait, not a slower CPU. On paced Wi-Fi links vgg5's pipeline is
bound by its activations on the links, not by device 3's compute, so a 10x slowdown of
device 3 barely shows there: the default is unshaped links, where compute bounds.

    .venv/bin/python bench/ftpipehd_capacity.py [--samples 12000] [--at 200]
        [--factor 10] [--every 50] [--network lan] [--out bench/results/DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from ftpipehd import _plot  # noqa: E402
from real_processes import ProcessFleet  # noqa: E402

from aiopipe import RunConfig  # noqa: E402
from aiopipe.api import _measure  # noqa: E402
from aiopipe.runtime.plan import build_model  # noqa: E402
from aiopipe.runtime.systems.ftpipehd.coordinator import Planner  # noqa: E402


def run_config(args: argparse.Namespace, partition: Any) -> dict[str, Any]:
    """The run (keys of the server's config file)."""
    return {"mode": "ftpipehd", "devices": 4, "model": args.model,
            "samples_per_device": args.samples, "batch_size": args.batch_size, "epochs": 1,
            "momentum": 0.5, "learning_rate": 0.02, "global_replication_every": args.every,
            "partition": partition, "network": args.network, "test_samples": 200,
            "heartbeat_interval": 0.5, "device_timeout": 30.0}


async def run(args: argparse.Namespace, partition: Any
              ) -> tuple[list[tuple[float, float]], list[Any], float]:
    """One fresh run: throughput per window, the re-partitions, the epoch's time."""
    with tempfile.TemporaryDirectory() as tmp:
        async with ProcessFleet(Path(tmp), run_config(args, partition)) as fleet:
            server = await fleet.start_server()
            devices = [await fleet.start_device(k, "--listen", "127.0.0.1:0")
                       for k in range(3)]
            devices.append(await fleet.start("device3", [
                "bench.slow_device", "--from-batch", str(args.at), "--factor",
                str(args.factor), "--", "--server", fleet.url, "--device-id", "3",
                "--listen", "127.0.0.1:0"]))
            await fleet.finish(server, devices, within=1800)
            (epoch,) = fleet.metrics()
            trace = json.loads((fleet.out_dir / "trace.json").read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("name") == "thread_name"}
    ends = sorted((e["ts"] + e["dur"]) / 1e6 for e in trace["traceEvents"]
                  if e.get("ph") == "X" and names[e["tid"]] == "device0/compute"
                  and e["cat"] == "b")
    every = args.every
    curve = [(ends[i + every - 1], every / (ends[i + every - 1] - ends[i]))
             for i in range(0, len(ends) - every + 1, every // 2)]
    changes = [(c["round"], c.get("after_batches"), c["before"], c["after"])
               for c in epoch["changes"]]  # type: ignore[union-attr]
    return curve, changes, float(epoch["time_s"])  # type: ignore[arg-type]


async def main() -> None:
    """Both runs; print (and draw) what they did."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--samples", type=int, default=12000)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--at", type=int, default=200)
    parser.add_argument("--factor", type=float, default=10.0)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--network", default="lan",
                        help="the links' preset (lan: unshaped loopback)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    base = RunConfig(mode="ftpipehd", model=args.model, devices=4, network=args.network,
                     samples_per_device=args.samples, batch_size=args.batch_size)
    planner = Planner.of(base, _measure(base, None), build_model(
        base, num_classes=10, in_shape=(3, 32, 32)), (3, 32, 32), args.batch_size)
    homogeneous = list(planner.cuts([1.0] * 4, range(4)).cuts)
    load, started = os.getloadavg()[0], time.monotonic()
    runs = {"homogeneous cuts kept": await run(args, homogeneous),
            "FTPipeHD re-partitioning": await run(args, "auto")}
    print(f"{args.model}: 4 device processes, device 3 {args.factor:g}x slower from batch "
          f"{args.at}; {args.samples // args.batch_size} batches, global replication every "
          f"{args.every}, links paced to {args.network}; load before {load:.2f}, after "
          f"{os.getloadavg()[0]:.2f}; {time.monotonic() - started:.0f} s wall")
    reference = runs["homogeneous cuts kept"][2]
    for name, (curve, changes, seconds) in runs.items():
        rates = ", ".join(f"{r:.0f}" for _, r in curve)
        print(f"  {name:<26} epoch {seconds:7.2f} s (x{reference / seconds:.2f}); "
              f"re-partitions (round, after batches, before, after) {changes}\n"
              f"    batches/s per {args.every}-batch window: {rates}")
    if args.out is not None:
        first = min(c[0][0][0] for c in runs.values() if c[0])
        _plot({name: [(t - first, r) for t, r in c[0]] for name, c in runs.items()},
              f"batches / s (over {args.every} batches)",
              f"{args.model}, 4 processes: device 3 {args.factor:g}x slower from batch "
              f"{args.at}", args.out / f"capacity-change-processes-{args.model}.png",
              xlabel="seconds (wall clock)")


if __name__ == "__main__":
    asyncio.run(main())
