"""The frame codec: round trips, zero-copy decoding, the layout, and every rejection."""

from __future__ import annotations

import dataclasses
import math
import random
import struct
import tracemalloc
import typing
from typing import Any

import msgpack
import numpy as np
import pytest

import aiopipe.protocol as protocol
from aiopipe.errors import FrameTooLargeError, LocalProtocolError, RemoteProtocolError
from aiopipe.protocol import (
    DTYPE_SIZES,
    FRAME_ALIGNMENT,
    HEADER_SLACK_BYTES,
    MAX_HEADER_BYTES,
    MAX_REASON_CHARS,
    PROTOCOL_VERSION,
    TENSOR_SLACK_BYTES,
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
    TensorData,
    codec,
    decode,
    encode,
)
from aiopipe.protocol.fields import MAX_LEAVES

U64 = 2**64 - 1


def td(dtype: str, shape: tuple[int, ...], seed: int = 0) -> TensorData:
    """A tensor of random (valid) bytes."""
    n = math.prod(shape)
    rng = random.Random(seed)
    data = bytes(rng.getrandbits(1) for _ in range(n)) if dtype == "bool" else None
    if data is None:
        data = rng.randbytes(n * DTYPE_SIZES[dtype])
    return TensorData(dtype, shape, data)


RUN = {
    "mode": "pipar",
    "devices": 3,
    "lr": 0.01,
    "shuffle": True,
    "split_point": [2, 3, "auto"],
    "network": {"name": "4g", "up_mbit": 10.0, "down_mbit": 25.0, "nested": {"deep": [[1], {}]}},
    "big": U64,
    "small": -(2**63),
    "empty": {},
    "inf": math.inf,
    "unicode": "μ-batch ✓",
}

SAMPLES: list[Message] = [
    Hello(PROTOCOL_VERSION, 7),
    Plan(3, "pipar", RUN, 2**62 - 1, 1234.5, 2**62, {"device4": "ab" * 32},
         (("float32", (3, 32, 32)),), (("int64", ()),), 10),
    Plan(0, "fl", {}, 1),
    RoundStart(1, 0, 10, 5, {
            "0.weight": td("float32", (8, 3, 3, 3)),
            "0.bias": td("float32", (8,), 1),
            "1.num_batches_tracked": td("int64", ()),
            "1.empty": td("float16", (0, 4)),
            "2.bf": td("bfloat16", (3, 5), 2),
        }, 0, 2, 0, 2, 1, 1, 0, "0F0 0SEND_F0 0RECV_B0 0B0 0STEP"),
    RoundStart(0, 0, 0, 0, {}, 0, 2, 0, 2, 1, 1, 0, "0F0 0SEND_F0 0RECV_B0 0B0 0STEP"),
    RoundStart(0, 0, 0, 1, {}, 0, 2, 0, 2, 1, 6, 0, "0F0 0SEND_F0 0RECV_B0 0B0 0REDUCE 0STEP",
               {"device1": {"stage": 1, "address": "memory://device1"},
                "device2": {"stage": 0, "address": "memory://device2", "rows": [4, 6]}},
               (0, 4)),
    Activation(0, 0, 0, 1, 2, 0, "device0", "server", (td("float32", (4, 2, 3, 3)),),
               td("int64", (4,))),
    Activation(0, 0, 1, 0, 0, 0, "device0", "server", (td("bfloat16", (0, 7)),),
               td("int64", (0,))),
    Gradient(0, 1, 0, 1, 2, 0, "server", "device0", (td("float32", (4, 2, 3, 3), 3),)),
    Gradient(U64, U64, U64, U64, U64, U64, "m" * 64, "n" * 64, (td("float64", (1,)),)),
    GroupGradient(3, 1, 0, 7, 7, "device2", "device4", {"3.weight": td("float32", (4, 2)),
                                                        "3.bias": td("float32", (4,))}),
    RoundResult(
        2, 100, 12.5, 80, {"w": td("int8", (5, 5)), "m": td("bool", (9,)), "u": td("uint8", (3,))}
    ),
    RoundResult(0, 0, 0.0, 0, {}),
    RoundResult(1, 2, 0.5, 1, {"x": td("float32", (2,))}),
    RoundReport(1, {"busy_s": {"device": 1.5, "uplink": 0.25}, "slices": [["f", 0, 1.0, 2.0]] * 3}),
    RoundReport(0, {}),
    RoundStalled(3, "the link to device2 failed"),
    Accusation(3, "device2", "device2 sent values out of range: activation holds NaN"),
    RoundStalled(0, ""),
    RoundAccepted(0),
    RoundAccepted(41),
    Rest(),
    Replica(4, 1, 50, 12.25, 37, {"0.weight": td("float32", (8, 3, 3, 3)),
                                  "momentum:0.weight": td("float32", (8, 3, 3, 3), 1)}),
    Replica(0, 3, 0, 0.0, 0, {}),
    ReplicaRequest(4, 50, (0, 2)),
    ReplicaRequest(0, 0, ()),
    SecAggRequest(3, 0, (), (), 1234, {"clients": td("int64", (100,))}),
    SecAggRequest(3, 1, (), (), 0, {"cipher:1": td("uint8", (32,)), "mask:1": td("uint8", (32,))}),
    SecAggRequest(3, 2, (), (), 0, {"1": td("uint8", (160,)), "5": td("uint8", (160,))}),
    SecAggRequest(3, 3, (0, 1), (5,), 0, {}),
    SecAggReply(3, 0, {"cipher": td("uint8", (32,)), "mask": td("uint8", (32,))}),
    SecAggReply(3, 1, {"1": td("uint8", (160,))}),
    SecAggReply(3, 2, {"masked": td("int32", (1234,))}),
    SecAggReply(3, 3, {"0": td("uint8", (66,)), "5": td("uint8", (66,))}),
    RoundResult(0, 1, 1.0, 0, {"a": td("int16", (2, 2)), "b": td("int32", (1, 1, 1))}),
    Heartbeat(0),
    Heartbeat(123456789),
    Bye(""),
    Bye("round limit reached"),
    ErrorMessage("protocol", "activation.tensors[0]: dtype unknown: 'complex64'"),
    Ready(200, (("float32", (1, 28, 28)),), (("int64", ()),), 10, "0123456789abcdef" * 2,
          "fe" * 8),
    Ready(0, (("float32", (12,)),), (("int64", ()),), 3, "ab" * 32),
    ProfileRequest((1, 2, 4, 50)),
    Profile({"forward": {"0": {"1": 0.5}}, "backward": {}, "step": {}}, 1.5, 10e6),
    Profile({}, 0.0, 0.0),
    Probe(td("uint8", (1024,))),
    FramePart(2, 5, td("uint8", (64,))),
    EvalRequest(3, {"0.weight": td("float32", (2, 2))}),
    EvalResult(3, 500, 812.25, 401),
    RoundStart(4, 1, 0, 40, {}, 0, 1, 0, 5, 1, 48, 0, "",
               {"device2": {"stage": 0, "address": "memory://device2"}},
               sync={"ring": [2, 0], "sender": 2, "receivers": [1], "learning_rate": 0.02,
                     "backup": False, "version": 0.0}),
    RoundResult(4, 1920, 80.5, 700, {}, version=6.25),
    RingChunk(2**62, 4, (2, 0, 1), 3, 1, td("float32", (17,))),
    RingBypass(7, 4, (2, 1)),
    RingHandshake(7, 4, 0),
    RingHandshake(7, 4, 1),
    SyncedModel(7, 4, 3.5, {"0.weight": td("float32", (8, 3, 3, 3))}),
    Activation(1, 2, 0, 3, 1, 4, "device1", "device2",
               (td("float32", (3, 4), 4), td("bool", (3, 4, 2), 5), td("int64", (3,), 6)),
               td("float32", (3, 5), 7)),
    Gradient(1, 2, 0, 3, 1, 4, "device2", "device1",
             (td("float32", (3, 4), 8), td("bfloat16", (3, 1, 1), 9))),
    Plan(1, "pipar", {}, 5, 0.0, 0, {},
         (("float32", (3, 8, 8)), ("bool", (64,)), ("int64", (1 << 20,))),
         (("float32", (5,)),), 0),
    Ready(9, (("bfloat16", (7,)), ("int8", (1,) * 8)), (("int32", (2, 2)),), 4, "cd" * 8),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Message) -> None:
    frame = encode(message)
    assert isinstance(frame, bytes)
    decoded = decode(frame)
    assert type(decoded) is type(message)
    assert decoded == message
    assert encode(decoded) == frame  # the layout is canonical


