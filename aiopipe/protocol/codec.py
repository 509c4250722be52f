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
tuple of them (an activation's or a gradient's leaves, 1 to ``MAX_LEAVES``) as an array
of descriptors, a ``Mapping[str, TensorData]`` as a map from name to descriptor.

The layout is canonical and checked: tensors appear in the data region in field order
(and, within a mapping, in the map's order), each at the first aligned offset after the
previous one, padding is zero, and the frame ends exactly where the last tensor ends. A
frame is therefore fully described by its header, and nothing can hide in it.

`aiopipe.protocol.fields` turns each field into its header value and each tensor into
its descriptor and its place in the data region; this module frames the result.

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

import struct
from collections.abc import Callable
from typing import Any, Final

import msgpack

from aiopipe.errors import FrameTooLargeError, LocalProtocolError, RemoteProtocolError
from aiopipe.protocol.fields import (
    FRAME_ALIGNMENT,
    MAX_LEAVES,
    MAX_TENSOR_NDIM,
    MAX_TREE_DEPTH,
    ZEROS,
    Decoder,
    Encoder,
    Schema,
    align,
    brief,
    byte_view,
    decode_field,
    encode_field,
    type_name,
)
from aiopipe.protocol.messages import (
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
    Rest,
    RingBypass,
    RingChunk,
    RingHandshake,
    RoundAccepted,
    RoundReport,
    RoundResult,
    RoundStalled,
    RoundStart,
    SecAggReply,
    SecAggRequest,
    SyncedModel,
)

__all__ = [
    "FRAME_ALIGNMENT",
    "FRAME_FORMAT_VERSION",
    "FRAME_MAGIC",
    "HEADER_SLACK_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_LEAVES",
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
#: Largest msgpack header accepted (or produced).
MAX_HEADER_BYTES: Final = 8 * 1024 * 1024
#: Bound on a frame's non-tensor bytes for small messages; see the module docstring.
HEADER_SLACK_BYTES: Final = 4096
#: Extra non-tensor bytes per tensor (plus its name's UTF-8 length) for large messages.
TENSOR_SLACK_BYTES: Final = 192

_PREFIX: Final = struct.Struct("<3sBI")

#: The address fields that open an `Activation` and a `Gradient`.
_STAGE_ADDRESS: Final[Schema] = (
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
_SCHEMAS: Final[dict[type[Any], tuple[str, Schema]]] = {
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
            ("inputs", "crossing"),
            ("target", "crossing"),
            ("num_classes", "int"),
        ),
    ),
    Ready: ("ready", (("samples", "int"), ("inputs", "crossing"), ("target", "crossing"),
                      ("num_classes", "int"), ("model_digest", "str"), ("host", "str"),
                      ("held_out", "int"))),
    EvalRequest: ("eval_request", (("epoch", "int"), ("tensors", "tensors"))),
    EvalResult: ("eval_result", (("epoch", "int"), ("samples", "int"), ("loss_sum", "float"),
                                 ("correct", "float"))),
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
    Activation: ("activation", (*_STAGE_ADDRESS, ("tensors", "leaves"), ("labels", "tensor"))),
    Gradient: ("gradient", (*_STAGE_ADDRESS, ("tensors", "leaves"))),
    GroupGradient: ("group_gradient", (*_STAGE_ADDRESS[:4], *_STAGE_ADDRESS[5:],
                                       ("tensors", "tensors"))),
    RoundResult: (
        "round_result",
        (
            ("round", "int"),
            ("samples", "int"),
            ("loss_sum", "float"),
            ("correct", "float"),
            ("tensors", "tensors"),
            ("version", "float"),
        ),
    ),
    RoundReport: ("round_report", (("round", "int"), ("report", "tree"))),
    RoundStalled: ("round_stalled", (("round", "int"), ("reason", "str"))),
    RoundAccepted: ("round_accepted", (("round", "int"),)),
    Rest: ("rest", ()),
    Accusation: ("accusation", (("round", "int"), ("culprit", "str"), ("reason", "str"))),
    Replica: ("replica", (("round", "int"), ("stage", "int"), ("batches", "int"),
                          ("loss_sum", "float"), ("correct", "float"), ("tensors", "tensors"))),
    ReplicaRequest: ("replica_request", (("round", "int"), ("batches", "int"),
                                         ("stages", "ints"))),
    RingChunk: ("ring_chunk", (("run_id", "int"), ("round", "int"), ("ring", "ints"),
                               ("step", "int"), ("chunk", "int"), ("values", "tensor"))),
    RingBypass: ("ring_bypass", (("run_id", "int"), ("round", "int"), ("ring", "ints"))),
    RingHandshake: ("ring_handshake", (("run_id", "int"), ("round", "int"), ("reply", "int"))),
    SecAggRequest: ("secagg_request", (("round", "int"), ("step", "int"), ("clients", "ints"),
                                       ("dropped", "ints"), ("length", "int"),
                                       ("tensors", "tensors"))),
    SecAggReply: ("secagg_reply", (("round", "int"), ("step", "int"), ("tensors", "tensors"))),
    SyncedModel: ("synced_model", (("run_id", "int"), ("round", "int"), ("version", "float"),
                                   ("tensors", "tensors"))),
    Heartbeat: ("heartbeat", (("seq", "int"),)),
    Bye: ("bye", (("reason", "str"),)),
    ErrorMessage: ("error", (("code", "str"), ("message", "str"))),
}
_BY_TAG: Final[dict[str, tuple[Callable[..., Message], Schema]]] = {
    tag: (cls, schema) for cls, (tag, schema) in _SCHEMAS.items()
}


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
        raise LocalProtocolError(f"cannot encode {type_name(message)}: not a message")
    kind, schema = entry
    enc = Encoder()
    fields = {
        name: encode_field(kind, name, ftype, getattr(message, name), enc)
        for name, ftype in schema
    }
    try:
        header = msgpack.packb([kind, fields], use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a lone surrogate in a str
        raise LocalProtocolError(
            f"{kind}: header cannot be packed: {brief(str(exc), 120)}"
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
        parts.append(ZEROS[: align(head_end) - head_end])
        parts.extend(enc.parts)
    return b"".join(parts)


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
        detail = brief(str(exc), 120).replace("\n", " ")
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
        view = byte_view(frame)
    except TypeError as exc:
        raise LocalProtocolError(
            f"decode needs a bytes-like frame, got {type_name(frame)}"
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
        raise RemoteProtocolError(f"header must be [kind, fields], got {brief(header)}")
    kind, fields = header
    entry = _BY_TAG.get(kind) if isinstance(kind, str) else None
    if entry is None:
        raise RemoteProtocolError(f"unknown message kind {brief(kind)}")
    cls, schema = entry
    if not isinstance(fields, dict):
        raise RemoteProtocolError(f"{kind}: fields must be a map, got {type_name(fields)}")
    for name, _ in schema:
        if name not in fields:
            raise RemoteProtocolError(f"{kind}: missing field {name!r}")
    if len(fields) != len(schema):
        known = {name for name, _ in schema}
        extra = next(key for key in fields if key not in known)
        raise RemoteProtocolError(f"{kind}: unknown field {brief(extra)}")
    dec = Decoder(view, head_end)
    values = {name: decode_field(kind, name, ftype, fields[name], dec) for name, ftype in schema}
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
