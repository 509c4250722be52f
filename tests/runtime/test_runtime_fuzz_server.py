"""Fuzzing the server's message handling (DESIGN §7), in virtual time over memory links.

A server node trains with a real device 0 while a scripted device 1 (or a crowd of
strangers) sends random bytes, mutated valid frames, frames with edited headers and
valid-but-wrong messages. The properties: ``serve_link`` raises nothing but aiopipe
errors; every frame or message that breaks the contract is answered with an
`ErrorMessage` and a closed connection (or just a closed connection); what the contract
allows is not refused; device 0 trains its full share; the run terminates.

An oracle (`InRound`, `after_hello`, `from_stranger`) says, from the conversation so far,
whether the server must refuse a message (True), must accept it (False) or may do either
(None: it depends on state that is the server's business, e.g. whether a round is over).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import struct
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from torch import nn

from aiopipe import CostTable, RunConfig, VirtualClock, models
from aiopipe.clock import wait_for
from aiopipe.errors import AiopipeError, RemoteProtocolError, TransportError
from aiopipe.metrics.results import RunResult
from aiopipe.metrics.trace import Slice
from aiopipe.protocol import (
    DTYPE_SIZES,
    FRAME_ALIGNMENT,
    FRAME_MAGIC,
    PROTOCOL_VERSION,
    Activation,
    Bye,
    ErrorMessage,
    Gradient,
    Heartbeat,
    Hello,
    Message,
    Plan,
    Ready,
    Replica,
    ReplicaRequest,
    RoundReport,
    RoundResult,
    RoundStart,
    TensorData,
    decode,
    encode,
    state_to_wire,
    to_torch,
)
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.device import DeviceSummary, run_device
from aiopipe.runtime.factories import build_model
from aiopipe.transport import LinkSpec, MemoryLink, open_memory_link_pair

U64 = 2**64 - 1
HUGE = 2**40
# slow compute in virtual time (free in real time), so that the run lasts while the junk
# arrives; device 0 computes 5 times slower still
COSTS = CostTable.uniform(5, forward=0.05, backward=0.1, step=0.005, batch=10)
UNSHAPED = LinkSpec(None)
WIRE = LinkSpec(50e6, 0.005)


def small_model(num_classes: int, in_shape: tuple[int, int, int]) -> nn.Sequential:
    """vgg5's 5 units and its 64x8x8 activation after unit 2 (what the junk imitates), at
    a fraction of its compute: what is fuzzed is the server's handling of messages."""
    return nn.Sequential(
        nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(in_shape[0], 8, 3, padding=1), nn.ReLU(),
                      nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(8, 64, 1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(64, 8, 1), nn.ReLU()),
        nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 8, 32), nn.ReLU()),
        nn.Linear(32, num_classes),
    )


# 2 devices x 40 samples, B=20, N=2: 2 iterations per epoch, aggregated after each
CONFIG = RunConfig(
    mode="pipar",
    model=small_model,
    devices=2,
    samples_per_device=40,
    batch_size=20,
    epochs=2,
    split_point=2,
    parallel_batches=2,
    aggregation_every=1,
    test_samples=20,
    network={"up_mbps": 50, "down_mbps": 50, "latency_ms": 5},
    device_slowdown=(5.0, 1.0),
    heartbeat_interval=1.0,
    device_timeout=5.0,
)
MICRO, N = 10, 2
SHAPE = (MICRO, 64, 8, 8)  # the activation after unit 2
SHARE = 40  # a device's samples per epoch
ROUNDS = 4  # rounds in the run
ROUND_SAMPLES = MICRO * N
# virtual seconds to wait for the server's answer: in a round, a NaN activation is refused
# only after the compute queued before it (keep it below device_timeout)
OBSERVE_S = 4.0
OBSERVE_AFTER_HELLO_S = 0.25


# --- tensors and messages -----------------------------------------------------------------


def tensor(
    shape: tuple[int, ...], dtype: str = "float32", fill: float | None = None, seed: int = 0
) -> TensorData:
    """Random normal values (``fill`` None) or ``fill``; other dtypes hold zeros."""
    if dtype != "float32":
        return TensorData(dtype, shape, bytes(math.prod(shape) * DTYPE_SIZES[dtype]))
    if fill is None:
        values = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    else:
        values = torch.full(shape, fill)
    return TensorData("float32", shape, values.numpy().tobytes())


def labels(batch: int, kind: str = "ok") -> TensorData:
    if kind == "int32":
        return TensorData("int32", (batch,), bytes(4 * batch))
    if kind == "ok":
        values = torch.arange(batch, dtype=torch.int64) % 10
    else:
        shape = (batch, 1) if kind == "2d" else (batch,)
        values = torch.full(shape, {"high": 10, "negative": -1, "2d": 0}[kind], dtype=torch.int64)
    return TensorData("int64", tuple(values.shape), values.numpy().tobytes())


#: The run's id: the harness gives its server this one (a real run draws it at random).
RUN_ID = 2**61 + 12345
ITERATIONS = SHARE // (MICRO * N)  # per epoch


def version(epoch: int, iteration: int) -> int:
    """The version of device 1's weights at an iteration (optimizer steps taken)."""
    return epoch * ITERATIONS + iteration


