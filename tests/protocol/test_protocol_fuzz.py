"""Generated messages round-trip; mutated and random frames only ever raise RemoteProtocolError.

"Nothing else escapes" is the property: a decode either returns a message that encodes
back to a frame decoding to the same message, or raises `RemoteProtocolError`.
"""

from __future__ import annotations

import math
import random
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiopipe.errors import RemoteProtocolError
from aiopipe.protocol import (
    DTYPE_SIZES,
    FRAME_MAGIC,
    HEADER_SLACK_BYTES,
    MODES,
    TENSOR_SLACK_BYTES,
    Activation,
    Bye,
    ErrorMessage,
    Gradient,
    Heartbeat,
    Hello,
    Message,
    Plan,
    Ready,
    RoundReport,
    RoundResult,
    RoundStart,
    TensorData,
    decode,
    encode,
)
from aiopipe.protocol.fields import MAX_LEAVES

U64 = 2**64 - 1
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

indices = st.integers(0, U64)
small_dims = st.lists(st.integers(0, 4), max_size=4).map(tuple)


@st.composite
def tensors(draw: st.DrawFn, shape: st.SearchStrategy[tuple[int, ...]] = small_dims) -> TensorData:
    dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
    dims = draw(shape)
    n = math.prod(dims)
    if dtype == "bool":
        data = bytes(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
    else:
        size = n * DTYPE_SIZES[dtype]
        data = draw(st.binary(min_size=size, max_size=size))
    return TensorData(dtype, dims, data)


@st.composite
def batched_leaves(draw: st.DrawFn) -> tuple[tuple[TensorData, ...], TensorData]:
    """1 to 4 leaves and labels, all with the same rows first."""
    batch = draw(st.integers(0, 4))
    rest = st.lists(st.integers(0, 3), max_size=3).map(lambda r: (batch, *r))
    leaves = tuple(draw(st.lists(tensors(rest), min_size=1, max_size=4)))
    return leaves, draw(tensors(rest))


#: A run's kind of data (`Plan.inputs`, `.target`), as `Plan` accepts it.
dims = st.integers(1, 1 << 20)
dtypes = st.sampled_from(sorted(DTYPE_SIZES))
data_inputs = st.lists(st.tuples(dtypes, st.lists(dims, min_size=1, max_size=8).map(tuple)),
                       min_size=1, max_size=MAX_LEAVES).map(tuple)
data_targets = st.tuples(st.tuples(dtypes, st.lists(dims, max_size=8).map(tuple)))


names = st.text(max_size=12)
scalars = (
    st.booleans() | st.integers(-(2**63), U64) | st.floats(allow_nan=False) | st.text(max_size=20)
)
trees = st.dictionaries(
    names,
    st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(names, inner, max_size=4),
        max_leaves=12,
    ),
    max_size=5,
)
tensor_maps = st.dictionaries(names, tensors(), max_size=4)
ascii_printable = st.characters(min_codepoint=32, max_codepoint=126)
node_names = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                     "0123456789_.:-"), min_size=1, max_size=64)

messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Hello, indices, indices, indices, st.text(ascii_printable, max_size=40)),
    st.builds(Plan, indices, st.sampled_from(MODES), trees, indices, st.floats(), indices,
              st.dictionaries(node_names, st.text("0123456789abcdef", min_size=64, max_size=64),
                              max_size=3), data_inputs, data_targets, indices),
    st.builds(Ready, indices, data_inputs, data_targets, indices,
              st.text("0123456789abcdef", min_size=16, max_size=64),
              st.text("0123456789abcdef", max_size=64), indices),
    st.builds(RoundStart, indices, indices, indices, indices, tensor_maps,
              st.integers(0, 3), st.integers(4, 9), st.integers(0, 3), st.integers(4, 40),
              st.integers(1, U64), st.integers(1, U64), indices,
              st.text(ascii_printable, max_size=200),
              st.dictionaries(node_names, st.fixed_dictionaries(
                  {"stage": indices, "address": st.text(ascii_printable, max_size=40)}),
                  max_size=3)),
    batched_leaves().flatmap(lambda p: st.builds(
        Activation, indices, indices, indices, indices, indices, indices, node_names,
        node_names, st.just(p[0]), st.just(p[1]))),
    batched_leaves().flatmap(lambda p: st.builds(
        Gradient, indices, indices, indices, indices, indices, indices, node_names,
        node_names, st.just(p[0]))),
    indices.flatmap(lambda samples: st.builds(
        RoundResult,
        indices,
        st.just(samples),
        st.floats(allow_nan=False, allow_infinity=False),
        # the samples' accuracies summed (float(samples) may round above samples)
        st.floats(0.0, float(samples)).filter(lambda c: c <= samples),
        tensor_maps,
    )),
    st.builds(RoundReport, indices, trees),
    st.builds(Heartbeat, indices),
    st.builds(Bye, st.text()),
    st.builds(ErrorMessage, st.text(), st.text()),
)