def test_samples_cover_every_kind() -> None:
    assert {type(m) for m in SAMPLES} == set(typing.get_args(Message))


def test_schema_matches_the_dataclasses() -> None:
    for cls in typing.get_args(Message):
        _, schema = codec._SCHEMAS[cls]
        assert [name for name, _ in schema] == [f.name for f in dataclasses.fields(cls)]


def _isort_key(name: str) -> tuple[int, str]:
    """ruff's RUF022 order: CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_public_api_is_sorted_and_complete() -> None:
    assert protocol.__all__ == sorted(protocol.__all__, key=_isort_key)
    from aiopipe.protocol import messages, tensors

    for module in (codec, messages, tensors):
        assert set(module.__all__) <= set(protocol.__all__), module.__name__
    for name in protocol.__all__:
        assert hasattr(protocol, name)


def test_accepts_bytearray_and_memoryview_frames() -> None:
    message = SAMPLES[5]
    frame = encode(message)
    assert decode(bytearray(frame)) == message
    assert decode(memoryview(frame)) == message
    assert decode(memoryview(b"xx" + frame)[2:]) == message
    assert decode(memoryview(frame).cast("B", (len(frame),))) == message


def test_plan_run_tuples_travel_as_lists() -> None:
    decoded = decode(encode(Plan(0, "sl", {"a": (1, (2, 3))}, 1)))
    assert isinstance(decoded, Plan)
    assert decoded.run == {"a": [1, [2, 3]]}


# --- zero copy ------------------------------------------------------------------------


def address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def test_decode_does_not_copy_tensor_bytes() -> None:
    message = Activation(0, 0, 0, 0, 0, 0, "device0", "server",
                         (td("float32", (16, 8, 4, 4)), td("bool", (16, 3))), td("int64", (16,)))
    frame = encode(message)
    decoded = decode(frame)
    assert isinstance(decoded, Activation)
    base = address(frame)
    for tensor in (*decoded.tensors, decoded.labels):
        assert isinstance(tensor.data, memoryview)
        assert tensor.data.obj is frame
        start = address(tensor.data) - base
        assert start > 0
        assert start + tensor.nbytes <= len(frame)
        assert frame[start : start + tensor.nbytes] == tensor.data
    first, second = decoded.tensors
    assert address(second.data) - address(first.data) == _align(first.nbytes)
    assert address(decoded.labels.data) - address(second.data) == _align(second.nbytes)


def _align(n: int) -> int:
    return -(-n // FRAME_ALIGNMENT) * FRAME_ALIGNMENT


def test_tensors_start_aligned() -> None:
    message = SAMPLES[3]
    frame = encode(message)
    header_len = struct.unpack_from("<I", frame, 4)[0]
    data_start = _align(8 + header_len)
    decoded = decode(frame)
    assert isinstance(decoded, RoundStart)
    for tensor in decoded.tensors.values():
        assert (address(tensor.data) - address(frame) - data_start) % FRAME_ALIGNMENT == 0
    assert frame[8 + header_len : data_start] == bytes(data_start - 8 - header_len)


def test_encode_copies_tensor_bytes_once() -> None:
    tensor = TensorData("float32", (1024, 1024), bytes(4 * 1024 * 1024))
    message = Gradient(0, 1, 0, 0, 0, 0, "server", "device0", (tensor,))
    encode(message)  # warm up
    tracemalloc.start()
    try:
        frame = encode(message)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(frame) < tensor.nbytes + HEADER_SLACK_BYTES
    assert peak < tensor.nbytes + 256 * 1024  # one frame-sized buffer, no second copy


def test_encode_accepts_any_contiguous_buffer() -> None:
    floats = np.arange(12, dtype=np.float32).reshape(3, 4)
    message = Gradient(0, 1, 0, 0, 0, 0, "server", "device0",
                       (TensorData("float32", (3, 4), floats.data),))
    decoded = decode(encode(message))
    assert isinstance(decoded, Gradient)
    assert bytes(decoded.tensors[0].data) == floats.tobytes()


# --- frame size limits ----------------------------------------------------------------


def test_frame_too_large_is_checked_before_parsing() -> None:
    frame = encode(SAMPLES[5])
    assert decode(frame, max_frame_bytes=len(frame)) == SAMPLES[5]
    with pytest.raises(FrameTooLargeError, match=f"frame of {len(frame)} bytes exceeds"):
        decode(frame, max_frame_bytes=len(frame) - 1)
    with pytest.raises(FrameTooLargeError):
        decode(b"garbage" * 10, max_frame_bytes=8)


def _non_tensor_bytes(message: Message) -> int:
    tensors: list[TensorData] = []
    for value in (getattr(message, f.name) for f in dataclasses.fields(message)):
        if isinstance(value, TensorData):
            tensors.append(value)
        elif isinstance(value, tuple):
            tensors.extend(v for v in value if isinstance(v, TensorData))
        elif isinstance(value, dict):
            tensors.extend(v for v in value.values() if isinstance(v, TensorData))
    return len(encode(message)) - sum(t.nbytes for t in tensors)


WIDE = (0, *([U64] * 14))  # 15 dimensions, zero elements, the longest shape encoding


@pytest.mark.parametrize(
    "message",
    [
        Hello(U64, U64),
        Heartbeat(U64),
        Bye("é" * 512),
        ErrorMessage("x" * 24, "✓" * 333),
        Activation(U64, U64, U64, U64, U64, U64, "n" * 64, "m" * 64,
                   (TensorData("bfloat16", WIDE, b""),), TensorData("bool", WIDE, b"")),
        Activation(U64, U64, U64, U64, U64, U64, "n" * 64, "m" * 64, (td("bool", (1,) * 15),),
                   td("bool", (1,) * 15)),
        Activation(U64, U64, U64, U64, U64, U64, "n" * 64, "m" * 64,
                   (TensorData("bfloat16", WIDE, b""),) * MAX_LEAVES,
                   TensorData("bool", WIDE, b"")),
        Gradient(U64, U64, U64, U64, U64, U64, "m" * 64, "n" * 64,
                 (TensorData("bfloat16", WIDE, b""),)),
        Gradient(U64, U64, U64, U64, U64, U64, "m" * 64, "n" * 64,
                 (TensorData("bfloat16", WIDE, b""),) * MAX_LEAVES),
        RoundStart(U64, U64, U64, U64,
                   {"n" * 63 + str(i): td("bool", (1,) * 15) for i in range(4)}, 0, 2, 0, 2, 1, 1,
                   0, "0F0 0SEND_F0 0RECV_B0 0B0 0STEP"),
        RoundResult(
            U64, U64, -1e300, U64, {"é" * 32 + str(i): td("int8", (1,) * 15) for i in range(4)}
        ),
    ],
    ids=lambda m: type(m).__name__,
)
def test_header_slack_bounds_small_messages(message: Message) -> None:
    assert _non_tensor_bytes(message) <= HEADER_SLACK_BYTES


def test_tensor_slack_bounds_state_messages() -> None:
    state = {f"layer{i}." + "x" * (i % 97): td("int8", (1,) * (i % 16)) for i in range(300)}
    message = RoundStart(U64, U64, U64, U64, state, 0, 2, 0, 2, 1, 1, 0,
                         "0F0 0SEND_F0 0RECV_B0 0B0 0STEP")
    bound = HEADER_SLACK_BYTES + sum(TENSOR_SLACK_BYTES + len(k.encode()) for k in state)
    assert _non_tensor_bytes(message) <= bound


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


# --- encode rejects what cannot travel ------------------------------------------------


def _resized_tensor() -> TensorData:
    buffer = bytearray(8)
    tensor = TensorData("float32", (2,), buffer)
    buffer.extend(b"1234")
    return tensor


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (object(), "not a message"),
        (Plan(0, "fl", {"a": None}, 1), "plan.run['a']: unsupported value of type NoneType"),
        (Plan(0, "fl", {1: 2}, 1), "plan.run: map key 1 is not a str"),  # type: ignore[dict-item]
        (
            Plan(0, "fl", {"a": [b"x"]}, 1),
            "plan.run['a'][0]: unsupported value of type bytes",
        ),
        (Plan(0, "fl", {"a": 2**64}, 1), "does not fit in 64 bits"),
        (Plan(0, "fl", {"a": -(2**63) - 1}, 1), "does not fit in 64 bits"),
        (Plan(0, "fl", [1], 1), "plan.run: expected a mapping, got list"),  # type: ignore[arg-type]
        (Plan(0, "fl", {"a": {"b": nested(31)}}, 1), "nested deeper than 32"),
        (Plan(0, "fl", {"s": "\ud800"}, 1), "plan: header cannot be packed"),
        (Hello(2**64, 0), "hello.version: 18446744073709551616 does not fit in 64 bits"),
        (Bye(5), "bye.reason: expected str, got int"),  # type: ignore[arg-type]
        (ErrorMessage("c", None), "error.message: expected str, got NoneType"),  # type: ignore[arg-type]
        (RoundResult(0, 0, 0.0, 0, [1]), "expected a mapping of tensors, got list"),  # type: ignore[arg-type]
        (RoundResult(0, 0, 0.0, 0, {"a": b"x"}), "round_result.tensors['a']: expected TensorData"),  # type: ignore[dict-item]
        (RoundStart(0, 0, 0, 0, {3: td("int8", (1,))},  # type: ignore[dict-item]
                    0, 2, 0, 2, 1, 1, 0, "0F0 0SEND_F0 0RECV_B0 0B0 0STEP"),
         "tensor name 3 is not a str"),
        (Gradient(0, 1, 0, 0, 0, 0, "server", "device0", (td("int8", (1,) * 33),)),
         "gradient.tensors[0]: 33 dimensions, at most 32 travel"),
        (Gradient(0, 1, 0, 0, 0, 0, "server", "device0", (td("int8", (2,)), _resized_tensor())),
         "gradient.tensors[1]: shape (2,) of float32 needs 8 bytes, the buffer now holds 12"),
        (
            Gradient(0, 1, 0, 0, 0, 0, "server", "device0",
                     (TensorData("int8", (4,), memoryview(bytes(8))[::2]),)),
            "gradient.tensors[0]: tensor bytes are not C-contiguous",
        ),
        (Bye("x" * (MAX_HEADER_BYTES + 1)), "bye: header of 8388627 bytes exceeds 8388608 bytes"),
    ],
)
def test_encode_rejects(message: Any, error: str) -> None:
    with pytest.raises(LocalProtocolError, match=_literal(error)):
        encode(message)


def test_encode_rejects_cyclic_run() -> None:
    run: dict[str, Any] = {}
    run["self"] = run
    with pytest.raises(LocalProtocolError, match="nested deeper"):
        encode(Plan(0, "fl", run, 1))


def _literal(text: str) -> str:
    import re

    return re.escape(text)


# --- decode rejects malformed frames --------------------------------------------------


def frame(
    header: object,
    data: bytes = b"",
    *,
    magic: bytes = b"APW",
    version: int = 1,
    header_len: int | None = None,
    raw_header: bytes | None = None,
) -> bytes:
    """A hand-made frame: prefix, header (packed unless raw), zero padding to the data."""
    packed = raw_header if raw_header is not None else msgpack.packb(header, use_bin_type=True)
    length = len(packed) if header_len is None else header_len
    head = struct.pack("<3sBI", magic, version, length) + packed
    if not data:
        return head
    return head + bytes(_align(len(head)) - len(head)) + data


def tensor_frame(kind: str, fields: dict[str, Any], data: bytes) -> bytes:
    return frame([kind, fields], data)


GRAD = {"run_id": 0, "stage": 1, "epoch": 0, "iteration": 0, "micro_batch": 0, "version": 0,
        "source": "server", "destination": "device0"}
PLAN = {
    "device_id": 0,
    "mode": "sl",
    "run": {},
    "run_id": 1,
    "server_time": 0.0,
    "session": 0,
    "peer_keys": {},
    "inputs": [["float32", [3, 32, 32]]],
    "target": [["int64", []]],
    "num_classes": 10,
}
READY = {"samples": 10, "inputs": [["float32", [1, 28, 28]]], "target": [["int64", []]],
         "num_classes": 10,
         "model_digest": "ab" * 16, "host": "", "held_out": 0}
RESULT = {"round": 0, "samples": 0, "loss_sum": 0.0, "correct": 0.0, "tensors": {},
          "version": 0.0}
REPORT = {"round": 0, "report": {}}
F32 = ["float32", [2], 0, 8]
EIGHT = bytes(8)
BYE_FRAME = frame(["bye", {"reason": "done"}])


#: RoundStart's assignment fields
ROUND_PLAN = {"stage": 0, "stages": 2, "first_unit": 0, "stop_unit": 2, "parallel_batches": 1,
              "micro_batch_size": 1, "version": 0, "actions": "", "peers": {}, "rows": [],
              "sync": {}}

BAD_FRAMES: list[tuple[str, bytes, str]] = [
    ("empty", b"", "truncated frame: 0 bytes"),
    ("short prefix", b"APW\x01\x00", "truncated frame: 5 bytes"),
    ("bad magic", frame(["heartbeat", {"seq": 1}], magic=b"XYZ"), "bad magic b'XYZ'"),
    ("version", frame(["heartbeat", {"seq": 1}], version=2), "unsupported frame format version 2"),
    ("huge header", frame(None, header_len=MAX_HEADER_BYTES + 1), "header length 8388609 exceeds"),
    ("header past end", frame(["heartbeat", {"seq": 1}], header_len=100), "the header claims"),
    ("not msgpack", frame(None, raw_header=b"\xc1"), "malformed msgpack header (FormatError"),
    ("cut msgpack", frame(None, raw_header=b"\x92\x01"), "malformed msgpack header"),
    ("extra msgpack", frame(None, raw_header=b"\x01\x02"), "malformed msgpack header (ExtraData"),
    ("deep msgpack", frame(None, raw_header=b"\x91" * 5000 + b"\x00"), "(StackError"),
    ("bad utf-8", frame(None, raw_header=b"\x92\xa2\xff\xfe\x80"), "(UnicodeDecodeError"),
    ("int key", frame(["plan", {1: 2}]), "not allowed for map key"),
    (
        "int for server_time",
        frame(["plan", {**PLAN, "server_time": 0}]),
        "plan.server_time: wrong field type: expected float, got int",
    ),
    (
        "report not map",
        frame(["round_report", {**REPORT, "report": None}]),
        "round_report.report: wrong field type: expected map, got NoneType",
    ),
    (
        "report nil",
        frame(["round_report", {**REPORT, "report": {"t": [[1.5, None]]}}]),
        "round_report.report['t'][0][1]: unsupported value of type NoneType",
    ),
    ("ext value", frame(["bye", {"reason": msgpack.ExtType(1, b"x")}]), "exceeds max_ext_len"),
    ("bin value", frame(["bye", {"reason": b"x"}]), "exceeds max_bin_len"),
    ("header is map", frame({"kind": "bye"}), "header must be [kind, fields]"),
    ("header of 3", frame(["bye", {}, 1]), "header must be [kind, fields]"),
    ("unknown kind", frame(["nope", {}]), "unknown message kind 'nope'"),
    ("kind not str", frame([5, {}]), "unknown message kind 5"),
    ("fields not map", frame(["bye", ["done"]]), "bye: fields must be a map, got list"),
    ("missing field", frame(["heartbeat", {}]), "heartbeat: missing field 'seq'"),
    ("unknown field", frame(["heartbeat", {"seq": 1, "x": 2}]), "heartbeat: unknown field 'x'"),
    (
        "str for int",
        frame(["heartbeat", {"seq": "1"}]),
        "heartbeat.seq: wrong field type: expected int, got str",
    ),
    ("bool for int", frame(["heartbeat", {"seq": True}]), "expected int, got bool"),
    (
        "float for int",
        frame(["hello", {"version": 1.0, "device_id": 0, "session": 0, "address": ""}]),
        "hello.version: wrong field type",
    ),
    (
        "negative int",
        frame(["heartbeat", {"seq": -1}]),
        "invalid heartbeat: seq must be a non-negative int",
    ),
    (
        "int for float",
        frame(["round_result", {**RESULT, "loss_sum": 1}]),
        "round_result.loss_sum: wrong field type: expected float, got int",
    ),
    (
        "nan loss",
        frame(["round_result", {**RESULT, "loss_sum": math.nan}]),
        "invalid round_result: loss_sum must be a finite float",
    ),
    ("negative version", frame(["round_result", {**RESULT, "version": -1.0}]),
     "invalid round_result: version must be a finite float >= 0"),
    ("ring repeats a device", tensor_frame("ring_chunk", {
        "run_id": 1, "round": 0, "ring": [1, 1], "step": 0, "chunk": 0, "values": F32}, EIGHT),
     "invalid ring_chunk: a ring is distinct device ids"),
    ("empty bypass ring", frame(["ring_bypass", {"run_id": 1, "round": 0, "ring": []}]),
     "invalid ring_bypass: a ring is distinct device ids"),
    ("handshake reply 2", frame(["ring_handshake", {"run_id": 1, "round": 0, "reply": 2}]),
     "invalid ring_handshake: reply must be 0 or 1"),
    ("synced model nan version", frame(["synced_model", {
        "run_id": 1, "round": 0, "version": math.inf, "tensors": {}}]),
     "invalid synced_model: version must be a finite float >= 0"),
    (
        "int for str",
        frame(["bye", {"reason": 1}]),
        "bye.reason: wrong field type: expected str, got int",
    ),
    (
        "nil for str",
        frame(["error", {"code": "x", "message": None}]),
        "error.message: wrong field type: expected str, got NoneType",
    ),
    ("bad mode", frame(["plan", {**PLAN, "mode": "x"}]), "invalid plan: mode must be one of"),
    ("plan shape not ints", frame(["plan", {**PLAN, "inputs": [["float32", ["3"]]]}]),
     "plan.inputs: shape must be at most 32 ints >= 0, got ['3']"),
    ("plan shape empty", frame(["plan", {**PLAN, "inputs": [["float32", []]]}]),
     "invalid plan: inputs must be 1 to 16 (dtype, shape) pairs with 1 to 8 dimensions in "
     "1..1048576, got (('float32', ()),)"),
    ("plan no inputs", frame(["plan", {**PLAN, "inputs": []}]),
     "plan.inputs: wrong field type: expected 1 to 16 [dtype, shape] pairs, got []"),
    ("ready huge shape", frame(["ready", {**READY, "inputs": [["float32", [1] * 9]]}]),
     "invalid ready: inputs must be 1 to 16 (dtype, shape) pairs with 1 to 8 dimensions"),
    ("ready digest not hex", frame(["ready", {**READY, "model_digest": "xyz" * 8}]),
     "invalid ready: model_digest must be hex digits"),
    ("ready host too long", frame(["ready", {**READY, "host": "a" * 65}]),
     "invalid ready: host must be hex digits"),
    ("profile negative time", frame(["profile", {"costs": {}, "seconds": -1.0,
                                                  "downlink_bps": 0.0}]),
     "invalid profile: seconds must be a finite float >= 0"),
    ("eval more correct than samples", frame(["eval_result", {
        "epoch": 0, "samples": 2, "loss_sum": 0.5, "correct": 3.0}]),
     "invalid eval_result: correct 3.0 exceeds samples 2"),
    ("profile request empty", frame(["profile_request", {"batch_sizes": []}]),
     "invalid profile_request: batch_sizes must hold 1 to 64 sizes"),
    (
        "zero batches",
        tensor_frame("round_start", {"round": 0, "epoch": 0, "first_iteration": 0,
                                     "iterations": 0, "tensors": {},
                                     **ROUND_PLAN, "parallel_batches": 0}, b""),
        "invalid round_start: parallel_batches must be >= 1",
    ),
    (
        "rows outside the micro-batch",
        tensor_frame("round_start", {"round": 0, "epoch": 0, "first_iteration": 0,
                                     "iterations": 0, "tensors": {},
                                     **ROUND_PLAN, "rows": [0, 2]}, b""),
        "invalid round_start: rows must be [start, stop] with 0 <= start < stop <= 1",
    ),
    (
        "peer rows reversed",
        tensor_frame("round_start", {"round": 0, "epoch": 0, "first_iteration": 0,
                                     "iterations": 0, "tensors": {}, **ROUND_PLAN,
                                     "micro_batch_size": 4,
                                     "peers": {"device1": {"stage": 0, "address": "x",
                                                           "rows": [3, 1]}}}, b""),
        "invalid round_start: peer 'device1' rows must be [start, stop]",
    ),
    (
        "bad node name",
        tensor_frame("gradient", {**GRAD, "source": "a b", "tensors": [F32]}, EIGHT),
        "invalid gradient: a node name must be 1..64 letters",
    ),
    (
        "peer with a key",
        tensor_frame("round_start", {"round": 0, "epoch": 0, "first_iteration": 0,
                                     "iterations": 0, "tensors": {}, **ROUND_PLAN,
                                     "peers": {"device1": {"stage": 1, "address": "x",
                                                           "key": "00"}}}, b""),
        "invalid round_start: peer 'device1' must map stage and address",
    ),
    (
        "bad peer key",
        frame(["plan", {**PLAN, "peer_keys": {"device1": "00"}}]),
        "invalid plan: the key of peer 'device1' must be 64 hex digits",
    ),
    (
        "run not map",
        frame(["plan", {**PLAN, "run": [1]}]),
        "plan.run: wrong field type: expected map, got list",
    ),
    (
        "run nil",
        frame(["plan", {**PLAN, "run": {"a": [None]}}]),
        "plan.run['a'][0]: unsupported value of type NoneType",
    ),
    (
        "run bin key",
        frame(["plan", {**PLAN, "run": {b"": 1}}]),
        "plan.run: map key b'' is not a str",
    ),
    (
        "run empty bin",
        frame(["plan", {**PLAN, "run": {"a": b""}}]),
        "unsupported value of type bytes",
    ),
    (
        "run empty ext",
        frame(
            None,
            raw_header=msgpack.packb(["plan", {**PLAN, "run": {"a": "EXT!"}}]).replace(
                b"\xa4EXT!", b"\xc7\x00\x05"
            ),
        ),
        "unsupported value of type ExtType",
    ),
    (
        "run too deep",
        frame(["plan", {**PLAN, "run": {"a": nested(40)}}]),
        "nested deeper than 32 levels",
    ),
    (
        "descriptor not list",
        tensor_frame("gradient", {**GRAD, "tensors": ["x"]}, EIGHT),
        "gradient.tensors[0]: tensor descriptor must be [dtype, shape, offset, nbytes], got 'x'",
    ),
    (
        "descriptor of 3",
        tensor_frame("gradient", {**GRAD, "tensors": [["float32", [2], 0]]}, EIGHT),
        "tensor descriptor must be",
    ),
    (
        "dtype unknown",
        tensor_frame("gradient", {**GRAD, "tensors": [["complex64", [1], 0, 8]]}, EIGHT),
        "gradient.tensors[0]: dtype unknown: 'complex64'",
    ),
    (
        "dtype not str",
        tensor_frame("gradient", {**GRAD, "tensors": [[4, [2], 0, 8]]}, EIGHT),
        "dtype unknown: 4",
    ),
    (
        "shape not list",
        tensor_frame("gradient", {**GRAD, "tensors": [["float32", 2, 0, 8]]}, EIGHT),
        "shape must be a list",
    ),
    (
        "shape negative",
        tensor_frame("gradient", {**GRAD, "tensors": [["float32", [-2], 0, 8]]}, EIGHT),
        "shape must hold ints >= 0",
    ),
    (
        "shape of str",
        tensor_frame("gradient", {**GRAD, "tensors": [["float32", ["2"], 0, 8]]}, EIGHT),
        "shape must hold ints >= 0",
    ),
    (
        "too many dims",
        tensor_frame("gradient", {**GRAD, "tensors": [["int8", [1] * 33, 0, 1]]}, b"\x00"),
        "at most 32 ints",
    ),
    (
        "offset str",
        tensor_frame("gradient", {**GRAD, "tensors": [["float32", [2], "0", 8]]}, EIGHT),
        "tensor offset must be an int >= 0",
    ),
    (
        "nbytes negative",
        tensor_frame("gradient", {**GRAD, "tensors": [["float32", [2], 0, -8]]}, EIGHT),
        "tensor nbytes must be an int >= 0",
    ),
    (
        "length mismatch",
        tensor_frame("gradient", {**GRAD, "tensors": [["float32", [2], 0, 7]]}, EIGHT),
        "shape/byte-length mismatch: shape [2] of float32 needs 8 bytes, descriptor says 7",
    ),
    (
        "huge shape",
        tensor_frame("gradient", {**GRAD, "tensors": [["float64", [U64, U64], 0, 8]]}, EIGHT),
        "shape/byte-length mismatch",
    ),
    (
        "offset moved",
        tensor_frame("gradient", {**GRAD, "tensors": [["float32", [2], 64, 8]]}, bytes(72)),
        "tensor offset 64 is not the canonical 0",
    ),
    (
        "out of range",
        tensor_frame("gradient", {**GRAD, "tensors": [["float32", [4], 0, 16]]}, EIGHT),
        "tensor bytes out of range",
    ),
    ("no data region", frame(["gradient", {**GRAD, "tensors": [F32]}]),
     "gradient.tensors[0]: tensor bytes out of range"),
    (
        "trailing bytes",
        tensor_frame("gradient", {**GRAD, "tensors": [F32]}, bytes(9)),
        "1 trailing bytes after the message",
    ),
    ("trailing after bye", BYE_FRAME + b"\x00", "1 trailing bytes after the message"),
    (
        "padding after empty state",
        frame(
            [
                "round_start",
                {"round": 0, "epoch": 0, "first_iteration": 0, "iterations": 0, "tensors": {},
                 **ROUND_PLAN},
            ]
        )
        + bytes(3),
        "3 trailing bytes",
    ),
    (
        "bool not 0/1",
        tensor_frame("gradient", {**GRAD, "tensors": [["bool", [3], 0, 3]]}, b"\x00\x01\x02"),
        "gradient.tensors[0]: bool tensor holds bytes other than 0 and 1",
    ),
    (
        "batch mismatch",
        tensor_frame(
            "activation",
            {**GRAD, "tensors": [["int8", [2], 0, 2]],
             "labels": ["int8", [3], FRAME_ALIGNMENT, 3]},
            bytes(FRAME_ALIGNMENT + 3),
        ),
        "invalid activation: activation tensor 0 of shape (2,) does not have the "
        "micro-batch's 3 rows first",
    ),
    (
        "no batch dim",
        tensor_frame(
            "activation",
            {**GRAD, "tensors": [["int8", [1], 0, 1]],
             "labels": ["int8", [], FRAME_ALIGNMENT, 1]},
            bytes(FRAME_ALIGNMENT + 1),
        ),
        "invalid activation: labels need a batch dimension",
    ),
    (
        "activation leaf without batch dim",
        tensor_frame(
            "activation",
            {**GRAD, "tensors": [["int8", [], 0, 1]],
             "labels": ["int8", [1], FRAME_ALIGNMENT, 1]},
            bytes(FRAME_ALIGNMENT + 1),
        ),
        "invalid activation: activation tensor 0 of shape () does not have the "
        "micro-batch's 1 rows first",
    ),
    (
        "gradient without batch dim",
        tensor_frame("gradient", {**GRAD, "tensors": [["float32", [], 0, 4]]}, bytes(4)),
        "invalid gradient: gradient tensor 0 has no batch dimension",
    ),
    (
        "gradient rows disagree",
        tensor_frame("gradient", {**GRAD, "tensors": [["int8", [2], 0, 2],
                                                     ["int8", [3], FRAME_ALIGNMENT, 3]]},
                     bytes(FRAME_ALIGNMENT + 3)),
        "invalid gradient: gradient tensor 1 of shape (3,) does not have the micro-batch's 2 "
        "rows first",
    ),
    (
        "old single tensor field",
        tensor_frame("gradient", {**GRAD, "tensor": F32}, EIGHT),
        "gradient: missing field 'tensors'",
    ),
    (
        "tensors not map",
        frame(
            [
                "round_start",
                {"round": 0, "epoch": 0, "first_iteration": 0, "iterations": 0, "tensors": [F32],
                 **ROUND_PLAN},
            ]
        ),
        "round_start.tensors: wrong field type: expected map of tensors, got list",
    ),
    (
        "tensor name bin",
        tensor_frame(
            "round_start",
            {"round": 0, "epoch": 0, "first_iteration": 0, "iterations": 0, "tensors": {b"": F32},
             **ROUND_PLAN},
            EIGHT,
        ),
        "round_start.tensors: tensor name b'' is not a str",
    ),
    (
        "named descriptor",
        tensor_frame(
            "round_start",
            {
                "round": 0,
                "epoch": 0,
                "first_iteration": 0,
                "iterations": 0,
                "tensors": {"w": ["float32", [2], 0, 9]},
                **ROUND_PLAN,
            },
            EIGHT,
        ),
        "round_start.tensors['w']: shape/byte-length mismatch",
    ),
]


def _with_byte(data: bytes, index: int, value: int) -> bytes:
    return data[:index] + bytes([value]) + data[index + 1 :]


def _padding_cases() -> list[tuple[str, bytes, str]]:
    good = encode(Activation(0, 0, 0, 0, 0, 0, "device12", "server",
                             (td("int8", (3,)), td("bool", (3,))), td("int8", (3,))))
    header_len = struct.unpack_from("<I", good, 4)[0]
    first_pad = 8 + header_len  # first byte of padding after the header
    data_start = _align(first_pad)
    assert data_start > first_pad  # this sample does have padding there
    return [
        (
            "nonzero header padding",
            _with_byte(good, first_pad, 1),
            "activation.tensors[0]: nonzero padding",
        ),
        (
            "nonzero padding between leaves",
            _with_byte(good, data_start + 3, 1),
            "activation.tensors[1]: nonzero padding",
        ),
        (
            "nonzero tensor padding",
            _with_byte(good, data_start + FRAME_ALIGNMENT + 3, 1),
            "activation.labels: nonzero padding",
        ),
        ("truncated data", good[:-1], "tensor bytes out of range"),
    ]


@pytest.mark.parametrize(
    ("frame_bytes", "error"),
    [pytest.param(f, e, id=name) for name, f, e in BAD_FRAMES]
    + [pytest.param(f, e, id=name) for name, f, e in _padding_cases()],
)
def test_decode_rejects(frame_bytes: bytes, error: str) -> None:
    with pytest.raises(RemoteProtocolError, match=_literal(error)) as info:
        decode(frame_bytes)
    assert type(info.value) is RemoteProtocolError
    assert "\n" not in str(info.value)


def test_hand_made_frame_helper_builds_valid_frames() -> None:
    """The table's frames differ from valid ones only in the named defect."""
    assert decode(tensor_frame("gradient", {**GRAD, "tensors": [F32]}, EIGHT)) == Gradient(
        0, 1, 0, 0, 0, 0, "server", "device0", (TensorData("float32", (2,), EIGHT),))
    assert decode(tensor_frame("activation", {**GRAD, "tensors": [F32],
                                              "labels": ["int8", [2], FRAME_ALIGNMENT, 2]},
                               bytes(FRAME_ALIGNMENT + 2))) == Activation(
        0, 1, 0, 0, 0, 0, "server", "device0", (TensorData("float32", (2,), EIGHT),),
        TensorData("int8", (2,), bytes(2)))
    assert decode(frame(["plan", PLAN])) == Plan(0, "sl", {}, 1, 0.0, 0, {},
                                                 (("float32", (3, 32, 32)),), (("int64", ()),),
                                                 10)
    assert decode(frame(["ready", READY])) == Ready(10, (("float32", (1, 28, 28)),),
                                                    (("int64", ()),), 10, "ab" * 16)
    assert decode(BYE_FRAME) == Bye("done")


