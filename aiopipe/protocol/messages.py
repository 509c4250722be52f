"""The messages nodes exchange: frozen, slotted dataclasses validated on construction.

A tensor travels as `TensorData` (dtype name, shape, raw C-contiguous little-endian
bytes); `aiopipe.protocol.tensors` converts to and from torch without copies. This module
is pure: no I/O, no torch.

Conversation (device ``k``, server ``S``)::

    k → S  Hello(version, device_id, session)
    S → k  Plan(device_id, mode, split_point, parallel_batches, micro_batch_size, run,
                server_time, session)
    repeat per round (aggregation period):
      S → k  RoundStart(round, epoch, first_iteration, iterations, tensors,
                        split_point, parallel_batches, micro_batch_size)
      split modes, per iteration, per micro-batch n:
        k → S  Activation(epoch, iteration, micro_batch, tensor, labels)
        S → k  Gradient(epoch, iteration, micro_batch, tensor)
      k → S  RoundResult(round, samples, loss_sum, correct, tensors)
      k → S  RoundReport(round, report)
    S → k  Bye(reason)
    either way, any time: Heartbeat(seq); ErrorMessage(code, message) before closing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from aiopipe.errors import LocalProtocolError

__all__ = [
    "DTYPE_SIZES",
    "MODES",
    "PROTOCOL_VERSION",
    "Activation",
    "Bye",
    "ErrorMessage",
    "Gradient",
    "Heartbeat",
    "Hello",
    "Message",
    "Plan",
    "RoundReport",
    "RoundResult",
    "RoundStart",
    "TensorData",
]

PROTOCOL_VERSION: Final = 2

#: Training modes a plan can name.
MODES: Final = ("fl", "sl", "sfl", "pipar")

#: Element size in bytes of every dtype that may travel.
DTYPE_SIZES: Final[Mapping[str, int]] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def _check_index(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LocalProtocolError(f"{name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True, slots=True)
class TensorData:
    """A tensor on the wire: dtype name, shape, and its raw bytes (C order)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview = field(repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise LocalProtocolError(f"unsupported tensor dtype {self.dtype!r}")
        if not isinstance(self.shape, tuple) or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape
        ):
            raise LocalProtocolError(
                f"tensor shape must be a tuple of ints >= 0, got {self.shape!r}"
            )
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if memoryview(self.data).nbytes != expected:
            raise LocalProtocolError(
                f"tensor of dtype {self.dtype} and shape {self.shape} needs {expected} bytes, "
                f"got {memoryview(self.data).nbytes}"
            )

    @property
    def nbytes(self) -> int:
        """Size of the raw data in bytes."""
        return memoryview(self.data).nbytes


@dataclass(frozen=True, slots=True)
class Hello:
    """First message of a device: who it is and which protocol it speaks.

    ``session`` is the `Plan.session` of the server-side session the device was talking
    to before it reconnected, or 0 for a device that starts afresh (a new process): only
    a matching session is resumed.
    """

    version: int
    device_id: int
    session: int = 0

    def __post_init__(self) -> None:
        _check_index("version", self.version)
        _check_index("device_id", self.device_id)
        _check_index("session", self.session)


@dataclass(frozen=True, slots=True)
class Plan:
    """The server's answer to Hello: what this device runs.

    ``run`` is the resolved run configuration (plain TOML-able values), so a device needs
    nothing but the server's address and its id. ``server_time`` is the server clock when
    the plan was sent, so a device can map its trace onto the server's time line.
    ``session`` names the server-side state serving this device: a device that reconnects
    and finds a different one (the server restarted, or gave up on it) drops its
    unfinished round and starts afresh from the next `RoundStart`.
    """

    device_id: int
    mode: str
    split_point: int
    parallel_batches: int
    micro_batch_size: int
    run: Mapping[str, Any]
    server_time: float = 0.0
    session: int = 0

    def __post_init__(self) -> None:
        _check_index("device_id", self.device_id)
        if self.mode not in MODES:
            raise LocalProtocolError(f"mode must be one of {MODES}, got {self.mode!r}")
        _check_index("split_point", self.split_point)
        for name in ("parallel_batches", "micro_batch_size"):
            value = getattr(self, name)
            _check_index(name, value)
            if value == 0:
                raise LocalProtocolError(f"{name} must be >= 1")
        _check_index("session", self.session)


@dataclass(frozen=True, slots=True)
class RoundStart:
    """Weights to load and the work to do until the next aggregation.

    ``split_point``, ``parallel_batches`` and ``micro_batch_size`` are the device's plan
    for this round; they differ from the `Plan`'s when the coordinator re-planned
    (``tensors`` then holds the new device half). 0 means "as before" (fl rounds).
    """

    round: int
    epoch: int
    first_iteration: int
    iterations: int
    tensors: Mapping[str, TensorData]
    split_point: int = 0
    parallel_batches: int = 0
    micro_batch_size: int = 0

    def __post_init__(self) -> None:
        for name in ("round", "epoch", "first_iteration", "iterations", "split_point",
                     "parallel_batches", "micro_batch_size"):
            _check_index(name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class Activation:
    """Output of the device half for one micro-batch, with its labels."""

    epoch: int
    iteration: int
    micro_batch: int
    tensor: TensorData
    labels: TensorData

    def __post_init__(self) -> None:
        for name in ("epoch", "iteration", "micro_batch"):
            _check_index(name, getattr(self, name))
        if not self.tensor.shape or not self.labels.shape:
            raise LocalProtocolError("activation and labels need a batch dimension")
        if self.tensor.shape[0] != self.labels.shape[0]:
            raise LocalProtocolError(
                f"activation batch {self.tensor.shape[0]} != labels batch {self.labels.shape[0]}"
            )


@dataclass(frozen=True, slots=True)
class Gradient:
    """Gradient of the loss with respect to one micro-batch's activation."""

    epoch: int
    iteration: int
    micro_batch: int
    tensor: TensorData

    def __post_init__(self) -> None:
        for name in ("epoch", "iteration", "micro_batch"):
            _check_index(name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class RoundResult:
    """A device's trained weights at the end of a round, with what it saw."""

    round: int
    samples: int
    loss_sum: float
    correct: int
    tensors: Mapping[str, TensorData]

    def __post_init__(self) -> None:
        _check_index("round", self.round)
        _check_index("samples", self.samples)
        _check_index("correct", self.correct)
        if not isinstance(self.loss_sum, float) or not math.isfinite(self.loss_sum):
            raise LocalProtocolError(f"loss_sum must be a finite float, got {self.loss_sum!r}")


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What a device's resources did in a round, sent after its `RoundResult`.

    ``report`` holds plain values (like ``Plan.run``): the device's trace slices of the
    round, including the upload of the `RoundResult` itself (which is why this travels
    separately, once that upload is over).
    """

    round: int
    report: Mapping[str, Any]

    def __post_init__(self) -> None:
        _check_index("round", self.round)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Liveness signal, either direction."""

    seq: int

    def __post_init__(self) -> None:
        _check_index("seq", self.seq)


@dataclass(frozen=True, slots=True)
class Bye:
    """Orderly end of the conversation."""

    reason: str


@dataclass(frozen=True, slots=True)
class ErrorMessage:
    """What went wrong, sent just before closing a connection."""

    code: str
    message: str


Message = (
    Hello
    | Plan
    | RoundStart
    | Activation
    | Gradient
    | RoundResult
    | RoundReport
    | Heartbeat
    | Bye
    | ErrorMessage
)
