"""HADFL (``mode = "hadfl"``) against the synchronous ways of training the same fleet:
time to accuracy, traffic, and the strategy's version prediction.

The fleet: 4 devices of computing power 4 : 2 : 2 : 1 (the paper's [4, 2, 2, 1]: device
slowdowns 1, 2, 2, 4, times ``--scale``), each with ``--samples`` samples of
synthetic-cifar10 (iid), vgg5, batches of 48, wifi-like links (``--network``). Four runs
on the same runtime, side by side:

- **hadfl**: one negotiation epoch, then local steps by capacity, rings of 2 chosen by
  predicted version, the average sent on to the other two;
- **decentralized FedAvg**: every device one epoch of local steps a round, then all four
  average over the ring (so each round waits for the slowest device);
- **DDP-like**: one step a round, then all four average (a ring all-reduce of the model
  every step, as PyTorch DDP all-reduces gradients: with plain SGD the same update);
- **central FL** (``mode = "fl"``): FedAvg through the coordinator once an epoch.

Every run evaluates its model on the same 1000 test samples after each epoch (HADFL and
the baselines on the ring's average, which the coordinator backs up then). Reported:
accuracy over time (a plot), the time each first reaches each of ``--targets`` test
accuracies, and HADFL's speedups; bytes device to device per round against the paper's 2·K·M; bytes
through the coordinator; Holt's predicted versions against those that happened.

``--virtual`` (the default): in virtual time, compute charged from one cost table
measured here for every run (deterministic). ``--processes``: the same runs between
real processes (``python -m aiopipe``: a server and four device processes over loopback
websockets, each sender paced at the network's rate, each device's compute stretched
by its slowdown: 4 devices emulated on this machine's cores, so the figures show the
schedule, not a Raspberry Pi).

    .venv/bin/python bench/hadfl.py [--virtual] [--processes] [--epochs 10]
        [--targets 0.6,0.7,0.8,0.85] [--samples 960] [--scale 1] [--network wifi] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.runtime.plan import build_model, measure_planning_costs, train_dataset
from aiopipe.runtime.systems.base import planning_batch_sizes

REPO = Path(__file__).resolve().parents[1]
SLOWDOWNS = (1.0, 2.0, 2.0, 4.0)
BATCH = 48


def runs(samples: int) -> dict[str, dict[str, Any]]:
    """Each run's config keys (besides the fleet's)."""
    batches = samples // BATCH
    return {
        "hadfl": {"mode": "hadfl", "options": {"ring_size": 2}},
        "decentralized FedAvg": {"mode": "hadfl", "options": {
            "warmup_epochs": 0, "local_steps": batches, "ring_size": 4}},
        "DDP-like": {"mode": "hadfl", "options": {
            "warmup_epochs": 0, "local_steps": 1, "ring_size": 4}},
        "central FL": {"mode": "fl"},
    }


def fleet_config(name: str, changes: dict[str, Any], *, epochs: int, samples: int,
                 scale: float, network: str) -> RunConfig:
    """The fleet's config for run ``name``; DDP-like's epoch is ``batches`` rounds, so
    it gets as many epochs as the others."""
    return RunConfig(model="vgg5", devices=4, samples_per_device=samples, batch_size=BATCH,
                     epochs=epochs, device_slowdown=tuple(scale * s for s in SLOWDOWNS),
                     network=network, test_samples=1000, learning_rate=0.02,
                     heartbeat_interval=5.0, device_timeout=120.0, **changes)


def summary(name: str, epochs: list[dict[str, Any]], targets: list[float]
            ) -> dict[str, Any]:
    """A run's curve (cumulative seconds, accuracy), time to each of ``targets``
    (None: not reached), traffic."""
    elapsed, curve = 0.0, []
    for e in epochs:
        elapsed += float(e["time_s"])
        curve.append((round(elapsed, 3), float(e["accuracy"])))
    reached = {str(target): next((t for t, a in curve if a >= target), None)
               for target in targets}
    rounds = [c for e in epochs for c in e.get("changes", []) if c.get("kind") == "hadfl-round"]
    return {"run": name, "curve": curve, "time_to_s": reached,
            "best_accuracy": max(a for _, a in curve), "time_s": elapsed,
            "samples": sum(int(e["samples"]) for e in epochs),
            "peer_bytes": [sum(e.get("peer_bytes", []) or [0]) for e in epochs],
            "bytes_up": [int(e["bytes_up"]) for e in epochs],
            "bytes_down": [int(e["bytes_down"]) for e in epochs], "rounds": rounds}


def prediction_errors(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Holt's predicted versions (the strategy's ``predicted``, from the versions of the
    round before) against the versions each round ended with, over the rounds where the
    prediction was Holt's (not the first HADFL round's Eq. 6)."""
    errors, relative = [], []
    held = [r for r in rounds if r["predicted"] is not None]
    for r in held[1:]:
        for predicted, actual in zip(r["predicted"], r["versions"], strict=True):
            errors.append(abs(predicted - actual))
            relative.append(abs(predicted - actual) / max(actual, 1e-9))
    if not errors:
        return {}
    return {"rounds": len(held) - 1, "mean_abs_epochs": statistics.fmean(errors),
            "max_abs_epochs": max(errors), "mean_relative": statistics.fmean(relative)}