def test_decode_rejects_non_buffers_locally() -> None:
    with pytest.raises(LocalProtocolError, match="bytes-like frame, got str"):
        decode("APW")  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="max_frame_bytes must be >= 0"):
        decode(BYE_FRAME, max_frame_bytes=-1)


def test_decode_rejects_strided_frames_locally() -> None:
    with pytest.raises(LocalProtocolError, match="C-contiguous frame"):
        decode(memoryview(BYE_FRAME * 2)[::2])


def test_encode_accepts_empty_multidimensional_buffers() -> None:
    empty = np.zeros((2, 0, 3), dtype=np.float32)
    message = Gradient(0, 1, 0, 0, 0, 0, "server", "device0",
                       (TensorData("float32", (2, 0, 3), empty.data),))
    decoded = decode(encode(message))
    assert isinstance(decoded, Gradient)
    assert decoded.tensors[0].shape == (2, 0, 3)
    assert decoded.tensors[0].nbytes == 0


def test_a_stall_s_reason_is_bounded() -> None:
    RoundStalled(0, "x" * MAX_REASON_CHARS)
    with pytest.raises(LocalProtocolError, match="longer than 500"):
        RoundStalled(0, "x" * (MAX_REASON_CHARS + 1))


def test_a_replica_s_counts_are_checked() -> None:
    with pytest.raises(LocalProtocolError, match="loss_sum"):
        Replica(0, 0, 1, math.nan, 0, {})
    with pytest.raises(LocalProtocolError, match="stage"):
        ReplicaRequest(0, 50, (1, -1))


