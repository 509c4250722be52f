"""Messages to frames and back: one frame per message, tensors as raw bytes, no pickle.

Theory of operation
-------------------
A frame is a small fixed prefix, a msgpack header, and the tensors' raw bytes::

    offset  size  content
    0       3     magic b"APW"
    3       1     frame format version (FRAME_FORMAT_VERSION = 1)
    4       4     header length H, unsigned little-endian
    8       H     header: msgpack array [kind, fields]
    D       ...   data region: the tensors' bytes, each starting FRAME_ALIGNMENT-aligned
                  (relative to the data region), gaps filled with zero bytes

``D`` is ``8 + H`` rounded up to a multiple of FRAME_ALIGNMENT when the message carries
tensors, else ``8 + H`` (and the frame ends there). ``kind`` is the message's tag
(``"hello"``, ``"plan"``, ``"round_start"``, ``"activation"``, ``"gradient"``,
``"round_result"``, ``"heartbeat"``, ``"bye"``, ``"error"``); ``fields`` maps every
dataclass field name to its value. Scalars travel as msgpack ints, floats and strings
(a float field must hold a Python float); ``Plan.run``, ``Plan.peer_keys``,
``RoundStart.peers`` and ``RoundReport.report`` as
nested msgpack maps of plain values (str, int, float, bool, arrays, maps with str keys;
arrays come back as lists, and there is no nil). A ``TensorData`` field travels as the
descriptor ``[dtype, shape, offset, nbytes]`` (offset relative to the data region), a
``Mapping[str, TensorData]`` as a map from name to descriptor.

The layout is canonical and checked: tensors appear in the data region in field order
(and, within a mapping, in the map's order), each at the first aligned offset after the
previous one, padding is zero, and the frame ends exactly where the last tensor ends. A
frame is therefore fully described by its header, and nothing can hide in it.

Copies: `encode` copies each tensor's bytes exactly once (into the frame, by one
``bytes.join``). `decode` copies none: each ``TensorData.data`` is a ``memoryview`` slice
of the frame, which it keeps alive (a ``bytearray`` frame cannot be resized while such
views exist). Only ``bool`` tensors are read, to check that every byte is 0 or 1.

Errors: `encode` raises `LocalProtocolError` for anything it cannot put on the wire;
`decode` raises `RemoteProtocolError` (or its subclass `FrameTooLargeError`, checked before
any parsing) naming what was wrong, and lets no foreign exception escape. msgpack runs
with ``strict_map_key``, ``raw=False``, no ext hooks and explicit length limits.

Frame limits: a frame's non-tensor bytes are at most ::

    HEADER_SLACK_BYTES + Σ over tensors (TENSOR_SLACK_BYTES + len(name.encode()))
                       + len(msgpack.packb(tree)) for each plain-value tree

where ``name`` is a tensor's mapping key (empty for a plain tensor field) and the trees
are ``Plan.run``, ``Plan.peer_keys``, ``RoundStart.peers`` and ``RoundReport.report``
(each key adds ~80 bytes), provided the message's
strings total at most 1 KiB of UTF-8 (``RoundStart.actions`` aside: add its length) and
each tensor has at most 15 dimensions. For Activation, Gradient, Hello, Heartbeat, Bye
and ErrorMessage (and RoundStart / RoundResult with at most 4 tensors named in at most
64 bytes each, and RoundReport with an empty report) ``HEADER_SLACK_BYTES``
alone suffices, so a plan's frame limit for them is tensor bytes + ``HEADER_SLACK_BYTES``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

import msgpack

from aiopipe.errors import FrameTooLargeError, LocalProtocolError, RemoteProtocolError
from aiopipe.protocol.messages import (
    DTYPE_SIZES,
    Accusation,
    Activation,
    Bye,
    ErrorMessage,
    EvalRequest,
    EvalResult,
    FramePart,
    Gradient,
    GroupGradient,
    Heartbeat,
    Hello,
    Message,
    Plan,
    Probe,
    Profile,
    ProfileRequest,
    Ready,
    Replica,
    ReplicaRequest,
    RingBypass,
    RingChunk,
    RingHandshake,
    RoundReport,
    RoundResult,
    RoundStalled,
    RoundStart,
    SyncedModel,
    TensorData,
)

__all__ = [
    "FRAME_ALIGNMENT",
    "FRAME_FORMAT_VERSION",
    "FRAME_MAGIC",
    "HEADER_SLACK_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_TENSOR_NDIM",
    "MAX_TREE_DEPTH",
    "TENSOR_SLACK_BYTES",
    "decode",
    "encode",
]

#: First three bytes of every frame.
FRAME_MAGIC: Final = b"APW"
#: Version of the frame layout (not of the conversation: that is Hello's PROTOCOL_VERSION).
FRAME_FORMAT_VERSION: Final = 1
#: Every tensor starts at a multiple of this many bytes from the data region's start (with
#: a 16-aligned frame buffer, as CPython's large ``bytes`` objects are, every element is
#: naturally aligned and SIMD loads are 16-aligned).
FRAME_ALIGNMENT: Final = 16
#: Largest msgpack header accepted (or produced).
MAX_HEADER_BYTES: Final = 8 * 1024 * 1024
#: Most dimensions a tensor may have on the wire.
MAX_TENSOR_NDIM: Final = 32
#: Deepest nesting of maps and arrays inside ``Plan.run`` (the top-level map is depth 1).
MAX_TREE_DEPTH: Final = 32
#: Bound on a frame's non-tensor bytes for small messages; see the module docstring.
HEADER_SLACK_BYTES: Final = 4096
#: Extra non-tensor bytes per tensor (plus its name's UTF-8 length) for large messages.
TENSOR_SLACK_BYTES: Final = 192

_PREFIX: Final = struct.Struct("<3sBI")
_ZEROS: Final = bytes(FRAME_ALIGNMENT)
_INT_MIN: Final = -(2**63)
_UINT_MAX: Final = 2**64 - 1

_FieldType = Literal["int", "float", "str", "ints", "tree", "tensor", "tensors"]

#: Most integers an "ints" field holds.
MAX_INTS: Final = 64
_Schema = tuple[tuple[str, _FieldType], ...]

#: The address fields that open an `Activation` and a `Gradient`.
_STAGE_ADDRESS: Final[_Schema] = (
    ("run_id", "int"),
    ("stage", "int"),
    ("epoch", "int"),
    ("iteration", "int"),
    ("micro_batch", "int"),
    ("version", "int"),
    ("source", "str"),
    ("destination", "str"),
)

#: Wire tag and field types of every message kind, in dataclass field order.
_SCHEMAS: Final[dict[type[Any], tuple[str, _Schema]]] = {
    Hello: ("hello", (("version", "int"), ("device_id", "int"), ("session", "int"),
                      ("address", "str"))),
    Plan: (
        "plan",
        (
            ("device_id", "int"),
            ("mode", "str"),
            ("run", "tree"),
            ("run_id", "int"),
            ("server_time", "float"),
            ("session", "int"),
            ("peer_keys", "tree"),
            ("in_shape", "ints"),
            ("num_classes", "int"),
        ),
    ),
    Ready: ("ready", (("samples", "int"), ("in_shape", "ints"), ("num_classes", "int"),
                      ("model_digest", "str"), ("host", "str"), ("held_out", "int"))),
    EvalRequest: ("eval_request", (("epoch", "int"), ("tensors", "tensors"))),
    EvalResult: ("eval_result", (("epoch", "int"), ("samples", "int"), ("loss_sum", "float"),
                                 ("correct", "int"))),
    ProfileRequest: ("profile_request", (("batch_sizes", "ints"),)),
    Profile: ("profile", (("costs", "tree"), ("seconds", "float"), ("downlink_bps", "float"))),
    Probe: ("probe", (("data", "tensor"),)),
    FramePart: ("frame_part", (("index", "int"), ("count", "int"), ("data", "tensor"))),
    RoundStart: (
        "round_start",
        (
            ("round", "int"),
            ("epoch", "int"),
            ("first_iteration", "int"),
            ("iterations", "int"),
            ("tensors", "tensors"),
            ("stage", "int"),
            ("stages", "int"),
            ("first_unit", "int"),
            ("stop_unit", "int"),
            ("parallel_batches", "int"),
            ("micro_batch_size", "int"),
            ("version", "int"),
            ("actions", "str"),
            ("peers", "tree"),
            ("rows", "ints"),
            ("sync", "tree"),
        ),
    ),
    Activation: ("activation", (*_STAGE_ADDRESS, ("tensor", "tensor"), ("labels", "tensor"))),
    Gradient: ("gradient", (*_STAGE_ADDRESS, ("tensor", "tensor"))),
    GroupGradient: ("group_gradient", (*_STAGE_ADDRESS[:4], *_STAGE_ADDRESS[5:],
                                       ("tensors", "tensors"))),
    RoundResult: (
        "round_result",
        (
            ("round", "int"),
            ("samples", "int"),
            ("loss_sum", "float"),
            ("correct", "int"),
            ("tensors", "tensors"),
            ("version", "float"),
        ),
    ),
    RoundReport: ("round_report", (("round", "int"), ("report", "tree"))),
    RoundStalled: ("round_stalled", (("round", "int"), ("reason", "str"))),
    Accusation: ("accusation", (("round", "int"), ("culprit", "str"), ("reason", "str"))),
    Replica: ("replica", (("round", "int"), ("stage", "int"), ("batches", "int"),
                          ("loss_sum", "float"), ("correct", "int"), ("tensors", "tensors"))),
    ReplicaRequest: ("replica_request", (("round", "int"), ("batches", "int"),
                                         ("stages", "ints"))),
    RingChunk: ("ring_chunk", (("run_id", "int"), ("round", "int"), ("ring", "ints"),
                               ("step", "int"), ("chunk", "int"), ("values", "tensor"))),
    RingBypass: ("ring_bypass", (("run_id", "int"), ("round", "int"), ("ring", "ints"))),
    RingHandshake: ("ring_handshake", (("run_id", "int"), ("round", "int"), ("reply", "int"))),
    SyncedModel: ("synced_model", (("run_id", "int"), ("round", "int"), ("version", "float"),
                                   ("tensors", "tensors"))),
    Heartbeat: ("heartbeat", (("seq", "int"),)),
    Bye: ("bye", (("reason", "str"),)),
    ErrorMessage: ("error", (("code", "str"), ("message", "str"))),
}
_BY_TAG: Final[dict[str, tuple[Callable[..., Message], _Schema]]] = {
    tag: (cls, schema) for cls, (tag, schema) in _SCHEMAS.items()
}


def _brief(value: object, limit: int = 60) -> str:
    """A short one-line repr of a value for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(value: object) -> str:
    return type(value).__name__


