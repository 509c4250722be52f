"""Secure aggregation (SecAgg+, ``secure_aggregation = true``) against plain FedAvg:
time and bytes per round, fl, for 10 and 100 devices in virtual time and for 4 devices
between real processes.

- **virtual time** (``--virtual 10,100``): one round (an epoch of one batch per device)
  of a small CNN (`cnn`, about 20 k parameters) on synthetic-mnist, wifi-like links, in
  one process over memory links, with and without secure aggregation. Virtual time
  charges training compute (a cost table measured here once) and every byte on the
  links, SecAgg's four request/reply steps included; the cryptography's compute is NOT
  charged in virtual time (it runs for real, in the same process): the wall-clock
  seconds of each simulation are printed beside it, and part 2 times it.
- **the protocol's compute** (same n): one SecAgg+ round of the pure library
  (aiopipe.secagg) over a vector of the model's length, per client (mean) and on the
  server, with no client lost and with 2 lost after sharing; wall clock, this machine.
- **real processes** (``--processes 4``): ``python -m aiopipe`` (a server and 4 device
  processes on this machine over websockets), ``--epochs`` epochs each way; wall-clock
  seconds per round and bytes from the results' metrics.

    PYTHONPATH=. .venv/bin/python bench/secagg.py [--virtual 10,100] [--processes 4]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.runtime.plan import build_model, measure_planning_costs, train_dataset
from aiopipe.runtime.systems.base import planning_batch_sizes
from aiopipe.secagg import Client, FixedPoint, RoundSetup, Server

BATCH = 16
HERE = Path(__file__).resolve().parent


def cnn(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """A small CNN in three units (about 20 k parameters)."""
    c, h, w = in_shape
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(32 * (h // 4) * (w // 4), num_classes)))


def config(devices: int, secure: bool, epochs: int = 1) -> RunConfig:
    return RunConfig(mode="fl", model="secagg:cnn", dataset="synthetic-mnist",
                     devices=devices, samples_per_device=BATCH, batch_size=BATCH,
                     epochs=epochs, test_samples=0, network="wifi", seed=1,
                     options={"secure_aggregation": secure})


def virtual(devices: int, costs: Any) -> dict[str, Any]:
    """One round with and without secure aggregation, in virtual time."""
    row: dict[str, Any] = {"devices": devices}
    for name, secure in (("plain", False), ("secagg", True)):
        started = time.perf_counter()
        result = asyncio.run(simulate(config(devices, secure), clock=VirtualClock(),
                                      cost_table=costs, progress=lambda _: None))
        epoch = result.epochs[0]
        row[name] = {"virtual_s": epoch.time_s, "bytes_up": epoch.bytes_up,
                     "bytes_down": epoch.bytes_down,
                     "wall_s": round(time.perf_counter() - started, 2)}
    return row


def protocol(devices: int, length: int, dropped: int) -> dict[str, float]:
    """Wall-clock seconds of one library round: mean per client, and the server's."""
    setup = RoundSetup(0, 7, tuple(range(devices)), length)
    code = FixedPoint.for_sum(100.0, devices)
    rng = np.random.default_rng(0)
    inputs = {c: code.encode(rng.normal(size=length)) for c in range(devices)}
    spent = {"client": 0.0, "server": 0.0}

    def timed(who: str, fn: Any, *args: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args)
        spent[who] += time.perf_counter() - t
        return out

    server = Server(setup)
    clients = {c: Client(setup, c) for c in range(devices)}
    for c in clients:
        timed("server", server.take_keys, c, timed("client", clients[c].advertise))
    lists = timed("server", server.close_keys)
    for c in clients:
        timed("server", server.take_shares, c, timed("client", clients[c].share, lists[c]))
    boxes = timed("server", server.close_shares)
    alive = list(range(dropped, devices))
    for c in alive:
        timed("server", server.take_masked, c,
              timed("client", clients[c].masked_input, boxes[c], inputs[c]))
    requests = timed("server", server.close_masked)
    for c in alive:
        timed("server", server.take_unmasking, c, timed("client", clients[c].unmask,
                                                        requests[c]))
    timed("server", server.result)
    return {"client_mean_s": round(spent["client"] / devices, 4),
            "server_s": round(spent["server"], 4), "degree": setup.degree,
            "threshold": setup.threshold}


def processes(devices: int, epochs: int) -> dict[str, Any]:
    """``python -m aiopipe`` with and without secure aggregation: per-round figures."""
    row: dict[str, Any] = {"devices": devices, "epochs": epochs}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    for name, secure in (("plain", False), ("secagg", True)):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            toml = Path(tmp) / "run.toml"
            toml.write_text(config(devices, secure, epochs).to_toml())
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "aiopipe", "--config", str(toml),
                            "--out-dir", str(out)], check=True, env=env, cwd=tmp,
                           stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - started
            epochs_seen = [json.loads(line) for line in
                           (out / "metrics.jsonl").read_text().splitlines()]
        row[name] = {"time_s": [round(e["time_s"], 3) for e in epochs_seen],
                     "bytes_up": [e["bytes_up"] for e in epochs_seen],
                     "bytes_down": [e["bytes_down"] for e in epochs_seen],
                     "wall_s_whole_run": round(wall, 1)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--virtual", default="10,100")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))  # (the model, by name)
    base = config(2, False)
    dataset = train_dataset(base)
    model = build_model(base, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    length = sum(v.numel() for v in model.state_dict().values()) + 1
    costs = measure_planning_costs(base, model, dataset.in_shape, dataset,
                                   sizes=planning_batch_sizes(base))
    record: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                              "vector_length": length, "virtual": [], "protocol": [],
                              "processes": None}
    print(f"model: {length - 1} values (+1 weight); fl, 1 batch of {BATCH} per device")
    print(f"\n{'devices':>7} {'run':>7} {'virtual s':>10} {'bytes up':>11} "
          f"{'bytes down':>11} {'wall s':>7}")
    for n in (int(x) for x in args.virtual.split(",") if x):
        row = virtual(n, costs)
        record["virtual"].append(row)
        for name in ("plain", "secagg"):
            r = row[name]
            print(f"{n:>7} {name:>7} {r['virtual_s']:>10.4f} {r['bytes_up']:>11} "
                  f"{r['bytes_down']:>11} {r['wall_s']:>7}")
        for dropped in (0, 2):
            found = protocol(n, length, dropped)
            record["protocol"].append({"devices": n, "dropped": dropped, **found})
            print(f"{'':>7} protocol alone, {dropped} lost: {found['client_mean_s']} s per "
                  f"client, {found['server_s']} s server (k = {found['degree']}, t = "
                  f"{found['threshold']})")
    if args.processes:
        row = processes(args.processes, args.epochs)
        record["processes"] = row
        print(f"\nreal processes, {args.processes} devices, {args.epochs} epochs (1 round "
              "each):")
        for name in ("plain", "secagg"):
            r = row[name]
            print(f"  {name:>7}: seconds per round {r['time_s']}, bytes up {r['bytes_up']}, "
                  f"down {r['bytes_down']} (whole run {r['wall_s_whole_run']} s wall)")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
