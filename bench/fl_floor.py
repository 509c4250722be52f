"""FL's floor on one device (issue 46 part 2): the same arithmetic as an aiopipe FL round's
training, timed three ways, one after another, in one process with one torch thread:

- ``plain``: a plain PyTorch loop (the Flower peer's ``fit``: batch, forward, loss,
  zero_grad, backward, step, the loss and accuracy summed);
- ``stage``: aiopipe's `StageWork` (forward_backward then step, one call per batch)
  reading the device's data as a device does, on the calling thread;
- ``compute``: the same, each batch one item on the node's `Compute` (the compute
  thread, handed over from the event loop), as `StageExecutor` runs it;

with the minor page faults per batch of the thread that trains ([Note: allocator] in
aiopipe/runtime/allocator.py: the compute thread's arena);

and the per-round fixed costs: the state for the wire (`state_to_wire`), back
(`state_from_wire`) and loaded into the stage (`load_stage_state`), FedAvg of the devices'
states (`fedavg`).

    PYTHONPATH=. .venv/bin/python bench/fl_floor.py [--model vgg5] [--batches 50]
        [--batch-size 100] [--repeat 3]

Each figure is the median over ``--repeat`` passes of ``--batches`` batches (a warm-up
pass first). Timing figures: run it under ``flock /tmp/bench.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from torch import nn

from aiopipe import RunConfig, SystemClock
from aiopipe.data import epoch_order
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import state_from_wire, state_to_wire
from aiopipe.runtime.aggregation import fedavg
from aiopipe.runtime.compute import Compute, warm_up_torch
from aiopipe.runtime.factories import make_optimizer
from aiopipe.runtime.holdings import load_stage_state
from aiopipe.runtime.plan import build_model, device_data
from aiopipe.runtime.stage import StageWork


def _plain(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    batches: int,
) -> None:
    loss_sum, correct = 0.0, 0
    for i in range(batches):
        x, y = batch(i)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += float(loss.detach()) * len(y)
        correct += int((logits.argmax(1) == y).sum())


def _stage(work: StageWork, batches: int) -> None:
    for i in range(batches):
        work.forward_backward(i, 0)
        work.step()


def _step_after(work: StageWork, i: int) -> None:
    work.forward_backward(i, 0)
    work.step()


def _faults() -> int:
    """Minor page faults of the calling thread so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


async def _compute(compute: Compute, work: StageWork, batches: int, faults: list[int]) -> None:
    before = await compute.call(_faults)
    for i in range(batches):
        await compute.run("s", partial(_step_after, work, i), iteration=i)
    faults.append(await compute.call(_faults) - before)


def _median(run: Callable[[], object], repeat: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _counted(run: Callable[[], object], faults: list[int]) -> None:
    before = _faults()
    run()
    faults.append(_faults() - before)


def main() -> None:
    """Print the floor and the per-round pieces, one line each."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2, help="states FedAvg averages")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warm_up_torch()
    b = args.batch_size
    config = RunConfig(
        mode="fl",
        model=args.model,
        devices=1,
        samples_per_device=args.batches * b,
        batch_size=b,
        epochs=1,
    )
    data = device_data(config, 0)
    order = epoch_order(np.arange(len(data)), epoch=0, seed=config.seed)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = data.batch(order[i * b : (i + 1) * b])
        return x, y  # type: ignore[return-value]

    model = build_model(config, num_classes=data.num_classes, in_shape=data.in_shape)
    print(
        f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; torch "
        f"{torch.__version__}, 1 thread; {args.model}, {args.batches} batches of {b}"
    )
    figures: dict[str, float] = {}
    faults: dict[str, list[int]] = {"plain": [], "stage": [], "compute": []}
    optimizer = make_optimizer(model, config)
    plain = partial(_plain, model, optimizer, batch, args.batches)
    figures["plain"] = _median(partial(_counted, plain, faults["plain"]), args.repeat)
    work = StageWork(
        model,
        make_optimizer(model, config),
        first=True,
        last=True,
        parallel_batches=1,
        num_classes=data.num_classes,
    )
    work.batch = lambda iteration, n: batch(iteration)
    stage = partial(_stage, work, args.batches)
    figures["stage"] = _median(partial(_counted, stage, faults["stage"]), args.repeat)
    compute = Compute(SystemClock(), Recorder(), "device0/compute")  # one thread, as a node's
    try:
        figures["compute"] = _median(
            lambda: asyncio.run(_compute(compute, work, args.batches, faults["compute"])),
            args.repeat,
        )
    finally:
        compute.close()
    for name, seconds in figures.items():
        print(
            f"{name:<8} {seconds:7.3f} s  {seconds / args.batches * 1e3:6.1f} ms/batch  "
            f"x{seconds / figures['plain']:.3f} of plain  "
            f"{statistics.median(faults[name][1:]) / args.batches:7.0f} page faults/batch"
        )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    wire = state_to_wire(state)
    size = sum(memoryview(t.data).nbytes for t in wire.values())
    pieces = {
        "state_to_wire": lambda: state_to_wire(state),
        "state_from_wire": lambda: state_from_wire(wire),
        "load_stage_state": lambda: load_stage_state(model, state_from_wire(wire), "state"),
        f"fedavg x{args.devices}": lambda: fedavg([state] * args.devices, [1.0] * args.devices),
    }
    print(f"state {size / 1e6:.2f} MB in {len(wire)} tensors")
    for name, piece in pieces.items():
        print(f"{name:<17} {_median(piece, max(args.repeat, 5)) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
