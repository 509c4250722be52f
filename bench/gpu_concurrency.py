"""What running several devices' server passes at once buys on a GPU (issue 27, item 2):
``--replicas`` copies of a model's server half (units ``--split``..Q), each trained one
pass at a time (forward, cross-entropy, backward, SGD step) on its own micro-batches,
three ways:

- **in turn**: one replica's pass after another from one thread, on the default stream
  (what the runtime's server queue does today);
- **streams**: the replicas' passes issued round-robin from one thread, each replica on
  its own CUDA stream;
- **threads**: one Python thread per replica, each on its own stream.

Printed: passes per second for each way and micro-batch size, and the speedup over "in
turn". A raw torch measurement, not the runtime.

    python3 bench/gpu_concurrency.py [--model resnet18] [--split 1] [--replicas 8]
        [--sizes 10,20,50,100] [--passes 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch
from torch import nn

from aiopipe import models
from aiopipe.config import RunConfig
from aiopipe.runtime.factories import build_model


def server_halves(name: str, split: int, replicas: int, device: torch.device
                  ) -> tuple[list[nn.Sequential], tuple[int, ...]]:
    """``replicas`` copies of the server half and the shape of its input."""
    model = build_model(RunConfig(model=name), num_classes=10, in_shape=(3, 32, 32))
    device_half, _ = models.split(model, split)
    with torch.no_grad():
        shape = tuple(device_half(torch.zeros(1, 3, 32, 32)).shape[1:])
    halves = [models.split(build_model(RunConfig(model=name), num_classes=10,
                                       in_shape=(3, 32, 32)), split)[1].to(device)
              for _ in range(replicas)]
    return halves, shape


def timed(run: object) -> float:
    """Seconds of ``run()`` with the GPU synchronised around it."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()  # type: ignore[operator]
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(size: int, halves: list[nn.Sequential], optimizers: list[torch.optim.SGD],
            streams: list[torch.cuda.Stream], shape: tuple[int, ...], passes: int
            ) -> dict[str, float]:
    """Passes per second of the three ways at micro-batches of ``size``."""
    device = torch.device("cuda")
    x = [torch.randn(size, *shape, device=device) for _ in halves]
    y = [torch.randint(10, (size,), device=device) for _ in halves]

    def one(r: int) -> None:
        loss = nn.functional.cross_entropy(halves[r](x[r]), y[r])
        loss.backward()
        optimizers[r].step()
        optimizers[r].zero_grad(set_to_none=True)

    def in_turn() -> None:
        for _ in range(passes):
            for r in range(len(halves)):
                one(r)

    def on_streams() -> None:
        for _ in range(passes):
            for r, stream in enumerate(streams):
                with torch.cuda.stream(stream):
                    one(r)

    def on_threads() -> None:
        def work(r: int) -> None:
            with torch.cuda.stream(streams[r]):
                for _ in range(passes):
                    one(r)
        threads = [threading.Thread(target=work, args=(r,)) for r in range(len(halves))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    ways = {"in turn": in_turn, "streams": on_streams, "threads": on_threads}
    for way in ways.values():  # warm-up
        way()
    total = passes * len(halves)
    row: dict[str, float] = {"size": size}
    for name, way in ways.items():
        row[name] = total / min(timed(way) for _ in range(3))
    return row


def main() -> None:
    """Measure and print (and write)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--split", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--sizes", default="10,20,50,100")
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    halves, shape = server_halves(args.model, args.split, args.replicas, device)
    optimizers = [torch.optim.SGD(h.parameters(), lr=0.01, momentum=0.9) for h in halves]
    streams = [torch.cuda.Stream() for _ in halves]
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        row = measure(size, halves, optimizers, streams, shape, args.passes)
        rows.append(row)
        print(f"{args.model} server half from unit {args.split}, {len(halves)} replicas, "
              f"{size} samples: " + ", ".join(
                  f"{k} {row[k]:.0f} passes/s ({row[k] / row['in turn']:.2f}x)"
                  for k in ("in turn", "streams", "threads")), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "model": args.model,
                                        "split": args.split, "replicas": args.replicas,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
