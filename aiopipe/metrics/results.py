"""`RunResult` and the results directory (DESIGN §6).

``out_dir/`` holds ``config.toml`` (resolved config), ``metrics.jsonl`` (one JSON object
per epoch), ``trace.json`` (Chrome trace, one track per resource), ``model.safetensors``
(the final global model), ``checkpoint/`` (when the server writes checkpoints) and, when
matplotlib is installed, ``timeline.png`` (one representative iteration) and
``overview.png`` (time, loss and accuracy per epoch); without it, one warning says why
they are missing and how to get them. A run that ended before its last
epoch (it failed, or was interrupted) keeps ``config.toml``, ``metrics.jsonl`` of its
finished epochs, ``model.safetensors`` as the last finished epoch left it, and
``unfinished.txt``: why it ended (`write_unfinished`, [Note: results on every ending]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError
from aiopipe.metrics.trace import Slice, chrome_trace
from aiopipe.wording import plural

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["UNFINISHED_NAME", "EpochMetrics", "RunResult", "write_atomic", "write_results",
           "write_unfinished"]

log = logging.getLogger("aiopipe.results")

#: The file that says why a run ended before its last epoch (absent when it finished).
UNFINISHED_NAME = "unfinished.txt"


@dataclass(frozen=True, slots=True)
class EpochMetrics:
    """Figures of one epoch. Device-side busy/idle figures are means over devices.

    ``epoch`` counts from 1, as every number a person reads does (the table, the log,
    ``metrics.jsonl``, ``/status``): the first epoch is 1, so that ``m.epoch`` can be
    printed as it is. Messages, traces and loops inside the runtime index epochs from
    0; the coordinator converts once, where it makes an `EpochMetrics`.

    ``samples`` counts only rounds that completed: ``device_samples[k]`` is what device k
    contributed; ``devices_lost`` lists devices that dropped out during the epoch (their
    unfinished rounds were excluded from aggregation) and those away at the start of
    every round of it (0 samples); ``updates_refused`` lists devices
    whose update was refused (not finite, or far beyond the run's scale: [Note: judging
    updates], whatever the options), or clipped or dropped as an outlier
    (``RunConfig.outliers``); their samples still count, their update does not. In a
    multi-device pipeline,
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
    aiopipe.runtime.exclusion); they are in ``devices_lost`` too.
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


#: What makes a directory hold a run's results (a new run there would overwrite them).
RESULT_NAMES = ("metrics.jsonl", "config.toml", "model.safetensors", "checkpoint")


def check_fresh_out_dir(out_dir: str | Path) -> None:
    """Refuse ``out_dir`` when it holds an earlier run's results (a new run would
    overwrite them); a missing or empty directory is fine.

    Raises:
        ConfigError: it holds results (one line naming what), or it is a file.
    """
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"out_dir {path} is a file, not a directory")
    held = [name for name in RESULT_NAMES if (path / name).exists()]
    if held:
        raise ConfigError(f"{path} already holds a run's results ({', '.join(held)}); choose "
                          "another out_dir, remove it, or resume that run")


def new_out_dir(parent: str | Path = "runs", stem: str = "") -> Path:
    """A results directory of its own under ``parent``, made now: ``STEM-YYYYmmdd-HHMMSS``
    (``-2``, ``-3``, ... when another run took that name in the same second).

    Raises:
        OSError: ``parent`` cannot be written.
    """
    name = "-".join(filter(None, [stem, time.strftime("%Y%m%d-%H%M%S")]))
    Path(parent).mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = Path(parent) / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir()  # atomic: two runs never get one directory
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


@contextlib.contextmanager
def own_out_dir(config: RunConfig, *, parent: str | Path = "runs",
                stem: str = "") -> Iterator[RunConfig]:
    """``config`` with a results directory of its own (`new_out_dir`) when it names none;
    the directory (and ``parent``, if made for it) is removed again if the run leaves it
    empty (it failed to start).

    Raises:
        OSError: ``parent`` cannot be written.
    """
    if config.out_dir:
        yield config
        return
    new_parent = not Path(parent).exists()
    path = new_out_dir(parent, stem)
    try:
        yield config.replace(out_dir=str(path))
    finally:
        with contextlib.suppress(OSError):  # not empty: the run wrote there
            path.rmdir()
            if new_parent:
                path.parent.rmdir()