def same_frame(message: Message) -> bytes:
    """Encode, decode, re-encode: the frames match (robust to NaN, unlike ==)."""
    frame = encode(message)
    again = encode(decode(frame))
    assert again == frame
    return frame


@pytest.mark.slow  # (hypothesis: 3-6 s on 2 cores)
@FAST
@given(messages)
def test_generated_messages_round_trip(message: Message) -> None:
    same_frame(message)
    if not (isinstance(message, Plan) and math.isnan(message.server_time)):
        assert decode(encode(message)) == message


@pytest.mark.slow  # (hypothesis: 3-6 s on 2 cores)
@FAST
@given(indices.flatmap(lambda samples: st.builds(
    RoundResult, indices, st.just(samples), st.just(1.0),
    st.floats(0.0, float(samples)).filter(lambda c: c <= samples), tensor_maps)))
def test_frame_overhead_stays_within_the_documented_bound(message: RoundResult) -> None:
    tensor_bytes = sum(t.nbytes for t in message.tensors.values())
    bound = HEADER_SLACK_BYTES + sum(
        TENSOR_SLACK_BYTES + len(name.encode()) for name in message.tensors
    )
    assert len(encode(message)) - tensor_bytes <= bound


@pytest.mark.slow  # (hypothesis: 3-6 s on 2 cores)
@FAST
@given(st.builds(RoundReport, indices, trees))
def test_report_overhead_stays_within_the_documented_bound(message: RoundReport) -> None:
    bound = HEADER_SLACK_BYTES + len(msgpack.packb(dict(message.report)))
    assert len(encode(message)) <= bound


# --- fuzzing --------------------------------------------------------------------------


def decodes_or_rejects(frame: bytes) -> bool:
    """The property under test: a valid message, or RemoteProtocolError; nothing else.

    Returns whether the frame was rejected.
    """
    try:
        message = decode(frame)
    except RemoteProtocolError as exc:
        error = str(exc)
    else:
        same_frame(message)
        return False
    assert "\n" not in error
    return True


