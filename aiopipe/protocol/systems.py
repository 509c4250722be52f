"""Messages only some systems send: FTPipeHD's chain replicas (`Replica`,
`ReplicaRequest`) and HADFL's ring average with its fault tolerance (`RingChunk`,
`RingBypass`, `RingHandshake`, `SyncedModel`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from aiopipe.errors import LocalProtocolError
from aiopipe.protocol.base import TensorData, check_index, check_score

__all__ = [
    "Replica",
    "ReplicaRequest",
    "RingBypass",
    "RingChunk",
    "RingHandshake",
    "SyncedModel",
]


@dataclass(frozen=True, slots=True)
class Replica:
    """FTPipeHD's chain replication (§III-E): stage ``stage``'s weights, buffers and
    momentum (``tensors``) once the first ``batches`` batches of round ``round`` were
    applied there, with the loss summed and the samples classified right over those
    batches (the last stage's; 0 elsewhere). Sent to the next stage's device (the last
    stage's to the coordinator), and to the coordinator when it asks (`ReplicaRequest`):
    then no tensors says the device holds none."""

    round: int
    stage: int
    batches: int
    loss_sum: float
    correct: float
    tensors: Mapping[str, TensorData]

    def __post_init__(self) -> None:
        for name in ("round", "stage", "batches"):
            check_index(name, getattr(self, name))
        check_score(self, "correct")
        if not isinstance(self.loss_sum, float) or not math.isfinite(self.loss_sum):
            raise LocalProtocolError(f"loss_sum must be a finite float, got {self.loss_sum!r}")


@dataclass(frozen=True, slots=True)
class ReplicaRequest:
    """The coordinator recovers round ``round`` from its chain replicas: send the
    `Replica` of each stage in ``stages`` after its first ``batches`` batches."""

    round: int
    batches: int
    stages: tuple[int, ...]

    def __post_init__(self) -> None:
        check_index("round", self.round)
        check_index("batches", self.batches)
        for stage in self.stages:
            check_index("stage", stage)


@dataclass(frozen=True, slots=True)
class RingChunk:
    """HADFL's ring average (aiopipe.runtime.systems.hadfl.gossip): step ``step`` of
    round ``round``'s average among ``ring`` (device ids in ring order: the attempt,
    which a bypass shortens), chunk ``chunk`` of the flat model, sent to the ring
    successor."""

    run_id: int
    round: int
    ring: tuple[int, ...]
    step: int
    chunk: int
    values: TensorData

    def __post_init__(self) -> None:
        for name in ("run_id", "round", "step", "chunk"):
            check_index(name, getattr(self, name))
        _check_ring(self.ring)
        if len(self.values.shape) != 1:
            raise LocalProtocolError("a ring chunk is a 1-D tensor")


@dataclass(frozen=True, slots=True)
class RingBypass:
    """HADFL's fault tolerance (§III-D): a member of round ``round``'s ring found a
    member dead; the average starts again among ``ring`` (the survivors, in ring order),
    each from its own model."""

    run_id: int
    round: int
    ring: tuple[int, ...]

    def __post_init__(self) -> None:
        check_index("run_id", self.run_id)
        check_index("round", self.round)
        _check_ring(self.ring)


@dataclass(frozen=True, slots=True)
class RingHandshake:
    """HADFL's handshake (§III-D): a ring member that heard nothing from its upstream
    within ``ring_timeout`` asks it (``reply`` 0); a live upstream answers (``reply``
    1)."""

    run_id: int
    round: int
    reply: int

    def __post_init__(self) -> None:
        check_index("run_id", self.run_id)
        check_index("round", self.round)
        if self.reply not in (0, 1):
            raise LocalProtocolError(f"reply must be 0 or 1, got {self.reply!r}")


@dataclass(frozen=True, slots=True)
class SyncedModel:
    """HADFL's non-blocking broadcast (§III-D): round ``round``'s ring average (the
    model's floating-point state, ``tensors``) at version ``version`` (epochs), sent by
    a ring member to a device the round left out, which merges it into its own."""

    run_id: int
    round: int
    version: float
    tensors: Mapping[str, TensorData]

    def __post_init__(self) -> None:
        check_index("run_id", self.run_id)
        check_index("round", self.round)
        if not isinstance(self.version, float) or not (math.isfinite(self.version)
                                                       and self.version >= 0):
            raise LocalProtocolError(f"version must be a finite float >= 0, got "
                                     f"{self.version!r}")


def _check_ring(ring: tuple[int, ...]) -> None:
    if not ring or len(set(ring)) != len(ring):
        raise LocalProtocolError(f"a ring is distinct device ids, got {list(ring)}")
    for device in ring:
        check_index("ring member", device)
