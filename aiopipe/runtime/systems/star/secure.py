"""Secure aggregation in fl, sfl and pipar: the coordinator's half (aiopipe.secagg,
SecAgg+; the device's half is aiopipe.runtime.systems.star.secure_device).

[Note: secure FedAvg] With ``secure_aggregation``, a device's `RoundResult` carries
no weights. After the round, the coordinator runs a SecAgg+ round over the devices
whose round completed ([Note: secagg rounds] in aiopipe.secagg.protocol), one
`SecAggRequest` per device and step, and learns only the sum of their vectors:

- the vector (`layout`): the whole model's entries of units 1..S, S the largest split
  point of the round (fl: every unit), frozen entries left out, flattened in the
  model's state order, then one more coordinate: the device's weight w. A device
  fills its own half's entries with w x (its weights), the rest with 0; w = its
  samples over the round's most (`SecureRound.unit`), so |w| <= 1.
- each value is clipped to [-clip, clip] (``secure_aggregation_clip``) and encoded in
  Z_{2^32} at the finest scale n such values can sum to without wrapping
  (aiopipe.secagg.fixed_point); the decoded sum of each coordinate is within
  e = n / (2 scale) of the sum of the clipped w x.
- sfl and pipar: the coordinator trains each device's server half itself (its
  replica), so those entries are no secret from it: it adds w x of each surviving
  device's replica in the clear.
- the average is (secure sum + replicas' sum) / W with W = the survivors' summed
  weight, which the coordinator knows from their results; so each entry of the
  average is within e / W of plain FedAvg over the same devices (when no value was
  clipped). The summed weight coordinate must come back as W within e: a check that
  the sum holds exactly the survivors.
- the strategy is handed that average as the one model of the round (FedAvg returns
  it; a server optimizer steps on its pseudo-gradient), frozen entries as at the
  start. The update judge and outlier screens see no single device's update and are
  not used (the config refuses ``outliers`` other than "keep").

Devices lost in the protocol are left out of the round (its metrics too), their
replicas rolled back; below the threshold the round fails with a
`SecureAggregationError`, which ends the run as any round's error does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch

from aiopipe.config import RunConfig
from aiopipe.errors import RemoteProtocolError, SecureAggregationError
from aiopipe.protocol import RoundResult, SecAggReply, SecAggRequest, TensorData
from aiopipe.runtime.plan import DevicePlan
from aiopipe.runtime.systems.base import Rounds
from aiopipe.runtime.systems.star.options import StarOptions
from aiopipe.runtime.systems.star.replicas import ReplicaPool
from aiopipe.secagg import FixedPoint, PublicKeys, RoundSetup, Server
from aiopipe.strategies import Strategy
from aiopipe.strategies import uploaded_aggregate as strategy_aggregate

__all__ = ["SecureHost", "SecureRound", "aggregate_securely", "layout", "unit_of"]

log = logging.getLogger("aiopipe.server")


def unit_of(key: str) -> int:
    """The unit (0-based) a state entry belongs to: units are named by their index."""
    return int(key.split(".", 1)[0])


def layout(state: Mapping[str, torch.Tensor], stop: int, frozen: Collection[str]
           ) -> list[tuple[str, int]]:
    """The secure vector's entries (name, size) before the weight: ``state``'s entries
    of units before ``stop``, not ``frozen``, in ``state``'s order ([Note: secure
    FedAvg])."""
    return [(key, value.numel()) for key, value in state.items()
            if key not in frozen and unit_of(key) < stop]


def blob(data: bytes) -> TensorData:
    """Bytes as a uint8 tensor of the wire."""
    return TensorData("uint8", (len(data),), data)


@dataclass
class SecureRound:
    """One round's secure aggregation: its settings (sent in each `RoundStart`'s
    ``sync["secagg"]``) and the protocol run over the devices that trained."""

    round_no: int
    seed: int
    clip: float
    unit: float  # samples of the round's busiest device: weights are samples / unit
    stop: int  # units 1..stop are summed securely
    summands: int  # devices of the round: the encoding's n
    #: the protocol's server half, once the sum is under way
    server: Server | None = field(default=None, repr=False)

    @classmethod
    def of(cls, config: RunConfig, round_no: int, plans: Sequence[DevicePlan],
           work: Sequence[int], participants: Sequence[int]) -> SecureRound:
        """Round ``round_no``'s, for ``participants`` training ``work[k]`` iterations
        each at their ``plans``."""
        options = config.options_as(StarOptions)
        chosen = [plans[k] for k in participants]
        return cls(round_no, config.seed * 1_000_003 + round_no,
                   options.secure_aggregation_clip,
                   float(max(work[p.device_id] * p.micro_batch_size * p.parallel_batches
                             for p in chosen)),
                   max(p.split_point for p in chosen), len(participants))

    def settings(self) -> dict[str, Any]:
        """What a device needs to encode and mask its upload."""
        return {"seed": self.seed, "clip": self.clip, "unit": self.unit, "stop": self.stop,
                "summands": self.summands}

    @property
    def code(self) -> FixedPoint:
        return FixedPoint.for_sum(self.clip, self.summands)

    async def sum(self, rounds: Rounds, clients: Sequence[int], length: int
                  ) -> tuple[np.ndarray, list[int]]:
        """The decoded sum of ``clients``' vectors (``length`` with the weight) and the
        devices it holds.

        Raises:
            SecureAggregationError: too few devices to the end (aiopipe.secagg.server).
        """
        setup = RoundSetup(self.round_no, self.seed, tuple(clients), length)
        server = self.server = Server(setup)
        everyone = np.array(setup.clients, dtype="<i8")
        replies = await _ask(rounds, {k: SecAggRequest(self.round_no, 0, (), (), length, {
            "clients": TensorData("int64", everyone.shape, everyone.tobytes())})
            for k in clients})
        _take(replies, lambda k, r: server.take_keys(k, PublicKeys(
            bytes(r.tensors["cipher"].data), bytes(r.tensors["mask"].data))))
        lists = server.close_keys()
        replies = await _ask(rounds, {k: SecAggRequest(self.round_no, 1, (), (), 0, {
            f"{kind}:{v}": blob(getattr(keys, kind))
            for v, keys in lists[k].items() for kind in ("cipher", "mask")})
            for k in lists})
        _take(replies, lambda k, r: server.take_shares(k, {
            int(name): bytes(t.data) for name, t in r.tensors.items()}))
        boxes = server.close_shares()
        replies = await _ask(rounds, {k: SecAggRequest(self.round_no, 2, (), (), 0, {
            str(u): blob(box) for u, box in boxes[k].items()}) for k in boxes})
        _take(replies, lambda k, r: server.take_masked(k, np.frombuffer(
            r.tensors["masked"].data, dtype="<u4").astype(np.uint32), _blamed(r)))
        requests = server.close_masked()
        for u in server.left_out:
            log.warning("secure aggregation round %d: device %d is left out, its shares "
                        "did not open for devices %s", self.round_no, u,
                        sorted(k for k, b in server.blamed.items() if u in b))
        replies = await _ask(rounds, {k: SecAggRequest(
            self.round_no, 3, tuple(sorted(q.survivors)), tuple(sorted(q.dropped)), 0, {})
            for k, q in requests.items()})
        _take(replies, lambda k, r: server.take_unmasking(k, {
            int(name): bytes(t.data) for name, t in r.tensors.items()}))
        total = server.result()
        return self.code.decode_sum(total), server.survivors

    def average(self, total: np.ndarray, entries: list[tuple[str, int]],
                results: Mapping[int, RoundResult],
                replicas: Mapping[int, Mapping[str, torch.Tensor]],
                start: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The survivors' weighted average ([Note: secure FedAvg]): ``total`` (the
        decoded secure sum over ``entries`` and the weight), plus each survivor's
        replica entries (``replicas``, sfl and pipar) weighted in the clear, over their
        summed weight; entries no one sent (frozen) as in ``start``.

        Raises:
            SecureAggregationError: the summed weight is not the survivors'.
        """
        weights = {k: res.samples / self.unit for k, res in results.items()}
        whole = sum(weights.values())
        if abs(total[-1] - whole) > self.code.error_bound + 1e-9:
            raise SecureAggregationError(
                f"secure aggregation round {self.round_no}: the summed weight is "
                f"{total[-1]:.6g}, the survivors' is {whole:.6g}")
        sums: dict[str, torch.Tensor] = {}
        at = 0
        for key, size in entries:
            sums[key] = torch.from_numpy(total[at:at + size].copy()).view(start[key].shape)
            at += size
        for k, replica in replicas.items():  # server halves: no device uploads them
            for key, value in replica.items():
                part = weights[k] * value.double()
                sums[key] = sums[key] + part if key in sums else part
        out = {}
        for key, value in start.items():
            if key not in sums:
                out[key] = value.clone()
                continue
            mean = sums[key] / whole
            out[key] = (mean.to(value.dtype) if value.is_floating_point()
                        else mean.round().to(value.dtype))
        return out


