"""The device half of fl, sl, sfl and PiPar: the stage the round assigns (PiPar's
device, §IV-A: the first P units, N micro-batches pipelined against the server's
stage; fl's: the whole model), its upload shared with the stage (no copy), and the
privacy options applied where the data leaves the device or, with DP-SGD, in its
training (aiopipe.runtime.dp_sgd), and with ``secure_aggregation`` its upload masked
(aiopipe.runtime.systems.star.secure_device). Between its rounds the device holds
no stage ([Note: a round's local optimizer] in aiopipe.runtime.systems.star.keeping)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from aiopipe.models import frozen_parameters
from aiopipe.protocol import Message, RoundStart, SecAggRequest
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.device_half import DeviceContext, DeviceHalf, Handler, StageRules
from aiopipe.runtime.factories import make_optimizer
from aiopipe.runtime.holdings import Holdings
from aiopipe.runtime.privacy import noisy_batch, noisy_state, round_generator
from aiopipe.runtime.stage import Batch, StageWork
from aiopipe.runtime.systems.star.keeping import keeping_rules, set_aside
from aiopipe.runtime.systems.star.options import star_options

if TYPE_CHECKING:
    from aiopipe.runtime.systems.star.secure_device import SecureUpload

__all__ = ["StarDevice"]


class StarDevice(DeviceHalf):
    """A star's device: its rounds end where they began if a device is lost (the
    coordinator leaves its update out), so a round's error is the device's."""

    def __init__(self, node: DeviceContext) -> None:
        super().__init__(node)
        self.secure: SecureUpload | None = None
        if star_options(node.config).secure_aggregation:
            # (the cryptography package is loaded only for runs that use it)
            from aiopipe.runtime.systems.star.secure_device import SecureUpload

            self.secure = SecureUpload(node)

    def handlers(self) -> Mapping[type[Message], Handler]:
        """With secure aggregation, the coordinator's `SecAggRequest`."""
        return {SecAggRequest: self.secure.answer} if self.secure is not None else {}

    async def run_round(self, start: RoundStart) -> int:
        """The stage's round (with secure aggregation: its upload kept for the
        protocol that follows)."""
        if self.secure is not None:
            self.secure.start(start)
        samples = await super().run_round(start)
        set_aside(self.node, self.stage_rules)  # [Note: a round's local optimizer]
        return samples

    @property
    def stage_rules(self) -> StageRules:
        """With DP-SGD, the device's stage is a `DpSgdWork`, told each round's number
        and batch; otherwise the default stage; either way, what the stage keeps between
        rounds ([Note: a round's local optimizer])."""
        options = star_options(self.node.config)
        return keeping_rules(_DP_SGD_RULES if options.privacy == "dp-sgd" else StageRules(),
                             options)

    def batches(self, batch: Batch, start: RoundStart, assignment: Assignment) -> Batch:
        """With PixelDP the first stage reads its inputs noised (aiopipe.runtime.privacy)."""
        config = self.node.config
        options = star_options(config)
        if options.privacy == "pixeldp" and assignment.stage == 0:
            return partial(noisy_batch, batch, options.privacy_noise,
                           round_generator(config.seed, self.node.device_id, start.round))
        return batch

    def upload_state(self, work: StageWork, round_no: int) -> dict[str, torch.Tensor]:
        """The trained stage, sharing the stage's memory on the CPU (no copy): it is kept
        until the next `RoundStart` (for re-sending), and only that round's weights,
        loaded after it, change the stage again; its frozen parameters left out (they do
        not change); with classic differential privacy, noised
        (aiopipe.runtime.privacy); with secure aggregation, nothing: the state is kept
        for the masked upload ([Note: secure FedAvg])."""
        frozen = frozen_parameters(work.module)  # [Note: frozen bases]: never sent
        state = {key: v for key, v in work.current_state().items() if key not in frozen}
        config = self.node.config
        options = star_options(config)
        if options.privacy == "classic":
            state = noisy_state(state, options.privacy_noise, round_generator(
                config.seed, self.node.device_id, round_no))
        if self.secure is not None:
            self.secure.keep(state)
            return {}
        return state


def _dp_sgd_work(module: torch.nn.Sequential, assignment: Assignment,
                 holdings: Holdings) -> StageWork:
    """The device's stage trained by DP-SGD (aiopipe.runtime.dp_sgd).

    Raises:
        ConfigError: Opacus is missing, or cannot take the units' per-sample gradients.
    """
    from aiopipe.runtime.dp_sgd import DpSgdWork  # Opacus: only for DP-SGD's runs

    config = holdings.config
    options = star_options(config)
    return DpSgdWork(
        module, make_optimizer(module, config), noise_multiplier=options.dp_noise_multiplier,
        max_grad_norm=options.dp_max_grad_norm, seed=config.seed,
        device_id=holdings.plan.device_id, first=assignment.stage == 0,
        last=assignment.last, parallel_batches=assignment.parallel_batches,
        num_classes=holdings.plan.num_classes, loss=holdings.loss, metric=holdings.metric)


def _dp_sgd_round(work: StageWork, assignment: Assignment, momentum: Mapping[str, Any],
                  kept: bool) -> None:
    """A round begins: the DP-SGD stage's noise for it and its batch B = N B'."""
    begin = getattr(work, "begin_round", None)
    if begin is not None:
        begin(assignment.round, assignment.micro_batch_size * assignment.parallel_batches)


_DP_SGD_RULES = StageRules(new_work=_dp_sgd_work, prepare=_dp_sgd_round)
