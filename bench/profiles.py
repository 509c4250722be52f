"""Plans from the devices' own profiles against the server-scaled assumption, side by side.

A half-slow fleet between real processes: ``python -m aiopipe.server`` and four
``python -m aiopipe.device`` processes on this machine, devices 2 and 3 really slower:
each runs in a cgroup (v1 ``cpu``) capped at ``--quota`` of one core (default 25%, so
about 4x slower when it has work), which no declared factor tells the server. Each
round runs the same "auto" run twice, alternating which goes first:

- ``profiles``: the default; each device times its own units where it runs and the
  server times each device's link (aiopipe.runtime.profiling), and plans from that;
- ``server-scaled``: ``profile_devices = false``: the server's own table times each
  device's ``device_slowdown`` (1: nothing declared), what aiopipe planned with before.

Per run: the plan each device got, the epoch time (mean over epochs 2..), and, for the
profiled run, what each device measured of itself (from the server's ``/status``). The
workload is the one where mixed plans lost before (bench/results/2026-11-24-s11-*):
mobilenetv3-small, wifi, B = 50, 200 samples per device.

What it shows and does not: a capped process is slow in bursts (the scheduler runs it
for its quota, then stops it until the next period), not like a slower CPU, and the five
processes share two cores, so the uncapped devices are not as fast as the server's
profile either. It shows whether planning from what devices measure of themselves finds
the slow ones, and what that is worth in epoch time here; not a speedup on real devices.
Needs root (cgroups); the caps are removed at the end.

    .venv/bin/python bench/profiles.py [--repeats 2] [--quota 0.25] [--model ...]
        [--network wifi] [--epochs 3] [--out bench/results/DATE-profiles]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from real_processes import ProcessFleet  # noqa: E402

CGROUP = Path("/sys/fs/cgroup/cpu/aiopipe-bench-slow")
PERIOD_US = 100_000
SLOW = (2, 3)
DEVICES = 4


def run_keys(args: argparse.Namespace, profiled: bool) -> dict[str, Any]:
    """The server's config file of one run."""
    return {"mode": "pipar", "model": args.model, "devices": DEVICES,
            "samples_per_device": args.samples, "batch_size": args.batch_size,
            "split_point": "auto", "parallel_batches": "auto", "network": args.network,
            "epochs": args.epochs, "test_samples": 200, "profile_devices": profiled,
            "seed": 0}


def set_quota(share: float | None) -> None:
    """Cap the cgroup at ``share`` of one core (None: no cap)."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    quota = -1 if share is None else int(share * PERIOD_US)
    (CGROUP / "cpu.cfs_quota_us").write_text(str(quota))


def cap(pid: int) -> None:
    """Move process ``pid`` (all its threads) into the capped cgroup."""
    (CGROUP / "cgroup.procs").write_text(str(pid))


async def status(url: str) -> dict[str, Any]:
    """The server's ``/status``."""
    http = url.replace("ws://", "http://").replace("/ws", "/status")

    def get() -> dict[str, Any]:
        with urllib.request.urlopen(http, timeout=10) as response:
            return dict(json.loads(response.read()))

    return await asyncio.to_thread(get)


async def one_run(args: argparse.Namespace, profiled: bool, directory: Path
                  ) -> dict[str, Any]:
    """One run; its plan, epoch times and (profiled) the devices' own figures."""
    label = "profiles" if profiled else "server-scaled"
    os.makedirs(directory)
    async with ProcessFleet(directory, run_keys(args, profiled)) as fleet:
        server = await fleet.start_server("--join-timeout", "300")
        for k in range(DEVICES):
            device = await fleet.start_device(k)
            if k in SLOW:
                cap(device.process.pid)
        await server.output.wait_for(r"^\s+1\s", within=900)  # the first epoch's row
        seen = await status(fleet.url)
        if await server.wait(1800) != 0:
            raise SystemExit(f"{label} failed:\n{fleet.all_output()}")
        epochs = fleet.metrics()
    times = [e["time_s"] for e in epochs[1:]] or [epochs[0]["time_s"]]
    plan = [(p["split_point"], p["parallel_batches"]) for p in epochs[-1]["plan"]]
    return {"label": label, "plan": plan, "epoch_s": statistics.mean(times),
            "epochs_s": [e["time_s"] for e in epochs], "profiles": seen.get("profiles", {}),
            "accuracy": epochs[-1]["accuracy"], "load": os.getloadavg()[0]}


async def main_async(args: argparse.Namespace) -> None:
    """Every round: both runs, in alternating order; then the table."""
    command = " ".join([".venv/bin/python bench/profiles.py", *sys.argv[1:]])
    lines = ["# Plans from devices' own profiles vs the server-scaled assumption",
             "", f"Command: `{command}`", f"Load average before: {os.getloadavg()[0]:.2f}",
             f"Devices {list(SLOW)} capped at {args.quota:.0%} of one core (cgroup v1 cpu); "
             f"{args.model}, network {args.network}, {DEVICES} devices x {args.samples} "
             f"samples, B = {args.batch_size}, {args.epochs} epochs; epoch time = mean of "
             "epochs 2..", ""]
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for repeat in range(args.repeats):
            order = (True, False) if repeat % 2 == 0 else (False, True)
            for profiled in order:
                run = await one_run(args, profiled, args.out / f"run{repeat}-"
                                    f"{'profiles' if profiled else 'scaled'}")
                runs.append(run)
                line = (f"repeat {repeat + 1} {run['label']:<13} plan {run['plan']}  epoch "
                        f"{run['epoch_s']:.3f} s (epochs {[round(t, 3) for t in run['epochs_s']]})"
                        f"  acc {run['accuracy']:.3f}  load {run['load']:.2f}")
                print(line, flush=True)
                lines.append(f"- {line}")
                if run["profiles"]:
                    measured = json.dumps(run["profiles"], sort_keys=True)
                    print(f"  measured: {measured}", flush=True)
                    lines.append(f"  - measured by the devices: `{measured}`")
    finally:
        set_quota(None)
    lines.append("")
    for label in ("profiles", "server-scaled"):
        mine = [r["epoch_s"] for r in runs if r["label"] == label]
        lines.append(f"- {label}: mean epoch {statistics.mean(mine):.3f} s over {len(mine)} "
                     f"runs ({', '.join(f'{t:.3f}' for t in mine)})")
    mean = {label: statistics.mean(r["epoch_s"] for r in runs if r["label"] == label)
            for label in ("profiles", "server-scaled")}
    lines.append(f"- server-scaled / profiles: {mean['server-scaled'] / mean['profiles']:.3f}")
    lines.append(f"- bench took {time.monotonic() - started:.0f} s; load average at the end "
                 f"{os.getloadavg()[0]:.2f}")
    print("\n".join(lines[-4:]))
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    (args.out / "runs.json").write_text(json.dumps(runs, indent=1))


def main() -> None:
    """Parse the options and run."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quota", type=float, default=0.25,
                        help="the slow devices' share of one core (default 0.25)")
    parser.add_argument("--model", default="mobilenetv3-small")
    parser.add_argument("--network", default="wifi")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench" / "results" / time.strftime("%Y-%m-%d-profiles"))
    args = parser.parse_args()
    if not 0 < args.quota <= 1:
        parser.error("--quota must be in (0, 1]")
    set_quota(args.quota)
    args.out.mkdir(parents=True, exist_ok=True)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