def test_an_accusation_names_a_device_and_a_bounded_reason() -> None:
    Accusation(0, "device12", "x" * MAX_REASON_CHARS)
    for culprit in ("server", "device", "device1\n", "device-1", ""):
        with pytest.raises(LocalProtocolError, match="device's node name"):
            Accusation(0, culprit, "why")
    with pytest.raises(LocalProtocolError, match="longer than 500"):
        Accusation(0, "device1", "x" * (MAX_REASON_CHARS + 1))


# --- an activation's leaves (protocol 10) ---------------------------------------------


def _header(frame_bytes: bytes) -> Any:
    header_len = struct.unpack_from("<I", frame_bytes, 4)[0]
    return msgpack.unpackb(frame_bytes[8 : 8 + header_len], raw=False)


def test_activation_of_three_leaves_of_different_dtypes_round_trips_bit_exactly() -> None:
    leaves = (td("float32", (4, 3), 1), td("bool", (4, 5), 2), td("int64", (4,), 3))
    labels = td("int64", (4,), 4)
    message = Activation(0, 1, 2, 3, 4, 5, "device0", "device1", leaves, labels)
    frame_bytes = encode(message)
    decoded = decode(frame_bytes)
    assert isinstance(decoded, Activation)
    assert decoded == message
    assert isinstance(decoded.tensors, tuple)
    assert [(t.dtype, t.shape) for t in decoded.tensors] == [
        ("float32", (4, 3)), ("bool", (4, 5)), ("int64", (4,))]
    for sent, received in zip(leaves, decoded.tensors, strict=True):
        assert bytes(received.data) == bytes(sent.data)
    assert bytes(decoded.labels.data) == bytes(labels.data)
    assert encode(decoded) == frame_bytes
    # canonical layout: the leaves in order, then the labels, each at the next aligned offset
    kind, fields = _header(frame_bytes)
    assert kind == "activation"
    assert fields["tensors"] == [["float32", [4, 3], 0, 48], ["bool", [4, 5], 48, 20],
                                 ["int64", [4], 80, 32]]
    assert fields["labels"] == ["int64", [4], 112, 32]
    assert "tensor" not in fields
    data_start = _align(8 + struct.unpack_from("<I", frame_bytes, 4)[0])
    for (_, _, offset, nbytes), received in zip(fields["tensors"], decoded.tensors, strict=True):
        assert address(received.data) - address(frame_bytes) == data_start + offset
        assert received.nbytes == nbytes
    assert len(frame_bytes) == data_start + 112 + 32