async def _ask(rounds: Rounds, requests: Mapping[int, SecAggRequest]
               ) -> dict[int, SecAggReply]:
    """Every device's answer to its request, at once; the lost ones left out."""
    async with asyncio.TaskGroup() as tasks:
        asked = {k: tasks.create_task(rounds.secagg(k, request))
                 for k, request in requests.items()}
    return {k: reply for k, task in asked.items() if (reply := task.result()) is not None}


def _blamed(reply: SecAggReply) -> frozenset[int]:
    """The devices a step-2 reply blames ([Note: secagg blame] in aiopipe.secagg.client)."""
    found = reply.tensors.get("blamed")
    if found is None:
        return frozenset()
    return frozenset(int(v) for v in np.frombuffer(found.data, dtype="<i8"))


def _take(replies: Mapping[int, SecAggReply], take: Callable[[int, SecAggReply], None]
          ) -> None:
    """Hand each reply to the server's state machine; a device whose reply it refuses
    is left out of the round, as a lost one, and named in the log."""
    for k, reply in sorted(replies.items()):
        try:
            take(k, reply)
        except (RemoteProtocolError, ValueError, KeyError) as exc:
            log.warning("device %d's secure aggregation reply is refused, it is left out: "
                        "%s", k, exc)


class SecureHost(Protocol):
    """What the secure aggregation needs of the star coordinator."""

    @property
    def model(self) -> torch.nn.Sequential: ...
    @property
    def frozen(self) -> Collection[str]: ...
    @property
    def replicas(self) -> ReplicaPool: ...
    @property
    def strategy(self) -> Strategy: ...
    @property
    def cost_table(self) -> Any: ...


