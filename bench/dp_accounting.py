"""Accuracy against epsilon: local DP-SGD (``privacy = "dp-sgd"``) and central DP
(``aggregation = "dp-fedavg"``) at three noise levels each, and the same fleets without
differential privacy, in virtual time (the numerics are real; the clock is not).

- **local**: fl, ``--local-devices`` devices (4) of ``--local-samples`` (256) samples of
  synthetic-mnist each, batches of 32 (sampling rate 1/8), ``--local-epochs`` (4)
  epochs; DP-SGD with clipping norm 1 and noise multipliers 0.5, 1 and 2. Reported:
  the test accuracy after the last epoch and the largest device's epsilon (per sample
  of a device) at delta 1e-5.
- **central**: fl, ``--central-devices`` devices (100) of 32 samples each, 20 drawn a
  round (sampling rate 0.2), one round an epoch of two local batches of 16,
  ``--central-epochs`` (30) rounds; DP-FedAvg with clipping norm 0.3 (fixed) and noise
  multipliers 0.5, 1 and 2, and one adaptive-clipping run at 1 (median target).
  Reported: the test accuracy and the run's epsilon (per device) at delta 1e-3 (about
  1 / N^1.5 for N = 100 devices).

Every epsilon is Opacus's RDP accountant's (aiopipe.runtime.privacy_accounting), as the
run reports it in ``metrics.jsonl``; its sampling is Poisson's ([Note: sampling
assumed by the accountant]). The model is a small MLP (`mlp`), SGD at 0.5 without
momentum (DP-SGD's clipped gradients are small), seed 1.

    PYTHONPATH=. .venv/bin/python bench/dp_accounting.py [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from torch import nn

from aiopipe import CostTable, RunConfig, VirtualClock, simulate

NOISES = (0.5, 1.0, 2.0)
COSTS = CostTable.uniform(3, forward=0.001, backward=0.002)


def mlp(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """Three units: 784 -> 64 -> 64 -> classes (no batch norm: Opacus refuses it)."""
    features = math.prod(in_shape)
    return nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(features, 64), nn.ReLU()),
                         nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
                         nn.Linear(64, num_classes))


def local_config(args: argparse.Namespace, noise: float | None) -> RunConfig:
    """The local DP-SGD fleet (``noise`` None: without DP)."""
    options: dict[str, Any] = {"privacy": "none"} if noise is None else {
        "privacy": "dp-sgd", "dp_noise_multiplier": noise, "dp_max_grad_norm": 1.0,
        "dp_delta": 1e-5}
    return RunConfig(mode="fl", model=mlp, dataset="synthetic-mnist",
                     devices=args.local_devices, samples_per_device=args.local_samples,
                     batch_size=32, epochs=args.local_epochs, test_samples=1000,
                     learning_rate=0.5, momentum=0.0, seed=1, network="lan", options=options)


def central_config(args: argparse.Namespace, noise: float | None,
                   clipping: str = "fixed") -> RunConfig:
    """The central DP fleet (``noise`` None: plain FedAvg)."""
    options: dict[str, Any] = {"aggregation": "fedavg"} if noise is None else {
        "aggregation": "dp-fedavg", "dp_delta": 1e-3,
        "aggregation_options": {"noise_multiplier": noise, "clip": 0.3,
                                "clipping": clipping}}
    return RunConfig(mode="fl", model=mlp, dataset="synthetic-mnist",
                     devices=args.central_devices, devices_per_round=20,
                     samples_per_device=32, batch_size=16, epochs=args.central_epochs,
                     test_samples=1000, learning_rate=0.5, momentum=0.0, seed=1,
                     network="lan", options=options)


async def measure(kind: str, label: str, config: RunConfig) -> dict[str, Any]:
    """One run's row: its final accuracy and epsilon."""
    started = time.monotonic()
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    final = result.final
    refused = sum(len(m.updates_refused) for m in result.epochs)
    return {"kind": kind, "run": label, "accuracy": final.accuracy,
            "epsilon": None if math.isnan(final.epsilon) else final.epsilon,
            "delta": None if math.isnan(final.delta) else final.delta,
            "unit": final.privacy_unit, "updates_refused": refused,
            "wall_s": round(time.monotonic() - started, 1)}


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = ["| DP | run | test accuracy | epsilon | delta | per | refused updates | wall s |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.3g}"
        delta = "-" if r["delta"] is None else f"{r['delta']:g}"
        lines.append(f"| {r['kind']} | {r['run']} | {r['accuracy']:.3f} | {eps} | {delta} "
                     f"| {r['unit'] or '-'} | {r['updates_refused']} | {r['wall_s']} |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = [await measure("local", "no DP", local_config(args, None))]
    for noise in NOISES:
        rows.append(await measure("local", f"DP-SGD sigma {noise:g}",
                                  local_config(args, noise)))
    rows.append(await measure("central", "no DP (FedAvg)", central_config(args, None)))
    for noise in NOISES:
        rows.append(await measure("central", f"dp-fedavg z {noise:g}",
                                  central_config(args, noise)))
    rows.append(await measure("central", "dp-fedavg z 1 adaptive",
                              central_config(args, 1.0, "adaptive")))
    return rows


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local-devices", type=int, default=4)
    parser.add_argument("--local-samples", type=int, default=256)
    parser.add_argument("--local-epochs", type=int, default=4)
    parser.add_argument("--central-devices", type=int, default=100)
    parser.add_argument("--central-epochs", type=int, default=30)
    parser.add_argument("--out", type=Path, help="write results.json here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    found = asyncio.run(main(arguments))
    print(table(found))
    if arguments.out is not None:
        arguments.out.mkdir(parents=True, exist_ok=True)
        (arguments.out / "results.json").write_text(json.dumps(found, indent=1) + "\n")