def test_activation_leaves_must_agree_on_rows() -> None:
    with pytest.raises(LocalProtocolError, match=_literal(
            "activation tensor 1 of shape (3, 5) does not have the micro-batch's 4 rows first")):
        Activation(0, 0, 0, 0, 0, 0, "device0", "server",
                   (td("float32", (4, 3)), td("bool", (3, 5)), td("int64", (4,))),
                   td("int64", (4,)))
    with pytest.raises(LocalProtocolError, match=_literal(
            "activation tensor 0 of shape (4, 3) does not have the micro-batch's 5 rows first")):
        Activation(0, 0, 0, 0, 0, 0, "device0", "server", (td("float32", (4, 3)),),
                   td("int64", (5,)))
    with pytest.raises(LocalProtocolError, match=_literal(
            "gradient tensor 1 of shape (2, 3) does not have the micro-batch's 4 rows first")):
        Gradient(0, 0, 0, 0, 0, 0, "server", "device0",
                 (td("float32", (4, 3)), td("float32", (2, 3))))
    bad = tensor_frame(
        "activation",
        {**GRAD, "tensors": [["float32", [4], 0, 16], ["int8", [3], FRAME_ALIGNMENT, 3]],
         "labels": ["int64", [4], 2 * FRAME_ALIGNMENT, 32]},
        bytes(2 * FRAME_ALIGNMENT + 32),
    )
    with pytest.raises(RemoteProtocolError, match=_literal(
            "invalid activation: activation tensor 1 of shape (3,) does not have the "
            "micro-batch's 4 rows first")) as info:
        decode(bad)
    assert type(info.value) is RemoteProtocolError
    good = bad.replace(msgpack.packb(["int8", [3], FRAME_ALIGNMENT, 3]),
                       msgpack.packb(["int8", [4], FRAME_ALIGNMENT, 4]))
    assert good != bad
    assert decode(good) == Activation(  # the same frame, rows agreeing: decodes
        0, 1, 0, 0, 0, 0, "server", "device0",
        (TensorData("float32", (4,), bytes(16)), TensorData("int8", (4,), bytes(4))),
        TensorData("int64", (4,), bytes(32)))


