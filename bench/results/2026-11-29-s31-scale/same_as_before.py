"""Small runs, before and after resting idle links: saves each final model and prints
each epoch's virtual time (repr), bytes and accuracy. Run it with the older commit's
package on PYTHONPATH, then with this tree's, and compare (README.md).

    PYTHONPATH=<package root> python same_as_before.py CASE OUT.pt

CASE: fl-40-4 (40 devices, 4 a round), sfl-40-4, pipar-40-4 (split at 2, N = 2),
pipar-8 and sfl-8 (8 devices, every one each round: no link ever rests).
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from typing import Any

import torch

import aiopipe
from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.scheduler.costs import CostTable

COSTS = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.0005, batch=1)


def main() -> None:
    warnings.simplefilter("ignore")
    case, out = sys.argv[1], sys.argv[2]
    mode, devices, *per_round = case.split("-")
    extra: dict[str, Any] = {}
    if mode in ("sfl", "pipar"):
        extra = {"split_point": 2, "parallel_batches": 2 if mode == "pipar" else 1}
    config = RunConfig(mode=mode, model="vgg5", devices=int(devices), samples_per_device=20,
                       batch_size=10, epochs=5, test_samples=20,
                       devices_per_round=int(per_round[0]) if per_round else 0,
                       momentum=0.9, seed=1, network="4g", **extra)
    result = asyncio.run(simulate(config, clock=VirtualClock(), cost_table=COSTS))
    torch.save({k: v.clone() for k, v in result.model.state_dict().items()}, out)
    print(aiopipe.__file__, case)
    for e in result.epochs:
        print(f"  epoch {e.epoch}: time {e.time_s!r} accuracy {e.accuracy!r} "
              f"bytes {getattr(e, 'bytes_up', None)!r}/{getattr(e, 'bytes_down', None)!r}")


if __name__ == "__main__":
    main()
