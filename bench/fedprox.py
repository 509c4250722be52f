"""FedProx against FedAvg on a Dirichlet(0.1) non-IID split with heterogeneous local
work (issue 45): test accuracy after a fixed budget of rounds, side by side.

The fleet: ``--devices`` devices (10) on synthetic-cifar10, labels spread by
Dirichlet(``--alpha``) (0.1: most devices hold one or two classes), device sizes spread
evenly from ``--smallest`` to ``--largest`` samples. A round is one pass of each device
over its own data, so local work differs by the same factor (the largest device takes
``largest / smallest`` times the smallest's local steps): the heterogeneity FedProx's
proximal term is for (Li et al. 2020, §5: "systems heterogeneity" there is variable
local epochs; here it is variable local data, which varies the local steps alike). The
arms share data, model, seed and learning rate:

- **fedavg**: FedAvg weighted by samples;
- **fedprox mu**: FedAvg on the server, each device's loss plus mu/2 ||w - w_global||^2
  (``aggregation = "fedprox"``, ``aggregation_options = {mu = ...}``).

Each arm runs for ``--rounds`` rounds from each of ``--seeds`` seeds (the seed draws the
split, the initial weights and the order); reported per arm: the accuracy after the
last round and the mean of the last three rounds, averaged over the seeds, with the
per-seed figures. Simulated in one process (memory links, virtual clock): accuracy does
not depend on the machine's load.

    .venv/bin/python bench/fedprox.py [--rounds 20] [--seeds 1,2,3] [--mus 0.01,0.1,1]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from aiopipe import RunConfig, VirtualClock, simulate


def arm_config(args: argparse.Namespace, seed: int, mu: float | None) -> RunConfig:
    """The fleet's config for one arm (``mu`` None: FedAvg)."""
    n = args.devices
    sizes = tuple(round(args.smallest + (args.largest - args.smallest) * k / max(1, n - 1))
                  for k in range(n))
    options: dict[str, Any] = ({} if mu is None else
                               {"aggregation": "fedprox", "aggregation_options": {"mu": mu}})
    return RunConfig(mode="fl", model="fedbuff:cnn", dataset="synthetic-cifar10", devices=n,
                     samples_per_device=sizes, batch_size=args.batch_size,
                     epochs=args.rounds, data_partition="dirichlet",
                     dirichlet_alpha=args.alpha, test_samples=1000,
                     learning_rate=args.learning_rate, momentum=0.0, seed=seed,
                     options=options)


def run_arm(config: RunConfig) -> list[float]:
    """``config`` simulated: its test accuracy after each round."""
    result = asyncio.run(simulate(config, clock=VirtualClock(), progress=lambda _: None))
    return [e.accuracy for e in result.epochs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--smallest", type=int, default=64)
    parser.add_argument("--largest", type=int, default=640)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--mus", default="0.01,0.1,1")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # (the model, by name)
    seeds = [int(s) for s in args.seeds.split(",")]
    arms: dict[str, float | None] = {"fedavg": None}
    arms.update({f"fedprox mu={m}": float(m) for m in args.mus.split(",")})
    rows: dict[str, dict[str, Any]] = {}
    for name, mu in arms.items():
        started = time.perf_counter()
        curves = {seed: run_arm(arm_config(args, seed, mu)) for seed in seeds}
        last = [c[-1] for c in curves.values()]
        tail = [statistics.fmean(c[-3:]) for c in curves.values()]
        rows[name] = {"mu": mu, "curves": {str(s): c for s, c in curves.items()},
                      "last": statistics.fmean(last), "last3": statistics.fmean(tail),
                      "last_per_seed": last, "wall_s": round(time.perf_counter() - started, 1)}
        print(f"{name}: last {rows[name]['last']:.3f} (seeds {', '.join(f'{a:.3f}' for a in last)})"
              f"; mean of last 3 rounds {rows[name]['last3']:.3f}; {rows[name]['wall_s']} s",
              flush=True)
    base = rows["fedavg"]["last3"]
    print(f"\n{'arm':<18} {'last round':>10} {'last 3':>8} {'vs fedavg':>10}")
    for name, row in rows.items():
        print(f"{name:<18} {row['last']:>10.3f} {row['last3']:>8.3f} "
              f"{row['last3'] - base:>+10.3f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"args": {k: v for k, v in vars(args).items() if k != "out"},
                  "sizes": list(arm_config(args, seeds[0], None).samples_per_device),
                  "arms": rows}
        (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