def test_more_than_max_leaves_are_refused_both_ways() -> None:
    assert MAX_LEAVES == 16
    many = (td("int8", (2,)),) * (MAX_LEAVES + 1)
    for leaves in (many, ()):
        with pytest.raises(LocalProtocolError, match=r"^activation needs a tuple of 1 to 16 "
                           rf"TensorData, got a tuple of {len(leaves)}$"):
            Activation(0, 0, 0, 0, 0, 0, "device0", "server", leaves, td("int8", (2,)))
    with pytest.raises(LocalProtocolError, match=r"^gradient needs a tuple of 1 to 16 "
                       r"TensorData, got a tuple of 17$"):
        Gradient(0, 0, 0, 0, 0, 0, "server", "device0", many)
    # 16 is the most that travels
    most = Activation(0, 0, 0, 0, 0, 0, "device0", "server", many[:MAX_LEAVES],
                      td("int8", (2,)))
    assert decode(encode(most)) == most
    # encode checks too (a message forced past its own check)
    object.__setattr__(most, "tensors", many)
    with pytest.raises(LocalProtocolError, match=_literal(
            "activation.tensors: expected a tuple of 1 to 16 tensors, got (TensorData(")):
        encode(most)

    def activation_frame(count: int) -> bytes:
        descriptors = [["int8", [2], i * FRAME_ALIGNMENT, 2] for i in range(count)]
        labels = ["int8", [2], count * FRAME_ALIGNMENT, 2]
        return tensor_frame("activation", {**GRAD, "tensors": descriptors, "labels": labels},
                            bytes(count * FRAME_ALIGNMENT + 2))

    decoded = decode(activation_frame(MAX_LEAVES))
    assert isinstance(decoded, Activation)
    assert len(decoded.tensors) == MAX_LEAVES
    with pytest.raises(RemoteProtocolError, match=_literal(
            "activation.tensors: wrong field type: expected 1 to 16 tensors, got [['int8', ")):
        decode(activation_frame(MAX_LEAVES + 1))
    with pytest.raises(RemoteProtocolError, match=_literal(
            "gradient.tensors: wrong field type: expected 1 to 16 tensors, got []")):
        decode(frame(["gradient", {**GRAD, "tensors": []}]))


