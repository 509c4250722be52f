"""`RunResult` and the results directory (DESIGN §6).

``out_dir/`` holds ``config.toml`` (resolved config), ``metrics.jsonl`` (one JSON object
per epoch), ``trace.json`` (Chrome trace, one track per resource), ``model.safetensors``
(the final global model) and ``timeline.png`` (drawn from the trace when matplotlib is
installed).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from torch import nn

from aiopipe.config import RunConfig
from aiopipe.metrics.trace import Slice, chrome_trace

__all__ = ["EpochMetrics", "RunResult", "write_atomic", "write_results"]


@dataclass(frozen=True, slots=True)
class EpochMetrics:
    """Figures of one epoch. Device-side busy/idle figures are means over devices.

    ``samples`` counts only rounds that completed: ``device_samples[k]`` is what device k
    contributed; ``devices_lost`` lists devices that dropped out during the epoch (their
    unfinished rounds were excluded from aggregation); ``updates_refused`` lists devices
    whose update was clipped or dropped as an outlier (``RunConfig.outliers``). In a
    multi-device pipeline,
    ``stages`` has one entry per stage (its device, units, compute busy and idle seconds,
    and ``peak_live``: the most micro-batches whose activations it held at once) and
    ``links`` the busy and idle seconds of each directed device-to-device link
    (``"device0->device1"``). ``held_out_accuracy``: the epoch's global model on the
    devices' own held-out data, over all of it (NaN when no device has any);
    ``device_accuracy``: per device that evaluated (keys: its id as a string).
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
        return out


@dataclass(frozen=True, slots=True)
class RunResult:
    """Everything a run produced."""

    config: RunConfig
    epochs: Sequence[EpochMetrics]
    model: nn.Sequential = field(repr=False)
    trace: Sequence[Slice] = field(repr=False, default=())
    trace_origin: float = 0.0
    out_dir: Path | None = None

    @property
    def final(self) -> EpochMetrics:
        """Metrics of the last epoch."""
        return self.epochs[-1]


def write_results(result: RunResult, out_dir: str | Path) -> Path:
    """Write the results directory; returns its path.

    Raises:
        OSError: the directory cannot be written.
    """
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    write_atomic(path / "config.toml", result.config.to_toml().encode())
    lines = b"".join(orjson.dumps(e.to_mapping()) + b"\n" for e in result.epochs)
    write_atomic(path / "metrics.jsonl", lines)
    trace = chrome_trace(result.trace, origin=result.trace_origin)
    write_atomic(path / "trace.json", json.dumps(trace).encode())
    from safetensors.torch import save

    state = {k: v.detach().contiguous().clone() for k, v in result.model.state_dict().items()}
    write_atomic(path / "model.safetensors", save(state))
    try:
        from aiopipe.metrics.timeline import draw_timeline
    except ImportError:  # matplotlib is optional
        pass
    else:
        draw_timeline(trace, path / "timeline.png")
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one:
    a temporary file, fsynced, renamed over the old, and the directory fsynced.

    Raises:
        OSError: the file cannot be written.
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
