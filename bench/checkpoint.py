"""Checkpoint cost: the copy of the server's state (on the server's compute thread as
the next round starts, while the devices run their first forward passes) and the
write of that copy (global model, replicas' weights where they
differ from it, every replica's momentum; fsynced, renamed), which runs while training
goes on ([Note: background checkpoints] in aiopipe/runtime/checkpoint.py); next to one
iteration's compute, so the overhead per round can be read off.

    .venv/bin/python bench/checkpoint.py [--model vgg5] [--devices 3] [--split-point 1]
        [--repeat 10]
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
from aiopipe.runtime.checkpoint import save_checkpoint
from aiopipe.runtime.coordinator import Coordinator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--split-point", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = RunConfig(model=args.model, devices=args.devices, samples_per_device=100,
                       batch_size=args.batch_size, momentum=0.9, test_samples=10,
                       split_point=args.split_point, parallel_batches=1)
    with tempfile.TemporaryDirectory() as tmp:
        node = Coordinator(config, clock=SystemClock(), checkpoint_dir=Path(tmp))
        node._tally = {"epoch": 0, "next_round": 0, "device_samples": [0] * args.devices,
                       "loss_sum": 0.0, "correct": 0, "lost": [], "elapsed_before": 0.0}
        for k, plan in enumerate(node.system.plans):  # as after a round: momentum held
            half, optimizer = node.system.replicas.open(k, plan.split_point, config)
            for param in half.parameters():
                optimizer.state[param]["momentum_buffer"] = torch.randn_like(param)
            node.system.replicas.close([k])
        copies, writes = [], []
        for _ in range(args.repeat):
            start = time.perf_counter()
            tensors, meta = node.system.checkpoint_tensors(), node._checkpoint_meta(0, 1, 0.0)
            copied = time.perf_counter()
            save_checkpoint(tmp, tensors, meta)
            copies.append(copied - start)
            writes.append(time.perf_counter() - copied)
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
    model = node.model
    x = torch.randn(args.batch_size, *node.test_set.in_shape)
    y = torch.randint(0, node.test_set.num_classes, (args.batch_size,))
    steps = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(args.repeat):
        start = time.perf_counter()
        torch.autograd.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        steps.append(time.perf_counter() - start)
    copy, write = statistics.median(copies), statistics.median(writes)
    step = statistics.median(steps)
    print(f"model {args.model}, {args.devices} devices, split point {args.split_point}, "
          f"checkpoint {size / 1e6:.1f} MB")
    print(f"copy, as the next round starts (median of {args.repeat}): {copy * 1e3:.1f} ms; "
          f"write, while training goes on: {write * 1e3:.1f} ms")
    print(f"one training step of the whole model at batch {args.batch_size}: "
          f"{step * 1e3:.1f} ms")
    print(f"copy / step: {copy / step:.2f}, write / step: {write / step:.2f} (one checkpoint "
          f"per round; a round is aggregation_every iterations, or an epoch; a write longer "
          f"than a round makes the next checkpoint wait for it)")


if __name__ == "__main__":
    main()
