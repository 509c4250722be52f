"""Secure aggregation (SecAgg+) in fl, sfl and pipar ([Note: secure FedAvg] in
aiopipe.runtime.systems.star.secure), in virtual time over memory links: the global
model equals plain FedAvg's within the fixed-point bound, the coordinator never holds a
device's unmasked upload, two devices lost mid-protocol are recovered, too many lost
fail the run with a clear error, and the runs that cannot use it are refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from fleet import COSTS

pytest.importorskip("cryptography")

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError, SecureAggregationError
from aiopipe.runtime.systems.star import secure, secure_device
from aiopipe.runtime.systems.star.device import StarDevice
from aiopipe.secagg import FixedPoint
from aiopipe.secagg import server as secagg_server
from aiopipe.testing import open_fleet

CONFIG = RunConfig(mode="fl", model="vgg5", devices=4, samples_per_device=40,
                   batch_size=10, epochs=1, test_samples=0, network="lan")
SECURE = {"secure_aggregation": True}


def _bound(config: RunConfig, survivors: int) -> float:
    """The stated bound on an entry of the average: e / W, e = n / (2 scale) for the
    round's n devices, W the survivors' summed weight (each 1 here: equal samples)."""
    n = config.round_size(config.devices)
    return FixedPoint.for_sum(config.options.secure_aggregation_clip, n).error_bound / survivors


def _assert_within(secure_model: torch.nn.Module, plain_model: torch.nn.Module,
                   bound: float) -> None:
    """Every entry within ``bound`` of plain FedAvg's, plus one float32 rounding step."""
    plain = plain_model.state_dict()
    for key, value in secure_model.state_dict().items():
        want = plain[key].double()
        slack = bound + want.abs() * 2.0**-23
        assert ((value.double() - want).abs() <= slack).all(), key


@pytest.mark.parametrize(("mode", "extra"), [
    ("fl", {}),
    ("sfl", {"split_point": 3}),
    ("pipar", {"split_point": 2, "parallel_batches": 2}),
    # devices cut at different units: the vector spans units 1..3, a device fills its
    # own and leaves zeros where its replica (added in the clear) holds the rest
    ("pipar", {"split_point": (1, 2, 3, 2), "parallel_batches": 2}),
    # 3 of 5 devices a round: n = 3 in the encoding
    ("fl", {"devices": 5, "devices_per_round": 3}),
])
async def test_the_aggregate_equals_plain_fedavg_within_the_bound(
        mode: str, extra: dict[str, Any]) -> None:
    config = CONFIG.replace(mode=mode, **extra)
    plain = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    secured = config.replace(options=SECURE)
    got = await simulate(secured, clock=VirtualClock(), cost_table=COSTS)
    n = secured.round_size(secured.devices)
    assert [e.device_samples for e in got.epochs] == [e.device_samples for e in plain.epochs]
    _assert_within(got.model, plain.model, _bound(secured, n))
    assert not all(torch.equal(v, plain.model.state_dict()[k])  # it did go through fixed point
                   for k, v in got.model.state_dict().items())


async def test_a_server_optimizer_steps_on_the_secure_average() -> None:
    config = CONFIG.replace(options={"aggregation": "fedavgm"})
    plain = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    secured = config.replace(options={**SECURE, "aggregation": "fedavgm"})
    got = await simulate(secured, clock=VirtualClock(), cost_table=COSTS)
    _assert_within(got.model, plain.model, _bound(secured, 4))


