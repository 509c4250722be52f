"""Checkpoint cost: time to write one server checkpoint (global model, every replica and
its momentum; fsynced, renamed) for a model and fleet size, next to one iteration's
compute, so the overhead per iteration can be read off.

    .venv/bin/python bench/checkpoint.py [--model vgg5] [--devices 3] [--repeat 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from aiopipe import RunConfig
from aiopipe.clock import SystemClock
from aiopipe.runtime.server import ServerNode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = RunConfig(model=args.model, devices=args.devices, samples_per_device=100,
                       batch_size=args.batch_size, momentum=0.9, test_samples=10)
    with tempfile.TemporaryDirectory() as tmp:
        node = ServerNode(config, clock=SystemClock(), checkpoint_dir=Path(tmp))
        node._tally = {"epoch": 0, "next_round": 0, "device_samples": [0] * args.devices,
                       "loss_sum": 0.0, "correct": 0, "lost": [], "elapsed_before": 0.0}
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            node._write_checkpoint(0, 1, 0.0)
            times.append(time.perf_counter() - start)
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
    model = node.model
    x = torch.randn(args.batch_size, *node.in_shape)
    y = torch.randint(0, node.num_classes, (args.batch_size,))
    steps = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(args.repeat):
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.append(time.perf_counter() - start)
    write, step = statistics.median(times), statistics.median(steps)
    print(f"model {args.model}, {args.devices} devices, checkpoint {size / 1e6:.1f} MB")
    print(f"checkpoint write (median of {args.repeat}): {write * 1e3:.1f} ms")
    print(f"one training step of the whole model at batch {args.batch_size}: "
          f"{step * 1e3:.1f} ms")
    print(f"checkpoint / step: {write / step:.2f} (one checkpoint per round; a round is "
          f"aggregation_every iterations, or an epoch)")


if __name__ == "__main__":
    main()