def stage_addressed(epoch: int, iteration: int, micro_batch: int, data: TensorData,
                    labels: TensorData) -> Activation:
    """Device 1's activation, addressed as the plan says."""
    return Activation(RUN_ID, 0, epoch, iteration, micro_batch,
                      version(epoch, iteration) % 2**64, "device1", "server", (data,), labels)


def activation(epoch: int, iteration: int, micro_batch: int, seed: int = 0) -> Activation:
    return stage_addressed(epoch, iteration, micro_batch, tensor(SHAPE, seed=seed), labels(MICRO))


def device_half_state() -> tuple[dict[str, TensorData], int]:
    """The weights a RoundStart carries for device 1, and the server's frame limit."""
    node = Coordinator(CONFIG, clock=VirtualClock(), cost_table=COSTS)
    node.system.prepare([CONFIG.device_samples_of(k) for k in range(CONFIG.devices)])
    half = models.split(node.model, node.system.plans[1].split_point)[0]
    state = state_to_wire({key: value.detach().clone() for key, value in half.state_dict().items()})
    return dict(state), min(node.system.frame_limit(), node.max_frame_bytes)


STATE, LIMIT = device_half_state()
#: What device 1 announces on every new session (the samples it held when the run was
#: planned: anything else is refused)
READY = Ready(SHARE, (("float32", (3, 32, 32)),), (("int64", ()),), 10, models.model_digest(
    build_model(CONFIG, num_classes=10, in_shape=(3, 32, 32))))


@dataclass(frozen=True)
class Context:
    """The round the fake device is in, and what it sent on this connection."""

    start: RoundStart
    valid: Activation  # accepted on this connection
    sent: frozenset[tuple[int, int, int]]  # activation ids sent on this connection
    last_round_done: int


#: For junk sent right after a Hello (the state of the session is unknown then).
AFTER_HELLO = Context(
    RoundStart(0, 0, 0, 1, STATE, 0, 2, 0, 2, N, MICRO, 0, "0F0 0SEND_F0 0RECV_B0 0B0 0STEP"),
    activation(0, 0, 0), frozenset(), -1)


@dataclass(frozen=True)
class ActivationSpec:
    """An activation; None ids are the round's own."""

    epoch: int | None
    iteration: int | None
    micro_batch: int
    shape: tuple[int, ...] | None
    dtype: str
    fill: float | None
    labels: str

    def build(self, ctx: Context) -> Message:
        start, shape = ctx.start, self.shape or SHAPE
        return stage_addressed(
            start.epoch if self.epoch is None else self.epoch,
            start.first_iteration if self.iteration is None else self.iteration,
            self.micro_batch,
            tensor(shape, self.dtype, self.fill),
            labels(shape[0], self.labels),
        )


@dataclass(frozen=True)
class ResultSpec:
    """A round result holding the round's own weights, under the right names or not.

    Sample counts, tensor shapes, dtypes and values are always right: the server does
    not check those yet (see `known_bug`).
    """

    round: int | None
    names: str  # "exact", "missing", "extra", "renamed"

    def build(self, ctx: Context) -> Message:
        tensors = dict(ctx.start.tensors)
        first = sorted(tensors)[0]
        if self.names == "missing":
            del tensors[first]
        elif self.names == "extra":
            tensors["extra.weight"] = tensor((2,))
        elif self.names == "renamed":
            tensors["renamed." + first] = tensors.pop(first)
        number = ctx.start.round if self.round is None else self.round
        return RoundResult(number, ROUND_SAMPLES, 0.0, 0, tensors)


@dataclass(frozen=True)
class ReportSpec:
    round: int | None
    report: dict[str, Any]

    def build(self, ctx: Context) -> Message:
        return RoundReport(ctx.start.round if self.round is None else self.round, self.report)


@dataclass(frozen=True)
class PlainSpec:
    """A message that needs no context: Heartbeat, or one a server never accepts."""

    message: Message

    def build(self, ctx: Context) -> Message:
        return self.message


@dataclass(frozen=True)
class Duplicate:
    """The activation already sent on this connection, again."""

    def build(self, ctx: Context) -> Message:
        return ctx.valid


MessageSpec = ActivationSpec | ResultSpec | ReportSpec | PlainSpec | Duplicate


def base_message(name: str, ctx: Context) -> Message:
    """A valid message to mutate ("result" names a round that is not the current one)."""
    start = ctx.start
    builders: dict[str, Callable[[], Message]] = {
        "next": lambda: activation(start.epoch, start.first_iteration, 1, 3),
        "activation": lambda: ctx.valid,
        "hello": lambda: Hello(PROTOCOL_VERSION, 1),
        "heartbeat": lambda: Heartbeat(7),
        "result": lambda: RoundResult(start.round + HUGE, ROUND_SAMPLES, 0.0, 0, start.tensors),
        "report": lambda: RoundReport(
            start.round, {"slices": [["device1/compute", "f", 0.0, 1.0, 0, 0, 0]]}
        ),
        "gradient": lambda: Gradient(0, 1, 0, 0, 0, 0, "server", "device0", (tensor((2, 3)),)),
        "bye": lambda: Bye("done"),
    }
    return builders[name]()


BASES = ["next", "activation", "hello", "heartbeat", "result", "report", "gradient", "bye"]


# --- junk: what goes on the wire ----------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """Random bytes, optionally after a valid frame prefix."""

    data: bytes
    magic: bool

    def frame(self, ctx: Context) -> bytes:
        return FRAME_MAGIC + b"\x01" + self.data if self.magic else self.data


