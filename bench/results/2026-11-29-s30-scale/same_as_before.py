"""One small star run with sampling and momentum (8 devices, 3 a round, 5 rounds, vgg5,
uniform costs, virtual time); saves the final model and prints the epochs' virtual times
and accuracies. Run it with an older commit's package first on PYTHONPATH and with this
tree's, then compare the saved models (README.md: "kept" is the old behaviour bit for
bit).

    PYTHONPATH=<package root> python same_as_before.py MODE OUT.pt [fresh|kept]
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
    mode, out = sys.argv[1], sys.argv[2]
    extra: dict[str, Any] = {}
    if mode in ("sfl", "pipar"):
        extra = {"split_point": 2, "parallel_batches": 2 if mode == "pipar" else 1}
    if len(sys.argv) > 3:
        extra["options"] = {"local_optimizer": sys.argv[3]}
    config = RunConfig(mode=mode, model="vgg5", devices=8, samples_per_device=20,
                       batch_size=10, epochs=5, test_samples=20, devices_per_round=3,
                       momentum=0.9, seed=1, **extra)
    result = asyncio.run(simulate(config, clock=VirtualClock(), cost_table=COSTS))
    torch.save({k: v.clone() for k, v in result.model.state_dict().items()}, out)
    print(aiopipe.__file__, mode, [e.time_s for e in result.epochs],
          [e.accuracy for e in result.epochs])


if __name__ == "__main__":
    main()
