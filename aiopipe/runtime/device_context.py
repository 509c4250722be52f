"""What a system's device half may use of its device node (aiopipe.runtime.device_half)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from aiopipe.clock import Clock
from aiopipe.config import RunConfig
from aiopipe.errors import TrainingError
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import Plan, RoundResult
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.compute import Compute
from aiopipe.runtime.delivery import Delivery
from aiopipe.runtime.executor import Inbox
from aiopipe.runtime.holdings import Holdings
from aiopipe.runtime.judge import ArrivalJudge
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.peer_links import PeerLinks, PeerRoute
from aiopipe.runtime.stage import StageWork
from aiopipe.scheduler.costs import CostTable

__all__ = ["DeviceContext", "Handler"]

#: Takes one of a system's own messages: (who sent it, the message).
Handler = Callable[[str, Any], None]


class DeviceContext(Protocol):
    """What a device half may use of its node."""

    device_id: int
    name: str
    config: RunConfig
    plan: Plan
    run_id: int
    clock: Clock
    costs: CostTable | None  # charge compute from this table (virtual time)
    compute: Compute
    recorder: Recorder
    holdings: Holdings
    peer: Peer  # the link to the coordinator
    peers: PeerLinks | None  # links to peer devices, when the run has them
    inbox: Inbox
    delivery: Delivery  # the data path: activations, gradients, a group's gradients
    judge: ArrivalJudge
    #: set when the coordinator ended the run
    ended: TrainingError | None
    assignment: Assignment | None  # the round being worked on
    work: StageWork | None

    async def report(self, result: RoundResult, mark: int, work: StageWork) -> None:
        """Send a round's result, then its report: the trace from ``mark`` on."""
        ...

    async def peer_route(self, assignment: Assignment, name: str, *,
                         dial: bool) -> PeerRoute:
        """The link to peer ``name`` of ``assignment``'s round."""
        ...
