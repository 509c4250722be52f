"""The device half of a synchronous pipeline: the stage the round assigns, its state
uploaded with its momentum (the coordinator holds both, so that a round played again
after a fault starts from them), and a round's error waits for the coordinator's
recovery."""

from __future__ import annotations

from typing import ClassVar

import torch

from aiopipe.runtime.arrivals import ArrivalRules
from aiopipe.runtime.device_half import DeviceHalf
from aiopipe.runtime.momentum import backs_up_momentum, stage_snapshot
from aiopipe.runtime.stage import StageWork

__all__ = ["PipelineDevice"]


class PipelineDevice(DeviceHalf):
    """A synchronous pipeline's device (module docstring)."""

    #: a round played again takes versions above every earlier attempt's
    arrivals: ClassVar[ArrivalRules] = ArrivalRules(replayed=True)
    recovers_rounds: ClassVar[bool] = True

    def upload_state(self, work: StageWork, round_no: int) -> dict[str, torch.Tensor]:
        """The trained stage with its momentum (module docstring)."""
        return stage_snapshot(work, momentum=backs_up_momentum(self.node.config))
