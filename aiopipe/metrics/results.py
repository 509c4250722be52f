"""`RunResult` and the results directory (DESIGN §6); an epoch's figures are
`EpochMetrics` (``aiopipe.metrics.epoch``, re-exported here).

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
import itertools
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError
from aiopipe.metrics.epoch import EpochMetrics
from aiopipe.metrics.timeline import draw_overview, draw_run_timeline
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
