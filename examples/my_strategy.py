"""A strategy of your own: FedAvg that moves the global model only part of the way.

``aggregation = "my_strategy:DampedFedAvg"`` (in a star mode's table, ``[fl]``, or
``--aggregation my_strategy:DampedFedAvg``) names it; ``aggregation_options`` are its
constructor's keyword arguments (``--aggregation-options server_learning_rate=0.5``).
Every node imports it: the server, and each device (for a strategy's ``train_hook``), from
its working directory or ``PYTHONPATH``::

    cd examples
    python -m aiopipe --mode fl --aggregation my_strategy:DampedFedAvg \\
        --aggregation-options server_learning_rate=0.5 --epochs 2

The new global model is start + lr x (FedAvg's average - start): lr = 1 is FedAvg, a
smaller one damps each round's move (a server learning rate, SGD on the pseudo-gradient
without momentum). It keeps no state between rounds, so it subclasses `FedAvg` (which
brings `aiopipe.strategies.Stateless`'s defaults: no settings for the devices, nothing
to checkpoint); aiopipe.strategies.FedAvgM is the same with momentum and state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from aiopipe.strategies import FedAvg, State

log = logging.getLogger("aiopipe.server")


class DampedFedAvg(FedAvg):
    """FedAvg with a server learning rate (module docstring).

    Raises:
        ValueError: ``server_learning_rate`` is not in (0, 1].
    """

    def __init__(self, server_learning_rate: float = 0.5) -> None:
        if not 0 < server_learning_rate <= 1:
            raise ValueError(f"server_learning_rate must be in (0, 1], got "
                             f"{server_learning_rate!r}")
        self.lr = float(server_learning_rate)
        self.rounds = 0

    def aggregate(self, start: Mapping[str, torch.Tensor],
                  states: Mapping[int, Mapping[str, torch.Tensor]],
                  weights: Mapping[int, float]) -> State:
        """start + lr x (FedAvg - start) on floating entries; FedAvg's on the others."""
        average = super().aggregate(start, states, weights)
        return {key: (start[key].double() + self.lr * (value.double() - start[key].double())
                      ).to(value.dtype) if value.is_floating_point() else value
                for key, value in average.items()}

    def installed(self) -> None:
        """Say so in the server's log (how the example's test sees it used)."""
        self.rounds += 1
        log.info("DampedFedAvg: round %d installed, moved %g of the way to FedAvg",
                 self.rounds, self.lr)
