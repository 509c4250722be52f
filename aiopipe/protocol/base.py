"""What every message is built from: `TensorData`, the dtypes that travel, and the field
checks the message modules share (node names, non-negative indices).

Pure: no I/O, no torch (`aiopipe.protocol.tensors` converts to and from torch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from aiopipe import auth
from aiopipe.errors import ConfigError, LocalProtocolError

__all__ = ["DTYPE_SIZES", "TensorData", "check_node_name", "check_score"]

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


def check_node_name(name: object) -> str:
    """``name`` once it is a valid node name (`aiopipe.auth.check_node_name`: 1 to
    `MAX_NODE_NAME_BYTES` ASCII letters, digits or ``_.:-``).

    Raises:
        LocalProtocolError: it is not.
    """
    try:
        return auth.check_node_name(name)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise LocalProtocolError(str(exc)) from None


def check_index(name: str, value: int) -> None:
    """Refuse ``value`` unless it is a non-negative int (not a bool).

    Raises:
        LocalProtocolError: it is not.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LocalProtocolError(f"{name} must be a non-negative int, got {value!r}")


def check_score(owner: object, name: str, samples: int | None = None) -> None:
    """Refuse ``owner.name`` unless it is a finite number >= 0 (at most ``samples`` when
    given): a sum of per-sample scores in [0, 1] (accuracies: correct predictions, for a
    classifier), and store it as a float (an int is taken as one).

    Raises:
        LocalProtocolError: it is not.
    """
    value = getattr(owner, name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value >= 0):
        raise LocalProtocolError(f"{name} must be a finite number >= 0, got {value!r}")
    if samples is not None and value > samples:
        raise LocalProtocolError(f"{name} {value} exceeds samples {samples}")
    object.__setattr__(owner, name, float(value))


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
