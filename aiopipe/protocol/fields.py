"""One message field to its header value and back: scalars, plain-value trees, and
tensors placed in the frame's data region (their descriptors, offsets and padding).

`aiopipe.protocol.codec` frames the result (its docstring draws the layout and the
canonical placement of tensors). Encoding refuses what cannot travel with
`LocalProtocolError`; decoding refuses what a peer sent with `RemoteProtocolError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final, Literal

import msgpack

from aiopipe.errors import LocalProtocolError, RemoteProtocolError
from aiopipe.protocol.base import DTYPE_SIZES, TensorData

__all__ = ["FRAME_ALIGNMENT", "MAX_LEAVES", "MAX_TENSOR_NDIM", "MAX_TREE_DEPTH"]

#: Every tensor starts at a multiple of this many bytes from the data region's start (with
#: a 16-aligned frame buffer, as CPython's large ``bytes`` objects are, every element is
#: naturally aligned and SIMD loads are 16-aligned).
FRAME_ALIGNMENT: Final = 16
#: Most dimensions a tensor may have on the wire.
MAX_TENSOR_NDIM: Final = 32
#: Deepest nesting of maps and arrays inside ``Plan.run`` (the top-level map is depth 1).
MAX_TREE_DEPTH: Final = 32

#: Padding: enough zero bytes to reach any aligned offset.
ZEROS: Final = bytes(FRAME_ALIGNMENT)
_INT_MIN: Final = -(2**63)
_UINT_MAX: Final = 2**64 - 1

#: How a field travels: a scalar, a list of ints, a plain-value tree, or tensors.
FieldType = Literal["int", "float", "str", "ints", "tree", "tensor", "leaves", "tensors",
                    "crossing"]

#: Most tensors a "leaves" field holds (what crosses one cut: an activation's leaves).
MAX_LEAVES: Final = 16

#: Most integers an "ints" field holds.
MAX_INTS: Final = 64
#: A message kind's fields, in dataclass field order, with how each travels.
Schema = tuple[tuple[str, FieldType], ...]


def brief(value: object, limit: int = 60) -> str:
    """A short one-line repr of a value for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def type_name(value: object) -> str:
    """The name of ``value``'s type, for error messages."""
    return type(value).__name__


