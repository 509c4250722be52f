"""Secure aggregation's messages (aiopipe.secagg, [Note: secagg rounds]): the
coordinator asks each device for one step of a SecAgg+ round (`SecAggRequest`), the
device answers it (`SecAggReply`). Binary values (keys, sealed shares, the masked
vector) travel as tensors, since a frame's header holds no bytes.

What a step carries, checked here by name, dtype and shape before anything reads it
(the state machines of aiopipe.secagg check the rest: who may appear, in which step)::

    step  request (C -> k)                          reply (k -> C)
    0     "clients": int64 (n,) (the round's), length  "cipher", "mask": uint8 (32,)
    1     "cipher:<id>", "mask:<id>": uint8 (32,)   "<id>": uint8 (<= 256,) sealed shares
    2     "<id>": uint8 (<= 256,) sealed shares     "masked": int32 (length,), and
                                                    "blamed": int64 (m,) (ids whose
                                                    shares did not open) when any
    3     clients (survivors), dropped              "<id>": uint8 (66,) a share
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from aiopipe.errors import LocalProtocolError
from aiopipe.protocol.base import TensorData, check_index

__all__ = ["MAX_SEALED_BYTES", "SECAGG_STEPS", "SecAggReply", "SecAggRequest"]

#: The four steps of a round.
SECAGG_STEPS: Final = 4
#: The most bytes one client's sealed shares for another may take.
MAX_SEALED_BYTES: Final = 256
_KEY = ("uint8", (32,))
_ID = re.compile(r"(0|[1-9][0-9]{0,8})")
_KEYED = re.compile(r"(cipher|mask):(0|[1-9][0-9]{0,8})")


def _check_tensors(kind: str, step: int, tensors: Mapping[str, TensorData]) -> None:
    """Each tensor's name, dtype and shape as the step allows (module docstring)."""
    for name, data in tensors.items():
        shape = (data.dtype, data.shape)
        if kind == "reply" and step == 0:
            ok = name in ("cipher", "mask") and shape == _KEY
        elif kind == "request" and step == 0:  # (an "ints" field holds at most 64)
            ok = name == "clients" and data.dtype == "int64" and len(data.shape) == 1
        elif kind == "request" and step == 1:
            ok = bool(_KEYED.fullmatch(name)) and shape == _KEY
        elif (kind, step) in (("reply", 1), ("request", 2)):
            ok = (bool(_ID.fullmatch(name)) and data.dtype == "uint8"
                  and len(data.shape) == 1 and data.shape[0] <= MAX_SEALED_BYTES)
        elif kind == "reply" and step == 2:
            ok = ((name == "masked" and data.dtype == "int32")
                  or (name == "blamed" and data.dtype == "int64")) and len(data.shape) == 1
        elif kind == "reply" and step == 3:
            ok = bool(_ID.fullmatch(name)) and shape == ("uint8", (66,))
        else:
            ok = False
        if not ok:
            raise LocalProtocolError(f"secure aggregation {kind} of step {step}: tensor "
                                     f"{name!r} ({data.dtype} {data.shape}) is not one it "
                                     "holds")
    if kind == "reply" and step in (0, 2):
        wanted = {"cipher", "mask"} if step == 0 else {"masked"}
        if set(tensors) - ({"blamed"} if step == 2 else set()) != wanted:
            raise LocalProtocolError(f"secure aggregation reply of step {step} holds "
                                     f"{sorted(tensors)}, not {sorted(wanted)}")


def _check_ids(name: str, ids: tuple[int, ...]) -> None:
    if not isinstance(ids, tuple):
        raise LocalProtocolError(f"{name} must be a tuple of ids")
    for i in ids:
        check_index(name, i)
    if len(set(ids)) != len(ids):
        raise LocalProtocolError(f"{name} names a device twice")


@dataclass(frozen=True, slots=True)
class SecAggRequest:
    """C -> k: do step ``step`` of round ``round``'s secure aggregation (module
    docstring): ``clients`` and ``dropped`` (step 3: the survivors and the dropped among
    the device's neighbours), ``length`` (step 0: of the summed vector), ``tensors``
    (step 0: the round's devices; steps 1 and 2: keys, sealed shares)."""

    round: int
    step: int
    clients: tuple[int, ...]
    dropped: tuple[int, ...]
    length: int
    tensors: Mapping[str, TensorData]

    def __post_init__(self) -> None:
        check_index("round", self.round)
        check_index("length", self.length)
        if not isinstance(self.step, int) or not 0 <= self.step < SECAGG_STEPS:
            raise LocalProtocolError(f"step must be 0 to 3, got {self.step!r}")
        _check_ids("clients", self.clients)
        _check_ids("dropped", self.dropped)
        if set(self.clients) & set(self.dropped):
            raise LocalProtocolError("a device both among the survivors and dropped")
        _check_tensors("request", self.step, self.tensors)


@dataclass(frozen=True, slots=True)
class SecAggReply:
    """k -> C: the device's answer to step ``step`` of round ``round`` (module
    docstring)."""

    round: int
    step: int
    tensors: Mapping[str, TensorData]

    def __post_init__(self) -> None:
        check_index("round", self.round)
        if not isinstance(self.step, int) or not 0 <= self.step < SECAGG_STEPS:
            raise LocalProtocolError(f"step must be 0 to 3, got {self.step!r}")
        _check_tensors("reply", self.step, self.tensors)
