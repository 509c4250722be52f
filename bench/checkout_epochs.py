"""Epoch times of honest runs, this checkout side by side with another (issue 41's
"nothing slower", issue 43's "nothing lost"): ``python -m aiopipe`` (a server and its
device processes over loopback websockets) run by each checkout in turn, A B A B ...,
the same config; the figures are each run's ``metrics.jsonl`` epoch times (the first
epoch left out: it includes the processes' warm-up). With ``--virtual``, each mode is
also simulated in virtual time by both checkouts (a fixed cost table): the epochs'
losses, accuracies and times and the final model's bytes must be identical.

    git worktree add /tmp/base <commit>
    .venv/bin/python bench/checkout_epochs.py --baseline /tmp/base [--runs 3]
        [--modes fl sfl pipar pipeline ftpipehd asteroid hadfl] [--epochs 3] [--virtual]

The baseline runs with this checkout's virtual environment and ``PYTHONPATH`` set to
its folder, so both arms use the same torch and packages. Prints, per mode, the median
epoch seconds of each arm (min and max over the runs) and the ratio of the medians.
Devices emulated on one machine share its cores: this compares the two checkouts'
costs on the same work, not a fleet's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
#: per mode: the options that make a small run of it (vgg5, 3 devices, 2-3 s epochs)
MODES: dict[str, list[str]] = {
    "fl": ["--mode", "fl"],
    "sfl": ["--mode", "sfl"],
    "pipar": ["--mode", "pipar"],
    "pipeline": ["--mode", "pipeline", "--parallel-batches", "2"],
    "ftpipehd": ["--mode", "ftpipehd", "--parallel-batches", "2"],
    "asteroid": ["--mode", "asteroid"],
    "hadfl": ["--mode", "hadfl", "--warmup-epochs", "0", "--local-steps", "2"],
}


def one_run(checkout: Path, mode: str, epochs: int, samples: int) -> list[float]:
    """One run of ``mode`` by ``checkout``: its epoch times after the first.

    Raises:
        RuntimeError: the run failed (its output's tail says why).
    """
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(checkout), AIOPIPE_LOG_LEVEL="WARNING")
        done = subprocess.run(
            [sys.executable, "-m", "aiopipe", *MODES[mode], "--model", "vgg5",
             "--devices", "3", "--samples-per-device", str(samples), "--batch-size", "20",
             "--epochs", str(epochs), "--test-samples", "200", "--network", "lan",
             "--out-dir", str(Path(out) / "run")],
            cwd=checkout, env=env, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{checkout} {mode}: exit {done.returncode}\n"
                               f"{(done.stdout + done.stderr)[-2000:]}")
        lines = (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()
        return [float(json.loads(line)["time_s"]) for line in lines][1:]


#: Simulates one mode in virtual time and prints what it computed (argv: mode, then the
#: mode's ``python -m aiopipe`` options as JSON); run by each checkout's own code.
_SIMULATE = """
import asyncio, dataclasses, hashlib, json, sys
from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.scheduler.costs import CostTable

options = json.loads(sys.argv[2])
def value(text):
    try:
        return json.loads(text)
    except ValueError:
        return text
keys = {o.removeprefix("--").replace("-", "_"): value(v)
        for o, v in zip(options[::2], options[1::2])}
fields = {f.name for f in dataclasses.fields(RunConfig)}
if "options" in fields:  # a key that is no field is a system's option (older: flat fields)
    keys["options"] = {k: keys.pop(k) for k in list(keys) if k not in fields}
config = RunConfig.from_mapping({**keys, "model": "vgg5", "devices": 3,
                                 "samples_per_device": 120, "batch_size": 20, "epochs": 2,
                                 "test_samples": 100})
costs = CostTable.uniform(5,  # vgg5's units
                          forward=0.002, backward=0.004, step=0.001, batch=1)
result = asyncio.run(simulate(config, clock=VirtualClock(), cost_table=costs))
digest = hashlib.sha256()
for name, tensor in sorted(result.model.state_dict().items()):
    digest.update(name.encode())
    digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
print(json.dumps({"epochs": [[e.loss, e.accuracy, e.time_s] for e in result.epochs],
                  "model": digest.hexdigest()}))
"""


def simulated(checkout: Path, mode: str) -> dict[str, object]:
    """What ``checkout`` computes for ``mode`` in virtual time.

    Raises:
        RuntimeError: the simulation failed.
    """
    env = dict(os.environ, PYTHONPATH=str(checkout), AIOPIPE_LOG_LEVEL="WARNING")
    done = subprocess.run([sys.executable, "-c", _SIMULATE, mode, json.dumps(MODES[mode])],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{checkout} {mode}: exit {done.returncode}\n"
                           f"{(done.stdout + done.stderr)[-2000:]}")
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> None:
    """Run the comparison and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    parser.add_argument("--virtual", action="store_true",
                        help="also compare what each mode computes in virtual time")
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()}")
    if args.virtual:
        print("| mode | virtual time: epochs (loss, accuracy, s) and model identical? |")
        print("|---|---|")
        for mode in args.modes:
            this, base = simulated(HERE, mode), simulated(args.baseline.resolve(), mode)
            print(f"| {mode} | {'identical' if this == base else f'DIFFER: {this} vs {base}'} |",
                  flush=True)
    if args.runs < 1:
        return
    print("| mode | this checkout: epoch s median (min-max) | baseline | this ÷ baseline |")
    print("|---|---|---|---|")
    for mode in args.modes:
        times: dict[str, list[float]] = {"this": [], "base": []}
        for _ in range(args.runs):
            for arm, checkout in (("this", HERE), ("base", args.baseline.resolve())):
                times[arm] += one_run(checkout, mode, args.epochs, args.samples)
        this, base = times["this"], times["base"]
        print(f"| {mode} | {statistics.median(this):.2f} ({min(this):.2f}-{max(this):.2f}) "
              f"| {statistics.median(base):.2f} ({min(base):.2f}-{max(base):.2f}) "
              f"| {statistics.median(this) / statistics.median(base):.3f} |", flush=True)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
