"""The coordinator's server-half replicas in the star systems (sl, sfl, pipar): one per
device, made when the device's round starts and let go when it ends.

[Note: replicas while training] Device k's server half (units P_k+1..Q) is trained on
its own replica, stepped by the coordinator for k's activations only. After every
aggregation all replicas equal the global model's server half, so what a replica holds
of its own between rounds is only its optimizer's state (SGD's momentum). A replica is
therefore built when k's round starts, from the global model and the state k's last
round left (`ReplicaPool.open`), and dropped when the round ends, keeping that state
by parameter name (`close`); a round that is dropped or refused keeps the state its
round began with (`roll_back`), so it leaves no trace. With ``local_optimizer = "fresh"``
(the default: [Note: a round's local optimizer] in aiopipe.runtime.systems.star.keeping)
nothing is kept: each round's replica starts its optimizer from nothing. Devices that
are not in a round (not sampled, or waiting for their turn in SL) hold no weights here:
memory grows with the devices in a round, plus, with "kept", the optimizer state of
those that have trained. Checkpoints
store each device's state at its current split point, as `momentum/<k>/<i>` for the
i-th parameter of its server half; replicas need no weights of their own, since each
round starts from the global model (a checkpoint's ``replica/`` weights, written by
older versions, are ignored).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from aiopipe import models
from aiopipe.config import RunConfig
from aiopipe.runtime.factories import make_optimizer, optimizer_states

__all__ = ["ReplicaPool"]

Replica = tuple[nn.Sequential, torch.optim.Optimizer]


class ReplicaPool:
    """The replicas of the devices in a round, and the optimizer state of every device
    that has trained ([Note: replicas while training]).

    Args:
        model: the global model (read when a replica is made).
        torch_device: where replicas compute.
        keeps: keep each device's optimizer state between its rounds (else each round's
            replica starts its optimizer afresh).
    """

    def __init__(self, model: nn.Sequential, torch_device: torch.device | str, *,
                 keeps: bool = True) -> None:
        self.model = model
        self.torch_device = torch_device
        self.keeps = keeps
        self._active: dict[int, Replica] = {}
        #: per device that has trained: its optimizer's state by parameter name
        self._kept: dict[int, dict[str, dict[str, Any]]] = {}

    def __contains__(self, device_id: object) -> bool:
        return device_id in self._active

    def __getitem__(self, device_id: int) -> Replica:
        """Device ``device_id``'s replica in its round.

        Raises:
            KeyError: the device is not in a round.
        """
        return self._active[device_id]

    def __len__(self) -> int:
        return len(self._active)

    def open(self, device_id: int, split_point: int, config: RunConfig) -> Replica:
        """The device's replica for its round at ``split_point``: the global model's server
        half, with (a copy of) the optimizer state its last finished round left; one
        still open from a round that did not end is replaced."""
        half = copy.deepcopy(models.split(self.model, split_point)[1])
        half.to(self.torch_device)
        found = half, make_optimizer(half, config, previous=self._kept.get(device_id))
        self._active[device_id] = found
        return found

    def close(self, device_ids: Sequence[int]) -> None:
        """The devices' rounds ended: keep each replica's optimizer state, drop its
        weights (the aggregation made them the global model's)."""
        for k in device_ids:
            found = self._active.pop(k, None)
            if found is not None and self.keeps:
                self._kept[k] = optimizer_states(*found)

    def roll_back(self, device_ids: Sequence[int]) -> None:
        """The devices' rounds were dropped or refused: their optimizer state stays as it
        was when the round began, and their replicas are dropped."""
        for k in device_ids:
            self._active.pop(k, None)

    def momentum(self, device_id: int, split_point: int) -> list[torch.Tensor | None]:
        """SGD's momentum of each parameter of the device's server half at
        ``split_point`` as its last finished round left it (None where it has none)."""
        kept = self._kept.get(device_id, {})
        half = models.split(self.model, split_point)[1]
        return [kept.get(name, {}).get("momentum_buffer")
                for name, _ in half.named_parameters()]

    def checkpoint_tensors(self, split_points: Sequence[int]) -> dict[str, torch.Tensor]:
        """``momentum/<k>/<i>`` of every device that has trained, device k at
        ``split_points[k]`` (copied to the CPU)."""
        tensors: dict[str, torch.Tensor] = {}
        for k in sorted(self._kept):
            for i, buffer in enumerate(self.momentum(k, split_points[k])):
                if buffer is not None:
                    tensors[f"momentum/{k}/{i}"] = buffer.detach().to("cpu", copy=True)
        return tensors

    def restore(self, tensors: Mapping[str, torch.Tensor], split_points: Sequence[int]
                ) -> None:
        """Take each device's momentum from a checkpoint's ``momentum/<k>/<i>``; no
        replica is open after it."""
        self._active.clear()
        self._kept.clear()
        for k, p in enumerate(split_points):
            half = models.split(self.model, p)[1]
            kept = {name: {"momentum_buffer": buffer.to(self.torch_device, copy=True)}
                    for i, (name, _) in enumerate(half.named_parameters())
                    if (buffer := tensors.get(f"momentum/{k}/{i}")) is not None}
            if kept:
                self._kept[k] = kept