@dataclass(frozen=True)
class Mutated:
    """A valid frame with bits flipped, bytes set, cut, extended, inserted or deleted, or
    grown past the server's frame limit."""

    base: str
    ops: tuple[tuple[str, int, int, bytes], ...]

    def frame(self, ctx: Context) -> bytes:
        data = bytearray(encode(base_message(self.base, ctx)))
        for op, where, value, extra in self.ops:
            at = where % (len(data) + 1)
            if op == "flip" and at < len(data):
                data[at] ^= 1 << (value % 8)
            elif op == "set" and at < len(data):
                data[at] = value % 256
            elif op == "truncate":
                del data[at:]
            elif op == "extend":
                data += extra
            elif op == "insert":
                data[at:at] = extra
            elif op == "delete":
                del data[at : at + 1 + value % 16]
            elif op == "oversize":
                data += bytes(max(0, LIMIT + 1 - len(data)))
        return bytes(data)


@dataclass(frozen=True)
class EditedHeader:
    """A valid frame whose msgpack header was edited: kind replaced, a field dropped,
    added or given another value, or the whole header replaced."""

    base: str
    edit: str  # "kind", "drop", "set", "add", "root"
    name: str
    value: Any

    def frame(self, ctx: Context) -> bytes:
        frame = encode(base_message(self.base, ctx))
        (length,) = struct.unpack_from("<I", frame, 4)
        kind, fields = msgpack.unpackb(frame[8 : 8 + length])
        data = frame[_align(8 + length) :] if len(frame) > 8 + length else b""
        names = sorted(fields)
        header: Any = [kind, fields]
        if self.edit == "kind":
            header[0] = self.value
        elif self.edit == "drop":
            del fields[names[len(self.name) % len(names)]]
        elif self.edit == "set":
            fields[names[len(self.name) % len(names)]] = self.value
        elif self.edit == "add":
            fields[self.name] = self.value
        else:
            header = self.value
        packed = msgpack.packb(header, use_bin_type=True)
        head_end = 8 + len(packed)
        pad = bytes(_align(head_end) - head_end) if data else b""
        return struct.pack("<3sBI", FRAME_MAGIC, 1, len(packed)) + packed + pad + data


@dataclass(frozen=True)
class Wrong:
    """A well-formed message built from the context."""

    spec: MessageSpec

    def frame(self, ctx: Context) -> bytes:
        return encode(self.spec.build(ctx))


Junk = Raw | Mutated | EditedHeader | Wrong