def write_metrics(config: RunConfig, epochs: Sequence[EpochMetrics],
                  out_dir: str | Path) -> Path:
    """Write ``config.toml`` and ``metrics.jsonl`` (one line per epoch of ``epochs``) into
    ``out_dir``, made if missing: what an interrupted run keeps of its finished epochs.

    Raises:
        OSError: the directory cannot be written.
    """
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    write_atomic(path / "config.toml", config.to_toml().encode())
    lines = b"".join(orjson.dumps(e.to_mapping()) + b"\n" for e in epochs)
    write_atomic(path / "metrics.jsonl", lines)
    return path


def write_results(result: RunResult, out_dir: str | Path) -> Path:
    """Write the results directory; returns its path.

    Raises:
        OSError: the directory cannot be written.
    """
    path = write_metrics(result.config, result.epochs, out_dir)
    trace = chrome_trace(result.trace, origin=result.trace_origin)
    write_atomic(path / "trace.json", json.dumps(trace).encode())
    _write_model(path, result.model.state_dict())
    (path / UNFINISHED_NAME).unlink(missing_ok=True)  # a resumed run that finished
    from aiopipe.metrics.timeline import draw_overview, draw_run_timeline

    config = result.config
    model = config.model if isinstance(config.model, str) else "custom model"
    label = f"{config.mode}, {model}, {plural(config.devices, 'device')}"
    try:  # matplotlib is optional: without it, no pictures, and one line saying why
        draw_run_timeline(trace, path / "timeline.png", label=label)
    except ImportError as exc:
        log.warning("no timeline.png or overview.png: drawing them needs matplotlib (%s); "
                    "to get them: pip install 'aiopipe[plot]' (in a checkout: pip install "
                    "-e \".[plot]\")", exc)
        return path
    draw_overview(result.epochs, path / "overview.png", title=f"{label}: per epoch")
    return path


def write_unfinished(config: RunConfig, epochs: Sequence[EpochMetrics],
                     model: Mapping[str, torch.Tensor] | None, out_dir: str | Path,
                     reason: str) -> Path:
    """Write what a run that ended before its last epoch keeps ([Note: results on every
    ending]): ``config.toml``, ``metrics.jsonl`` of ``epochs`` (the finished ones),
    ``model.safetensors`` from ``model`` (the state the last finished epoch left; not
    written when None) and ``unfinished.txt``, one line: ``reason``. Returns the path.

    Raises:
        OSError: the directory cannot be written.
    """
    path = write_metrics(config, epochs, out_dir)
    if model is not None:
        _write_model(path, model)
    write_atomic(path / UNFINISHED_NAME, " ".join(reason.split()).encode() + b"\n")
    return path


def _write_model(path: Path, state: Mapping[str, torch.Tensor]) -> None:
    """``model.safetensors`` in ``path``, from a model's state dict."""
    from safetensors.torch import save

    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    write_atomic(path / "model.safetensors", save(tensors))


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


# Note [results on every ending]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A run keeps what it finished however it ends. `Coordinator.train` copies the global
# model after every finished epoch whose weights are all finite (the last good model),
# and when training ends any other way than finishing (it failed, or was cancelled:
# Ctrl-C, SIGTERM, the launcher giving up) it writes `write_unfinished` into
# `config.out_dir` before the error goes on: so `simulate`, `Server.run`, `python -m
# aiopipe.server` and `python -m aiopipe` share this one path, and the commands then exit
# nonzero (1 failed, 130 / 143 interrupted). Nothing is written when no epoch finished
# (the run failed to start: its own directory is removed again). `unfinished.txt` is
# removed by a later run in the directory that finishes (a resumed one).
