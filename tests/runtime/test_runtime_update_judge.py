"""One device's round result cannot take a star run down with default options (issue 41,
[Note: judging updates] in aiopipe/runtime/aggregation.py): a device that uploads its
trained model x1e6 (finite) or NaN is refused every round; the run completes, the device
is named in the log and in the epoch's metrics, and the global model, every honest
device's model in these modes, ends within 2 points of a run in which the same device
was lost before its first round finished (the reference: killed as its round 0
started, never restarted).

Before the judge, x1e6 made every device's loss non-finite in fl and pipar: they failed,
and the server gave up with "every device was lost".
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import pytest
import torch
from fleet import vgg5_shaped

from aiopipe import RunConfig
from aiopipe.metrics.results import RunResult
from aiopipe.protocol import RoundResult
from aiopipe.runtime.systems.star import coordinator as star_module
from aiopipe.runtime.systems.star.device import StarDevice
from aiopipe.testing import open_fleet

BAD = 3
# vgg5's stand-in (its frames, a tenth of its compute): what is judged is the uploaded
# model, whatever it is, and it learns as vgg5 does here (0.42 test accuracy in 3 epochs)
CONFIG = RunConfig(model=vgg5_shaped, devices=4, samples_per_device=200, batch_size=20,
                   epochs=3, split_point=2, parallel_batches=1, test_samples=1000,
                   learning_rate=0.05)

Poison = Callable[..., None]


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch) -> Poison:
    """``poison(factor, rounds=None)``: device BAD multiplies the trained model it uploads
    by ``factor`` (in the rounds numbered in ``rounds``; every round by default)."""

    def install(factor: float, rounds: set[int] | None = None) -> None:
        honest = StarDevice.upload_state

        def upload(self: Any, work: Any, round_no: int) -> dict[str, torch.Tensor]:
            state = honest(self, work, round_no)
            if self.node.device_id != BAD or (rounds is not None and round_no not in rounds):
                return state
            return {name: t * factor if t.is_floating_point() else t
                    for name, t in state.items()}

        monkeypatch.setattr(StarDevice, "upload_state", upload)

    return install


async def _run(config: RunConfig) -> tuple[RunResult, dict[str, Any]]:
    """The run's result, and what ``GET /status`` says at its end."""
    async with open_fleet(config) as fleet:
        result = await fleet.train()
        return result, fleet.node.describe()


async def _without_bad(config: RunConfig) -> RunResult:
    """The reference: device BAD lost as its first round starts, never back."""
    async with open_fleet(config) as fleet:
        training = fleet.train()
        await fleet.until(lambda: (s := fleet.node.sessions.get(BAD)) is not None
                          and s.window is not None)
        fleet.kill(BAD)
        return await training


def _named(result: RunResult) -> set[int]:
    return {k for e in result.epochs for k in (*e.updates_refused, *e.devices_lost)}


Reference = Callable[[str], Awaitable[RunResult]]


@pytest.fixture(scope="module")
def references() -> dict[str, RunResult]:
    return {}


@pytest.fixture
def reference(references: dict[str, RunResult]) -> Reference:
    """``await reference(mode)``: `_without_bad` in ``mode``, run once per module (before
    any poison is installed: the test awaits it first)."""

    async def get(mode: str) -> RunResult:
        if mode not in references:
            result = await _without_bad(CONFIG.replace(mode=mode))
            assert _named(result) == {BAD}
            references[mode] = result
        return references[mode]

    return get


# NaN in pipar only: in fl it would repeat the same path, a round result holding NaN is
# refused on arrival by the same check in either mode (`check_tensors` in the session's
# `_accept_result`, before any aggregation) and the device is lost. x1e6 passes that
# check and is judged with the round's other updates (`UpdateJudge`), over whole models
# that fl and pipar assemble differently (pipar: the device's half and its replica on the
# server): both modes
@pytest.mark.slow
@pytest.mark.parametrize(("mode", "factor"),
                         [("fl", 1e6), ("pipar", 1e6), ("pipar", float("nan"))])
async def test_a_poisoned_round_result_is_refused_and_its_device_named(
        poison: Poison, caplog: pytest.LogCaptureFixture, reference: Reference, mode: str,
        factor: float) -> None:
    config = CONFIG.replace(mode=mode)
    without_bad = await reference(mode)
    poison(factor)
    with caplog.at_level(logging.WARNING, logger="aiopipe"):
        attacked, status = await _run(config)
    assert len(attacked.epochs) == config.epochs
    assert _named(attacked) == {BAD}
    if factor == 1e6:  # (NaN: refused on arrival, a protocol error: the device is lost)
        assert all(e.updates_refused == (BAD,) for e in attacked.epochs)
        assert f"device {BAD}'s update is refused" in caplog.text
        assert status["updates_refused"] == [BAD]
        assert all(e["updates_refused"] == [BAD] for e in status["finished_epochs"])
    assert f"device {BAD}" in caplog.text
    assert abs(attacked.final.accuracy - without_bad.final.accuracy) <= 0.02, (
        attacked.final, without_bad.final)