def _align(n: int) -> int:
    return -(-n // FRAME_ALIGNMENT) * FRAME_ALIGNMENT


# --- the oracle ---------------------------------------------------------------------------

NEVER_ACCEPTED = (Hello, Plan, RoundStart, Gradient, ErrorMessage, Bye, Replica, ReplicaRequest)


def known_bug(message: Message, ctx: Context) -> bool:
    """Messages whose verdict this oracle does not model; not sent.

    A report slice with an infinite float where an int belongs (refused by the server as a
    bad slice, but `slices_are_bad` does not model it).
    """
    if isinstance(message, RoundReport):
        items = message.report.get("slices", ())
        return isinstance(items, list) and any(
            isinstance(item, list)
            and len(item) == 7
            and any(isinstance(v, float) and math.isinf(v) for v in item[4:])
            for item in items
        )
    return False


def slices_are_bad(report: RoundReport, device_id: int) -> bool:
    try:
        slices = [Slice.from_list(s) for s in report.report.get("slices", ())]
    except (TypeError, ValueError):
        return True
    return any(not s.track.startswith(f"device{device_id}/") for s in slices)


class InRound:
    """What the server must do with each message of a connection of device 1 that is in
    round ``ctx.start`` (see [Note: reconnection] in aiopipe/runtime/session.py)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.sent = set(ctx.sent)
        self.last_done = ctx.last_round_done
        self.result_round: int | None = None
        self.over = False  # the round completed: what follows is the coordinator's business
        self.accepted = {(ctx.valid.epoch, ctx.valid.iteration, ctx.valid.micro_batch)}

    def verdict(self, message: Message) -> bool | None:
        start = self.ctx.start
        if isinstance(message, Heartbeat):
            return False
        if isinstance(message, NEVER_ACCEPTED):
            return True
        if isinstance(message, Activation):
            return self._activation(message)
        if isinstance(message, RoundResult):
            if message.round <= self.last_done or message.round == self.result_round:
                return False  # taken for a re-send
            if message.round < start.round:
                return False  # of a round given up on (a pipeline played it again)
            if self.over:
                return None
            if message.round != start.round or set(message.tensors) != set(start.tensors):
                return True
            own = start.tensors
            if any((t.dtype, t.shape) != (own[n].dtype, own[n].shape)
                   or not bool(torch.isfinite(to_torch(t)).all())
                   for n, t in message.tensors.items()):
                return True  # wrong dtype, shape, or NaN/Inf weights
            if message.samples != ROUND_SAMPLES or len(self.accepted) != start.iterations * N:
                return True  # a wrong sample count, or the round's work is not done
            self.result_round = message.round
            return False
        assert isinstance(message, RoundReport)
        if message.round <= self.last_done or message.round < start.round:
            return False  # a re-send, or of a round given up on
        if self.over:
            return None
        if (
            self.result_round is None
            or message.round != self.result_round
            or slices_are_bad(message, 1)
        ):
            return True
        self.over = True
        return False

    def _activation(self, message: Activation) -> bool | None:
        key = (message.epoch, message.iteration, message.micro_batch)
        if key in self.sent:
            return True  # a replay on one connection
        self.sent.add(key)
        if self.over:
            return None
        start = self.ctx.start
        if (
            (message.run_id, message.stage, message.source, message.destination)
            != (RUN_ID, 0, "device1", "server")
            or message.epoch != start.epoch
            or message.micro_batch >= N
            or not start.first_iteration
            <= message.iteration
            < start.first_iteration + start.iterations
        ):
            return True
        if message.version != version(message.epoch, message.iteration):
            return True
        if len(message.tensors) != 1 or (message.tensors[0].dtype, message.tensors[0].shape
                                         ) != ("float32", SHAPE):
            return True
        if message.labels.dtype != "int64" or message.labels.shape != (MICRO,):
            return True
        values = to_torch(message.labels)
        if int(values.min()) < 0 or int(values.max()) >= 10:
            return True
        values = to_torch(message.tensors[0])
        if not bool(torch.isfinite(values).all()):
            return True
        if float(values.abs().max()) > 1e30:
            # finite, but the server's loss or gradients may overflow: refused then
            return None
        self.accepted.add(key)
        return False


def after_hello(message: Message) -> bool | None:
    """What the server must do with a message right after a Hello of device 1, whatever
    the state of device 1's session: ids beyond the run's are wrong in any state."""
    if isinstance(message, Heartbeat):
        return False
    if isinstance(message, NEVER_ACCEPTED):
        return True
    if isinstance(message, Activation):
        return True if message.epoch >= CONFIG.epochs else None
    assert isinstance(message, RoundResult | RoundReport)
    return True if message.round >= ROUNDS else None


def from_stranger(message: Message) -> bool | None:
    """What the server must do with the first frame of a connection while both devices
    are connected: refuse it (None: a valid Hello, which it may take as a reconnection)."""
    if (
        isinstance(message, Hello)
        and message.version == PROTOCOL_VERSION
        and message.device_id < CONFIG.devices
    ):
        return None
    return True


Rule = Callable[[Message], bool | None]


def judge(
    frame: bytes, rule: Rule, ctx: Context = AFTER_HELLO
) -> tuple[Message | None, bool | None] | None:
    """Decode as the server does and apply ``rule``: a frame that does not decode must be
    refused. None: do not send it (`known_bug`)."""
    try:
        message = decode(frame, max_frame_bytes=LIMIT)
    except RemoteProtocolError:
        return None, True
    if known_bug(message, ctx):
        return None
    return message, rule(message)


# --- hypothesis strategies ----------------------------------------------------------------

indices = st.integers(0, 3) | st.integers(0, U64)
words = st.integers(-(2**63), U64)  # what msgpack carries


def mostly_none(other: st.SearchStrategy[int]) -> st.SearchStrategy[int | None]:
    """None (the round's own value) 3 times in 4."""
    return st.integers(0, 3).flatmap(lambda i: other if i == 0 else st.none())


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of ``choices``, each drawn with its weight."""
    return st.sampled_from([s for w, s in choices for _ in range(w)]).flatmap(lambda s: s)


shapes = st.sampled_from(
    [
        SHAPE,
        (MICRO, 64, 8, 7),
        (MICRO, 64, 8, 8, 1),
        (MICRO + 1, 64, 8, 8),
        (0, 64, 8, 8),
        (MICRO,),
        (3, 64, 8, 8),
        (MICRO, 8, 8, 64),
    ]
)
dtypes = st.sampled_from(sorted(DTYPE_SIZES))
fills = st.sampled_from([math.nan, math.inf, -math.inf, 3e38, 0.0]) | st.none()
label_kinds = st.sampled_from(["high", "negative", "int32", "2d", "ok"])


@st.composite
def activation_specs(draw: st.DrawFn, epochs: st.SearchStrategy[int | None]) -> ActivationSpec:
    """The round's next activation with one fault (or none, or several)."""
    fault = draw(
        st.sampled_from(
            ["ids", "shape", "dtype", "labels", "labels", "values", "values", "none", "several"]
        )
    )
    several = fault == "several"
    spec = ActivationSpec(draw(epochs), None, 1, None, "float32", None, "ok")
    if fault == "ids" or several:
        spec = dataclasses.replace(
            spec,
            iteration=draw(mostly_none(indices)),
            micro_batch=draw(st.integers(0, N) | indices),
        )
    if fault == "shape" or several:
        spec = dataclasses.replace(spec, shape=draw(shapes))
    if fault == "dtype" or several:
        spec = dataclasses.replace(spec, dtype=draw(dtypes))
    if fault == "labels" or several:
        spec = dataclasses.replace(spec, labels=draw(label_kinds))
    if fault == "values" or several:
        spec = dataclasses.replace(spec, fill=draw(fills))
    return spec


# the int fields of a slice never hold an infinite float here (see `known_bug`)
slice_values = (
    words
    | st.floats(allow_infinity=False)
    | st.text(max_size=4)
    | st.booleans()
    | st.lists(st.integers(0, 3), max_size=2)
)
good_slices = st.tuples(
    st.sampled_from(
        [
            "device1/compute",
            "device1/uplink",
            "device0/compute",
            "server/compute",
            "device10/compute",
        ]
    ),
    st.text(max_size=3),
    st.floats(),
    st.floats(),
    st.integers(-1, 9),
    st.integers(-1, 9),
    st.integers(-1, 9),
).map(list)
reports = st.one_of(
    st.fixed_dictionaries(
        {"slices": st.lists(good_slices | st.lists(slice_values, max_size=9), max_size=3)}
    ),
    st.fixed_dictionaries(
        {
            "slices": words
            | st.text(max_size=8)
            | st.dictionaries(st.text(max_size=3), words, max_size=2)
        }
    ),
    st.dictionaries(st.text(max_size=6), words, max_size=2),
)
plain: st.SearchStrategy[Message] = st.builds(Heartbeat, indices) | st.sampled_from(
    [
        Hello(PROTOCOL_VERSION, 1),
        Hello(PROTOCOL_VERSION, 0),
        Plan(1, "pipar", {"mode": "pipar"}, 1),
        RoundStart(0, 0, 0, 1, {}, 0, 2, 0, 2, 1, 1, 0, "0F0 0SEND_F0 0RECV_B0 0B0 0STEP"),
        Gradient(0, 1, 0, 0, 0, 0, "server", "device0", (tensor((2, 3)),)),
        ErrorMessage("protocol", "no"),
        Bye("leaving"),
    ]
)
in_round_specs: st.SearchStrategy[MessageSpec] = weighted(
    (5, activation_specs(mostly_none(indices))),
    (
        2,
        st.builds(
            ResultSpec,
            mostly_none(indices),
            st.sampled_from(["exact", "missing", "extra", "renamed"]),
        ),
    ),
    (1, st.builds(ReportSpec, mostly_none(indices), reports)),
    (1, plain.map(PlainSpec)),
    (1, st.just(Duplicate())),
)
after_hello_specs: st.SearchStrategy[MessageSpec] = st.one_of(
    activation_specs(st.integers(CONFIG.epochs, U64)),
    activation_specs(st.none()),
    st.builds(ResultSpec, st.integers(ROUNDS, U64), st.sampled_from(["exact", "missing"])),
    st.builds(ReportSpec, st.integers(ROUNDS, U64), reports),
    plain.map(PlainSpec),
)
mutation_ops = st.tuples(
    st.sampled_from(
        ["flip", "flip", "flip", "set", "truncate", "extend", "insert", "delete", "oversize"]
    ),
    st.integers(0, 64) | st.integers(0, 400) | st.integers(0, 2**20),
    st.integers(0, 255),
    st.binary(min_size=1, max_size=24),
)
msgpack_values = st.recursive(
    st.none() | st.booleans() | words | st.floats() | st.text(max_size=6) | st.binary(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=8,
)


def junk(specs: st.SearchStrategy[MessageSpec], wrong: int) -> st.SearchStrategy[Junk]:
    """Frames: messages from ``specs`` (weight ``wrong``), random bytes, mutated frames and
    frames with an edited header."""
    bases = st.sampled_from(BASES)
    return weighted(
        (wrong, specs.map(Wrong)),
        (1, st.builds(Raw, st.binary(max_size=64), st.booleans())),
        (2, st.builds(Mutated, bases, st.lists(mutation_ops, min_size=1, max_size=3).map(tuple))),
        (
            1,
            st.builds(
                EditedHeader,
                bases,
                st.sampled_from(["kind", "drop", "set", "set", "add", "root"]),
                st.text(max_size=6),
                msgpack_values,
            ),
        ),
    )


in_round_junk = junk(in_round_specs, 6)
# what device 1 sends in a round: anything, or a valid result first, so that reports count
in_round_lists = weighted(
    (3, st.lists(in_round_junk, min_size=1, max_size=3)),
    (
        1,
        st.lists(in_round_junk, min_size=1, max_size=2).map(
            lambda items: [Wrong(ResultSpec(None, "exact")), *items]
        ),
    ),
    (
        1,
        reports.map(
            lambda report: [Wrong(ResultSpec(None, "exact")), Wrong(ReportSpec(None, report))]
        ),
    ),
)
after_hello_junk = junk(after_hello_specs, 3)


#: Well-formed messages that are wrong anywhere (a Heartbeat: before a Hello): never accepted,
#: ids beyond the run's, Hellos of other versions or ids.
STRAY_MESSAGES: list[Message] = [
    Heartbeat(1),
    Bye("hi"),
    ErrorMessage("x", "y"),
    Gradient(0, 1, 0, 0, 0, 0, "server", "device0", (tensor((2,)),)),
    RoundResult(HUGE, ROUND_SAMPLES, 0.0, 0, STATE),
    RoundReport(HUGE, {"slices": []}),
    Replica(HUGE, 0, 1, 0.0, 0, {}),  # (a chain replica nobody asked for)
    ReplicaRequest(0, 1, (0,)),
    Plan(0, "pipar", {}, 1),
    RoundStart(0, 0, 0, 1, {}, 0, 2, 0, 2, 1, 1, 0, "0F0 0SEND_F0 0RECV_B0 0B0 0STEP"),
    stage_addressed(HUGE, 0, 0, tensor((2, 3)), labels(2)),
    Hello(PROTOCOL_VERSION + 1, 0),
    Hello(0, 1),
    Hello(PROTOCOL_VERSION, 2),
    Hello(PROTOCOL_VERSION, U64),
    Hello(U64, U64),
]


def random_junk(rng: random.Random) -> Junk:
    """Junk drawn by plain ``random`` (many frames per example, or per stranger)."""
    small = ["hello", "heartbeat", "report", "gradient", "bye"]
    choice = rng.randrange(6)
    if choice == 0:
        return Raw(rng.randbytes(rng.randrange(80)), rng.random() < 0.5)
    if choice in (1, 2):
        ops = tuple(
            (
                rng.choice(["flip", "flip", "set", "truncate", "extend", "insert", "delete"]),
                rng.randrange(80),
                rng.randrange(256),
                rng.randbytes(rng.randrange(1, 9)),
            )
            for _ in range(rng.randint(1, 3))
        )
        return Mutated("activation" if rng.random() < 0.02 else rng.choice(small), ops)
    if choice == 3:
        values: list[Any] = [
            None,
            True,
            -1,
            0,
            1,
            U64,
            1.5,
            math.nan,
            "x",
            [],
            {},
            [1, "a"],
            {"k": 1},
            b"\x00",
        ]
        return EditedHeader(
            rng.choice(small),
            rng.choice(["kind", "drop", "set", "add", "root"]),
            rng.choice(["", "a", "seq", "version"]),
            rng.choice(values),
        )
    if choice == 4:
        return Wrong(PlainSpec(rng.choice(STRAY_MESSAGES)))
    return Mutated("hello", (("set", 8 + rng.randrange(20), rng.randrange(256), b""),))


# --- the harness ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What the server did after a frame: "error" (an ErrorMessage; ``closed`` says whether
    the connection then closed), "closed", "bye" (it ended the run) or "silent"."""

    kind: str
    code: str = ""
    text: str = ""
    closed: bool = True

    @property
    def refused(self) -> bool:
        return self.kind in ("error", "closed")


async def observe(clock: VirtualClock, link: MemoryLink, seconds: float) -> Outcome:
    deadline = clock.now() + seconds
    while (left := deadline - clock.now()) > 0:
        try:
            frame = await wait_for(clock, link.receive(), left)
        except TimeoutError:
            break
        except TransportError:
            return Outcome("closed")
        message = decode(frame)
        if isinstance(message, ErrorMessage):
            return Outcome("error", message.code, message.message, await closes(clock, link))
        if isinstance(message, Bye):
            return Outcome("bye")
    return Outcome("silent")


async def closes(clock: VirtualClock, link: MemoryLink) -> bool:
    """Whether the server closes the connection soon."""
    with contextlib.suppress(TimeoutError):
        while True:
            try:
                await wait_for(clock, link.receive(), OBSERVE_S)
            except TransportError:
                return True
    return False


def check_answer(verdict: bool | None, outcome: Outcome, training_over: bool, what: object) -> None:
    if outcome.kind == "bye":
        assert training_over, (what, outcome)
        return
    if outcome.kind == "error":
        assert outcome.code in ("protocol", "refused", "busy"), (what, outcome)
        assert outcome.text, (what, outcome)
        assert outcome.closed, ("the connection stayed open after an error", what, outcome)
    if verdict is True:
        assert outcome.refused, ("invalid input was not refused", what, outcome)
    elif verdict is False and not training_over:
        assert not outcome.refused, ("valid input was refused", what, outcome)


class Harness:
    """A server node in virtual time whose every connection is served in a task that
    records what ``serve_link`` raised, if it is not an aiopipe error."""

    def __init__(self, clock: VirtualClock, tasks: asyncio.TaskGroup) -> None:
        self.node = Coordinator(CONFIG, clock=clock, cost_table=COSTS)
        self.node.run_id = RUN_ID
        self.clock, self.tasks = clock, tasks
        self.serving: list[asyncio.Task[None]] = []
        self.crashes: list[BaseException] = []

    def connect(self, spec: LinkSpec = UNSHAPED) -> MemoryLink:
        device_end, server_end = open_memory_link_pair(self.clock, a_to_b=spec, b_to_a=spec)
        self.serving.append(self.tasks.create_task(self._serve(server_end)))
        return device_end

    async def _serve(self, link: MemoryLink) -> None:
        try:
            await self.node.serve_link(link)
        except AiopipeError:
            pass
        except Exception as exc:
            self.crashes.append(exc)

    async def wind_down(self) -> None:
        """Every connection ends by itself (a session waiting for its device gives up
        after device_timeout)."""
        deadline = self.clock.now() + 3 * CONFIG.device_timeout
        while not all(t.done() for t in self.serving) and self.clock.now() < deadline:
            await self.clock.sleep(0.05)
        hanging = [t for t in self.serving if not t.done()]
        for task in hanging:
            task.cancel()
        assert not hanging, f"{len(hanging)} connections were still being served"


async def virtual_cap(clock: VirtualClock, seconds: float) -> None:
    await clock.sleep(seconds)
    raise TimeoutError(f"not finished within {seconds:g} virtual seconds")


async def honest_device(link: MemoryLink, clock: VirtualClock, k: int) -> DeviceSummary:
    try:
        return await run_device(link, k, clock=clock, cost_table=COSTS, clock_offset=0.0,
                                model=small_model(10, (3, 32, 32)))
    finally:
        await link.aclose()


Others = Callable[[Harness, asyncio.Task[RunResult]], Coroutine[Any, Any, None]]


async def run_with(
    honest: list[int], others: Others, *, link: LinkSpec = UNSHAPED
) -> tuple[RunResult, Harness, list[DeviceSummary]]:
    """Train with real devices ``honest`` while ``others(harness, training)`` runs;
    the run's result, the harness and the devices' summaries."""
    clock = VirtualClock()
    try:
        async with asyncio.timeout(60), asyncio.TaskGroup() as tasks:
            harness = Harness(clock, tasks)
            devices = [
                tasks.create_task(honest_device(harness.connect(link), clock, k)) for k in honest
            ]
            cap = tasks.create_task(virtual_cap(clock, 1000.0))
            training = tasks.create_task(harness.node.train())
            side = tasks.create_task(others(harness, training))
            result = await training
            await side
            summaries = [await d for d in devices]
            await harness.wind_down()
            cap.cancel()
    finally:
        await clock.aclose()
    return result, harness, summaries


def check_honest(
    result: RunResult, harness: Harness, summaries: list[DeviceSummary], honest: list[int]
) -> None:
    assert not harness.crashes, harness.crashes
    for summary in summaries:
        assert summary.samples == SHARE * CONFIG.epochs, summary
        assert summary.reason == "training finished", summary
    for epoch in result.epochs:
        for k in honest:
            assert epoch.device_samples[k] == SHARE, epoch
            assert k not in epoch.devices_lost, epoch
        assert epoch.samples == sum(epoch.device_samples)
    for value in result.model.state_dict().values():
        assert torch.isfinite(value).all()


# --- device 1 misbehaves --------------------------------------------------------------------


class RunOver(Exception):
    """The server admits nobody once training has finished."""


class FakeDevice:
    """Device 1: takes part in rounds, misbehaves in them, and sends junk on one new
    connection after another."""

    def __init__(self, harness: Harness, training: asyncio.Task[RunResult]) -> None:
        self.harness, self.clock, self.training = harness, harness.clock, training
        self.frames = 0  # junk frames sent
        self.rounds = 0  # rounds it misbehaved in
        self.excluded = False  # the coordinator excluded it for values it sent

    async def next_message(self, link: MemoryLink, kind: type[Any]) -> Any:
        """The next message of type ``kind``; None if the run or the connection ended."""
        while True:
            try:
                message = decode(await link.receive())
            except TransportError:
                return None
            if isinstance(message, kind):
                return message
            if isinstance(message, Bye):
                return None
            assert isinstance(message, Heartbeat | Gradient | RoundStart), message

    async def join(self) -> MemoryLink:
        """Connect and say hello as device 1 (again while the server is still tearing
        down the previous connection)."""
        for _ in range(100):
            link = self.harness.connect()
            await link.send(encode(Hello(PROTOCOL_VERSION, 1)))
            answer = decode(await link.receive())
            if isinstance(answer, Plan):  # a new session: say what it holds
                await link.send(encode(READY))
                return link
            assert isinstance(answer, ErrorMessage), answer
            if answer.message == "the run is over":
                await link.aclose()
                raise RunOver
            if answer.code == "refused" and "was excluded from the run" in answer.message:
                # values the coordinator's stage refused (out of range, NaN or Inf)
                # exclude it ([Note: judging arrivals]): nothing more to send
                self.excluded = True
                await link.aclose()
                raise RunOver
            assert answer.code == "busy", answer
            await link.aclose()
            await self.clock.sleep(0.01)
        raise AssertionError("device 1 could not connect again")

    async def send(
        self, link: MemoryLink, frame: bytes, verdict: bool | None, what: object, seconds: float
    ) -> Outcome:
        await link.send(frame)
        self.frames += 1
        outcome = await observe(self.clock, link, seconds)
        check_answer(verdict, outcome, self.training.done(), what)
        return outcome

    async def episode(self, items: list[Junk], finish_a_round: bool, first: bool) -> None:
        """With a new session, take part in a round (after a complete valid one, maybe),
        then send ``items`` on the same connection until one is refused."""
        if not first:  # end the session a previous connection may have left waiting
            link = await self.join()
            await self.send(link, encode(Bye("reset")), True, "reset", OBSERVE_AFTER_HELLO_S)
            await link.aclose()
        link = await self.join()  # a new session: it starts clean at the next round
        start = await self.next_message(link, RoundStart)
        sent: set[tuple[int, int, int]] = set()
        last_done = -1
        if start is not None and finish_a_round:
            for n in range(N):
                await link.send(encode(activation(start.epoch, start.first_iteration, n, n)))
                sent.add((start.epoch, start.first_iteration, n))
            for _ in range(N):
                await self.next_message(link, Gradient)
            await link.send(encode(RoundResult(start.round, ROUND_SAMPLES, 0.0, 0, start.tensors)))
            await link.send(encode(RoundReport(start.round, {"slices": []})))
            last_done = start.round
            start = await self.next_message(link, RoundStart)
        if start is not None:
            self.rounds += 1
            valid = activation(start.epoch, start.first_iteration, 0, 7)
            await link.send(encode(valid))
            sent.add((valid.epoch, valid.iteration, valid.micro_batch))
            ctx = Context(start, valid, frozenset(sent), last_done)
            oracle = InRound(ctx)
            for seq, item in enumerate(items):
                frame = item.frame(ctx)
                judged = judge(frame, oracle.verdict, ctx)
                if judged is None:
                    continue
                message, verdict = judged
                await link.send(encode(Heartbeat(seq)))  # keeps the watchdog away
                outcome = await self.send(link, frame, verdict, message or item, OBSERVE_S)
                if outcome.kind != "silent":
                    break
        await link.aclose()

    async def fresh(self, item: Junk) -> None:
        """One junk frame right after a Hello, on a new connection."""
        frame = item.frame(AFTER_HELLO)
        judged = judge(frame, after_hello)
        if judged is None:
            return
        message, verdict = judged
        link = await self.join()
        await self.send(link, frame, verdict, message or item, OBSERVE_AFTER_HELLO_S)
        await link.aclose()
        await self.clock.sleep(0.01)  # spread the junk over device 0's training


Episode = tuple[list[Junk], bool, list[Junk], random.Random]


def refused_by_the_worker(fill: float, kind: str) -> Junk:
    """The round's next activation, valid but for its values or labels (checked only when
    the server computes it)."""
    return Wrong(ActivationSpec(None, None, 1, None, "float32", fill, kind))


SLICE = ["device1/compute", "f", 0.0, 1.0, 0, 0, 0]


# an example trains a whole run: shrinking a failure would take many minutes, and the
# assertion messages name the message and the server's answer. 40 examples (each up to 3
# sessions of device 1, with 6-15 drawn frames and 20 plain-random ones per session) draw
# every branch of the strategies many times over: more examples only repeat them
@settings(
    max_examples=40,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@example(
    [
        ([refused_by_the_worker(math.nan, "ok")], False, [], random.Random(0)),
        ([refused_by_the_worker(0.0, "high")], False, [], random.Random(1)),
        # finite but too large: the loss overflows; once, the model went NaN
        ([refused_by_the_worker(3e38, "ok")], False, [], random.Random(4)),
    ]
)
@example(
    [
        (
            [Wrong(ResultSpec(None, "exact")), refused_by_the_worker(-math.inf, "ok")],
            True,
            [],
            random.Random(2),
        ),
        (
            [
                Wrong(ResultSpec(None, "exact")),
                Wrong(ReportSpec(None, {"slices": [SLICE, ["device0/compute", *SLICE[1:]]]})),
            ],
            False,
            [],
            random.Random(3),
        ),
    ]
)
@given(
    st.lists(
        st.tuples(
            in_round_lists,
            st.booleans(),
            st.lists(after_hello_junk, min_size=5, max_size=12),
            st.randoms(use_true_random=False),
        ),
        min_size=1,
        max_size=3,
    )
)
@pytest.mark.slow
def test_a_misbehaving_device_is_refused_and_the_others_train_on(episodes: list[Episode]) -> None:
    fakes: list[FakeDevice] = []

    async def misbehave(harness: Harness, training: asyncio.Task[RunResult]) -> None:
        fake = FakeDevice(harness, training)
        fakes.append(fake)
        with contextlib.suppress(RunOver):
            for i, (in_round, finish_a_round, after_hello_items, rng) in enumerate(episodes):
                await fake.episode(in_round, finish_a_round, first=i == 0)
                for item in after_hello_items + [random_junk(rng) for _ in range(20)]:
                    await fake.fresh(item)

    result, harness, summaries = asyncio.run(run_with([0], misbehave))
    check_honest(result, harness, summaries, [0])
    (fake,) = fakes
    # the junk stops when the run ends (the server then admits nobody), or when the
    # coordinator excluded the device for values it sent
    assert fake.frames >= 20 or fake.excluded
    if fake.excluded:  # for what the coordinator's stage refused, and for nothing else
        assert harness.node.exclusions.excluded[1].startswith(
            "the coordinator refused what it sent: device1 sent values out of range"), (
            harness.node.exclusions.excluded)


# --- strangers ------------------------------------------------------------------------------

STRANGERS = 2000


def stranger_frames(rng: random.Random, count: int) -> list[bytes]:
    """First frames of connections that never said a valid hello."""
    frames: list[bytes] = []
    while len(frames) < count:
        frame = random_junk(rng).frame(AFTER_HELLO)
        judged = judge(frame, from_stranger)
        if judged is not None and judged[1]:
            frames.append(frame)
    return frames


async def test_strangers_are_refused_before_hello_while_a_run_trains() -> None:
    frames = stranger_frames(random.Random(5), STRANGERS)
    answers: list[tuple[bytes, Outcome, bool]] = []

    async def strangers(harness: Harness, training: asyncio.Task[RunResult]) -> None:
        await harness.node.joined.wait()
        pending = iter(frames)

        async def stranger() -> None:
            for frame in pending:
                link = harness.connect()
                await link.send(frame)
                outcome = await observe(harness.clock, link, OBSERVE_S)
                answers.append((frame, outcome, training.done()))
                await link.aclose()
                await harness.clock.sleep(0.01)  # 4 at a time: over about 5 s of the run

        async with asyncio.TaskGroup() as tasks:
            for _ in range(4):
                tasks.create_task(stranger())

    result, harness, summaries = await run_with([0, 1], strangers, link=WIRE)
    check_honest(result, harness, summaries, [0, 1])
    assert len(answers) == STRANGERS
    for frame, outcome, training_over in answers:
        assert not training_over, "a stranger came after the run"
        assert outcome.refused, outcome
        if outcome.kind == "error":
            # a Hello (of another version) for a connected device's id is "busy"
            hello = isinstance((judge(frame, from_stranger) or (None,))[0], Hello)
            assert outcome.code in (("refused", "busy") if hello else ("refused",)), outcome
            assert outcome.closed, outcome
