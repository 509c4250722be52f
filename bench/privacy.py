"""Differential privacy's cost (PiPar §5.6.2, Fig. 13): epoch time and test accuracy of
FL, SFL and PiPar without privacy, with classic DP (noise on the uploaded model half) and
with PixelDP (noise on every training input), side by side, between real processes
(``python -m aiopipe``: a server and the devices over loopback websockets, each sender
paced at ``--network``'s rates, each device's compute stretched by ``--slowdown``).

    .venv/bin/python bench/privacy.py [--model vgg5] [--devices 2] [--samples 960]
        [--epochs 3] [--network wifi] [--slowdown 4] [--classic 0.01] [--pixeldp 0.1]
        [--out DIR]

The epoch time is the mean of the epochs after the first (the first holds the devices'
set-up); the accuracy is the last epoch's. One run each: differences of a few per cent
are noise on this shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from aiopipe import RunConfig

REPO = Path(__file__).resolve().parents[1]
MODES = {"fl": {"mode": "fl"}, "sfl": {"mode": "sfl", "split_point": 2},
         "pipar": {"mode": "pipar", "split_point": 2, "parallel_batches": 4}}


def one_run(config: RunConfig, scratch: Path) -> list[dict[str, Any]]:
    """``config`` between processes; its epochs' metrics."""
    path = scratch / "run.toml"
    path.write_text(config.to_toml())
    out = scratch / f"run{len(list(scratch.iterdir()))}"
    done = subprocess.run([sys.executable, "-m", "aiopipe", "--config", str(path),
                           "--out-dir", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"run failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    """Run every mode with every method; print (and write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--samples", type=int, default=960)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--network", default="wifi")
    parser.add_argument("--slowdown", type=float, default=4.0)
    parser.add_argument("--classic", type=float, default=0.01)
    parser.add_argument("--pixeldp", type=float, default=0.1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    methods = {"none": 0.01, "classic": args.classic, "pixeldp": args.pixeldp}
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for mode, keys in MODES.items():
            for method, noise in methods.items():
                config = RunConfig(model=args.model, devices=args.devices,
                                   samples_per_device=args.samples, batch_size=48,
                                   epochs=args.epochs, network=args.network,
                                   device_slowdown=args.slowdown, **keys,
                                   options={"privacy": method, "privacy_noise": noise})
                epochs = one_run(config, Path(scratch))
                rows[f"{mode} {method}"] = {
                    "mode": mode, "method": method, "noise": noise,
                    "epoch_s": statistics.fmean(e["time_s"] for e in epochs[1:] or epochs),
                    "accuracy": epochs[-1]["accuracy"]}
                print(f"  {mode} {method}: {rows[f'{mode} {method}']}", flush=True)
    title = (f"{args.model}, {args.devices} devices x {args.samples} samples, B = 48, "
             f"{args.network}, devices {args.slowdown:g}x, {args.epochs} epochs; noise: "
             f"classic {args.classic:g}, pixeldp {args.pixeldp:g}")
    lines = [title, "", "| mode | epoch s: none | classic (overhead) | pixeldp (overhead) | "
             "accuracy: none | classic | pixeldp |", "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        base, classic, pixel = (rows[f"{mode} {m}"] for m in methods)
        lines.append(
            f"| {mode} | {base['epoch_s']:.2f} | {classic['epoch_s']:.2f} "
            f"({classic['epoch_s'] - base['epoch_s']:+.2f}) | {pixel['epoch_s']:.2f} "
            f"({pixel['epoch_s'] - base['epoch_s']:+.2f}) | {base['accuracy']:.3f} | "
            f"{classic['accuracy']:.3f} | {pixel['accuracy']:.3f} |")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "privacy.md").write_text("\n".join(lines) + "\n")
        (args.out / "privacy.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
