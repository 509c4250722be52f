"""The messages between the coordinator and a device: joining a run (Hello, Plan,
Ready), profiling, evaluation, each round's start and its results, and the conversation's
end. `aiopipe.protocol.messages` draws the whole conversation.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from aiopipe.errors import LocalProtocolError
from aiopipe.protocol.base import (
    DTYPE_SIZES,
    TensorData,
    check_index,
    check_node_name,
    check_score,
)
from aiopipe.protocol.fields import MAX_LEAVES

__all__ = [
    "MAX_ACTIONS_CHARS",
    "MAX_ADDRESS_CHARS",
    "MAX_REASON_CHARS",
    "MODES",
    "TRAINING_FINISHED",
    "Accusation",
    "Bye",
    "ErrorMessage",
    "EvalRequest",
    "EvalResult",
    "Heartbeat",
    "Hello",
    "Plan",
    "Probe",
    "Profile",
    "ProfileRequest",
    "Ready",
    "Rest",
    "RoundAccepted",
    "RoundReport",
    "RoundResult",
    "RoundStalled",
    "RoundStart",
]

#: Training modes a plan can name.
MODES: Final = ("fl", "sl", "sfl", "pipar", "pipeline", "ftpipehd", "asteroid", "hadfl",
                 "fedbuff", "auto")

#: Longest endpoint address a node may announce.
MAX_ADDRESS_CHARS: Final = 256
#: Longest reason a `RoundStalled` may give.
MAX_REASON_CHARS: Final = 500
#: Longest action list a `RoundStart` may carry.
MAX_ACTIONS_CHARS: Final = 1 << 16
#: Most dimensions a sample's input may have.
MAX_INPUT_DIMS: Final = 8

_HEX_KEY = re.compile(r"[0-9a-f]{64}")


def _check_address(what: str, address: object) -> None:
    if not isinstance(address, str) or len(address) > MAX_ADDRESS_CHARS or (
            address and not address.isprintable()):
        raise LocalProtocolError(f"{what} must be a printable str of at most "
                                 f"{MAX_ADDRESS_CHARS} characters")


#: What a sample's input is when not said: one float32 value.
ONE_INPUT: Final = (("float32", (1,)),)
#: What a sample's target is when not said: a class index.
CLASS_TARGET: Final = (("int64", ()),)


def _check_data(name: str, crossing: object, *, leaves: int) -> None:
    """``crossing`` (`Plan.inputs` or `.target`) is 1 to ``leaves`` pairs of a dtype that
    travels and a per-sample shape of at most `MAX_INPUT_DIMS` ints in 1..2**20 (an
    input has at least one dimension, a target may have none)."""
    least = 1 if name == "inputs" else 0
    count = f"1 to {leaves} (dtype, shape) pairs" if leaves > 1 else "one (dtype, shape) pair"
    if not isinstance(crossing, tuple) or not 1 <= len(crossing) <= leaves or any(
            not isinstance(leaf, tuple) or len(leaf) != 2 or not isinstance(leaf[0], str)
            or leaf[0] not in DTYPE_SIZES
            or not isinstance(leaf[1], tuple) or not least <= len(leaf[1]) <= MAX_INPUT_DIMS
            or any(isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= 1 << 20
                   for d in leaf[1])
            for leaf in crossing):
        raise LocalProtocolError(
            f"{name} must be {count} with {least} to "
            f"{MAX_INPUT_DIMS} dimensions in 1..{1 << 20}, got {crossing!r}")


_DEVICE_NAME = re.compile(r"device[0-9]{1,9}")


def _is_device_name(name: str) -> bool:
    """``name`` is a device's node name (``device<k>``)."""
    return isinstance(name, str) and _DEVICE_NAME.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class Hello:
    """First message of a device: who it is and which protocol it speaks.

    ``session`` is the `Plan.session` of the server-side session the device was talking
    to before it reconnected, or 0 for a device that starts afresh (a new process): only
    a matching session is resumed. ``address`` is where other nodes can dial this device
    for device-to-device links (an endpoint address, e.g. ``ws://10.0.0.7:8766/peer``),
    or "" when it does not listen.
    """

    version: int
    device_id: int
    session: int = 0
    address: str = ""

    def __post_init__(self) -> None:
        check_index("version", self.version)
        check_index("device_id", self.device_id)
        check_index("session", self.session)
        _check_address("address", self.address)


