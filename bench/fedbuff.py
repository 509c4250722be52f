"""FedBuff (``mode = "fedbuff"``) against synchronous FedAvg (``mode = "fl"``) on a
fleet of unequal devices: time to a target test accuracy, in virtual time.

The fleet: ``--devices`` devices (8) with compute slowdowns spread evenly from 1x to
``--slowest`` (10x), each with ``--samples`` samples of synthetic-mnist (iid), a small
MLP (`mlp`: fast on a CPU), batches of 32, wifi-like links. Both runs use the same
data, model, seed and one cost table measured here once (so they are charged alike):

- **fl**: FedAvg through the coordinator once an epoch: every device trains its epoch,
  then the coordinator averages; each round waits for the slowest device;
- **fedbuff**: each device trains ``--local-steps`` mini-batches from the newest model
  and uploads its delta; the server applies every ``--buffer-size`` arrivals with
  staleness weights 1/sqrt(1+tau) (an epoch: as many samples as the fleet holds).

With ``--concurrency C`` the fleet is a population of which C train at a time: fl draws C
devices each round (``devices_per_round``), fedbuff keeps C training at once, each next
one drawn from the idle (its ``concurrency``).

Reported: each run's accuracy after each epoch against virtual time, the time each
first reaches each of ``--targets`` test accuracies, and fl's time over fedbuff's,
printed next to the paper's 3.3x (Nguyen et al. 2022: FedBuff vs FedAvg, time to target
on their benchmarks, thousands of simulated clients); FedBuff's rounds per device and
the staleness of their deltas.

    .venv/bin/python bench/fedbuff.py [--targets 0.5,0.6,0.7] [--epochs 20]
        [--devices 8] [--concurrency 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from torch import nn

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.runtime.plan import build_model, measure_planning_costs, train_dataset
from aiopipe.runtime.systems.base import planning_batch_sizes

BATCH = 32
PAPER_SPEEDUP = 3.3


def cnn(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """A small CNN in four units (about 20 k parameters: little to send, compute enough
    for the devices' speeds to matter): three 3x3 convolutions with pooling, then the
    classifier."""
    c, h, w = in_shape
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(32 * (h // 8) * (w // 8), num_classes)))


def fleet(mode: str, args: argparse.Namespace, **changes: Any) -> RunConfig:
    """The fleet's config for ``mode``."""
    n = args.devices
    slowdowns = tuple(round(1 + (args.slowest - 1) * k / max(1, n - 1), 3) for k in range(n))
    return RunConfig(mode=mode, model="fedbuff:cnn", dataset=args.dataset, devices=n,
                     samples_per_device=args.samples, batch_size=BATCH,
                     device_slowdown=slowdowns, network=args.network, test_samples=1000,
                     learning_rate=args.learning_rate, momentum=0.0, seed=1,
                     **{"epochs": args.epochs, **changes})


def time_to(epochs: list[dict[str, Any]], target: float) -> float | None:
    """Virtual seconds until the first epoch at ``target`` accuracy (None: never)."""
    elapsed = 0.0
    for e in epochs:
        elapsed += e["time_s"]
        if e["accuracy"] >= target:
            return elapsed
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--slowest", type=float, default=10.0)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--fl-epochs", type=int, default=0,
                        help="fl's epochs where they differ (a sampled fl epoch is a round)")
    parser.add_argument("--targets", default="0.5,0.6,0.7")
    parser.add_argument("--dataset", default="synthetic-cifar10")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--network", default="wifi")
    parser.add_argument("--buffer-size", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=0,
                        help="devices training at once (0: all): fl's devices_per_round")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    targets = [float(t) for t in args.targets.split(",")]
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # (the model, by name)
    base = fleet("fl", args)
    dataset = train_dataset(base)
    model = build_model(base, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    costs = measure_planning_costs(base, model, dataset.in_shape, dataset,
                                   sizes=planning_batch_sizes(base))
    runs = {"fl": fleet("fl", args, devices_per_round=args.concurrency,
                        epochs=args.fl_epochs or args.epochs),
            "fedbuff": fleet("fedbuff", args, options={
                "buffer_size": args.buffer_size, "local_steps": args.local_steps,
                "concurrency": args.concurrency})}
    rows: dict[str, dict[str, Any]] = {}
    for name, config in runs.items():
        started = time.perf_counter()
        result = asyncio.run(simulate(config, clock=VirtualClock(), cost_table=costs,
                                      progress=lambda _: None))
        epochs = [e.to_mapping() for e in result.epochs]
        rows[name] = {"epochs": [{"time_s": e["time_s"], "accuracy": e["accuracy"],
                                  "loss": e["loss"]} for e in epochs],
                      "time_to_target_s": {t: time_to(epochs, t) for t in targets},
                      "best_accuracy": max(e["accuracy"] for e in epochs),
                      "total_s": sum(e["time_s"] for e in epochs),
                      "wall_s": round(time.perf_counter() - started, 1)}
        curve = ", ".join(f"{e['accuracy']:.2f}" for e in epochs)
        print(f"{name}: epoch accuracies {curve}; {rows[name]['total_s']:.2f} virtual s "
              f"({rows[name]['wall_s']} s wall)")
    # (result: the last run's, fedbuff's)
    changes = [c for e in result.epochs for c in e.changes if c.get("kind") == "fedbuff-epoch"]
    per_device = [sum(c["rounds"][k] for c in changes) for k in range(args.devices)]
    taus = [[t for c in changes for t in c["staleness"][k]] for k in range(args.devices)]
    mean_tau = [round(sum(t) / len(t), 2) if t else None for t in taus]
    print(f"fedbuff rounds per device (1x .. {args.slowest:g}x): {per_device}; mean "
          f"staleness {mean_tau}; server updates {changes[-1]['version']}; at most "
          f"{max(c['most_at_once'] for c in changes)} training at once")
    ratios: dict[float, float | None] = {}
    print(f"\n{'target':>7} {'fl (s)':>8} {'fedbuff (s)':>12} {'fl/fedbuff':>11}")
    for t in targets:
        fl, fb = rows["fl"]["time_to_target_s"][t], rows["fedbuff"]["time_to_target_s"][t]
        ratios[t] = fl / fb if fl is not None and fb is not None else None
        shown = "n/a" if ratios[t] is None else f"{ratios[t]:.2f}x"
        print(f"{t:>7.0%} {'never' if fl is None else f'{fl:.2f}':>8} "
              f"{'never' if fb is None else f'{fb:.2f}':>12} {shown:>11}")
    print(f"(the paper: {PAPER_SPEEDUP}x; virtual seconds)")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"args": {k: v for k, v in vars(args).items() if k != "out"},
                  "slowdowns": list(runs["fl"].device_slowdown),
                  "ratios": {str(t): r for t, r in ratios.items()},
                  "fedbuff_rounds_per_device": per_device, "fedbuff_mean_staleness": mean_tau,
                  "paper_ratio": PAPER_SPEEDUP, "runs": rows}
        (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
