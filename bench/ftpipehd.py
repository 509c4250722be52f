"""FTPipeHD's asynchronous pipeline against the synchronous one, side by side (learning).

Both in virtual time over memory links (``aiopipe.simulate``), three stages of the same
model cut at the same points, the same data, epochs and learning rate: ``ftpipehd``
(asynchronous 1F1B, weight stashing, vertical sync, weight aggregation every
``version_aggregation`` x (S - p) updates) and ``pipeline`` (synchronous 1F1B, one
micro-batch per iteration, so each step uses the freshest weights), at each momentum
given. Prints per epoch the training loss and test accuracy of each.

What it shows: what staleness (batch b computes with the weights after update b - S)
costs in learning per epoch, and how momentum interacts with it. Not a throughput
comparison: in virtual time the compute of each stage costs the cost table's time;
throughput against PipeDream's partition and real processes are later parts of the
issue (bench/results/* when they exist).

    .venv/bin/python bench/ftpipehd.py [--model vgg5] [--samples 1000] [--epochs 4]
        [--momentum 0.9 0.5 0.0] [--aggregation 1 0]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from aiopipe import CostTable, RunConfig, VirtualClock, simulate


async def _run(config: RunConfig) -> tuple[list[float], list[float]]:
    costs = CostTable.uniform(5, forward=0.001, backward=0.002)
    result = await simulate(config, clock=VirtualClock(), cost_table=costs)
    return [e.loss for e in result.epochs], [e.accuracy for e in result.epochs]


async def main() -> None:
    """Run every variant and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--learning-rate", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, nargs="+", default=[0.9, 0.5, 0.0])
    parser.add_argument("--aggregation", type=int, nargs="+", default=[1, 0])
    args = parser.parse_args()
    base = RunConfig(model=args.model, devices=3, samples_per_device=args.samples,
                     batch_size=args.batch_size, epochs=args.epochs, partition=(1, 3),
                     test_samples=500, seed=3, learning_rate=args.learning_rate,
                     mode="pipeline", parallel_batches=1)
    print(f"{args.model}, 3 stages cut at (1, 3), {args.samples} samples, B = "
          f"{args.batch_size}, lr {args.learning_rate}, {args.epochs} epochs; "
          "loss / test accuracy per epoch")
    for momentum in args.momentum:
        variants = [("pipeline (sync)", base.replace(momentum=momentum))]
        variants += [(f"ftpipehd agg {m}", base.replace(mode="ftpipehd", momentum=momentum,
                                                        version_aggregation=m))
                     for m in args.aggregation]
        for name, config in variants:
            started = time.monotonic()
            losses, accuracies = await _run(config)
            cells = "  ".join(f"{loss:.3f}/{acc:.3f}" for loss, acc in
                              zip(losses, accuracies, strict=True))
            print(f"momentum {momentum:<4} {name:<17} {cells}   "
                  f"({time.monotonic() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