@pytest.mark.parametrize(
    ("tensors", "error"),
    [
        pytest.param({"0": F32}, "gradient.tensors: wrong field type: expected 1 to 16 "
                     "tensors, got {'0': ['float32', [2], 0, 8]}", id="map"),
        pytest.param(F32, "gradient.tensors[0]: tensor descriptor must be [dtype, shape, "
                     "offset, nbytes], got 'float32'", id="bare descriptor"),
        pytest.param(["float32", [2], 0, 8, 0], "gradient.tensors[0]: tensor descriptor must "
                     "be [dtype, shape, offset, nbytes], got 'float32'", id="five-item list"),
        pytest.param("float32", "gradient.tensors: wrong field type: expected 1 to 16 tensors, "
                     "got 'float32'", id="str"),
        pytest.param(None, "gradient.tensors: wrong field type: expected 1 to 16 tensors, "
                     "got None", id="nil"),
    ],
)
def test_leaves_that_are_not_a_list_of_descriptors_are_refused(tensors: object,
                                                                 error: str) -> None:
    with pytest.raises(RemoteProtocolError, match=f"^{_literal(error)}$") as info:
        decode(tensor_frame("gradient", {**GRAD, "tensors": tensors}, EIGHT))
    assert type(info.value) is RemoteProtocolError
    activation_error = error.replace("gradient", "activation")
    with pytest.raises(RemoteProtocolError, match=f"^{_literal(activation_error)}$"):
        decode(tensor_frame("activation", {**GRAD, "tensors": tensors,
                                           "labels": ["int8", [2], FRAME_ALIGNMENT, 2]},
                            bytes(FRAME_ALIGNMENT + 2)))


def test_encode_refuses_leaves_that_are_not_a_tuple_of_tensors() -> None:
    message = Gradient(0, 0, 0, 0, 0, 0, "server", "device0", (td("float32", (2,)),))
    object.__setattr__(message, "tensors", td("float32", (2,)))
    with pytest.raises(LocalProtocolError,
                       match=_literal("gradient.tensors: expected a tuple of 1 to 16 tensors")):
        encode(message)
    object.__setattr__(message, "tensors", (td("float32", (2,)), b"x"))
    with pytest.raises(LocalProtocolError,
                       match=_literal("gradient.tensors[1]: expected TensorData, got bytes")):
        encode(message)


def test_a_gradient_needs_a_batch_dimension() -> None:
    with pytest.raises(LocalProtocolError,
                       match=r"^gradient tensor 0 has no batch dimension$"):
        Gradient(0, 0, 0, 0, 0, 0, "server", "device0", (td("float32", ()),))
    with pytest.raises(LocalProtocolError, match=_literal(
            "gradient tensor 1 of shape () does not have the micro-batch's 2 rows first")):
        Gradient(0, 0, 0, 0, 0, 0, "server", "device0", (td("float32", (2,)), td("int64", ())))
    with pytest.raises(LocalProtocolError, match=r"^labels need a batch dimension$"):
        Activation(0, 0, 0, 0, 0, 0, "device0", "server", (td("float32", (2,)),),
                   td("int64", ()))


# --- the run's kind of data: Plan.inputs / .target, Ready's -------------------------------


MULTI_INPUTS = (("float32", (3, 16, 16)), ("bool", (16,)), ("int64", (1 << 20,)))
VECTOR_TARGET = (("float32", (5,)),)


def test_plan_and_ready_with_multi_leaf_inputs_and_a_vector_target_round_trip() -> None:
    plan = Plan(2, "pipar", {}, 7, 1.0, 3, {}, MULTI_INPUTS, VECTOR_TARGET, 0)
    ready = Ready(40, MULTI_INPUTS, VECTOR_TARGET, 0, "ab" * 32, "", 5)
    for message in (plan, ready):
        frame_bytes = encode(message)
        decoded = decode(frame_bytes)
        assert decoded == message
        assert isinstance(decoded, Plan | Ready)
        assert decoded.inputs == MULTI_INPUTS
        assert decoded.target == VECTOR_TARGET
        assert all(type(leaf) is tuple and type(leaf[1]) is tuple
                   for leaf in (*decoded.inputs, *decoded.target))
        assert encode(decoded) == frame_bytes
        _, fields = _header(frame_bytes)
        assert fields["inputs"] == [["float32", [3, 16, 16]], ["bool", [16]],
                                    ["int64", [1 << 20]]]
        assert fields["target"] == [["float32", [5]]]
        assert "in_shape" not in fields


def test_plan_defaults_to_one_float_input_and_a_class_index_target() -> None:
    plan = Plan(0, "fl", {}, 1)
    assert plan.inputs == (("float32", (1,)),)
    assert plan.target == (("int64", ()),)
    assert decode(encode(plan)) == plan


ONE = (("float32", (1,)),)
CLASS = (("int64", ()),)
_INPUTS_ERROR = ("inputs must be 1 to 16 (dtype, shape) pairs with 1 to 8 dimensions in "
                 "1..1048576, got ")
