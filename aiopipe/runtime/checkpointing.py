"""Writing the coordinator's checkpoints while training goes on (DESIGN §7).

[Note: background checkpoints] Writing a checkpoint (hundreds of MB for a deep model's
replicas and their momentum, fsynced) takes seconds, and for a whole round's length the
coordinator would stand idle. So the state is copied in the compute thread, where nothing
else touches it meanwhile (a memory copy, traced as a "ckpt" slice), and the copy is
written by another thread while the next round runs.

The copy itself (0.2 s for resnet18's 4 replicas with momentum, 0.5 s for vgg16's) waits
for the next round: it is queued on the compute thread just after the weights for the
round's `RoundStart`s were taken (`Checkpoints.copy`, which the systems call), so it runs
while the devices compute and send their first activations, when the coordinator has
nothing to do. It still comes before any coordinator work of that round (the compute
queue is FIFO), so it sees the state the finished round left. The metadata is taken
when the checkpoint is asked for. The last round of an epoch is not checkpointed by
itself: the checkpoint after the epoch (with its metrics) follows its evaluation.

One checkpoint is in flight at a time: the next one, and the end of training, wait for
it, and a failed write raises there. A copy still waiting when training ends (or fails:
nothing has changed the state yet) is made then. The files are renamed into place only
when whole (`aiopipe.runtime.checkpoint`), so a crash during a write leaves the previous
checkpoint to resume from. When costs are charged (virtual time) the checkpoint is
written in place, as a deterministic simulation wants.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aiopipe.clock import Clock
from aiopipe.runtime.checkpoint import save_checkpoint
from aiopipe.runtime.compute import Compute

__all__ = ["Checkpoints"]


class Checkpoints:
    """Checkpoints into ``directory`` (see the module docstring).

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
        tensors = await self._compute.run("ckpt", self._tensors, epoch=epoch)
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