async def aggregate_securely(host: SecureHost, rounds: Rounds, secure: SecureRound,
                             done: Mapping[int, RoundResult], epoch: int
                             ) -> dict[int, RoundResult]:
    """Sum the round's devices' uploads by SecAgg+, install the strategy's aggregate of
    their average, and return the results of the devices the sum holds (the others
    were lost in the protocol: their replicas are rolled back).

    Raises:
        SecureAggregationError: fewer devices than the threshold to the end.
    """
    entries = layout(host.model.state_dict(), secure.stop, host.frozen)
    length = sum(size for _, size in entries) + 1
    total, survivors = await secure.sum(rounds, sorted(done), length)
    kept = {k: done[k] for k in survivors}
    lost = sorted(set(done) - set(kept))
    if lost:
        log.warning("secure aggregation round %d goes on without devices %s, lost in its "
                    "protocol", secure.round_no, lost)
        await rounds.compute.call(partial(host.replicas.roll_back, lost))
    cost = host.cost_table.aggregate_time(len(kept)) if host.cost_table else None
    await rounds.compute.run("agg", partial(_install, host, secure, total, entries, kept),
                             cost=cost, epoch=epoch)
    return kept


def _install(host: SecureHost, secure: SecureRound, total: np.ndarray,
             entries: list[tuple[str, int]], results: Mapping[int, RoundResult]) -> None:
    """The average made the global model through the run's strategy (compute thread)."""
    start = host.model.state_dict()
    replicas = {k: {key: v.cpu() for key, v in host.replicas[k][0].state_dict().items()
                    if key not in host.frozen}
                for k in results if k in host.replicas}
    average = secure.average(total, entries, results, replicas, start)
    state = strategy_aggregate(host.strategy, start, {0: average}, {0: 1.0}, host.frozen)
    host.model.load_state_dict(state)
    host.strategy.installed()
