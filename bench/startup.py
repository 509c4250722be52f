"""How long a PiPar run with "auto" plans takes to start training, with and without the
cost cache, between real processes (issue 46, part 4).

Each arm runs the server and the devices as separate processes, the way bench/shaped.py
does (the server in one network namespace, each device in its own, tc tbf shaping each
direction: bench/netns.py; without namespaces, over loopback unshaped, and it says so):

    ip netns exec <srv> python -m aiopipe.server --host 10.213.0.1 --port P --no-shaping \
        --mode pipar --split-point auto --parallel-batches auto --model vgg5 ... --epochs 1
    ip netns exec <dev k> python -m aiopipe.device --server ws://10.213.0.1:P/ws --device-id k

with ``AIOPIPE_COST_CACHE`` set for every process: ``cold`` (an empty cache directory),
``warm`` (the directory ``cold`` filled), ``off`` twice (no cache). It reads the first
epoch's ``startup`` figures from ``metrics.jsonl`` ([Note: startup figures]:
``startup_s`` from the coordinator's start to the first micro-batch computed, and of it
``join_s``, ``profiling_s``, ``planning_s``), the server's readiness (process start to
listening, which the coordinator's clock cannot see) and the log lines that say where
each table came from, and prints a table.

    .venv/bin/python bench/startup.py [--samples-per-device 5000] [--network 4g]
        [--arms cold,warm,off,off] [--no-netns] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import netns  # noqa: E402  (bench/ is not a package)
import shaped  # noqa: E402

#: What the processes' logs say of their tables (aiopipe.runtime.cost_cache).
TABLE_LINE = re.compile(r"(device \d+'s profile|the server's cost table) "
                        r"(read from \S+|measured in [\d.]+ s)")
#: What the coordinator's log says of each device's profile (aiopipe.runtime.profiling).
PROFILED_LINE = re.compile(r"device \d+ profiled itself in [\d.]+ s: .*")


def server_options(args: argparse.Namespace, shaped_links: bool) -> list[str]:
    """The server's options of every arm."""
    return ["--mode", "pipar", "--model", args.model, "--dataset", "synthetic-cifar10",
            "--devices", str(args.devices), "--samples-per-device",
            str(args.samples_per_device), "--batch-size", str(args.batch_size),
            "--epochs", "1", "--split-point", "auto", "--parallel-batches", "auto",
            "--network", args.network, "--seed", "0",
            *(["--no-shaping"] if shaped_links else [])]


def run_arm(args: argparse.Namespace, run_dir: Path, cache: str,
            topology: netns.Topology | None, port: int) -> dict[str, Any]:
    """One run with ``AIOPIPE_COST_CACHE=cache``; its figures, or an ``error``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    server_env, device_envs = shaped._credentials(args.devices)
    for env in (server_env, *device_envs):
        env["AIOPIPE_COST_CACHE"] = cache
    host = topology.server_ip if topology else "127.0.0.1"
    if topology is None:
        port = shaped._free_port()
    py = sys.executable
    server = [py, "-m", "aiopipe.server", "--host", host, "--port", str(port),
              "--join-timeout", "120", *server_options(args, topology is not None),
              "--out-dir", str(run_dir)]
    devices = [[py, "-m", "aiopipe.device", "--server", f"ws://{host}:{port}/ws",
                "--device-id", str(k)] for k in range(args.devices)]
    if topology is not None:
        server = topology.in_server(server)
        devices = [topology.in_device(k, d) for k, d in enumerate(devices)]
    procs = shaped.Processes()
    started = time.perf_counter()
    try:
        srv = procs.start(server, run_dir / "server.log", server_env)
        shaped._wait_for_text(run_dir / "server.log", "waiting for", srv, 180)
        ready_s = time.perf_counter() - started
        devs = [procs.start(d, run_dir / f"device{k}.log", device_envs[k])
                for k, d in enumerate(devices)]
        if srv.wait(timeout=args.run_timeout) != 0:
            raise RuntimeError(f"server exited with code {srv.returncode}")
        for k, d in enumerate(devs):
            if d.wait(timeout=30) != 0:
                raise RuntimeError(f"device {k} exited with code {d.returncode}")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"cache": cache, "error": str(exc), "wall_s": time.perf_counter() - started}
    finally:
        procs.kill_all()
    epoch = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    for bulky in ("model.safetensors", "trace.json", "timeline.png", "overview.png"):
        (run_dir / bulky).unlink(missing_ok=True)  # kept: config, metrics, logs
    shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("*.log")))
    return {"cache": cache, "server_ready_s": round(ready_s, 3), **epoch["startup"],
            "epoch_s": round(epoch["time_s"], 3), "plan": epoch["plan"],
            "wall_s": round(time.perf_counter() - started, 3),
            "tables": [" ".join(m) for m in TABLE_LINE.findall(logs)],
            "profiles": PROFILED_LINE.findall(logs),
            "server_command": " ".join(server)}


FIGURES = ("server_ready_s", "join_s", "profiling_s", "planning_s", "startup_s", "epoch_s",
           "wall_s")


def table(results: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The arms' figures as a Markdown table, seconds."""
    lines = ["| arm | " + " | ".join(FIGURES) + " |", "|---" * (len(FIGURES) + 1) + "|"]
    for name, r in results:
        cells = ["error: " + r["error"]] if "error" in r else [
            f"{r.get(f, float('nan')):.2f}" for f in FIGURES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--samples-per-device", type=int, default=5000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--network", default="4g", choices=sorted(netns.NETWORKS))
    parser.add_argument("--arms", default="cold,warm,off,off",
                        help="comma-separated: cold (empty cache), warm (cold's), off")
    parser.add_argument("--no-netns", action="store_true", help="loopback, unshaped")
    parser.add_argument("--run-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or BENCH / "results" / time.strftime("%Y-%m-%d") / "startup"
    out.mkdir(parents=True, exist_ok=True)
    reason = "--no-netns" if args.no_netns else netns.unavailable_reason()
    cache_dir = Path(tempfile.mkdtemp(prefix="aiopipe-startup-cache-"))
    results: list[tuple[str, dict[str, Any]]] = []
    try:
        up, down = netns.NETWORKS[args.network]
        with (netns.open_topology(args.devices, up_mbps=up, down_mbps=down)
              if reason is None else contextlib.nullcontext()) as top:
            if top is not None:
                shaped.log(f"namespaces, tc tbf {up:g} Mbit/s up, {down:g} down")
            else:
                shaped.log(f"no namespaces ({reason}): loopback, unshaped")
            for i, arm in enumerate(args.arms.split(",")):
                cache = "off" if arm == "off" else str(cache_dir)
                if arm == "cold":
                    shutil.rmtree(cache_dir, ignore_errors=True)
                shaped.log(f"arm {i + 1} {arm}: AIOPIPE_COST_CACHE={cache}")
                result = run_arm(args, out / f"{i + 1}-{arm}", cache, top, 8900 + i)
                results.append((arm, result))
                shaped.log(json.dumps({k: v for k, v in result.items()
                                       if k != "server_command"}))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    text = table(results)
    print(text)
    raw = {"args": {k: str(v) for k, v in vars(args).items()},
           "links": "loopback, unshaped" if reason else f"netns + tc tbf ({args.network})",
           "arms": [{"arm": a, **r} for a, r in results]}
    (out / "raw.json").write_text(json.dumps(raw, indent=1) + "\n")
    (out / "table.md").write_text(text + "\n")
    return 0 if all("error" not in r for _, r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
