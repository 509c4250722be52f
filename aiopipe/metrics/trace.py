"""Where time went: slices per resource track, busy-time sums and Chrome trace export.

A *track* is one resource: ``device{k}/compute``, ``device{k}/uplink``,
``server/compute``, ``device{k}/downlink``, and a directed device-to-device link
``device{i}->device{j}`` (what device i sends to device j, in a pipeline). A *slice* is
one stage of one micro-batch on one track (PiPar's f, u, s, d, b; plus ``step`` and model
transfers), in seconds on the recording node's clock. ``trace.json`` is the Chrome trace
event format (opens in Perfetto): one thread per track, one complete ("X") event per
slice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_REPORT_SLICES", "REPORT_SLICE_BYTES", "RESOURCE_KINDS", "Recorder", "Slice",
           "chrome_trace", "device_of", "resource_kind"]

#: Resource kinds reported per epoch (DESIGN §6).
RESOURCE_KINDS = ("device", "uplink", "server", "downlink")

#: Most slices a device reports of one round (a longer round's report keeps its first
#: ones), and an upper bound of one slice's size in a report: together they bound a
#: report's frame before the coordinator knows how long the devices' rounds are.
MAX_REPORT_SLICES = 250_000
REPORT_SLICE_BYTES = 128


@dataclass(frozen=True, slots=True)
class Slice:
    """One stage of one micro-batch on one resource track."""

    track: str
    name: str
    start: float
    end: float
    epoch: int = -1
    iteration: int = -1
    micro_batch: int = -1

    @property
    def duration(self) -> float:
        """Length in seconds."""
        return self.end - self.start

    def shifted(self, offset: float) -> Slice:
        """The same slice on a clock ``offset`` seconds ahead."""
        return Slice(self.track, self.name, self.start + offset, self.end + offset,
                     self.epoch, self.iteration, self.micro_batch)

    def to_list(self) -> list[Any]:
        """Plain form, for sending inside a `RoundResult.report`."""
        return [self.track, self.name, self.start, self.end, self.epoch, self.iteration,
                self.micro_batch]

    @classmethod
    def from_list(cls, item: Sequence[Any]) -> Slice:
        """Inverse of `to_list`.

        Raises:
            ValueError: the item does not have the seven fields of a slice.
        """
        if len(item) != 7:
            raise ValueError(f"a slice has 7 fields, got {len(item)}")
        track, name, start, end, epoch, iteration, micro_batch = item
        return cls(str(track), str(name), float(start), float(end), int(epoch),
                   int(iteration), int(micro_batch))


def device_of(track: str) -> int | None:
    """The device a node name or trace track belongs to ("device3", "device3/compute";
    a link "device3->device1": its sender), None for the server's or another name."""
    node = track.partition("->")[0].partition("/")[0]
    number = node.removeprefix("device")
    return int(number) if node.startswith("device") and number.isdigit() else None


def resource_kind(track: str) -> str:
    """The `RESOURCE_KINDS` entry a track belongs to ("device3/uplink" -> "uplink"), or
    "link" for a device-to-device link (not one of them)."""
    if "->" in track:
        return "link"
    node, _, resource = track.partition("/")
    if resource == "compute":
        return "server" if node == "server" else "device"
    return resource


class Recorder:
    """Collects slices; answers busy time per track within a time window."""

    def __init__(self) -> None:
        self.slices: list[Slice] = []

    def add(self, track: str, name: str, start: float, end: float, *, epoch: int = -1,
            iteration: int = -1, micro_batch: int = -1) -> None:
        """Record one slice."""
        self.slices.append(Slice(track, name, start, end, epoch, iteration, micro_batch))

    def extend(self, slices: Iterable[Slice]) -> None:
        """Record slices made elsewhere (a device's report)."""
        self.slices.extend(slices)

    def busy(self, track: str, start: float, end: float) -> float:
        """Seconds ``track`` was busy within ``[start, end]``."""
        spans = [(max(start, s.start), min(end, s.end)) for s in self.slices
                 if s.track == track and min(end, s.end) > max(start, s.start)]
        return _union(spans) if spans else 0.0

    def busy_by_track(self, start: float, end: float) -> dict[str, float]:
        """Seconds each track was busy within ``[start, end]``: the union of its slices
        there (a server's compute with several lanes runs slices at once)."""
        spans: dict[str, list[tuple[float, float]]] = {}
        for s in self.slices:
            lo, hi = max(start, s.start), min(end, s.end)
            if hi > lo:
                spans.setdefault(s.track, []).append((lo, hi))
        return {track: _union(pieces) for track, pieces in spans.items()}

    def take(self, since: int = 0) -> list[Slice]:
        """Slices recorded from index ``since`` on."""
        return self.slices[since:]


def _union(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``spans``; in order (a serial track's) in one pass."""
    if any(spans[i][0] < spans[i - 1][0] for i in range(1, len(spans))):
        spans = sorted(spans)
    total, lo, hi = 0.0, spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a > hi:
            total, lo, hi = total + hi - lo, a, b
        elif b > hi:
            hi = b
    return total + hi - lo


def chrome_trace(slices: Iterable[Slice], *, origin: float = 0.0) -> dict[str, Any]:
    """Chrome trace JSON object (``{"traceEvents": [...]}``) with one thread per track."""
    slices = sorted(slices, key=lambda s: (s.start, s.track))
    tracks = sorted({s.track for s in slices}, key=_track_order)
    tids = {track: i + 1 for i, track in enumerate(tracks)}
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "aiopipe"}}
    ]
    for track, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                       "args": {"name": track}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                       "args": {"sort_index": tid}})
    for s in slices:
        label = s.name if s.micro_batch < 0 else f"{s.name}{s.micro_batch + 1}"
        events.append({
            "name": label, "cat": s.name, "ph": "X", "pid": 1, "tid": tids[s.track],
            "ts": round((s.start - origin) * 1e6, 3), "dur": round(s.duration * 1e6, 3),
            "args": {"epoch": s.epoch, "iteration": s.iteration, "micro_batch": s.micro_batch},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _track_order(track: str) -> tuple[int, int, int, int]:
    """Devices first (compute, uplink, then their links to other devices, by peer), the
    server, then the downlinks."""
    if "->" in track:  # a device-to-device link: with its sender
        node, _, peer = track.partition("->")
        return (0, _device_number(node), 2, _device_number(peer))
    node, _, resource = track.partition("/")
    if node == "server":
        return (1, 0, 0, 0)
    k = _device_number(node)
    if resource == "downlink":
        return (2, k, 0, 0)
    return (0, k, {"compute": 0, "uplink": 1}.get(resource, 3), 0)


def _device_number(node: str) -> int:
    number = node.removeprefix("device")
    return int(number) if number.isdigit() else 0
