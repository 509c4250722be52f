"""The run as a system's rounds see it: `SystemRounds`, the coordinator's `Rounds`.

A system's `run_round` and `after_round` (aiopipe.runtime.systems) play devices' parts
of a round, ask devices for replicas, number rounds and record what they change. They do
it through this object, not the whole coordinator: it holds the devices' sessions (the
coordinator's `Admission`), the run's round count and its record of changes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from aiopipe.clock import Clock, wait_for
from aiopipe.config import RunConfig
from aiopipe.errors import DeviceLostError
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import (
    Replica,
    ReplicaRequest,
    RoundResult,
    RoundStart,
    SecAggReply,
    SecAggRequest,
    TensorData,
)
from aiopipe.runtime.admission import Admission
from aiopipe.runtime.checkpoint import Checkpoints
from aiopipe.runtime.compute import Compute
from aiopipe.runtime.epoch_figures import numbered_for_people
from aiopipe.runtime.stage import ServerStage
from aiopipe.runtime.systems.base import System
from aiopipe.scheduler.costs import CostTable

__all__ = ["SystemRounds"]

log = logging.getLogger("aiopipe.server")


class SystemRounds:
    """What a system's rounds play through (`Rounds`): the devices of ``admission``,
    ``checkpoints`` to let go, and the run's round count (``played``) and record of
    changes (``replans``, epochs and rounds numbered for people).

    Args:
        system: the run's system; its ``config`` (re-planned as it goes) is read when
            needed.
        admission: the devices' sessions and connections.
        checkpoints: the run's checkpoints.
        clock, compute, cost_table, recorder: the coordinator's.
    """

    def __init__(self, system: System, admission: Admission, checkpoints: Checkpoints, *,
                 clock: Clock, compute: Compute, cost_table: CostTable | None,
                 recorder: Recorder) -> None:
        self.system = system
        self.admission = admission
        self.checkpoints = checkpoints
        self.clock = clock
        self.compute = compute
        self.cost_table = cost_table
        self.recorder = recorder
        self.played = 0  # rounds numbered so far
        self.replans: list[dict[str, Any]] = []
        self.origin = clock.now()  # the trace's zero: training's start

    @property
    def config(self) -> RunConfig:
        """The run's config, "auto" resolved (and re-planned)."""
        return self.system.config

    async def play(self, device_id: int, start: RoundStart, stage: ServerStage | None, *,
                   returns: Mapping[str, TensorData] | None = None) -> RoundResult | None:
        """Device ``device_id``'s part of a round; None when it was lost meanwhile.
        ``returns``: the tensors its result must hold, when not the ones ``start``
        sends."""
        session = self.admission.sessions[device_id]
        if session.window is None and start.round > 0 and not self.system.devices_sit_out:
            # (drawn to train, a device's first round may be any one)
            log.warning("device %d takes part again from round %d", device_id,
                        start.round + 1)
        try:
            return await session.run_round(start, stage, returns=returns)
        except DeviceLostError as exc:
            log.warning("round %d goes on without device %d: %s", start.round + 1, device_id,
                        exc)
            return None

    def session_of(self, device_id: int) -> int:
        """An id of device ``device_id``'s session (0: none): a new one when its process
        started afresh, the same across reconnections."""
        session = self.admission.sessions.get(device_id)
        return session.nonce if session is not None and not session.ended else 0

    def copy_checkpoint(self) -> None:
        """Let a pending checkpoint's copy go now (see [Note: background checkpoints])."""
        self.checkpoints.copy()

    def address_of(self, device_id: int) -> str:
        """Where device ``device_id`` listens for peers ("" when it does not)."""
        return self.admission.addresses.get(device_id, "")

    async def settled_alive(self) -> list[int]:
        """The devices taking part, once none is between connections (waiting at most
        ``reconnect_grace`` for each to come back or be given up)."""
        deadline = self.clock.now() + self.config.reconnect_grace + 1.0
        while (set(self.admission.alive()) - self.admission.connected
               and self.clock.now() < deadline):
            await self.clock.sleep(0.05)
        return self.admission.alive()

    def new_round(self) -> int:
        """A fresh round number (a round played again after a fault takes one)."""
        self.played += 1
        return self.played - 1

    def record_change(self, change: dict[str, Any], *,
                      recovery: tuple[float, float] | None = None) -> None:
        """Keep what the system changed mid-round with its re-plans. A ``recovery``'s
        span (clock times: the fault noticed, training resumed) goes into the trace
        (track ``server/recovery``) and into the record as ``noticed_s`` and
        ``resumed_s``, seconds in the trace."""
        change = dict(change)
        if recovery is not None:
            start, end = recovery
            self.recorder.add("server/recovery", "recover", start, end,
                              epoch=int(change.get("epoch", -1)))
            change["noticed_s"], change["resumed_s"] = start - self.origin, end - self.origin
        self.replans.append(numbered_for_people(change))

    async def replicas(self, device_id: int, request: ReplicaRequest) -> list[Replica]:
        """Device ``device_id``'s answer to ``request`` (empty when it was lost, or did
        not answer within ``device_timeout``)."""
        session = self.admission.sessions.get(device_id)
        if session is None:
            return []
        try:
            return await wait_for(self.clock, session.replicas(request),
                                  self.config.device_timeout)
        except (DeviceLostError, TimeoutError):
            return []

    async def secagg(self, device_id: int, request: SecAggRequest) -> SecAggReply | None:
        """Device ``device_id``'s answer to a secure aggregation step (None when it was
        lost, or did not answer within ``device_timeout``)."""
        session = self.admission.sessions.get(device_id)
        if session is None or session.ended:
            return None
        try:
            return await wait_for(self.clock, session.questions.secagg(request),
                                  self.config.device_timeout)
        except (DeviceLostError, TimeoutError):
            return None