_TARGET_ERROR = ("target must be one (dtype, shape) pair with 0 to 8 dimensions in "
                 "1..1048576, got ")


@pytest.mark.parametrize(
    ("inputs", "target", "error"),
    [
        pytest.param((("complex64", (3,)),), CLASS, _INPUTS_ERROR + "(('complex64', (3,)),)",
                     id="unknown dtype"),
        pytest.param((("float32", (3, 0)),), CLASS, _INPUTS_ERROR + "(('float32', (3, 0)),)",
                     id="zero dim"),
        pytest.param((("float32", (1,) * 9),), CLASS,
                     _INPUTS_ERROR + f"(('float32', {(1,) * 9!r}),)", id="nine dims"),
        pytest.param((), CLASS, _INPUTS_ERROR + "()", id="no inputs"),
        pytest.param((("float32", ()),), CLASS, _INPUTS_ERROR + "(('float32', ()),)",
                     id="scalar input"),
        pytest.param((("float32", (1 << 20 + 1,)),), CLASS,
                     _INPUTS_ERROR + "(('float32', (2097152,)),)", id="dim too big"),
        pytest.param((("float32", (True,)),), CLASS, _INPUTS_ERROR + "(('float32', (True,)),)",
                     id="bool dim"),
        pytest.param((("float32", [3]),), CLASS, _INPUTS_ERROR + "(('float32', [3]),)",
                     id="list shape"),
        pytest.param((("float32", (3,), 0),), CLASS, _INPUTS_ERROR + "(('float32', (3,), 0),)",
                     id="triple"),
        pytest.param(("float32", (3,)), CLASS, _INPUTS_ERROR + "('float32', (3,))",
                     id="bare pair"),
        pytest.param([("float32", (3,))], CLASS, _INPUTS_ERROR + "[('float32', (3,))]",
                     id="list of pairs"),
        pytest.param((("float32", (1,)),) * 17, CLASS,
                     _INPUTS_ERROR + repr((("float32", (1,)),) * 17), id="17 inputs"),
        pytest.param(ONE, (("int64", ()), ("int64", ())),
                     _TARGET_ERROR + "(('int64', ()), ('int64', ()))", id="two targets"),
        pytest.param(ONE, (), _TARGET_ERROR + "()", id="no target"),
        pytest.param(ONE, (("float32", (1,) * 9),),
                     _TARGET_ERROR + f"(('float32', {(1,) * 9!r}),)", id="nine-dim target"),
        pytest.param(ONE, (("str", ()),), _TARGET_ERROR + "(('str', ()),)",
                     id="unknown target dtype"),
    ],
)
def test_plan_and_ready_refuse_a_bad_kind_of_data(inputs: Any, target: Any, error: str) -> None:
    with pytest.raises(LocalProtocolError, match=f"^{_literal(error)}$"):
        Plan(0, "fl", {}, 1, 0.0, 0, {}, inputs, target, 10)
    with pytest.raises(LocalProtocolError, match=f"^{_literal(error)}$"):
        Ready(10, inputs, target, 10, "ab" * 16)


@pytest.mark.parametrize(
    ("inputs", "error"),
    [
        pytest.param("float32", "plan.inputs: wrong field type: expected 1 to 16 "
                     "[dtype, shape] pairs, got 'float32'", id="str"),
        pytest.param({"float32": [3]}, "plan.inputs: wrong field type: expected 1 to 16 "
                     "[dtype, shape] pairs, got {'float32': [3]}", id="map"),
        pytest.param(["float32", [3]], "plan.inputs: expected a [dtype, shape] pair, got "
                     "'float32'", id="bare pair"),
        pytest.param([3, 32, 32], "plan.inputs: expected a [dtype, shape] pair, got 3",
                     id="old in_shape"),
        pytest.param([["float32", [3], 0]], "plan.inputs: expected a [dtype, shape] pair, got "
                     "['float32', [3], 0]", id="triple"),
        pytest.param([{"float32": [3]}], "plan.inputs: expected a [dtype, shape] pair, got "
                     "{'float32': [3]}", id="map pair"),
        pytest.param([["complex64", [3]]], "plan.inputs: dtype unknown: 'complex64'",
                     id="unknown dtype"),
        pytest.param([[3, [3]]], "plan.inputs: dtype unknown: 3", id="dtype not str"),
        pytest.param([["float32", 3]], "plan.inputs: shape must be at most 32 ints >= 0, got 3",
                     id="shape not list"),
        pytest.param([["float32", [True]]], "plan.inputs: shape must be at most 32 ints >= 0, "
                     "got [True]", id="bool dim"),
        pytest.param([["float32", [-1]]], "plan.inputs: shape must be at most 32 ints >= 0, "
                     "got [-1]", id="negative dim"),
        pytest.param([["float32", [1]]] * 17, "plan.inputs: wrong field type: expected 1 to 16 "
                     "[dtype, shape] pairs, got [['float32', [1]], ", id="17 pairs"),
        pytest.param([["float32", [0]]], "invalid plan: " + _INPUTS_ERROR
                     + "(('float32', (0,)),)", id="zero dim"),
        pytest.param([["float32", [1] * 9]], "invalid plan: " + _INPUTS_ERROR
                     + f"(('float32', {(1,) * 9!r}),)", id="nine dims"),
    ],
)
def test_plan_frame_with_bad_inputs_is_refused(inputs: object, error: str) -> None:
    with pytest.raises(RemoteProtocolError, match=_literal(error)) as info:
        decode(frame(["plan", {**PLAN, "inputs": inputs}]))
    assert type(info.value) is RemoteProtocolError
    assert "\n" not in str(info.value)
    with pytest.raises(RemoteProtocolError,
                       match=_literal(error.replace("plan", "ready"))) as info:
        decode(frame(["ready", {**READY, "inputs": inputs}]))


@pytest.mark.parametrize(
    ("target", "error"),
    [
        pytest.param([], "plan.target: wrong field type: expected 1 to 16 [dtype, shape] "
                     "pairs, got []", id="empty"),
        pytest.param(["int64", []], "plan.target: expected a [dtype, shape] pair, got 'int64'",
                     id="bare pair"),
        pytest.param([["int64", []], ["int64", []]], "invalid plan: " + _TARGET_ERROR
                     + "(('int64', ()), ('int64', ()))", id="two pairs"),
        pytest.param([["float32", [1] * 9]], "invalid plan: " + _TARGET_ERROR
                     + f"(('float32', {(1,) * 9!r}),)", id="nine dims"),
    ],
)
def test_plan_frame_with_a_bad_target_is_refused(target: object, error: str) -> None:
    with pytest.raises(RemoteProtocolError, match=_literal(error)) as info:
        decode(frame(["plan", {**PLAN, "target": target}]))
    assert type(info.value) is RemoteProtocolError


def test_an_old_plan_with_in_shape_is_refused() -> None:
    old = {key: value for key, value in PLAN.items() if key not in ("inputs", "target")}
    with pytest.raises(RemoteProtocolError, match=r"^plan: missing field 'inputs'$"):
        decode(frame(["plan", {**old, "in_shape": [3, 32, 32]}]))
    with pytest.raises(RemoteProtocolError, match=r"^plan: unknown field 'in_shape'$"):
        decode(frame(["plan", {**PLAN, "in_shape": [3, 32, 32]}]))


def test_encode_refuses_a_plan_forced_past_its_check() -> None:
    plan = Plan(0, "fl", {}, 1)
    object.__setattr__(plan, "inputs", (("float32", "3"),))
    with pytest.raises(LocalProtocolError, match=_literal(
            "plan.inputs: shape must be at most 32 ints >= 0, got '3'")):
        encode(plan)
