"""HADFL (``mode = "hadfl"``) against the synchronous ways of training the same fleet:
time to accuracy, traffic, and the strategy's version prediction.

The fleet: 4 devices of computing power 4 : 2 : 2 : 1 (the paper's [4, 2, 2, 1]: device
slowdowns 1, 2, 2, 4, times ``--scale``), each with ``--samples`` samples of ``--dataset``
(synthetic-cifar10 by default; iid, or with ``--dirichlet ALPHA`` non-IID shards, as the
paper's harder regime), ``--model`` (vgg5), batches of 48, wifi-like links
(``--network``). Four runs on the same runtime, side by side:

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
accuracies (with ``--relative``: fractions of the best accuracy any run reached, the
paper's "0.7 / 0.8 of the final accuracy"), and HADFL's speedups; bytes device to
device per round against the paper's 2·K·M; bytes through the coordinator; Holt's
predicted versions against those that happened.

``--virtual`` (the default): in virtual time, compute charged from one cost table
measured here for every run (deterministic). ``--processes``: the same runs between
real processes (``python -m aiopipe``: a server and four device processes over loopback
websockets, each sender paced at the network's rate, each device's compute stretched
by its slowdown: 4 devices emulated on this machine's cores, so the figures show the
schedule, not a Raspberry Pi).

    .venv/bin/python bench/hadfl.py [--virtual] [--processes] [--epochs 10]
        [--targets 0.6,0.7,0.8,0.85] [--relative] [--samples 960] [--scale 1]
        [--network wifi] [--model vgg5] [--dataset synthetic-cifar10] [--dirichlet ALPHA]
        [--out DIR]
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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Fleet:
    """What every run of the comparison shares."""

    epochs: int
    samples: int
    scale: float = 1.0
    network: str = "wifi"
    model: str = "vgg5"
    dataset: str = "synthetic-cifar10"
    #: None: iid shards; else each device's labels drawn from Dirichlet(alpha)
    dirichlet: float | None = None

    def config(self, changes: dict[str, Any]) -> RunConfig:
        """The fleet's config with one run's ``changes`` (DDP-like's epoch is
        ``batches`` rounds, so it gets as many epochs as the others)."""
        partition: dict[str, Any] = ({} if self.dirichlet is None else {
            "data_partition": "dirichlet", "dirichlet_alpha": self.dirichlet})
        return RunConfig(model=self.model, dataset=self.dataset, devices=4,
                         samples_per_device=self.samples, batch_size=BATCH,
                         epochs=self.epochs,
                         device_slowdown=tuple(self.scale * s for s in SLOWDOWNS),
                         network=self.network, test_samples=1000, learning_rate=0.02,
                         heartbeat_interval=5.0, device_timeout=120.0, **partition,
                         **changes)

    def title(self, kind: str) -> str:
        """One line naming the fleet."""
        shards = "iid" if self.dirichlet is None else f"Dirichlet({self.dirichlet:g})"
        return (f"{kind}: 4 devices, slowdowns {[self.scale * s for s in SLOWDOWNS]}, "
                f"{self.samples} samples each ({shards}) of {self.dataset}, {self.model}, "
                f"{self.network}, {self.epochs} epochs")


def absolute_targets(rows: list[dict[str, Any]], fractions: list[float]
                     ) -> list[float]:
    """``fractions`` of the best test accuracy any run reached, rounded to 3 places (the
    paper's time to 0.7 / 0.8 of the final accuracy)."""
    best = max(row["best_accuracy"] for row in rows)
    return [round(f * best, 3) for f in fractions]


def retimed(rows: list[dict[str, Any]], targets: list[float]) -> None:
    """Set each row's ``time_to_s`` to the first epoch end at or above each target."""
    for row in rows:
        row["time_to_s"] = {str(t): next((s for s, a in row["curve"] if a >= t), None)
                            for t in targets}


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


def virtual(fleet: Fleet, targets: list[float]) -> list[dict[str, Any]]:
    """Every run in virtual time, charged from one cost table measured here."""
    base = fleet.config({"mode": "hadfl"})
    dataset = train_dataset(base)
    model = build_model(base, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    costs = measure_planning_costs(base, model, dataset.in_shape, dataset,
                                   sizes=planning_batch_sizes(base))
    rows = []
    for name, changes in runs(fleet.samples).items():
        config = fleet.config(changes)
        started = time.perf_counter()
        result = asyncio.run(simulate(config, clock=VirtualClock(), cost_table=costs))
        row = summary(name, [e.to_mapping() for e in result.epochs], targets)
        row["wall_s"] = time.perf_counter() - started
        rows.append(row)
        print(f"  {name}: best {row['best_accuracy']:.3f} in {row['time_s']:.1f} s "
              f"(virtual; {row['wall_s']:.0f} s wall)", flush=True)
    return rows


def processes(fleet: Fleet, targets: list[float]) -> list[dict[str, Any]]:
    """Every run between real processes (``python -m aiopipe``)."""
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, changes in runs(fleet.samples).items():
            config = fleet.config(changes)
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
              "| run | " + " | ".join(f"to {t:g}" for t in targets) + " |",
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
    parser.add_argument("--relative", action="store_true",
                        help="--targets are fractions of the best accuracy any run reached")
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--dataset", default="synthetic-cifar10")
    parser.add_argument("--dirichlet", type=float, metavar="ALPHA",
                        help="non-IID shards: each device's labels from Dirichlet(ALPHA)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    fleet = Fleet(epochs=args.epochs, samples=args.samples, scale=args.scale,
                  network=args.network, model=args.model, dataset=args.dataset,
                  dirichlet=args.dirichlet)
    config = fleet.config({"mode": "hadfl"})
    data = train_dataset(config)
    model = build_model(config, num_classes=data.num_classes, in_shape=data.in_shape)
    model_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values()
                      if v.is_floating_point())
    targets = [float(t) for t in args.targets.split(",")]
    kinds = [k for k in ("virtual", "processes") if getattr(args, k)] or ["virtual"]
    for kind in kinds:
        title = fleet.title(kind)
        print(title, flush=True)
        rows = (virtual if kind == "virtual" else processes)(fleet, targets)
        timed = targets
        if args.relative:
            timed = absolute_targets(rows, targets)
            retimed(rows, timed)
            title += (f"; targets {', '.join(f'{f:g}' for f in targets)} of the best "
                      f"accuracy reached ({max(r['best_accuracy'] for r in rows):.3f}): "
                      f"{', '.join(f'{t:.3f}' for t in timed)}")
        lines = [title, "", *table(rows, timed, model_bytes)]
        print("\n".join(lines), flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{kind}.md").write_text("\n".join(lines) + "\n")
            (args.out / f"{kind}.json").write_text(json.dumps(rows, indent=1))
            plot(rows, args.out / f"{kind}.png", title, timed)


if __name__ == "__main__":
    main()