def _align(n: int) -> int:
    return -(-n // FRAME_ALIGNMENT) * FRAME_ALIGNMENT


def _byte_view(buffer: bytes | bytearray | memoryview) -> memoryview | None:
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
            raise error(f"{where}: integer {_brief(value)} does not fit in 64 bits")
        return value
    if isinstance(value, Mapping | list | tuple) and not isinstance(value, msgpack.ExtType):
        if depth >= MAX_TREE_DEPTH:
            raise error(f"{where}: nested deeper than {MAX_TREE_DEPTH} levels")
        if isinstance(value, Mapping):
            out: dict[str, object] = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    raise error(f"{where}: map key {_brief(key)} is not a str")
                out[key] = _tree(item, f"{where}[{_brief(key)}]", depth + 1, error)
            return out
        return [_tree(item, f"{where}[{i}]", depth + 1, error) for i, item in enumerate(value)]
    raise error(f"{where}: unsupported value of type {_type_name(value)}")


# --- encode ---------------------------------------------------------------------------


class _Encoder:
    """Collects tensor parts while the header's fields are built."""

    __slots__ = ("count", "end", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []
        self.end = 0  # end of the last tensor, relative to the data region
        self.count = 0

    def tensor(self, value: object, where: str) -> list[object]:
        if not isinstance(value, TensorData):
            raise LocalProtocolError(f"{where}: expected TensorData, got {_type_name(value)}")
        if len(value.shape) > MAX_TENSOR_NDIM:
            raise LocalProtocolError(
                f"{where}: {len(value.shape)} dimensions, at most {MAX_TENSOR_NDIM} travel"
            )
        if any(d > _UINT_MAX for d in value.shape):
            raise LocalProtocolError(f"{where}: shape {_brief(value.shape)} does not fit 64 bits")
        view = _byte_view(value.data)
        if view is None:
            raise LocalProtocolError(f"{where}: tensor bytes are not C-contiguous")
        expected = math.prod(value.shape) * DTYPE_SIZES[value.dtype]
        if view.nbytes != expected:
            raise LocalProtocolError(
                f"{where}: shape {value.shape} of {value.dtype} needs {expected} bytes, "
                f"the buffer now holds {view.nbytes}"
            )
        offset = _align(self.end)
        if offset != self.end:
            self.parts.append(_ZEROS[: offset - self.end])
        self.parts.append(view)
        self.end = offset + view.nbytes
        self.count += 1
        return [value.dtype, list(value.shape), offset, view.nbytes]


def _encode_field(kind: str, name: str, ftype: _FieldType, value: object, enc: _Encoder) -> object:
    where = f"{kind}.{name}"
    if ftype == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise LocalProtocolError(f"{where}: expected int, got {_type_name(value)}")
        if not _INT_MIN <= value <= _UINT_MAX:
            raise LocalProtocolError(f"{where}: {_brief(value)} does not fit in 64 bits")
        return value
    if ftype == "float":
        if not isinstance(value, float):
            raise LocalProtocolError(f"{where}: expected float, got {_type_name(value)}")
        return value
    if ftype == "str":
        if not isinstance(value, str):
            raise LocalProtocolError(f"{where}: expected str, got {_type_name(value)}")
        return value
    if ftype == "ints":
        if not isinstance(value, tuple | list) or len(value) > MAX_INTS or any(
                not isinstance(v, int) or isinstance(v, bool) or not _INT_MIN <= v <= _UINT_MAX
                for v in value):
            raise LocalProtocolError(f"{where}: expected at most {MAX_INTS} 64-bit ints, "
                                     f"got {_brief(value)}")
        return list(value)
    if ftype == "tree":
        if not isinstance(value, Mapping):
            raise LocalProtocolError(f"{where}: expected a mapping, got {_type_name(value)}")
        return _tree(value, where, 0, LocalProtocolError)
    if ftype == "tensor":
        return enc.tensor(value, where)
    if not isinstance(value, Mapping):
        raise LocalProtocolError(f"{where}: expected a mapping of tensors, got {_type_name(value)}")
    out: dict[str, object] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise LocalProtocolError(f"{where}: tensor name {_brief(key)} is not a str")
        out[key] = enc.tensor(item, f"{where}[{_brief(key)}]")
    return out


def encode(message: Message) -> bytes:
    """Serialize one message into one frame (layout in the module docstring).

    Each tensor's bytes are copied exactly once, into the returned frame.

    Raises:
        LocalProtocolError: ``message`` is not a message, or a field cannot travel (wrong
            type, integer beyond 64 bits, ``Plan.run`` holding a non-plain value or nested
            too deep, non-contiguous tensor bytes, header above MAX_HEADER_BYTES).
    """
    entry = _SCHEMAS.get(type(message))
    if entry is None:
        raise LocalProtocolError(f"cannot encode {_type_name(message)}: not a message")
    kind, schema = entry
    enc = _Encoder()
    fields = {
        name: _encode_field(kind, name, ftype, getattr(message, name), enc)
        for name, ftype in schema
    }
    try:
        header = msgpack.packb([kind, fields], use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a lone surrogate in a str
        raise LocalProtocolError(
            f"{kind}: header cannot be packed: {_brief(str(exc), 120)}"
        ) from exc
    if len(header) > MAX_HEADER_BYTES:
        raise LocalProtocolError(
            f"{kind}: header of {len(header)} bytes exceeds {MAX_HEADER_BYTES} bytes"
        )
    head_end = _PREFIX.size + len(header)
    parts: list[bytes | memoryview] = [
        _PREFIX.pack(FRAME_MAGIC, FRAME_FORMAT_VERSION, len(header)),
        header,
    ]
    if enc.count:
        parts.append(_ZEROS[: _align(head_end) - head_end])
        parts.extend(enc.parts)
    return b"".join(parts)


# --- decode ---------------------------------------------------------------------------


class _Decoder:
    """Checks tensor descriptors against the frame and slices the data region."""

    __slots__ = ("count", "end", "frame", "head_end", "start")

    def __init__(self, frame: memoryview, head_end: int) -> None:
        self.frame = frame
        self.head_end = head_end
        self.start = _align(head_end)  # the data region's start, if any tensor travels
        self.end = 0  # end of the last tensor, relative to the data region
        self.count = 0

    def frame_end(self) -> int:
        """Where the frame must end, given the tensors seen so far."""
        return self.start + self.end if self.count else self.head_end

    def tensor(self, desc: object, where: str) -> TensorData:
        if not isinstance(desc, list) or len(desc) != 4:
            raise RemoteProtocolError(
                f"{where}: tensor descriptor must be [dtype, shape, offset, nbytes], "
                f"got {_brief(desc)}"
            )
        dtype, shape, offset, nbytes = desc
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise RemoteProtocolError(f"{where}: dtype unknown: {_brief(dtype)}")
        if not isinstance(shape, list) or len(shape) > MAX_TENSOR_NDIM:
            raise RemoteProtocolError(
                f"{where}: shape must be a list of at most {MAX_TENSOR_NDIM} ints, "
                f"got {_brief(shape)}"
            )
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise RemoteProtocolError(f"{where}: shape must hold ints >= 0, got {_brief(shape)}")
        for label, value in (("offset", offset), ("nbytes", nbytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RemoteProtocolError(
                    f"{where}: tensor {label} must be an int >= 0, got {_brief(value)}"
                )
        expected = math.prod(shape) * DTYPE_SIZES[dtype]
        if nbytes != expected:
            raise RemoteProtocolError(
                f"{where}: shape/byte-length mismatch: shape {_brief(shape)} of {dtype} "
                f"needs {expected} bytes, descriptor says {nbytes}"
            )
        if offset != _align(self.end):
            raise RemoteProtocolError(
                f"{where}: tensor offset {offset} is not the canonical {_align(self.end)}"
            )
        first, last = self.start + offset, self.start + offset + nbytes
        if last > self.frame.nbytes:
            raise RemoteProtocolError(
                f"{where}: tensor bytes out of range: [{first}, {last}) "
                f"beyond the {self.frame.nbytes}-byte frame"
            )
        gap_start = self.start + self.end if self.count else self.head_end
        if self.frame[gap_start:first] != _ZEROS[: first - gap_start]:
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


def _decode_field(kind: str, name: str, ftype: _FieldType, value: object, dec: _Decoder) -> object:
    where = f"{kind}.{name}"
    if ftype == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise RemoteProtocolError(
                f"{where}: wrong field type: expected int, got {_type_name(value)}"
            )
        return value
    if ftype == "float":
        if not isinstance(value, float):
            raise RemoteProtocolError(
                f"{where}: wrong field type: expected float, got {_type_name(value)}"
            )
        return value
    if ftype == "str":
        if not isinstance(value, str):
            raise RemoteProtocolError(
                f"{where}: wrong field type: expected str, got {_type_name(value)}"
            )
        return value
    if ftype == "ints":
        if not isinstance(value, list) or len(value) > MAX_INTS or any(
                not isinstance(v, int) or isinstance(v, bool) for v in value):
            raise RemoteProtocolError(
                f"{where}: wrong field type: expected at most {MAX_INTS} ints, "
                f"got {_brief(value)}")
        return tuple(value)
    if ftype == "tree":
        if not isinstance(value, dict):
            raise RemoteProtocolError(
                f"{where}: wrong field type: expected map, got {_type_name(value)}"
            )
        return _tree(value, where, 0, RemoteProtocolError)
    if ftype == "tensor":
        return dec.tensor(value, where)
    if not isinstance(value, dict):
        raise RemoteProtocolError(
            f"{where}: wrong field type: expected map of tensors, got {_type_name(value)}"
        )
    out: dict[str, TensorData] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise RemoteProtocolError(f"{where}: tensor name {_brief(key)} is not a str")
        out[key] = dec.tensor(item, f"{where}[{_brief(key)}]")
    return out


def _unpack_header(header: memoryview) -> object:
    size = header.nbytes
    try:
        return msgpack.unpackb(
            header,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=size,
            max_bin_len=0,
            max_array_len=size,
            max_map_len=size,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises ValueError, UnicodeDecodeError, its own ...
        detail = _brief(str(exc), 120).replace("\n", " ")
        raise RemoteProtocolError(
            f"malformed msgpack header ({type(exc).__name__}{': ' + detail if detail else ''})"
        ) from exc


def decode(frame: bytes | bytearray | memoryview, *, max_frame_bytes: int | None = None) -> Message:
    """Parse one frame into a message; tensor bytes become memoryview slices of ``frame``.

    Raises:
        FrameTooLargeError: the frame is longer than ``max_frame_bytes`` (checked first).
        RemoteProtocolError: the frame is malformed; the message names what was wrong
            (truncated, bad magic, unsupported format version, malformed header, unknown
            kind, missing or unknown field, wrong field type, dtype unknown, shape/byte-length
            mismatch, tensor bytes out of range, nonzero padding, trailing bytes, or a
            field value the message itself rejects).
        LocalProtocolError: ``frame`` is not a contiguous bytes-like object, or
            ``max_frame_bytes`` is negative.
    """
    try:
        view = _byte_view(frame)
    except TypeError as exc:
        raise LocalProtocolError(
            f"decode needs a bytes-like frame, got {_type_name(frame)}"
        ) from exc
    if view is None:
        raise LocalProtocolError("decode needs a C-contiguous frame buffer")
    size = view.nbytes
    if max_frame_bytes is not None:
        if max_frame_bytes < 0:
            raise LocalProtocolError(f"max_frame_bytes must be >= 0, got {max_frame_bytes}")
        if size > max_frame_bytes:
            raise FrameTooLargeError(
                f"frame of {size} bytes exceeds the limit of {max_frame_bytes} bytes"
            )
    if size < _PREFIX.size:
        raise RemoteProtocolError(f"truncated frame: {size} bytes, the prefix alone needs 8")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != FRAME_MAGIC:
        raise RemoteProtocolError(f"bad magic {magic!r}: not an aiopipe frame")
    if version != FRAME_FORMAT_VERSION:
        raise RemoteProtocolError(
            f"unsupported frame format version {version} (this side speaks {FRAME_FORMAT_VERSION})"
        )
    if header_len > MAX_HEADER_BYTES:
        raise RemoteProtocolError(
            f"header length {header_len} exceeds the limit of {MAX_HEADER_BYTES} bytes"
        )
    head_end = _PREFIX.size + header_len
    if head_end > size:
        raise RemoteProtocolError(
            f"truncated frame: {size} bytes, the header claims to end at {head_end}"
        )
    header = _unpack_header(view[_PREFIX.size : head_end])
    if not isinstance(header, list) or len(header) != 2:
        raise RemoteProtocolError(f"header must be [kind, fields], got {_brief(header)}")
    kind, fields = header
    entry = _BY_TAG.get(kind) if isinstance(kind, str) else None
    if entry is None:
        raise RemoteProtocolError(f"unknown message kind {_brief(kind)}")
    cls, schema = entry
    if not isinstance(fields, dict):
        raise RemoteProtocolError(f"{kind}: fields must be a map, got {_type_name(fields)}")
    for name, _ in schema:
        if name not in fields:
            raise RemoteProtocolError(f"{kind}: missing field {name!r}")
    if len(fields) != len(schema):
        known = {name for name, _ in schema}
        extra = next(key for key in fields if key not in known)
        raise RemoteProtocolError(f"{kind}: unknown field {_brief(extra)}")
    dec = _Decoder(view, head_end)
    values = {name: _decode_field(kind, name, ftype, fields[name], dec) for name, ftype in schema}
    end = dec.frame_end()
    if end != size:
        raise RemoteProtocolError(
            f"{size - end} trailing bytes after the message"
            if end < size
            else f"truncated frame: {size} bytes, the message needs {end}"
        )
    try:
        return cls(**values)
    except LocalProtocolError as exc:
        raise RemoteProtocolError(f"invalid {kind}: {exc}") from exc
