"""`EpochMetrics`: the figures of one epoch of a run.

A value of its own module, so that what reads the figures (``aiopipe.metrics.timeline``'s
overview picture) and what writes them (``aiopipe.metrics.results``) need not import each
other.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsIndex, overload

__all__ = ["EpochMetrics", "SparseCounts", "counts_by_device"]

#: a count per device is kept sparse from this many devices on, when at most one in
#: eight of them is nonzero (a sampled population's epoch)
SPARSE_FROM = 1024


class SparseCounts(Sequence[int]):
    """A count per device, mostly 0, held as its nonzero entries.

    A sampled population's epoch trains a few of its devices: 100 of 100,000 a round.
    A tuple of its counts is 8 bytes a device, 0.8 MB an epoch that the run's result
    keeps for every epoch, so that a 100-round run would grow by 80 MB; this keeps the
    ones that trained. It reads as the tuple would (index, slice, iterate, ``len``,
    ``sum``) and equals any sequence of the same counts.
    """

    __slots__ = ("_length", "_nonzero")

    def __init__(self, counts: Sequence[int]) -> None:
        self._length = len(counts)
        self._nonzero = {k: int(n) for k, n in enumerate(counts) if n}

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return tuple(self._nonzero.get(k, 0) for k in range(*index.indices(self._length)))
        k = operator.index(index)
        if k < 0:
            k += self._length
        if not 0 <= k < self._length:
            raise IndexError(f"device {index} of {self._length}")
        return self._nonzero.get(k, 0)

    def __iter__(self) -> Iterator[int]:
        get = self._nonzero.get
        return (get(k, 0) for k in range(self._length))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SparseCounts):
            return self._length == other._length and self._nonzero == other._nonzero
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(other) == self._length and all(
                a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"SparseCounts({self._length} devices, nonzero {self._nonzero!r})"

    def nonzero(self) -> dict[int, int]:
        """The devices whose count is not 0, with their counts."""
        return dict(self._nonzero)


def counts_by_device(counts: Sequence[int]) -> Sequence[int]:
    """``counts`` (one per device) as a tuple, or as `SparseCounts` when there are at
    least `SPARSE_FROM` of them and at most one in eight is nonzero."""
    values = tuple(int(n) for n in counts)
    if len(values) >= SPARSE_FROM and 8 * sum(1 for n in values if n) <= len(values):
        return SparseCounts(values)
    return values


@dataclass(frozen=True, slots=True)
class EpochMetrics:
    """Figures of one epoch. Device-side busy/idle figures are means over devices.

    ``epoch`` counts from 1, as every number a person reads does (the table, the log,
    ``metrics.jsonl``, ``/status``): the first epoch is 1, so that ``m.epoch`` can be
    printed as it is. Messages, traces and loops inside the runtime index epochs from
    0; the coordinator converts once, where it makes an `EpochMetrics`.

    ``samples`` counts only rounds that completed: ``device_samples[k]`` is what device k
    contributed (a tuple, or for a large population of which few trained a
    `SparseCounts`, which reads and compares as the tuple); ``devices_lost`` lists
    devices that dropped out during the epoch (their unfinished rounds were excluded
    from aggregation) and those away at the start of every round of it (0 samples);
    ``updates_refused`` lists devices whose update was refused (not finite, or far
    beyond the run's scale: [Note: judging updates], whatever the options), or clipped
    or dropped as an outlier (``RunConfig.outliers``); their samples still count, their
    update does not. In a multi-device pipeline,
    ``stages`` has one entry per stage (its device, units, compute busy and idle seconds,
    and ``peak_live``: the most micro-batches whose activations it held at once; in
    asteroid one per device, with its ``rows`` and, in MiB, ``peak_memory_mb``: the most
    its training held, measured, ``planned_memory_mb``: the planner's Eq. 3 for it, and
    ``budget_mb``: its ``device_memory_mb``) and
    ``links`` the busy and idle seconds of each directed device-to-device link
    (``"device0->device1"``). ``held_out_accuracy``: the epoch's global model on the
    devices' own held-out data, over all of it (NaN when no device has any);
    ``device_accuracy``: per device that evaluated (keys: its id as a string).
    ``changes``: what the system changed during the epoch, in order (re-plans between
    rounds; FTPipeHD's recoveries, with when the loss was noticed and when the round was
    played again, in the trace's seconds; their ``epoch``, ``round`` and ``replayed_as``
    count from 1 as ``epoch`` does, their iterations are offsets from the epoch's start).
    ``loss`` and ``train_accuracy`` are NaN (null
    in ``metrics.jsonl``) for an epoch in which no round completed; ``accuracy`` is NaN
    without a test set. ``peer_bytes``: per device, the bytes it sent to other devices
    over their direct links in the epoch's rounds, as it measured and reported them
    (empty where devices do not link: the star modes). ``sampled``: with
    ``devices_per_round``, the devices drawn for each of the epoch's rounds (empty when
    every device trains). ``devices_excluded``: devices excluded from the run during
    the epoch for what they sent a neighbour (values out of range, the plan broken:
    aiopipe.runtime.exclusion); they are in ``devices_lost`` too. ``epsilon`` and
    ``delta``: differential privacy's guarantee for the run so far, from an accountant
    (DP-SGD: the largest device's; dp-fedavg: the run's), NaN (null) without DP-SGD or
    central DP; ``device_epsilon``: each device's (keys: its id as a string);
    ``privacy_unit``: what neighbouring datasets differ by, "sample" (DP-SGD: one of a
    device's samples) or "device" (central DP: one device's data), "" without.
    ``startup``: in the first epoch a process trains (else empty), how long the run took
    to start training, in seconds on the coordinator's clock (`aiopipe.runtime.startup`,
    [Note: startup figures]): ``startup_s`` from the coordinator's start to the end of
    the run's first micro-batch computed, ``join_s`` of it waiting for the devices to
    join, ``profiling_s`` the devices profiling themselves, ``planning_s`` the plan (and
    the server's own cost table).
    """

    epoch: int
    time_s: float
    busy_s: Mapping[str, float]
    idle_s: Mapping[str, float]
    loss: float
    accuracy: float
    train_accuracy: float
    samples: int
    bytes_up: int
    bytes_down: int
    plan: Sequence[Mapping[str, int]]
    device_samples: Sequence[int] = ()
    devices_lost: Sequence[int] = ()
    updates_refused: Sequence[int] = ()
    stages: Sequence[Mapping[str, Any]] = ()
    links: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    held_out_accuracy: float = math.nan
    device_accuracy: Mapping[str, float] = field(default_factory=dict)
    changes: Sequence[Mapping[str, Any]] = ()
    peer_bytes: Sequence[int] = ()
    sampled: Sequence[Sequence[int]] = ()
    devices_excluded: Sequence[int] = ()
    #: ``exp(loss)`` where the loss is the run's cross-entropy (per token, for a language
    #: model: its perplexity); NaN for any other loss
    perplexity: float = math.nan
    epsilon: float = math.nan
    delta: float = math.nan
    device_epsilon: Mapping[str, float] = field(default_factory=dict)
    privacy_unit: str = ""
    startup: Mapping[str, float] = field(default_factory=dict)

    def to_mapping(self) -> dict[str, Any]:
        """Plain JSON-able form (one line of ``metrics.jsonl``)."""
        out = dataclasses.asdict(self)
        out["plan"] = [dict(p) for p in self.plan]
        out["device_samples"] = list(self.device_samples)
        out["devices_lost"] = list(self.devices_lost)
        out["updates_refused"] = list(self.updates_refused)
        out["stages"] = [dict(s) for s in self.stages]
        out["links"] = {k: dict(v) for k, v in self.links.items()}
        out["device_accuracy"] = dict(self.device_accuracy)
        out["changes"] = [dict(c) for c in self.changes]
        out["peer_bytes"] = list(self.peer_bytes)
        out["sampled"] = [list(r) for r in self.sampled]
        out["devices_excluded"] = list(self.devices_excluded)
        out["device_epsilon"] = dict(self.device_epsilon)
        out["startup"] = dict(self.startup)
        return out