def align(n: int) -> int:
    """``n`` rounded up to a multiple of FRAME_ALIGNMENT."""
    return -(-n // FRAME_ALIGNMENT) * FRAME_ALIGNMENT


def byte_view(buffer: bytes | bytearray | memoryview) -> memoryview | None:
    """A flat unsigned-byte view of ``buffer``, or None if it is not C-contiguous."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        return None
    if view.ndim == 1 and view.format == "B":
        return view
    if view.nbytes == 0:  # memoryview refuses to cast views with zeros in their shape
        return memoryview(b"")
    return view.cast("B")


# --- plain-value trees (Plan.run) -----------------------------------------------------


def _tree(value: object, where: str, depth: int, error: type[Exception]) -> object:
    """Check that ``value`` is a plain-value tree and return it as dicts, lists and scalars.

    Raises:
        error: with the path of the first offending value.
    """
    if isinstance(value, bool | float | str):
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value <= _UINT_MAX:
            raise error(f"{where}: integer {brief(value)} does not fit in 64 bits")
        return value
    if isinstance(value, Mapping | list | tuple) and not isinstance(value, msgpack.ExtType):
        if depth >= MAX_TREE_DEPTH:
            raise error(f"{where}: nested deeper than {MAX_TREE_DEPTH} levels")
        if isinstance(value, Mapping):
            out: dict[str, object] = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    raise error(f"{where}: map key {brief(key)} is not a str")
                out[key] = _tree(item, f"{where}[{brief(key)}]", depth + 1, error)
            return out
        return [_tree(item, f"{where}[{i}]", depth + 1, error) for i, item in enumerate(value)]
    raise error(f"{where}: unsupported value of type {type_name(value)}")


def _crossing(value: object, where: str, error: type[Exception]
              ) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``value`` as a crossing (`aiopipe.models.crossing`): 1 to `MAX_LEAVES` pairs of a
    dtype name and a shape of at most `MAX_TENSOR_NDIM` ints >= 0.

    Raises:
        error: it is not one.
    """
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_LEAVES:
        raise error(f"{where}: wrong field type: expected 1 to {MAX_LEAVES} [dtype, shape] "
                    f"pairs, got {brief(value)}")
    out = []
    for leaf in value:
        if not isinstance(leaf, list | tuple) or len(leaf) != 2:
            raise error(f"{where}: expected a [dtype, shape] pair, got {brief(leaf)}")
        dtype, shape = leaf
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise error(f"{where}: dtype unknown: {brief(dtype)}")
        if not isinstance(shape, list | tuple) or len(shape) > MAX_TENSOR_NDIM or any(
                not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= _UINT_MAX
                for d in shape):
            raise error(f"{where}: shape must be at most {MAX_TENSOR_NDIM} ints >= 0, got "
                        f"{brief(shape)}")
        out.append((dtype, tuple(shape)))
    return tuple(out)


# --- encode ---------------------------------------------------------------------------


class Encoder:
    """Collects tensor parts while the header's fields are built."""

    __slots__ = ("count", "end", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []
        self.end = 0  # end of the last tensor, relative to the data region
        self.count = 0

    def tensor(self, value: object, where: str) -> list[object]:
        if not isinstance(value, TensorData):
            raise LocalProtocolError(f"{where}: expected TensorData, got {type_name(value)}")
        if len(value.shape) > MAX_TENSOR_NDIM:
            raise LocalProtocolError(
                f"{where}: {len(value.shape)} dimensions, at most {MAX_TENSOR_NDIM} travel"
            )
        if any(d > _UINT_MAX for d in value.shape):
            raise LocalProtocolError(f"{where}: shape {brief(value.shape)} does not fit 64 bits")
        view = byte_view(value.data)
        if view is None:
            raise LocalProtocolError(f"{where}: tensor bytes are not C-contiguous")
        expected = math.prod(value.shape) * DTYPE_SIZES[value.dtype]
        if view.nbytes != expected:
            raise LocalProtocolError(
                f"{where}: shape {value.shape} of {value.dtype} needs {expected} bytes, "
                f"the buffer now holds {view.nbytes}"
            )
        offset = align(self.end)
        if offset != self.end:
            self.parts.append(ZEROS[: offset - self.end])
        self.parts.append(view)
        self.end = offset + view.nbytes
        self.count += 1
        return [value.dtype, list(value.shape), offset, view.nbytes]


def encode_field(kind: str, name: str, ftype: FieldType, value: object, enc: Encoder) -> object:
    """The header value of field ``name`` of a ``kind`` message; its tensors go to ``enc``.

    Raises:
        LocalProtocolError: ``value`` cannot travel as ``ftype``.
    """
    where = f"{kind}.{name}"
    if ftype == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise LocalProtocolError(f"{where}: expected int, got {type_name(value)}")
        if not _INT_MIN <= value <= _UINT_MAX:
            raise LocalProtocolError(f"{where}: {brief(value)} does not fit in 64 bits")
        return value
    if ftype == "float":
        if not isinstance(value, float):
            raise LocalProtocolError(f"{where}: expected float, got {type_name(value)}")
        return value
    if ftype == "str":
        if not isinstance(value, str):
            raise LocalProtocolError(f"{where}: expected str, got {type_name(value)}")
        return value
    if ftype == "ints":
        if not isinstance(value, tuple | list) or len(value) > MAX_INTS or any(
                not isinstance(v, int) or isinstance(v, bool) or not _INT_MIN <= v <= _UINT_MAX
                for v in value):
            raise LocalProtocolError(f"{where}: expected at most {MAX_INTS} 64-bit ints, "
                                     f"got {brief(value)}")
        return list(value)
    if ftype == "tree":
        if not isinstance(value, Mapping):
            raise LocalProtocolError(f"{where}: expected a mapping, got {type_name(value)}")
        return _tree(value, where, 0, LocalProtocolError)
    if ftype == "crossing":
        return [[dtype, list(shape)] for dtype, shape in _crossing(value, where,
                                                                   LocalProtocolError)]
    if ftype == "tensor":
        return enc.tensor(value, where)
    if ftype == "leaves":
        if not isinstance(value, tuple) or not 1 <= len(value) <= MAX_LEAVES:
            raise LocalProtocolError(f"{where}: expected a tuple of 1 to {MAX_LEAVES} "
                                     f"tensors, got {brief(value)}")
        return [enc.tensor(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if not isinstance(value, Mapping):
        raise LocalProtocolError(f"{where}: expected a mapping of tensors, got {type_name(value)}")
    out: dict[str, object] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise LocalProtocolError(f"{where}: tensor name {brief(key)} is not a str")
        out[key] = enc.tensor(item, f"{where}[{brief(key)}]")
    return out


# --- decode ---------------------------------------------------------------------------


class Decoder:
    """Checks tensor descriptors against the frame and slices the data region."""

    __slots__ = ("count", "end", "frame", "head_end", "start")

    def __init__(self, frame: memoryview, head_end: int) -> None:
        self.frame = frame
        self.head_end = head_end
        self.start = align(head_end)  # the data region's start, if any tensor travels
        self.end = 0  # end of the last tensor, relative to the data region
        self.count = 0

    def frame_end(self) -> int:
        """Where the frame must end, given the tensors seen so far."""
        return self.start + self.end if self.count else self.head_end

    def tensor(self, desc: object, where: str) -> TensorData:
        if not isinstance(desc, list) or len(desc) != 4:
            raise RemoteProtocolError(
                f"{where}: tensor descriptor must be [dtype, shape, offset, nbytes], "
                f"got {brief(desc)}"
            )
        dtype, shape, offset, nbytes = desc
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise RemoteProtocolError(f"{where}: dtype unknown: {brief(dtype)}")
        if not isinstance(shape, list) or len(shape) > MAX_TENSOR_NDIM:
            raise RemoteProtocolError(
                f"{where}: shape must be a list of at most {MAX_TENSOR_NDIM} ints, "
                f"got {brief(shape)}"
            )
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise RemoteProtocolError(f"{where}: shape must hold ints >= 0, got {brief(shape)}")
        for label, value in (("offset", offset), ("nbytes", nbytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RemoteProtocolError(
                    f"{where}: tensor {label} must be an int >= 0, got {brief(value)}"
                )
        expected = math.prod(shape) * DTYPE_SIZES[dtype]
        if nbytes != expected:
            raise RemoteProtocolError(
                f"{where}: shape/byte-length mismatch: shape {brief(shape)} of {dtype} "
                f"needs {expected} bytes, descriptor says {nbytes}"
            )
        if offset != align(self.end):
            raise RemoteProtocolError(
                f"{where}: tensor offset {offset} is not the canonical {align(self.end)}"
            )
        first, last = self.start + offset, self.start + offset + nbytes
        if last > self.frame.nbytes:
            raise RemoteProtocolError(
                f"{where}: tensor bytes out of range: [{first}, {last}) "
                f"beyond the {self.frame.nbytes}-byte frame"
            )
        gap_start = self.start + self.end if self.count else self.head_end
        if self.frame[gap_start:first] != ZEROS[: first - gap_start]:
            raise RemoteProtocolError(f"{where}: nonzero padding before the tensor bytes")
        view = self.frame[first:last]
        if dtype == "bool" and view.tobytes().translate(None, b"\x00\x01"):
            raise RemoteProtocolError(f"{where}: bool tensor holds bytes other than 0 and 1")
        self.end = offset + nbytes
        self.count += 1
        try:
            return TensorData(dtype, tuple(shape), view)
        except LocalProtocolError as exc:  # pragma: no cover - checked above
            raise RemoteProtocolError(f"{where}: {exc}") from exc


def decode_field(kind: str, name: str, ftype: FieldType, value: object, dec: Decoder) -> object:
    """Field ``name`` of a ``kind`` message from its header value; ``dec`` slices its
    tensors out of the frame.

    Raises:
        RemoteProtocolError: ``value`` is not a valid ``ftype``.
    """
    where = f"{kind}.{name}"
    if ftype == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise RemoteProtocolError(
                f"{where}: wrong field type: expected int, got {type_name(value)}"
            )
        return value
    if ftype == "float":
        if not isinstance(value, float):
            raise RemoteProtocolError(
                f"{where}: wrong field type: expected float, got {type_name(value)}"
            )
        return value
    if ftype == "str":
        if not isinstance(value, str):
            raise RemoteProtocolError(
                f"{where}: wrong field type: expected str, got {type_name(value)}"
            )
        return value
    if ftype == "ints":
        if not isinstance(value, list) or len(value) > MAX_INTS or any(
                not isinstance(v, int) or isinstance(v, bool) for v in value):
            raise RemoteProtocolError(
                f"{where}: wrong field type: expected at most {MAX_INTS} ints, "
                f"got {brief(value)}")
        return tuple(value)
    if ftype == "tree":
        if not isinstance(value, dict):
            raise RemoteProtocolError(
                f"{where}: wrong field type: expected map, got {type_name(value)}"
            )
        return _tree(value, where, 0, RemoteProtocolError)
    if ftype == "crossing":
        return _crossing(value, where, RemoteProtocolError)
    if ftype == "tensor":
        return dec.tensor(value, where)
    if ftype == "leaves":
        if not isinstance(value, list) or not 1 <= len(value) <= MAX_LEAVES:
            raise RemoteProtocolError(f"{where}: wrong field type: expected 1 to "
                                      f"{MAX_LEAVES} tensors, got {brief(value)}")
        return tuple(dec.tensor(item, f"{where}[{i}]") for i, item in enumerate(value))
    if not isinstance(value, dict):
        raise RemoteProtocolError(
            f"{where}: wrong field type: expected map of tensors, got {type_name(value)}"
        )
    out: dict[str, TensorData] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise RemoteProtocolError(f"{where}: tensor name {brief(key)} is not a str")
        out[key] = dec.tensor(item, f"{where}[{brief(key)}]")
    return out