@dataclass(frozen=True, slots=True)
class Plan:
    """The server's answer to Hello: the run this device takes part in.

    ``run`` is the resolved run configuration (plain TOML-able values), so a device needs
    nothing but the server's address and its id; what it computes (its stage, units,
    micro-batches and actions) arrives with each `RoundStart`. ``run_id`` names the run:
    every stage-addressed message carries it. ``server_time`` is the server clock when
    the plan was sent, so a device can map its trace onto the server's time line.
    ``session`` names the server-side state serving this device: a device that reconnects
    and finds a different one (the server restarted, or gave up on it) drops its
    unfinished round and starts afresh from the next `RoundStart`. ``peer_keys`` maps
    every other device this one may link to directly (a pipeline's) to the key of their
    pair (`aiopipe.auth.pair_key`, 64 hex digits): what the two prove to each other when
    they connect (`aiopipe.transport.fabric`); empty when the run has no such links.
    ``inputs``, ``target`` and ``num_classes``: the run's kind of data, which the model
    is built for (a device's own data must match it; `aiopipe.data.DataKind`): each
    input's and the target's dtype and per-sample shape, and the classes a target of
    class indices ranges over (0: the target is not class indices).
    """

    device_id: int
    mode: str
    run: Mapping[str, Any]
    run_id: int
    server_time: float = 0.0
    session: int = 0
    peer_keys: Mapping[str, Any] = field(default_factory=dict)
    inputs: tuple[tuple[str, tuple[int, ...]], ...] = ONE_INPUT
    target: tuple[tuple[str, tuple[int, ...]], ...] = CLASS_TARGET
    num_classes: int = 1

    def __post_init__(self) -> None:
        check_index("device_id", self.device_id)
        _check_data("inputs", self.inputs, leaves=MAX_LEAVES)
        _check_data("target", self.target, leaves=1)
        check_index("num_classes", self.num_classes)
        if not isinstance(self.mode, str) or (self.mode not in MODES and ":" not in self.mode):
            raise LocalProtocolError(f"mode must be one of {MODES} or module:attribute (a "
                                     f"system of the user's), got {self.mode!r}")
        check_index("run_id", self.run_id)
        check_index("session", self.session)
        if not isinstance(self.peer_keys, Mapping):
            raise LocalProtocolError("peer_keys must be a mapping")
        for name, key in self.peer_keys.items():
            check_node_name(name)
            if not isinstance(key, str) or not _HEX_KEY.fullmatch(key):
                raise LocalProtocolError(f"the key of peer {name!r} must be 64 hex digits")


@dataclass(frozen=True, slots=True)
class Ready:
    """A device has set up for the run (its answer to a new session's `Plan`): what it
    holds, its own data (``samples`` training samples of the kind ``inputs``, ``target``
    and ``num_classes`` describe, as `Plan`'s do), and the digest of the
    model it built from the run's config (`aiopipe.models.model_digest`): the
    coordinator plans and weights from what devices announce and refuses a device whose
    data or model do not fit the run. ``held_out``: samples of its own held-out data it
    evaluates the global model on after each epoch (0: none; `EvalRequest`)."""

    samples: int
    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    target: tuple[tuple[str, tuple[int, ...]], ...]
    num_classes: int
    model_digest: str
    host: str = ""
    held_out: int = 0

    def __post_init__(self) -> None:
        check_index("samples", self.samples)
        check_index("num_classes", self.num_classes)
        check_index("held_out", self.held_out)
        _check_data("inputs", self.inputs, leaves=MAX_LEAVES)
        _check_data("target", self.target, leaves=1)
        for name in ("model_digest", "host"):
            value = getattr(self, name)
            if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{0,64}", value) or (
                    name == "model_digest" and len(value) < 16):
                raise LocalProtocolError(f"{name} must be hex digits (a model digest 16 to "
                                         "64, a host 0 to 64)")


@dataclass(frozen=True, slots=True)
class EvalRequest:
    """After epoch ``epoch``, the whole global model (``tensors``) for a device to
    evaluate on its own held-out data."""

    epoch: int
    tensors: Mapping[str, TensorData]

    def __post_init__(self) -> None:
        check_index("epoch", self.epoch)


@dataclass(frozen=True, slots=True)
class EvalResult:
    """What a device's held-out data says of the global model of epoch ``epoch``: its
    ``samples``, their summed loss and their summed accuracy (``correct``: the run's
    metric per sample, summed; a classifier's right predictions)."""

    epoch: int
    samples: int
    loss_sum: float
    correct: float

    def __post_init__(self) -> None:
        for name in ("epoch", "samples"):
            check_index(name, getattr(self, name))
        check_score(self, "correct", self.samples)
        if not isinstance(self.loss_sum, float) or not math.isfinite(self.loss_sum) or (
                self.loss_sum < 0):
            raise LocalProtocolError(f"loss_sum must be a finite float >= 0, got "
                                     f"{self.loss_sum!r}")