@pytest.mark.slow  # (about 2 s)
async def test_sl_refuses_a_turn_that_would_poison_the_next_device(poison: Poison) -> None:
    poison(1e6)
    result, _ = await _run(CONFIG.replace(mode="sl"))
    assert [e.updates_refused for e in result.epochs] == [(BAD,)] * CONFIG.epochs
    assert result.final.accuracy > 0.3


async def test_a_refused_device_is_judged_afresh_each_round(poison: Poison) -> None:
    """Refused in its first round only, device BAD's later honest updates are taken: a
    refusal does not exclude a device for the rest of the run (docs/design.md)."""
    poison(1e6, rounds={0})
    # what is judged is each round's updates, not what the model learns: a small run
    result, _ = await _run(CONFIG.replace(mode="fl", samples_per_device=40, test_samples=100))
    assert [e.updates_refused for e in result.epochs] == [(BAD,), (), ()]
    assert all(e.device_samples[BAD] > 0 for e in result.epochs)
    assert not any(e.devices_lost for e in result.epochs)


async def test_a_trimmed_mean_that_trims_nothing_in_a_round_says_so(
        poison: Poison, caplog: pytest.LogCaptureFixture) -> None:
    """Five devices trim one at each end (the config refuses four); with one refused, a
    round of four trims nothing, and the log says so once."""
    poison(1e6)
    config = CONFIG.replace(mode="fl", devices=5, samples_per_device=40, epochs=2, test_samples=100,
                            options={"aggregation": "trimmed-mean"})
    with caplog.at_level(logging.WARNING, logger="aiopipe"):
        result, _ = await _run(config)
    assert [e.updates_refused for e in result.epochs] == [(BAD,), (BAD,)]
    assert caplog.text.count("a round of 4 updates: the trimmed mean trims nothing "
                             "(floor(0.2 x 4) = 0; it needs 5)") == 1


@pytest.mark.slow
async def test_an_update_under_the_norm_limit_that_wrecks_the_loss_is_refused(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        reference: Reference) -> None:
    """Device BAD's update boosted 900 times (its model start + 900 x (trained - start),
    set where the coordinator reads it: in fl, what the device sent): under the norm
    limit of 1000 x the median, but FedAvg's loss went to 1e6 and the next round every
    device's to NaN. The aggregate's loss on the coordinator's batch refuses it."""
    config = CONFIG.replace(mode="fl")
    without_bad = await reference("fl")
    honest = star_module.Star._whole_state

    def boosted(self: Any, k: int, result: RoundResult,
                start: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = honest(self, k, result, start)
        if k != BAD:
            return state
        return {key: start[key] + (v - start[key]) * 900 if v.is_floating_point() else v
                for key, v in state.items()}

    monkeypatch.setattr(star_module.Star, "_whole_state", boosted)
    with caplog.at_level(logging.WARNING, logger="aiopipe"):
        attacked, _ = await _run(config)
    assert [e.updates_refused for e in attacked.epochs] == [(BAD,)] * config.epochs
    assert "its loss on the coordinator's evaluation batch" in caplog.text
    assert abs(attacked.final.accuracy - without_bad.final.accuracy) <= 0.02, (
        attacked.final, without_bad.final)


async def test_the_first_rounds_start_is_probed_before_its_round_then_only_aggregates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: judging updates]: the run's first starting model is probed on the
    coordinator's evaluation batch while the fleet is planned, not in round 1's
    aggregation; each round then probes its aggregate alone (the installed one is the
    next round's start)."""
    events: list[str] = []
    make_probe = star_module.evaluation_probe

    def counted(*args: Any, **kwargs: Any) -> Any:
        probe = make_probe(*args, **kwargs)

        def measured(state: Mapping[str, torch.Tensor]) -> tuple[float, float]:
            events.append("probe")
            return probe(state)

        return measured

    round_start = star_module.Star.round_start

    def started(self: Any, *args: Any) -> Any:
        events.append("round start")
        return round_start(self, *args)

    monkeypatch.setattr(star_module, "evaluation_probe", counted)
    monkeypatch.setattr(star_module.Star, "round_start", started)
    config = CONFIG.replace(mode="fl", devices=2, samples_per_device=40, epochs=2,
                            test_samples=100)
    async with open_fleet(config) as fleet:
        await fleet.train()
    assert events == ["probe", *(["round start"] * 2 + ["probe"]) * 2]