async def test_the_coordinator_never_holds_an_unmasked_upload(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What each device encodes (its weighted half) is recorded on the device side;
    every vector that reaches the coordinator's SecAgg server differs from it in all
    but a chance few coordinates, and no round result carries weights. With the masks
    skipped (the device sending its encoded vector) the first check would fail."""
    encoded: dict[int, np.ndarray] = {}
    received: dict[int, np.ndarray] = {}
    results: list[dict[str, Any]] = []
    keep, take, aggregate = (secure_device.SecureUpload.keep,
                             secagg_server.Server.take_masked, secure.aggregate_securely)

    def keep_and_record(self: secure_device.SecureUpload, state: Any) -> None:
        keep(self, state)
        assert self._vector is not None
        encoded[self.node.device_id] = self._vector.copy()

    def take_and_record(self: secagg_server.Server, sender: int, masked: np.ndarray,
                        blamed: frozenset[int] = frozenset()) -> None:
        take(self, sender, masked, blamed)
        received[sender] = np.array(masked, copy=True)

    async def aggregate_and_record(host: Any, rounds: Any, round_: Any, done: Any,
                                   epoch: int) -> Any:
        results.extend(dict(res.tensors) for res in done.values())
        return await aggregate(host, rounds, round_, done, epoch)

    monkeypatch.setattr(secure_device.SecureUpload, "keep", keep_and_record)
    monkeypatch.setattr(secagg_server.Server, "take_masked", take_and_record)
    monkeypatch.setattr(secure, "aggregate_securely", aggregate_and_record)
    await simulate(CONFIG.replace(options=SECURE), clock=VirtualClock(), cost_table=COSTS)
    assert sorted(received) == sorted(encoded) == [0, 1, 2, 3]
    for k, vector in received.items():
        assert vector.shape == encoded[k].shape
        assert np.count_nonzero(vector == encoded[k]) < 10  # ~length / 2^32 by chance
    assert results == [{}] * 4


async def test_a_device_lost_mid_protocol_and_the_round_completes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Device 0 is killed once its shares went round (step 2, masked inputs): its
    pairwise masks are rebuilt from the survivors' shares and the round's model is the
    average of devices 1, 2 and 3 (what they trained, recorded in a plain run of the
    same round) within the bound. (One of four: the threshold is 3, more than half.)"""
    config = CONFIG.replace(network="4g", reconnect_grace=2.0, device_timeout=10.0)
    trained: dict[int, dict[str, torch.Tensor]] = {}
    upload = StarDevice.upload_state

    def recorded(self: StarDevice, work: Any, round_no: int) -> dict[str, torch.Tensor]:
        state = upload(self, work, round_no)
        trained[self.node.device_id] = {k: v.clone() for k, v in state.items()}
        return state

    with monkeypatch.context() as patched:
        patched.setattr(StarDevice, "upload_state", recorded)
        await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    async with open_fleet(config.replace(options=SECURE), cost_table=COSTS) as fleet:
        training = fleet.train()
        system: Any = fleet.node.system

        def at_masking() -> bool:
            round_ = system.secure
            return (round_ is not None and round_.server is not None
                    and round_.server.step == 2)

        await fleet.until(at_masking)
        fleet.kill(0)
        result = await training
    server = system.secure.server
    assert server.survivors == [1, 2, 3]
    assert server.step == 4  # the sum was given
    assert result.epochs[0].device_samples == (0, 40, 40, 40)
    bound = FixedPoint.for_sum(100.0, 4).error_bound / 3  # n = 4 encoded, W = 3 summed
    for key, value in result.model.state_dict().items():
        want = sum(trained[k][key].double() for k in (1, 2, 3)) / 3
        assert ((value.double() - want).abs() <= bound + want.abs() * 2.0**-23).all(), key


async def test_too_few_devices_left_fail_the_run_clearly() -> None:
    """Two of four lost at step 2: two masked inputs, below the threshold of 3: the
    round, and so the run, fails with a `SecureAggregationError` saying so."""
    config = CONFIG.replace(network="4g", reconnect_grace=2.0, device_timeout=10.0,
                            options=SECURE)
    async with open_fleet(config, cost_table=COSTS) as fleet:
        system: Any = fleet.node.system

        async def kill() -> None:
            await fleet.until(lambda: system.secure is not None
                              and system.secure.server is not None
                              and system.secure.server.step == 2)
            for k in (0, 1):
                fleet.kill(k)

        fleet.tasks.create_task(kill())
        with pytest.raises(SecureAggregationError,
                           match="2 clients sent a masked input, the threshold is 3"):
            await fleet.node.train()


@pytest.mark.parametrize(("changes", "reason"), [
    ({"mode": "sl"}, "sl aggregates nothing"),
    ({"options": {"aggregation": "fedmedian"}}, 'aggregation "fedmedian" needs each device'),
    ({"devices": 4, "options": {"aggregation": "trimmed-mean", "trim_fraction": 0.25}},
     "needs each device's update"),
    ({"devices": 5, "options": {"aggregation": "krum"}}, "needs each device's update"),
    ({"options": {"outliers": "drop"}}, 'outliers "drop" needs each device'),
    ({"devices": 1}, "it needs 2 devices a round"),
    ({"mode": "hadfl"}, "its default in mode hadfl"),
    ({"mode": "fedbuff"}, "its default in mode fedbuff"),
    ({"mode": "pipeline", "devices": 2}, "its default in mode pipeline"),
    ({"mode": "ftpipehd", "devices": 2}, "its default in mode ftpipehd"),
    ({"mode": "asteroid", "devices": 2}, "its default in mode asteroid"),
])
def test_runs_that_cannot_use_it_are_refused_with_the_reason(
        changes: dict[str, Any], reason: str) -> None:
    options = {**changes.pop("options", {}), **SECURE}
    with pytest.raises(ConfigError, match="secure_aggregation") as raised:
        RunConfig(**{"mode": "fl", **changes}, options=options)
    assert reason in str(raised.value)


def test_it_is_off_by_default_and_its_clip_is_checked() -> None:
    assert CONFIG.options.secure_aggregation is False
    with pytest.raises(ConfigError, match="secure_aggregation_clip"):
        CONFIG.replace(options={"secure_aggregation_clip": 0})
