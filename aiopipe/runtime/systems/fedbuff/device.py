"""The device half of FedBuff: fl's round (the whole model, Q mini-batches from the
model it was sent), reading its data round and round: a device's rounds in an epoch
continue where its last one stopped, and go round its data again when it outpaces the
fleet (`StageRules.wraps_epoch`)."""

from __future__ import annotations

import torch

from aiopipe.models import frozen_parameters
from aiopipe.runtime.device_half import DeviceHalf, StageRules
from aiopipe.runtime.stage import StageWork

__all__ = ["FedBuffDevice"]


class FedBuffDevice(DeviceHalf):
    """A FedBuff device (module docstring)."""

    @property
    def stage_rules(self) -> StageRules:
        """Past the end of its data, a round goes round it again."""
        return StageRules(wraps_epoch=True)

    def upload_state(self, work: StageWork, round_no: int) -> dict[str, torch.Tensor]:
        """The trained model without its frozen parameters ([Note: frozen bases]: they
        never change, and never travel)."""
        frozen = frozen_parameters(work.module)
        return {key: v for key, v in work.trained_state().items() if key not in frozen}
