"""The device half of a system: what a device does that only its system knows.

A system is a pair (aiopipe.runtime.systems): its coordinator half plans and runs the
rounds from the server; its device half, a `DeviceHalf`, runs a round on a device. The
device node itself (aiopipe.runtime.device_node) is a shell shared by every system: the
link to the coordinator, the handshake, reconnection, the control loop, the peer
links and the data path of activations and gradients (aiopipe.runtime.delivery). It
hands the rest to the half:

- the system's own messages, from peers or the coordinator, by type (`handlers`);
- what a broken peer link means (`peer_failed`);
- a round (`run_round`): by default the stage the `RoundStart` assigns, run by the
  `StageExecutor` iteration after iteration (aiopipe.runtime.stage_round), with the
  half's hooks after a backward (`after_backward`), after an iteration
  (`after_iteration`), beside the round (`watch`), and what the trained stage uploads
  (`upload_state`);
- what the stage keeps between rounds and how a round is played again (`stage_rules`,
  `arrivals`), and whether a round's error waits for the coordinator's recovery
  (`recovers_rounds`).

A half sees the node through `DeviceContext`: the services every system may use.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import ClassVar

import torch

from aiopipe.protocol import Message, Replica, RoundStart
from aiopipe.runtime.arrivals import ArrivalRules
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.device_context import DeviceContext, Handler
from aiopipe.runtime.executor import Route
from aiopipe.runtime.holdings import StageRules
from aiopipe.runtime.peer_links import PeerRoute
from aiopipe.runtime.stage import Batch, StageWork
from aiopipe.runtime.stage_round import StageRound

__all__ = ["DeviceContext", "DeviceHalf", "Handler", "StageRules"]


class DeviceHalf:
    """A system's device half (module docstring); the defaults run the stage the
    round assigns with the executor's loop, and accept no messages of their own."""

    #: how data messages of this system's rounds arrive (aiopipe.runtime.arrivals)
    arrivals: ClassVar[ArrivalRules] = ArrivalRules()
    #: whether a round stopped by an error (not a neighbour's fault) waits for the
    #: coordinator's recovery (it plays the round again) instead of failing the device
    recovers_rounds: ClassVar[bool] = False

    def __init__(self, node: DeviceContext) -> None:
        self.node = node

    @property
    def stage_rules(self) -> StageRules:
        """What the stage keeps between rounds."""
        return StageRules()

    def set_up(self) -> None:
        """Once the node holds its data and model (``node.holdings``), before the
        first round."""

    def handlers(self) -> Mapping[type[Message], Handler]:
        """The system's own messages this half takes, by type, from peers and from
        the coordinator (whose sender name is ``aiopipe.runtime.stage_round.COORDINATOR``);
        a handler raises `RemoteProtocolError` for one it refuses."""
        return {}

    def peer_failed(self, name: str, error: Exception) -> bool:
        """A link to peer ``name`` broke; whether the half takes care of it (False: the
        round in progress cannot finish)."""
        return False

    async def run_round(self, start: RoundStart) -> int:
        """Run the round ``start`` begins, upload its result and report; the samples
        it trained."""
        return await StageRound(self.node, self, start).run()

    def own_backup(self, start: RoundStart) -> Replica | None:
        """The device's own snapshot to start the round's stage from, when sent no
        weights (None: none)."""
        return None

    def frame_limit(self, assignment: Assignment, default: int) -> int:
        """The largest frame a peer may send this round (``default``: what the plan's
        activations, gradients and a group's gradients need)."""
        return default

    def batches(self, batch: Batch, start: RoundStart, assignment: Assignment) -> Batch:
        """The micro-batches the stage reads (``batch``: the device's data in the
        epoch's order)."""
        return batch

    def after_backward(self, work: StageWork, assignment: Assignment,
                       routes: Mapping[int, Route]) -> Callable[[], None] | None:
        """What runs after each backward (None: nothing)."""
        return None

    def reducer(self, work: StageWork, assignment: Assignment, group: Mapping[str, PeerRoute]
                ) -> Callable[[int, int, int], Awaitable[None]] | None:
        """What a REDUCE action runs (epoch, iteration, version), with the other members
        of the stage's data-parallel group (``group``); None: no REDUCE."""
        return None

    async def after_iteration(self, work: StageWork, assignment: Assignment,
                              iteration: int) -> None:
        """After iteration ``iteration`` of the round, every gradient of it in."""

    def watch(self, assignment: Assignment) -> Awaitable[None] | None:
        """A watcher that runs beside the round's iterations (cancelled at its end)."""
        return None

    def upload_state(self, work: StageWork, round_no: int) -> dict[str, torch.Tensor]:
        """The trained stage as it leaves the device (compute thread): by default a
        copy of its state."""
        return work.trained_state()

    def close(self) -> None:
        """The device stops: release what the half holds."""
