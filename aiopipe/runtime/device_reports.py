"""What a device sends the coordinator at a round's end: the round's result (its
trained weights), then, once that is sent, its report (the round's trace, peak memory,
bytes sent to peers). Both are kept until the next `RoundStart` acknowledges them, to
be re-sent after a reconnection."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from aiopipe.light_event import LightEvent
from aiopipe.metrics.trace import MAX_REPORT_SLICES, Recorder
from aiopipe.protocol import RoundReport, RoundResult
from aiopipe.runtime.compute import Compute
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.stage import StageWork

__all__ = ["DeviceSummary", "RoundReports"]

log = logging.getLogger("aiopipe.device")


@dataclass(frozen=True, slots=True)
class DeviceSummary:
    """What a device did in a run."""

    device_id: int
    rounds: int
    samples: int
    reason: str


class RoundReports:
    """Device ``device_id``'s round results and reports, posted on ``peer`` (the link to
    the coordinator). ``clock_offset``: the server clock minus ours, to shift the trace
    by; ``peer_bytes``: bytes this device has sent to peers so far."""

    def __init__(self, device_id: int, peer: Peer, recorder: Recorder, compute: Compute, *,
                 clock_offset: Callable[[], float], peer_bytes: Callable[[], int]) -> None:
        self.device_id = device_id
        self.peer, self.recorder, self.compute = peer, recorder, compute
        self.clock_offset, self.peer_bytes = clock_offset, peer_bytes
        self.unacked: list[RoundResult | RoundReport] = []  # until the next RoundStart
        self.epoch = 0  # of the round being reported
        self._sent = LightEvent()
        self._peer_bytes_reported = 0  # bytes sent to peers, as the last report said

    async def report(self, result: RoundResult, mark: int, work: StageWork) -> None:
        """Send the round's result, then, once it is sent, its report: the trace
        slices from ``mark`` on (so that it includes the result's upload)."""
        self.unacked = [result]
        self._sent.clear()
        self.post(result)
        await self._sent.wait()
        slices = self.recorder.take(mark)
        if len(slices) > MAX_REPORT_SLICES:
            log.warning("device %d: round %d made %d trace slices; reporting the first %d",
                        self.device_id, result.round + 1, len(slices), MAX_REPORT_SLICES)
        offset, sent = self.clock_offset(), self.peer_bytes()
        report = RoundReport(result.round, {
            "slices": [s.shifted(offset).to_list() for s in slices[:MAX_REPORT_SLICES]],
            "peak_live": work.peak_live,
            "peak_memory_bytes": await self.compute.call(work.peak_memory),
            "peer_bytes": sent - self._peer_bytes_reported,
        })
        self._peer_bytes_reported = sent
        self.unacked.append(report)
        self.post(report)

    def post(self, message: RoundResult | RoundReport) -> None:
        """Post a result (noting when it is sent) or a report."""
        if isinstance(message, RoundResult):
            sent = self.peer.post(message, "m", epoch=self.epoch)
            sent.add_done_callback(lambda _: self._sent.set())
        else:
            self.peer.post(message, "report", epoch=self.epoch)

    def accepted(self, round_no: int) -> None:
        """The coordinator holds round ``round_no``'s result and report (`RoundAccepted`):
        they need not be kept for re-sending."""
        if self.unacked and self.unacked[0].round == round_no:
            self.unacked = []

    def resend(self) -> None:
        """Post again, in order, what the coordinator has not acknowledged."""
        for message in self.unacked:
            self.post(message)
