"""HADFL's partial synchronisation on one device (§III-D): the average of the models of
a ring's members by gossip-based scatter-gather, as a state machine the device drives
with the messages it sends to its ring successor and receives from its predecessor.

The members' models are flat float vectors of the same length (the same model), cut
into as many chunks as there are members. With N members at ring positions 0..N-1
(each sends to the next, the last to the first), there are 2 (N - 1) steps:

- *scatter-reduce*, steps 0..N-2: at step s the member at position r sends its running
  sum of chunk (r - s) mod N and adds what it receives to its own chunk (r - s - 1)
  mod N; after the last of these it holds the whole sum of chunk (r + 1) mod N;
- *all-gather*, steps N-1..2N-3: it sends the whole chunk it holds last, (r + 1 - t)
  mod N at all-gather step t, and takes the one it receives as is.

Each member so sends and receives 2 (N - 1) / N of a model, the whole ring 2 (N - 1)
models: with the one model a ring member sends to every device left out (non-blocking,
§III-D), K devices' synchronisation moves about the paper's 2·K·M. Every member ends with
the same bits: each chunk is summed once, by one member, in ring order, and copied to the
others; the average is that sum divided by N.
"""

from __future__ import annotations

import torch

from aiopipe.errors import RemoteProtocolError
from aiopipe.runtime.judge import all_finite

__all__ = ["RingAverage", "chunk_bounds", "chunk_sent"]


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``0..numel``, their lengths differing by at
    most one (the first ones the longer)."""
    size, extra = divmod(numel, parts)
    bounds, start = [], 0
    for k in range(parts):
        stop = start + size + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def chunk_sent(position: int, members: int, step: int) -> int:
    """The chunk the member at ``position`` of a ring of ``members`` sends at ``step``
    (it receives chunk ``chunk_sent(...) - 1`` mod ``members`` from its predecessor)."""
    n = members
    if step < n - 1:
        return (position - step) % n
    return (position + 1 - (step - (n - 1))) % n


class RingAverage:
    """One member's part of a ring's average (module docstring).

    Args:
        vector: this member's model, flat (not modified).
        position: its place in the ring, 0..members-1.
        members: the ring's length (>= 1).
    """

    def __init__(self, vector: torch.Tensor, position: int, members: int) -> None:
        if vector.dim() != 1 or not vector.is_floating_point():
            raise ValueError("a ring averages flat floating-point vectors")
        if not 0 <= position < members:
            raise ValueError(f"position {position} is not in a ring of {members}")
        self.position, self.members = position, members
        self.bounds = chunk_bounds(vector.numel(), members)
        self._vector = vector.clone()
        self.step = 0

    @property
    def steps(self) -> int:
        """How many steps the ring takes: 2 (N - 1)."""
        return 2 * (self.members - 1)

    @property
    def done(self) -> bool:
        """Whether every step was taken."""
        return self.step >= self.steps

    def _chunk_sent(self, step: int) -> int:
        return chunk_sent(self.position, self.members, step)

    def outgoing(self) -> tuple[int, torch.Tensor]:
        """This step's message to the successor: which chunk, and its values.

        Raises:
            RuntimeError: every step was taken.
        """
        if self.done:
            raise RuntimeError("the ring's steps are over")
        k = self._chunk_sent(self.step)
        a, b = self.bounds[k]
        return k, self._vector[a:b].clone()

    def incoming(self, chunk: int, values: torch.Tensor) -> None:
        """The predecessor's message of this step; the step is then over.

        Raises:
            RemoteProtocolError: it is not the chunk or the size this step expects, or
                holds a non-finite value.
        """
        if self.done:
            raise RemoteProtocolError("a ring message after the ring's last step")
        n = self.members
        expected = (self._chunk_sent(self.step) - 1) % n
        a, b = self.bounds[expected]
        if chunk != expected or values.shape != (b - a,) or values.dtype != self._vector.dtype:
            raise RemoteProtocolError(f"ring step {self.step}: got chunk {chunk} of "
                                      f"{tuple(values.shape)} {values.dtype}, expected chunk "
                                      f"{expected} of {(b - a,)} {self._vector.dtype}")
        if not all_finite(values):
            raise RemoteProtocolError(f"ring step {self.step}: chunk {chunk} holds NaN or Inf")
        if self.step < n - 1:
            self._vector[a:b] += values
        else:
            self._vector[a:b] = values
        self.step += 1

    def average(self) -> torch.Tensor:
        """The members' average (every member's the same bits).

        Raises:
            RuntimeError: steps are left.
        """
        if not self.done:
            raise RuntimeError(f"{self.steps - self.step} ring steps are left")
        return self._vector / self.members