def virtual(epochs: int, samples: int, scale: float, network: str, targets: list[float]
            ) -> list[dict[str, Any]]:
    """Every run in virtual time, charged from one cost table measured here."""
    base = fleet_config("hadfl", {"mode": "hadfl"}, epochs=epochs, samples=samples,
                        scale=scale, network=network)
    dataset = train_dataset(base)
    model = build_model(base, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    costs = measure_planning_costs(base, model, dataset.in_shape, dataset,
                                   sizes=planning_batch_sizes(base))
    rows = []
    for name, changes in runs(samples).items():
        config = fleet_config(name, changes, epochs=epochs, samples=samples, scale=scale,
                              network=network)
        started = time.perf_counter()
        result = asyncio.run(simulate(config, clock=VirtualClock(), cost_table=costs))
        row = summary(name, [e.to_mapping() for e in result.epochs], targets)
        row["wall_s"] = time.perf_counter() - started
        rows.append(row)
        print(f"  {name}: best {row['best_accuracy']:.3f} in {row['time_s']:.1f} s "
              f"(virtual; {row['wall_s']:.0f} s wall)", flush=True)
    return rows


def processes(epochs: int, samples: int, scale: float, network: str, targets: list[float]
              ) -> list[dict[str, Any]]:
    """Every run between real processes (``python -m aiopipe``)."""
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, changes in runs(samples).items():
            config = fleet_config(name, changes, epochs=epochs, samples=samples, scale=scale,
                                  network=network)
            path = Path(scratch) / f"{len(rows)}.toml"
            path.write_text(config.to_toml())
            run_dir = Path(scratch) / f"run{len(rows)}"
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "aiopipe", "--config", str(path),
                                   "--out-dir", str(run_dir)], cwd=REPO, capture_output=True,
                                  text=True, timeout=3000, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
            metrics = [json.loads(line)
                       for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            row = summary(name, metrics, targets)
            row["wall_s"] = time.perf_counter() - started
            rows.append(row)
            print(f"  {name}: best {row['best_accuracy']:.3f} in {row['time_s']:.1f} s",
                  flush=True)
    return rows


def table(rows: list[dict[str, Any]], targets: list[float], model_bytes: int) -> list[str]:
    """The side-by-side tables, traffic and prediction lines."""
    ours = rows[0]
    lines = ["| run | samples | time s | best acc | device→device MB/round | "
             "coordinator MB/epoch (up, down) |", "|---|---|---|---|---|---|"]
    for row in rows:
        rounds = max(1, len(row["rounds"]))
        peer = sum(row["peer_bytes"]) / rounds / 1e6 if row["rounds"] else 0.0
        up = statistics.fmean(row["bytes_up"]) / 1e6
        down = statistics.fmean(row["bytes_down"]) / 1e6
        lines.append(f"| {row['run']} | {row['samples']} | {row['time_s']:.1f} | "
                     f"{row['best_accuracy']:.3f} | {peer:.2f} | {up:.2f}, {down:.3f} |")
    lines += ["", "Seconds to each test accuracy (HADFL's speedup: the run's time ÷ "
              "HADFL's):", "",
              "| run | " + " | ".join(f"to {t:.2f}" for t in targets) + " |",
              "|---|" + "---|" * len(targets)]
    for row in rows:
        cells = []
        for target in targets:
            t, mine = row["time_to_s"][str(target)], ours["time_to_s"][str(target)]
            if t is None:
                cells.append("not reached")
            else:
                cells.append(f"{t:.1f}" + (f" ({t / mine:.2f}×)" if mine else ""))
        lines.append(f"| {row['run']} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"M (the model's floating-point state) = {model_bytes / 1e6:.2f} MB; the "
                 f"paper's 2·K·M for K = 4 is {8 * model_bytes / 1e6:.2f} MB a round.")
    errors = prediction_errors(ours["rounds"])
    if errors:
        lines.append(f"Holt's prediction over {errors['rounds']} rounds: mean absolute error "
                     f"{errors['mean_abs_epochs']:.3f} epochs of version (max "
                     f"{errors['max_abs_epochs']:.3f}), mean relative error "
                     f"{100 * errors['mean_relative']:.1f}%.")
    return lines


def plot(rows: list[dict[str, Any]], path: Path, title: str, targets: list[float]) -> None:
    """Test accuracy over time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for row in rows:
        ax.plot([0.0, *(t for t, _ in row["curve"])], [0.1, *(a for _, a in row["curve"])],
                marker="o", markersize=3, label=row["run"])
    for target in targets:
        ax.axhline(target, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    """Run and print (and with ``--out``, write the tables, rows and plots)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--virtual", action="store_true")
    parser.add_argument("--processes", action="store_true")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=960)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--network", default="wifi")
    parser.add_argument("--targets", default="0.6,0.7,0.8,0.85",
                        help="test accuracies to time (comma list)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = fleet_config("hadfl", {"mode": "hadfl"}, epochs=args.epochs,
                          samples=args.samples, scale=args.scale, network=args.network)
    model = build_model(config, num_classes=10, in_shape=(3, 32, 32))
    model_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values()
                      if v.is_floating_point())
    targets = [float(t) for t in args.targets.split(",")]
    kinds = [k for k in ("virtual", "processes") if getattr(args, k)] or ["virtual"]
    for kind in kinds:
        title = (f"{kind}: 4 devices, slowdowns {[args.scale * s for s in SLOWDOWNS]}, "
                 f"{args.samples} samples each, vgg5, {args.network}, {args.epochs} epochs")
        print(title, flush=True)
        rows = (virtual if kind == "virtual" else processes)(
            args.epochs, args.samples, args.scale, args.network, targets)
        lines = [title, "", *table(rows, targets, model_bytes)]
        print("\n".join(lines), flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{kind}.md").write_text("\n".join(lines) + "\n")
            (args.out / f"{kind}.json").write_text(json.dumps(rows, indent=1))
            plot(rows, args.out / f"{kind}.png", title, targets)


if __name__ == "__main__":
    main()
