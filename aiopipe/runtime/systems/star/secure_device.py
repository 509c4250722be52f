"""Secure aggregation in fl, sfl and pipar: the device's half ([Note: secure FedAvg] in
aiopipe.runtime.systems.star.secure). At the round's end the device keeps its weighted
half as the round's vector instead of uploading it, then answers the coordinator's
four `SecAggRequest`s with an `aiopipe.secagg.Client`: the vector leaves the device
only masked."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from aiopipe.errors import RemoteProtocolError, SecureAggregationError
from aiopipe.models import frozen_parameters
from aiopipe.protocol import RoundStart, SecAggReply, SecAggRequest, TensorData
from aiopipe.runtime.device_context import DeviceContext
from aiopipe.runtime.systems.star.secure import blob, layout
from aiopipe.secagg import Client, FixedPoint, PublicKeys, RoundSetup, UnmaskRequest

__all__ = ["SecureUpload"]

log = logging.getLogger("aiopipe.device")


class SecureUpload:
    """A device's secure uploads, one round at a time."""

    def __init__(self, node: DeviceContext) -> None:
        self.node = node
        self._layouts: dict[int, list[tuple[str, int]]] = {}  # by stop unit
        self._round = -1
        self._settings: Mapping[str, Any] = {}
        self._vector: np.ndarray | None = None  # the weighted half, encoded
        self._client: Client | None = None
        self._samples = 0

    def start(self, start: RoundStart) -> None:
        """A round begins: forget the last one's vector."""
        self._round, self._vector, self._client = start.round, None, None
        settings = start.sync.get("secagg")
        self._settings = settings if isinstance(settings, Mapping) else {}
        self._samples = start.iterations * start.micro_batch_size * start.parallel_batches

    def keep(self, state: Mapping[str, torch.Tensor]) -> None:
        """The trained half (``state``, frozen entries left out) as this round's vector:
        weight w = samples / unit times each entry, in the round's layout, then w; then
        encoded (compute thread).

        Raises:
            RemoteProtocolError: the round's settings are missing or malformed.
        """
        try:
            stop, unit = int(self._settings["stop"]), float(self._settings["unit"])
            code = FixedPoint.for_sum(float(self._settings["clip"]),
                                      int(self._settings["summands"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"a RoundStart without secure aggregation settings "
                                      f"({exc})") from None
        if not unit > 0:  # (NaN too)
            raise RemoteProtocolError(f"a secure aggregation weight unit of {unit}")
        weight = self._samples / unit
        parts = []
        for key, size in self._layout(stop):
            value = state.get(key)
            parts.append(np.zeros(size) if value is None
                         else weight * value.detach().double().flatten().numpy())
        parts.append(np.array([weight]))
        vector = np.concatenate(parts)
        clipped = code.clipped(vector)
        if clipped:
            log.warning("secure aggregation: %d of %d values beyond +-%g are clipped",
                        clipped, vector.size, code.clip)
        self._vector = code.encode(vector)

    def _layout(self, stop: int) -> list[tuple[str, int]]:
        found = self._layouts.get(stop)
        if found is None:
            model = self.node.holdings.model_copy(0, stop)
            found = self._layouts[stop] = layout(model.state_dict(), stop,
                                                 set(frozen_parameters(model)))
        return found

    def answer(self, sender: str, request: SecAggRequest) -> None:
        """Answer step ``request.step`` of this round's secure aggregation (a handler:
        the reply is posted to the coordinator). A step this device cannot take safely
        (too few neighbours left) gets no answer: the coordinator goes on without it.

        Raises:
            RemoteProtocolError: a request out of step, for another round, or that the
                client's checks refuse.
        """
        if request.round != self._round or self._vector is None:
            raise RemoteProtocolError(f"a secure aggregation request for round "
                                      f"{request.round}, which this device holds no "
                                      "vector of")
        try:
            tensors = self._step(request, self._vector)
        except SecureAggregationError as exc:
            log.warning("%s", exc)
            return
        self.node.peer.post(SecAggReply(request.round, request.step, tensors), "m")

    def _step(self, request: SecAggRequest, vector: np.ndarray) -> dict[str, TensorData]:
        if request.step == 0:
            if (request.length != vector.size or self._client is not None
                    or "clients" not in request.tensors):
                raise RemoteProtocolError(f"a secure round of length {request.length}, this "
                                          f"device's vector has {vector.size}")
            everyone = np.frombuffer(request.tensors["clients"].data, dtype="<i8")
            try:
                setup = RoundSetup(request.round, int(self._settings["seed"]),
                                   tuple(int(c) for c in everyone), request.length)
                self._client = Client(setup, self.node.device_id)
            except (KeyError, ValueError) as exc:
                raise RemoteProtocolError(f"a secure round this device cannot take part "
                                          f"in: {exc}") from None
            keys = self._client.advertise()
            return {"cipher": blob(keys.cipher), "mask": blob(keys.mask)}
        client = self._client
        if client is None:
            raise RemoteProtocolError("a secure aggregation step before step 0")
        if request.step == 1:
            advertised: dict[int, dict[str, bytes]] = {}
            for name, data in request.tensors.items():
                kind, _, who = name.partition(":")
                advertised.setdefault(int(who), {})[kind] = bytes(data.data)
            if any(set(found) != {"cipher", "mask"} for found in advertised.values()):
                raise RemoteProtocolError("a neighbour's keys come without their pair")
            sealed = client.share({v: PublicKeys(found["cipher"], found["mask"])
                                   for v, found in advertised.items()})
            return {str(v): blob(box) for v, box in sealed.items()}
        if request.step == 2:
            masked = client.masked_input(
                {int(name): bytes(data.data) for name, data in request.tensors.items()},
                vector)
            self._vector = np.zeros(0, dtype=np.uint32)  # the input is not kept
            wire = masked.astype("<u4").view(np.int32)
            reply = {"masked": TensorData("int32", (wire.size,), wire.tobytes())}
            if client.blamed:  # [Note: secagg blame] in aiopipe.secagg.client
                log.warning("secure aggregation round %d: the shares of devices %s do not "
                            "open; masked without them", request.round, sorted(client.blamed))
                ids = np.array(sorted(client.blamed), dtype="<i8")
                reply["blamed"] = TensorData("int64", ids.shape, ids.tobytes())
            return reply
        shares = client.unmask(UnmaskRequest(frozenset(request.clients),
                                             frozenset(request.dropped)))
        return {str(v): blob(share) for v, share in shares.items()}
