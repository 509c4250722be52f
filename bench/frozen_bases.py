"""Bytes a round moves with a frozen base against full fine-tuning, side by side (issue
44, item 4; [Note: frozen bases] in aiopipe/runtime/systems/star/coordinator.py).

A four-unit model on synthetic-cifar10 (3072 -> 32 -> 32 -> 32 -> 10), its first two
units frozen (98.6% of its parameters) or not, trained by three devices of unequal
shares in virtual time, the same seed and config otherwise; per mode the last epoch's
bytes up and down of both runs and their ratio, and whether the frozen units came back
bit for bit. Deterministic: bytes on the wire, not seconds.

    .venv/bin/python bench/frozen_bases.py [--modes fl sfl pipar]
"""

from __future__ import annotations

import argparse
import asyncio

import torch
from torch import nn

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.runtime.plan import build_model, train_dataset

COSTS = CostTable.uniform(4, forward=0.001, backward=0.002)


def frozen_base(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """Four units; the first two frozen."""
    features = 1
    for side in in_shape:
        features *= side
    model = nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(features, 32), nn.ReLU()),
                          nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
                          nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
                          nn.Linear(32, num_classes))
    for unit in list(model)[:2]:
        unit.requires_grad_(False)
    return model


def everything_trained(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """The same model with nothing frozen."""
    return frozen_base(num_classes, in_shape).requires_grad_(True)


async def compare(mode: str) -> str:
    config = RunConfig(mode=mode, model=frozen_base, devices=3,
                       samples_per_device=(40, 30, 70), batch_size=10, epochs=2,
                       split_point=2, parallel_batches=2, learning_rate=0.05, momentum=0.9,
                       test_samples=20, seed=4)
    frozen = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    full = await simulate(config.replace(model=everything_trained), clock=VirtualClock(),
                          cost_table=COSTS)
    dataset = train_dataset(config)
    initial = build_model(config, num_classes=dataset.num_classes,
                          in_shape=dataset.in_shape).state_dict()
    kept = all(torch.equal(frozen.model.state_dict()[k], v) for k, v in initial.items()
               if k.startswith(("0.", "1.")))
    a, b = frozen.epochs[-1], full.epochs[-1]
    return (f"| {mode} | {a.bytes_up} | {b.bytes_up} | {a.bytes_up / b.bytes_up:.3f} | "
            f"{a.bytes_down} | {b.bytes_down} | {a.bytes_down / b.bytes_down:.3f} | "
            f"{'yes' if kept else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="*", default=["fl", "sfl", "pipar"])
    args = parser.parse_args()
    print("| mode | up B, frozen base | up B, all trained | ratio | down B, frozen | "
          "down B, all | ratio | frozen units bit for bit |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        print(asyncio.run(compare(mode)))


if __name__ == "__main__":
    main()
