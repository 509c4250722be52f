"""How much a pipelined compute item costs beyond the cost table's unit costs (issue 27,
item 3's lead): one device, PiPar at a fixed split P and N = 1, 5, 10, 20, on the real
clock and in virtual time from a table measured here just before; the device's busy
seconds of both, and the difference per compute item (a forward or backward per
micro-batch and one step per iteration). The device runs with slowdown 1.001, so its
busy seconds are its compute thread's CPU seconds ([Note: emulated slow devices]); the
server's are elapsed seconds (its passes share the 2 cores with the device's thread).

    .venv/bin/python bench/item_overhead.py [--model vgg5] [--split 1]

What a run's device pays per item beyond the table (the stage's wrapper: wire tensors in
and out, the loss, autograd's bookkeeping) is what an emulated device multiplies by its
slowdown and what the planner's estimate does not charge.
"""

from __future__ import annotations

import argparse
import asyncio

from aiopipe import RunConfig, SystemClock, VirtualClock, simulate
from aiopipe.runtime.plan import build_model, measure_planning_costs, train_dataset
from aiopipe.runtime.systems.base import planning_batch_sizes


def main() -> None:
    """Print one line per N."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--split", type=int, default=1)
    parser.add_argument("--samples", type=int, default=500)
    args = parser.parse_args()
    for n in (1, 5, 10, 20):
        config = RunConfig(mode="pipar", model=args.model, devices=1,
                           samples_per_device=args.samples, batch_size=100, epochs=2,
                           split_point=args.split, parallel_batches=n, device_slowdown=1.001,
                           test_samples=0, network="lan")
        data = train_dataset(config)
        model = build_model(config, num_classes=data.num_classes, in_shape=data.in_shape)
        table = measure_planning_costs(config, model, data.in_shape, data,
                                       sizes=planning_batch_sizes(config))
        charged = asyncio.run(simulate(config, clock=VirtualClock(), cost_table=table,
                                       progress=lambda metrics: None)).epochs[-1]
        real = asyncio.run(simulate(config, clock=SystemClock(),
                                    progress=lambda metrics: None)).epochs[-1]
        items = args.samples // 100 * (2 * n + 1)
        extra = real.busy_s["device"] - charged.busy_s["device"]
        print(f"{args.model} P{args.split} N{n}: device busy {real.busy_s['device']:.3f} s, "
              f"table's {charged.busy_s['device']:.3f} s, {extra * 1e3 / items:.2f} ms more "
              f"per item ({items} items); server busy {real.busy_s['server']:.3f} s, "
              f"table's {charged.busy_s['server']:.3f} s", flush=True)


if __name__ == "__main__":
    main()
