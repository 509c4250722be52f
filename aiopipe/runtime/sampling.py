"""Which devices train in a round when the config samples them (``devices_per_round``).

[Note: sampling per round] Federated populations are larger than what trains at once:
each round a few devices are drawn from those alive, train from the global model, and
FedAvg weighs their samples (Flower's ``fraction_fit``). The draw is a function of the
run's seed, the epoch and the round within it, and of who is alive, nothing else: the
same config draws the same devices in every run, and a run resumed from a checkpoint
draws what the uninterrupted run would have.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["sampled_devices"]


def sampled_devices(seed: int, epoch: int, round_index: int, alive: Sequence[int],
                    size: int) -> list[int]:
    """``size`` of the ``alive`` devices (all of them when ``size`` reaches their number),
    in increasing order, drawn by a generator seeded with the seed, epoch and round."""
    pool = sorted(alive)
    if size >= len(pool):
        return pool
    draw = random.Random(f"aiopipe devices_per_round {seed} {epoch} {round_index}")
    return sorted(draw.sample(pool, size))
