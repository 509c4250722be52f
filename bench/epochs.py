"""Epoch time of PiPar vs SFL vs FL over real loopback websockets with real processes.

Each mode runs as its own ``python -m aiopipe --mode M ...`` (a server and K device
processes talking over loopback websockets; the devices pace their uplink and the server
its downlinks at the network preset's rates; ``--device-slowdown`` makes each device's
compute items take s x their CPU time), one after the other, with
the same model, data, seed and batch size. The figures come from each run's
``metrics.jsonl``:

- epoch time: mean over the epochs after the first (all epochs when there is one);
- busy / idle seconds per resource (``device``, ``uplink``, ``server``, ``downlink``;
  device-side figures are means over devices), averaged over the same epochs;
- test accuracy after the last epoch;
- speedups: FL epoch time / PiPar epoch time and SFL / PiPar (> 1: PiPar is faster).

Sweeps add PiPar runs with other N (``--sweep-n``, default 2,8) and split points
(``--sweep-p``, default 4); their speedups are against the same FL and SFL runs. The
default (6 runs of 2 x 1000 samples, 3 epochs) takes about 6-8 minutes on 2 cores.

    .venv/bin/python bench/epochs.py [--epochs 3] [--samples-per-device 1000]
        [--devices 2] [--split-point 2] [--parallel-batches 4] [--batch-size 50]
        [--network 4g] [--device-slowdown 4] [--sweep-n 2,8] [--sweep-p 4] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESOURCES = ("device", "uplink", "server", "downlink")


@dataclass(frozen=True, slots=True)
class Run:
    """One finished ``python -m aiopipe`` run."""

    label: str
    epochs: list[dict[str, Any]]
    wall_s: float

    @property
    def measured(self) -> list[dict[str, Any]]:
        """The epochs the figures average over: all after the first (or the only one)."""
        return self.epochs[1:] or self.epochs

    def mean(self, key: str, resource: str | None = None) -> float:
        """Mean of ``key`` (or ``key[resource]``) over the measured epochs."""
        values = [float(e[key][resource] if resource else e[key]) for e in self.measured]
        return sum(values) / len(values)


def run_mode(label: str, options: list[str], out_dir: Path) -> Run:
    """Run ``python -m aiopipe`` with ``options``; its metrics per epoch and wall time.

    Raises:
        SystemExit: the run failed.
    """
    command = [sys.executable, "-m", "aiopipe", *options, "--out-dir", str(out_dir)]
    print(f"--- {label}: python -m aiopipe {' '.join(options)}", flush=True)
    started = time.perf_counter()
    process = subprocess.run(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
    )
    wall = time.perf_counter() - started
    for line in process.stdout.splitlines():
        print(f"    {line}", flush=True)
    if process.returncode != 0:
        raise SystemExit(f"{label}: python -m aiopipe exited with code {process.returncode}")
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return Run(label, [json.loads(line) for line in lines if line.strip()], wall)


def table(runs: list[Run], fl: Run | None, sfl: Run | None) -> list[str]:
    """The results table, one row per run."""
    head = (
        f"{'run':<16} {'epoch s':>8} {'test acc':>8} "
        + " ".join(f"{r[:4] + ' b/i':>11}" for r in RESOURCES)
        + f" {'MB up':>7} {'MB dn':>7} {'fl÷x':>6} {'sfl÷x':>6} {'wall s':>7}"
    )
    rows = [head]
    for run in runs:
        t = run.mean("time_s")
        cells = " ".join(
            f"{run.mean('busy_s', r):>5.1f}/{run.mean('idle_s', r):<5.1f}" for r in RESOURCES
        )
        vs_fl = f"{fl.mean('time_s') / t:>6.2f}" if fl else f"{'-':>6}"
        vs_sfl = f"{sfl.mean('time_s') / t:>6.2f}" if sfl else f"{'-':>6}"
        rows.append(
            f"{run.label:<16} {t:>8.2f} {run.epochs[-1]['accuracy']:>8.3f} {cells} "
            f"{run.mean('bytes_up') / 1e6:>7.1f} {run.mean('bytes_down') / 1e6:>7.1f} "
            f"{vs_fl} {vs_sfl} {run.wall_s:>7.1f}"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples-per-device", type=int, default=1000)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--split-point", type=int, default=2, help="PiPar and SFL split point P")
    parser.add_argument("--parallel-batches", type=int, default=4, help="PiPar N")
    parser.add_argument("--network", default="4g")
    parser.add_argument("--device-slowdown", default="4")
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--dataset", default="synthetic-cifar10")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sweep-n", default="2,8", help='extra PiPar runs with these N (default 2,8; "" for none)'
    )
    parser.add_argument(
        "--sweep-p", default="4", help='extra PiPar runs with these P (default 4; "" for none)'
    )
    parser.add_argument("--keep", help="keep the results directories under this path")
    args = parser.parse_args()

    common = [
        "--model",
        args.model,
        "--dataset",
        args.dataset,
        "--devices",
        str(args.devices),
        "--samples-per-device",
        str(args.samples_per_device),
        "--batch-size",
        str(args.batch_size),
        "--epochs",
        str(args.epochs),
        "--network",
        args.network,
        "--device-slowdown",
        args.device_slowdown,
        "--seed",
        str(args.seed),
    ]
    p, n = args.split_point, args.parallel_batches
    plans: list[tuple[str, list[str]]] = [
        (
            f"pipar P={p} N={n}",
            ["--mode", "pipar", "--split-point", str(p), "--parallel-batches", str(n)],
        ),
        (f"sfl P={p}", ["--mode", "sfl", "--split-point", str(p)]),
        ("fl", ["--mode", "fl"]),
    ]
    plans += [
        (
            f"pipar P={p} N={v}",
            ["--mode", "pipar", "--split-point", str(p), "--parallel-batches", v],
        )
        for v in args.sweep_n.split(",")
        if v and int(v) != n
    ]
    plans += [
        (
            f"pipar P={v} N={n}",
            ["--mode", "pipar", "--split-point", v, "--parallel-batches", str(n)],
        )
        for v in args.sweep_p.split(",")
        if v and int(v) != p
    ]

    print(
        f"epochs bench: {args.model} on {args.dataset}, {args.devices} devices x "
        f"{args.samples_per_device} samples, B={args.batch_size}, {args.epochs} epochs, "
        f"network {args.network}, device slowdown {args.device_slowdown}, seed {args.seed}; "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="aiopipe-epochs-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        runs = [
            run_mode(label, options + common, root / f"run{i}")
            for i, (label, options) in enumerate(plans)
        ]
    fl = next((r for r in runs if r.label == "fl"), None)
    sfl = next((r for r in runs if r.label.startswith("sfl")), None)
    measured = "epochs 2.." if args.epochs > 1 else "the one epoch"
    print(
        f"\nmeans over {measured}; busy/idle seconds per epoch (b/i) per resource "
        "(device, uplink, downlink: means over devices); fl÷x and sfl÷x = that mode's "
        "epoch time / this run's (> 1: this run is faster); wall s = whole process run"
    )
    print(*table(runs, fl, sfl), sep="\n")
    pipar = runs[0]
    print(f"speedup pipar/fl  = {fl.mean('time_s') / pipar.mean('time_s'):.2f}x" if fl else "")
    print(f"speedup pipar/sfl = {sfl.mean('time_s') / pipar.mean('time_s'):.2f}x" if sfl else "")
    print(
        f"bench took {time.perf_counter() - started:.0f} s; "
        f"load average at the end {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