@FAST
@given(st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    decodes_or_rejects(data)
    decodes_or_rejects(FRAME_MAGIC + b"\x01" + data)


@FAST
@given(st.binary(max_size=200))
def test_random_headers(header: bytes) -> None:
    prefix = struct.pack("<3sBI", FRAME_MAGIC, 1, len(header))
    decodes_or_rejects(prefix + header)
    decodes_or_rejects(prefix + header + bytes(40))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


@pytest.mark.slow  # (hypothesis: 3-6 s on 2 cores)
@FAST
@given(
    st.sampled_from(
        [
            "hello",
            "plan",
            "ready",
            "round_start",
            "activation",
            "gradient",
            "round_result",
            "heartbeat",
            "bye",
            "error",
        ]
    ),
    msgpack_values,
    st.binary(max_size=80),
)
def test_random_structured_headers(kind: str, fields: Any, data: bytes) -> None:
    header = msgpack.packb([kind, fields], use_bin_type=True)
    prefix = struct.pack("<3sBI", FRAME_MAGIC, 1, len(header))
    decodes_or_rejects(prefix + header + data)


def _seed_frames() -> list[bytes]:
    rng = random.Random(1)

    def tensor(dtype: str, shape: tuple[int, ...]) -> TensorData:
        n = math.prod(shape)
        if dtype == "bool":
            return TensorData(dtype, shape, bytes(rng.getrandbits(1) for _ in range(n)))
        return TensorData(dtype, shape, rng.randbytes(n * DTYPE_SIZES[dtype]))

    return [
        encode(m)
        for m in (
            Hello(1, 3),
            Plan(1, "pipar", {"a": [1, 2.5, "x", {"b": True}], "c": {}}, 1, 5.0),
            RoundStart(1, 2, 3, 4, {"w": tensor("float16", (2, 3)), "b": tensor("bool", (3,))}, 0,
                       2, 0, 2, 1, 1, 0, "0F0 0SEND_F0 0RECV_B0 0B0 0STEP"),
            Activation(0, 0, 1, 2, 3, 0, "device0", "server", (tensor("bfloat16", (2, 2)),),
                       tensor("int64", (2,))),
            Activation(0, 0, 1, 2, 3, 0, "device0", "server",
                       (tensor("float32", (2, 3)), tensor("bool", (2, 4)), tensor("int64", (2,))),
                       tensor("float32", (2, 5))),
            Gradient(0, 1, 1, 2, 3, 0, "server", "device0", (tensor("float32", (1, 3)),)),
            Gradient(0, 1, 1, 2, 3, 0, "server", "device0",
                     (tensor("float32", (1, 3)), tensor("float16", (1,)))),
            Plan(1, "sl", {}, 1, 0.0, 0, {}, (("float32", (3, 8, 8)), ("bool", (8,))),
                 (("float32", (5,)),), 0),
            Ready(4, (("float32", (3, 8, 8)), ("bool", (8,))), (("int64", ()),), 10,
                  "ab" * 16),
            RoundResult(1, 2, 0.5, 1, {"x": tensor("int8", (5,))}),
            RoundReport(1, {"busy": [1.0, 2.0]}),
            Heartbeat(9),
            Bye("done"),
            ErrorMessage("e", "m"),
        )
    ]


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    data = bytearray(frame)
    header_end = min(8 + struct.unpack_from("<I", frame, 4)[0], len(frame))
    choice = rng.randrange(7)
    if choice == 0:  # flip bits, mostly in the prefix and header
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(min(len(data), header_end + 8))
            data[i] ^= 1 << rng.randrange(8)
    elif choice == 1:  # set a byte to an interesting value
        i = rng.randrange(len(data))
        data[i] = rng.choice([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xFF, 0x90, 0xA0, 0xDC, 0xDE])
    elif choice == 2:  # truncate
        del data[rng.randrange(len(data)) :]
    elif choice == 3:  # extend
        data += rng.randbytes(rng.randint(1, 70))
    elif choice == 4:  # cut a slice out of the middle
        i = rng.randrange(len(data))
        del data[i : i + rng.randint(1, 16)]
    elif choice == 5:  # a new header length
        struct.pack_into(
            "<I", data, 4, rng.choice([0, 1, header_end - 9, header_end - 7, 2**32 - 1]) % 2**32
        )
    else:  # insert random bytes
        i = rng.randrange(len(data))
        data[i:i] = rng.randbytes(rng.randint(1, 8))
    return bytes(data)


@pytest.mark.parametrize("seed", range(4))
def test_mutated_frames(seed: int) -> None:
    rng = random.Random(seed)
    frames = _seed_frames()
    rejected = 0
    for _ in range(1500):
        frame = rng.choice(frames)
        for _ in range(rng.randint(1, 3)):
            if len(frame) >= 8:
                frame = _mutate(frame, rng)
        rejected += decodes_or_rejects(frame)
    assert rejected > 1000  # the mutations do reach the decoder's checks


def _replace_random_node(value: Any, rng: random.Random, replacement: Any) -> Any:
    """Copy of a header tree with one randomly chosen node replaced."""
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return [*value[:i], _replace_random_node(value[i], rng, replacement), *value[i + 1 :]]
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        if rng.random() < 0.1:
            return {k: v for k, v in value.items() if k != key}  # drop a field
        return {**value, key: _replace_random_node(value[key], rng, replacement)}
    return replacement


REPLACEMENTS = [
    None,
    True,
    0,
    -1,
    1,
    2**63,
    U64,
    0.5,
    math.nan,
    "",
    "x",
    "float32",
    b"",
    [],
    [0],
    {},
    {"": 0},
    [1] * 40,
    "bool",
]


def test_structurally_mutated_headers() -> None:
    """Replace one node of a valid header with an odd value and keep the data region."""
    rng = random.Random(7)
    rejected = 0
    for frame in _seed_frames():
        header_len = struct.unpack_from("<I", frame, 4)[0]
        header = msgpack.unpackb(frame[8 : 8 + header_len], raw=False)
        rest = frame[8 + header_len :]
        for _ in range(300):
            mutated = _replace_random_node(header, rng, rng.choice(REPLACEMENTS))
            packed = msgpack.packb(mutated, use_bin_type=True)
            frame = struct.pack("<3sBI", FRAME_MAGIC, 1, len(packed)) + packed + rest
            rejected += decodes_or_rejects(frame)
    assert rejected > 1000
