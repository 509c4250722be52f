"""FedBuff's server buffer: the pure core of the update rule (no event loop, no I/O).

Theory of operation. A device starts from the global model at server version v, trains
Q mini-batches and uploads its delta, Delta = w_local - w_start. When it arrives the
server is at version v' >= v: its staleness is tau = v' - v. The buffer keeps each
arrival's weighted delta, s(tau) * Delta; at the K-th it empties and the server takes
one step (Nguyen et al. 2022, Algorithm 1, with their server update):

    w <- w + eta_g / K * sum_k s(tau_k) * Delta_k        (the version becomes v' + 1)

with s(tau) = 1 / sqrt(1 + tau) ("sqrt", the paper's choice) or 1 ("none"). Sums are
in float64 and cast back to each tensor's dtype; a tensor that is not floating point
(a batch-norm layer's counter) takes the newest arrival's value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

__all__ = ["ServerBuffer", "delta_of", "staleness_weight"]


def staleness_weight(tau: int, kind: str) -> float:
    """s(tau) for a delta ``tau`` server versions old: 1/sqrt(1+tau) ("sqrt") or 1
    ("none").

    Raises:
        ValueError: ``tau`` < 0, or an unknown ``kind``.
    """
    if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")
    if kind == "sqrt":
        return 1.0 / math.sqrt(1.0 + tau)
    if kind == "none":
        return 1.0
    raise ValueError(f"unknown staleness weight {kind!r}")


def delta_of(trained: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor]
             ) -> dict[str, torch.Tensor]:
    """Delta = trained - start for the floating-point tensors (float64); the others as
    trained. Keys: ``trained``'s (what the device uploaded).

    Raises:
        KeyError: ``trained`` holds a tensor ``start`` lacks.
    """
    return {key: (value.double() - start[key].double()) if value.is_floating_point()
            else value.clone() for key, value in trained.items()}


@dataclass(slots=True)
class ServerBuffer:
    """The buffer of K weighted deltas (module docstring). ``version``: the server's,
    the number of updates applied so far."""

    size: int
    learning_rate: float
    staleness: str = "sqrt"
    version: int = 0
    #: the buffered (s(tau), Delta) pairs, in arrival order
    entries: list[tuple[float, dict[str, torch.Tensor]]] = field(default_factory=list)
    #: each buffered arrival's staleness (for the record)
    taus: list[int] = field(default_factory=list)

    def add(self, delta: dict[str, torch.Tensor], started_at: int) -> bool:
        """Buffer a delta from a device that started at version ``started_at``;
        whether the buffer is full (time for `apply`).

        Raises:
            ValueError: ``started_at`` is a version the server has not reached.
        """
        tau = self.version - started_at
        self.entries.append((staleness_weight(tau, self.staleness), delta))
        self.taus.append(tau)
        return len(self.entries) >= self.size

    @property
    def full(self) -> bool:
        """Whether K deltas wait (time for an update)."""
        return len(self.entries) >= self.size

    def take(self) -> list[tuple[float, dict[str, torch.Tensor]]]:
        """The first K buffered (s(tau), Delta) pairs, out of the buffer (arrivals past
        the K-th wait for the next update)."""
        taken, self.entries = self.entries[:self.size], self.entries[self.size:]
        self.taus = self.taus[self.size:]
        return taken

    def combine(self, model: Mapping[str, torch.Tensor],
                taken: list[tuple[float, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
        """The new global state: ``model`` (the current one) + eta_g / len(taken) * the
        sum of ``taken``'s weighted deltas; tensors no delta holds stay as they are
        (pure: the version does not move)."""
        new = {key: value.clone() for key, value in model.items()}
        scale = self.learning_rate / len(taken)
        for key, value in model.items():
            deltas = [(s, d[key]) for s, d in taken if key in d]
            if not deltas:
                continue
            if value.is_floating_point():
                total = torch.zeros_like(value, dtype=torch.float64)
                for s, d in deltas:
                    total += s * d
                new[key] = (value.double() + scale * total).to(value.dtype)
            else:
                new[key] = deltas[-1][1].to(value.dtype)
        return new

    def apply(self, model: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new global state from ``model`` and the first K buffered deltas
        (`take`, `combine`); the version advances."""
        new = self.combine(model, self.take())
        self.version += 1
        return new
