"""Atomic server checkpoints at round boundaries, for ``--resume`` (DESIGN §7).

A checkpoint directory holds ``state-<n>.safetensors`` (tensors: the global model, the
weights of each server-half replica where they differ from the global model's, and each
replica's SGD momentum) and ``checkpoint.json`` (the run config, where training stands,
the finished epochs' metrics and the current epoch's tallies). Each file is written to a
temporary name, fsynced and renamed; ``checkpoint.json`` is written last and names its
state file, so a crash at any moment leaves the previous checkpoint whole. The server
writes it while training goes on: `Checkpoints`, see [Note: background checkpoints]
below.

Training itself draws no random numbers (data order and initialization derive from the
seed), so no RNG state needs saving. Device-side optimizer state stays on the devices.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from aiopipe.clock import Clock
from aiopipe.errors import ConfigError
from aiopipe.metrics.results import write_atomic
from aiopipe.runtime.compute import Compute

__all__ = ["CHECKPOINT_FILE", "Checkpoints", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_FILE = "checkpoint.json"


def save_checkpoint(directory: str | Path, tensors: Mapping[str, torch.Tensor],
                    meta: Mapping[str, Any]) -> Path:
    """Write a checkpoint atomically; returns the path of ``checkpoint.json``.

    ``tensors`` must not change until it returns (pass a copy to write one while
    training goes on).

    Raises:
        OSError: the directory cannot be written.
    """
    from safetensors.torch import save

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    previous = _read_meta(path)
    generation = int(previous.get("generation", -1)) + 1 if previous else 0
    state_name = f"state-{generation}.safetensors"
    write_atomic(path / state_name,
                  save({k: v.detach().contiguous() for k, v in tensors.items()}))
    write_atomic(path / CHECKPOINT_FILE, json.dumps(
        {**meta, "generation": generation, "state": state_name}).encode())
    for old in path.glob("state-*.safetensors"):
        if old.name != state_name:
            old.unlink(missing_ok=True)
    return path / CHECKPOINT_FILE


def load_checkpoint(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and metadata of the checkpoint in ``directory``.

    Raises:
        ConfigError: no checkpoint there, or it is unreadable.
    """
    from safetensors.torch import load_file

    path = Path(directory)
    meta = _read_meta(path)
    if not meta:
        raise ConfigError(f"no checkpoint in {str(path)!r} (expected {CHECKPOINT_FILE})")
    try:
        tensors = load_file(str(path / str(meta["state"])))
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigError(f"checkpoint in {str(path)!r} is unreadable: {exc}") from None
    return tensors, meta


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        text = (path / CHECKPOINT_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read {str(path / CHECKPOINT_FILE)!r}: {exc}") from None
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{str(path / CHECKPOINT_FILE)!r} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{str(path / CHECKPOINT_FILE)!r} does not hold a checkpoint")
    return meta


# [Note: background checkpoints] Writing a checkpoint (hundreds of MB for a deep model's
# replicas and their momentum, fsynced) takes seconds, and for a whole round's length the
# coordinator would stand idle. So the state is copied in the compute thread, where nothing
# else touches it meanwhile (a memory copy, traced as a "ckpt" slice), and the copy is
# written by another thread while the next round runs.
#
# The copy itself (every replica and its momentum, a noticeable pause for a deep model)
# waits for the next round: it is queued on the compute thread just after the weights for
# the round's `RoundStart`s were taken (`Checkpoints.copy`, which the systems call), so it
# runs while the devices compute and send their first activations, when the coordinator
# has nothing to do. It still comes before any coordinator work of that round (the compute
# queue is FIFO), so it sees the state the finished round left. The metadata is taken
# when the checkpoint is asked for. The last round of an epoch is not checkpointed by
# itself: the checkpoint after the epoch (with its metrics) follows its evaluation.
#
# One checkpoint is in flight at a time: the next one, and the end of training, wait for
# it, and a failed write raises there. A copy still waiting when training ends (or fails:
# nothing has changed the state yet) is made then. The files are renamed into place only
# when whole (`save_checkpoint`), so a crash during a write leaves the previous
# checkpoint to resume from. When costs are charged (virtual time) the checkpoint is
# written in place, as a deterministic simulation wants.


class Checkpoints:
    """Checkpoints into ``directory`` while training goes on ([Note: background
    checkpoints]).

    Args:
        directory: where they go (None: none are written).
        clock: the node's clock.
        compute: the node's compute queue (the state is copied there).
        tensors: makes a copy of the tensors a checkpoint holds (compute thread).
    """

    def __init__(self, directory: Path | None, *, clock: Clock, compute: Compute,
                 tensors: Callable[[], dict[str, torch.Tensor]]) -> None:
        self.directory = directory
        self._clock = clock
        self._compute = compute
        self._tensors = tensors
        self._writer: asyncio.Future[None] | None = None
        #: metadata and epoch of a checkpoint whose copy waits for the next round
        self._pending: tuple[dict[str, Any], int] | None = None

    async def save(self, meta: dict[str, Any], epoch: int) -> None:
        """Checkpoint with ``meta``; the copy is a "ckpt" slice of ``epoch``. Training
        goes on while the state is copied (at the next round) and written.

        Raises:
            OSError: the previous checkpoint's write failed.
        """
        if self.directory is None:
            return
        await self.written()
        if self._compute.charge_costs:
            save_checkpoint(self.directory, await self._compute.call(self._tensors), meta)
            return
        self._pending = (meta, epoch)

    def copy(self) -> None:
        """Queue the pending checkpoint's copy on the compute thread, then its write."""
        if self._pending is None:
            return
        meta, epoch = self._pending
        self._pending = None
        # created before the round's tasks, this task takes the compute lock first
        self._writer = asyncio.ensure_future(self._copy_and_write(meta, epoch))

    async def _copy_and_write(self, meta: dict[str, Any], epoch: int) -> None:
        assert self.directory is not None
        tensors = await self._compute.run("ckpt", self._tensors, epoch=epoch, exclusive=True)
        with self._clock.hold():
            await asyncio.to_thread(save_checkpoint, self.directory, tensors, meta)

    async def written(self) -> None:
        """Wait for the checkpoint in flight, if any (starting a pending one first).

        Raises:
            OSError: its copy or write failed (or what else they raised).
        """
        self.copy()
        writer, self._writer = self._writer, None
        if writer is not None:
            await writer
