"""Epoch times of honest runs, this checkout side by side with another (issue 41's
"nothing slower"): ``python -m aiopipe`` (a server and its device processes over
loopback websockets) run by each checkout in turn, A B A B ..., the same config; the
figures are each run's ``metrics.jsonl`` epoch times (the first epoch left out: it
includes the processes' warm-up).

    git worktree add /tmp/base <commit>
    .venv/bin/python bench/checkout_epochs.py --baseline /tmp/base [--runs 3]
        [--modes fl pipar pipeline ftpipehd asteroid hadfl] [--epochs 3]

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


def main() -> None:
    """Run the comparison and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()}")
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
