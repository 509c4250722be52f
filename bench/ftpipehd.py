"""FTPipeHD's asynchronous pipeline side by side: against the synchronous pipeline
(learning), and its planner's partition against PipeDream's homogeneous one on a
heterogeneous fleet (throughput, ``--throughput``).

Both in virtual time over memory links (``aiopipe.simulate``), three stages of the same
model cut at the same points, the same data, epochs and learning rate: ``ftpipehd``
(asynchronous 1F1B, weight stashing, vertical sync, weight aggregation every
``version_aggregation`` x (S - p) updates) and ``pipeline`` (synchronous 1F1B, one
micro-batch per iteration, so each step uses the freshest weights), at each momentum
given. Prints per epoch the training loss and test accuracy of each.

What it shows: what staleness (batch b computes with the weights after update b - S)
costs in learning per epoch, and how momentum interacts with it.

``--throughput``: 4 stages, devices 1, 1, 1 and 10x slower (``device_slowdown``), the
model's costs measured on this machine at the start (virtual time then charges them):
the epoch time of FTPipeHD's cuts for those capacities against the homogeneous cuts
(the same planner with every capacity 1, PipeDream's assumption), and of a run that
declares every device alike and re-partitions from what its first epoch measured.
Virtual time: the figures are the cost model's (each stage's compute, the links'
shaping), not a measurement of real devices; a slowdown factor is not a slow device.

    .venv/bin/python bench/ftpipehd.py [--model vgg5] [--samples 1000] [--epochs 4]
        [--momentum 0.9 0.5 0.0] [--aggregation 1 0]
    .venv/bin/python bench/ftpipehd.py --throughput [--models vgg5 mobilenetv3-small]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.api import _measure
from aiopipe.runtime.plan import build_model
from aiopipe.runtime.systems.pipeline import _Planner


async def _run(config: RunConfig) -> tuple[list[float], list[float]]:
    costs = CostTable.uniform(5, forward=0.001, backward=0.002)
    result = await simulate(config, clock=VirtualClock(), cost_table=costs)
    return [e.loss for e in result.epochs], [e.accuracy for e in result.epochs]


async def throughput(model: str, samples: int, batch: int) -> None:
    """Epoch times of the three partitions on a 1, 1, 1, 10x fleet (module docstring)."""
    slow = (1.0, 1.0, 1.0, 10.0)
    base = RunConfig(mode="ftpipehd", model=model, devices=4, samples_per_device=samples,
                     batch_size=batch, epochs=2, test_samples=100, seed=3, momentum=0.5,
                     learning_rate=0.02, device_slowdown=slow)
    costs = _measure(base, None)
    planner = _Planner.of(base, costs, build_model(base, num_classes=10,
                                                   in_shape=(3, 32, 32)), (3, 32, 32), batch)
    homogeneous = planner.cuts([1.0] * 4, range(4))
    dynamic = planner.cuts(list(slow), range(4))
    rows = []
    for name, config in (
            ("homogeneous (PipeDream)", base.replace(partition=homogeneous.cuts)),
            ("FTPipeHD, declared", base.replace(partition=dynamic.cuts)),
    ):
        result = await simulate(config, clock=VirtualClock(), cost_table=costs)
        rows.append((name, config.partition, result.epochs[-1].time_s))
    # declared alike, really 1, 1, 1, 10: the first epoch measures, the second re-plans
    from aiopipe.runtime import device as device_module

    honest = device_module._DeviceNode._run_config

    def really_slow(self: Any, plan: Any) -> RunConfig:
        return honest(self, plan).replace(device_slowdown=slow)

    device_module._DeviceNode._run_config = really_slow  # type: ignore[method-assign]
    try:
        measured = await simulate(base.replace(device_slowdown=1.0, partition="auto"),
                                  clock=VirtualClock(), cost_table=costs)
    finally:
        device_module._DeviceNode._run_config = honest  # type: ignore[method-assign]
    first, second = measured.epochs
    estimate = planner.time(homogeneous.cuts, slow, range(4))
    print(f"{model}: 4 stages, devices 1, 1, 1, 10x; {samples} samples, B = {batch}; "
          f"estimated batch time homogeneous {estimate:.4f} s, "
          f"FTPipeHD {dynamic.time_s:.4f} s")
    for name, cuts, seconds in rows:
        print(f"  {name:<26} cuts {cuts!s:<14} epoch {seconds:8.3f} s  "
              f"x{rows[0][2] / seconds:.2f}")
    print(f"  {'measured, re-partitioned':<26} epoch 1 {first.time_s:.3f} s -> epoch 2 "
          f"{second.time_s:.3f} s (cuts {[p['units'] for p in second.plan]})")


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
    parser.add_argument("--throughput", action="store_true",
                        help="the heterogeneous-fleet comparison instead")
    parser.add_argument("--models", nargs="+", default=["vgg5", "mobilenetv3-small"])
    args = parser.parse_args()
    if args.throughput:
        for model in args.models:
            await throughput(model, args.samples // 5, args.batch_size)
        return
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