@dataclass(frozen=True, slots=True)
class ProfileRequest:
    """The coordinator asks a device to time its own compute at ``batch_sizes`` (the
    micro-batch sizes the plan may use); a `Probe` follows at once, whose arrival after
    this one times the downlink."""

    batch_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.batch_sizes, tuple) or not 1 <= len(self.batch_sizes) <= 64:
            raise LocalProtocolError("batch_sizes must hold 1 to 64 sizes")
        for size in self.batch_sizes:
            check_index("batch size", size)


@dataclass(frozen=True, slots=True)
class Profile:
    """A device's answer to `ProfileRequest`: its own cost table (``costs``, as
    `aiopipe.scheduler.CostTable.to_mapping` writes it; empty when the device shares
    the coordinator's machine and its table), the ``seconds`` profiling took, and the
    downlink rate it saw (``downlink_bps``, bits per second; 0 when the probe arrived
    too fast to time: an unshaped link). A `Probe` follows, which times the uplink."""

    costs: Mapping[str, Any]
    seconds: float
    downlink_bps: float

    def __post_init__(self) -> None:
        for name in ("seconds", "downlink_bps"):
            value = getattr(self, name)
            if not isinstance(value, float) or not math.isfinite(value) or value < 0:
                raise LocalProtocolError(f"{name} must be a finite float >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Probe:
    """Bytes whose arrival right after the message before times a link."""

    data: TensorData


@dataclass(frozen=True, slots=True)
class RoundStart:
    """Weights to load and the work to do until the next aggregation (or evaluation).

    The device runs stage ``stage`` of a pipeline of ``stages``: units
    ``first_unit``..``stop_unit - 1`` of the model, whose weights (at ``version``, the
    number of optimizer steps they have taken in the run) are ``tensors``; each iteration
    it runs ``actions`` (one iteration's action list, space-separated as
    `aiopipe.scheduler.actions.Action` prints them, e.g. ``"0F0 0SEND_F0 0RECV_B0 0B0 0STEP"``)
    on ``parallel_batches`` micro-batches of ``micro_batch_size`` samples. ``peers`` maps
    the name of every device the actions send to or receive from to ``{"stage": int,
    "address": str}``: which stage it runs and where to dial it (the stage next to
    this one is on the coordinator itself when no peer runs it: the split modes).

    A stage run by a data-parallel group (Asteroid): ``rows`` = (start, stop), the rows
    of every micro-batch this device computes (empty: all of them), and each peer also
    maps ``"rows"`` to its [start, stop]; the members of this device's own stage are
    peers too (they all-reduce the stage's gradients: `GroupGradient`).
    """

    round: int
    epoch: int
    first_iteration: int
    iterations: int
    tensors: Mapping[str, TensorData]
    stage: int
    stages: int
    first_unit: int
    stop_unit: int
    parallel_batches: int
    micro_batch_size: int
    version: int
    actions: str
    peers: Mapping[str, Any] = field(default_factory=dict)
    rows: tuple[int, ...] = ()
    sync: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("round", "epoch", "first_iteration", "iterations", "stage", "stages",
                     "first_unit", "stop_unit", "parallel_batches", "micro_batch_size",
                     "version"):
            check_index(name, getattr(self, name))
        if not self.stage < self.stages:
            raise LocalProtocolError(f"stage {self.stage} is not below stages {self.stages}")
        if not self.first_unit < self.stop_unit:
            raise LocalProtocolError(f"units {self.first_unit}..{self.stop_unit - 1} are empty")
        for name in ("parallel_batches", "micro_batch_size"):
            if getattr(self, name) == 0:
                raise LocalProtocolError(f"{name} must be >= 1")
        if not isinstance(self.actions, str) or len(self.actions) > MAX_ACTIONS_CHARS:
            raise LocalProtocolError(f"actions must be a str of at most {MAX_ACTIONS_CHARS} "
                                     "characters")
        if not isinstance(self.peers, Mapping):
            raise LocalProtocolError("peers must be a mapping")
        for name, peer in self.peers.items():
            check_node_name(name)
            if not isinstance(peer, Mapping) or set(peer) - {"rows"} != {"stage", "address"}:
                raise LocalProtocolError(f"peer {name!r} must map stage and address (and "
                                         "maybe rows)")
            check_index(f"peer {name!r} stage", peer["stage"])
            _check_address(f"peer {name!r} address", peer["address"])
            if "rows" in peer:
                _check_rows(f"peer {name!r} rows", peer["rows"], self.micro_batch_size)
        if self.rows:
            _check_rows("rows", self.rows, self.micro_batch_size)


def _check_rows(what: str, rows: object, micro_batch_size: int) -> None:
    if not isinstance(rows, tuple | list) or len(rows) != 2 or any(
            isinstance(r, bool) or not isinstance(r, int) for r in rows) or not (
            0 <= rows[0] < rows[1] <= micro_batch_size):
        raise LocalProtocolError(f"{what} must be [start, stop] with 0 <= start < stop <= "
                                 f"{micro_batch_size}, got {rows!r}")


@dataclass(frozen=True, slots=True)
class RoundResult:
    """A device's trained weights at the end of a round, with what it saw. HADFL: no
    weights (but the model's backup, when asked), and ``version``: the version its model
    reached, in epochs of training (0.0 in every other mode)."""

    round: int
    samples: int
    loss_sum: float
    correct: float
    tensors: Mapping[str, TensorData]
    version: float = 0.0

    def __post_init__(self) -> None:
        check_index("round", self.round)
        if not isinstance(self.version, float) or not (math.isfinite(self.version)
                                                       and self.version >= 0):
            raise LocalProtocolError(f"version must be a finite float >= 0, got "
                                     f"{self.version!r}")
        check_index("samples", self.samples)
        check_score(self, "correct", self.samples)
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
        check_index("round", self.round)


@dataclass(frozen=True, slots=True)
class RoundAccepted:
    """The coordinator holds the device's result and report of ``round``: the device may
    forget them. A device keeps them for re-sending until acknowledged; the next
    `RoundStart` acknowledges them, and a device that is not drawn for the next round
    ([Note: sampling per round]) is told by this instead, so that it holds nothing of
    its rounds while it waits ([Note: a round's local optimizer])."""

    round: int

    def __post_init__(self) -> None:
        check_index("round", self.round)


@dataclass(frozen=True, slots=True)
class Rest:
    """The coordinator expects nothing of the device until its next message: both ends
    of the link stop their heartbeats and silence watchdogs until then ([Note: idle
    links rest] in aiopipe.runtime.liveness). Any other message from the coordinator
    wakes the device's end. Only in a run whose links rest (a simulation that samples
    devices per round): just before the `Plan` (the link starts at rest), and to a
    device that the coordinator's last message woke and that is in no round now; a
    server over websockets sends none."""


@dataclass(frozen=True, slots=True)
class RoundStalled:
    """A device's round cannot finish: a neighbour's link failed or it refused what the
    neighbour sent, or no gradient came within ``device_timeout`` (FTPipeHD). The
    coordinator plays the round again or ends the run."""

    round: int
    reason: str

    def __post_init__(self) -> None:
        check_index("round", self.round)
        if len(self.reason) > MAX_REASON_CHARS:
            raise LocalProtocolError(f"a stall's reason is longer than {MAX_REASON_CHARS} "
                                     "characters")


@dataclass(frozen=True, slots=True)
class Accusation:
    """In round ``round`` the device refused what its neighbour ``culprit`` (a device's
    node name) sent: values out of range or the plan broken (``reason``; [Note: judging
    arrivals]). The coordinator decides whom that excludes ([Note: whose word
    excludes]); the device's round may go on (HADFL bypasses the neighbour) or stop (a
    `RoundStalled` follows)."""

    round: int
    culprit: str
    reason: str

    def __post_init__(self) -> None:
        check_index("round", self.round)
        if not _is_device_name(self.culprit):
            raise LocalProtocolError(f"an accusation names a device's node name (deviceK), "
                                     f"got {self.culprit[:40]!r}")
        if len(self.reason) > MAX_REASON_CHARS:
            raise LocalProtocolError(f"an accusation's reason is longer than "
                                     f"{MAX_REASON_CHARS} characters")


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Liveness signal, either direction."""

    seq: int

    def __post_init__(self) -> None:
        check_index("seq", self.seq)


@dataclass(frozen=True, slots=True)
class Bye:
    """Orderly end of the conversation: ``reason`` is `TRAINING_FINISHED` when the run
    completed, else why the server ended it."""

    reason: str


#: `Bye.reason` of a run that completed.
TRAINING_FINISHED = "training finished"


@dataclass(frozen=True, slots=True)
class ErrorMessage:
    """What went wrong, sent just before closing a connection."""

    code: str
    message: str


