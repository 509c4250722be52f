"""One authenticated device poisons the model (issue: hold against hostile peers): it
sends its server replica activations scaled by a huge finite factor. The coordinator's
arrival judge refuses the first of them and excludes the device ([Note: judging
arrivals]); each layer behind it holds alone too: with the arrival judge off and the
robust options on (``outliers = "drop"``) the global model's test accuracy stays within
2 points of a clean run's and the device is named; without them, the update judge that
runs whatever the options refuses the replica's x1e6 update; with that judge off too, the
model is ruined (the attack is real).

Every attacked run is compared with one clean run of the default options (a clean run's
updates are all accepted and none is an outlier, so the robust options would train it
alike), run once per module.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.metrics.results import RunResult
from aiopipe.protocol import Activation, to_tensor_data, to_torch
from aiopipe.runtime import stage_round
from aiopipe.runtime.aggregation import UpdateJudge
from aiopipe.runtime.judge import ArrivalJudge

COSTS = CostTable.uniform(5, forward=0.001, backward=0.002)
BAD = 3
# (momentum kept across rounds, as these bounds were set with: with "fresh", the attacked
# runs, three devices once the fourth is excluded, ended 2.4 points below the clean run's
# 0.393 after three epochs)
CONFIG = RunConfig(devices=4, samples_per_device=200, batch_size=20, epochs=3, split_point=2,
                   parallel_batches=1, test_samples=1000, learning_rate=0.05,
                   options={"local_optimizer": "kept"})
ROBUST = CONFIG.replace(options={"outliers": "drop", "local_optimizer": "kept"})


@pytest.fixture
def without_arrival_judge(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator takes what devices send as it comes (the layers behind it)."""
    monkeypatch.setattr(ArrivalJudge, "judge_data", lambda self, *args, **kwargs: None)


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``poison(factor)``: device BAD scales every activation it sends by ``factor``."""

    def install(factor: float) -> None:
        honest = stage_round._ServerRoute.send

        def send(self: Any, message: Any, name: str, *, ready_at: float | None) -> None:
            if self.owner.device_id == BAD and isinstance(message, Activation):
                scaled = to_tensor_data(to_torch(message.tensors[0]) * factor)
                message = dataclasses.replace(message, tensors=(scaled,))
            honest(self, message, name, ready_at=ready_at)

        monkeypatch.setattr(stage_round._ServerRoute, "send", send)

    return install


async def _run(config: RunConfig) -> RunResult:
    return await simulate(config, clock=VirtualClock(), cost_table=COSTS)


@pytest.fixture(scope="module")
def clean() -> RunResult:
    """The clean run every attacked one is compared with (judge on, nobody refused)."""
    result = asyncio.run(_run(CONFIG))
    assert not any(e.updates_refused or e.devices_lost for e in result.epochs), result.epochs
    return result


# x1e15 only: at x1e6 the update judge refuses the replica's update before the outlier
# screening sees it, whatever the options (judge, then `screen_updates`, in
# aiopipe/runtime/systems/star.py), so a robust run of x1e6 would repeat the next test's
# run exactly; x1e15 takes another path (the server's loss is not finite: the device is
# lost)
@pytest.mark.slow
async def test_the_coordinators_arrival_judge_excludes_the_poisoning_device_at_once(
        poison: Any, clean: RunResult, caplog: pytest.LogCaptureFixture) -> None:
    """Default options: the first x1e6 activation is refused, the device excluded; the
    others train on, and no update of the device's is ever aggregated."""
    poison(1e6)
    attacked = await _run(CONFIG)
    assert attacked.final.accuracy >= clean.final.accuracy - 0.02, (attacked.final, clean.final)
    assert [list(e.devices_excluded) for e in attacked.epochs] == [[BAD], [], []]
    assert not any(e.updates_refused for e in attacked.epochs)
    assert (f"device {BAD} is excluded from the run: the coordinator refused what it sent: "
            f"device{BAD} sent values out of range: activation (0, 0, 0)") in caplog.text


@pytest.mark.slow
@pytest.mark.usefixtures("without_arrival_judge")
async def test_a_poisoning_device_cannot_move_the_model_with_the_robust_options(
        poison: Any, clean: RunResult) -> None:
    poison(1e15)
    attacked = await _run(ROBUST)
    assert attacked.final.accuracy >= clean.final.accuracy - 0.02, (attacked.final, clean.final)
    named = {k for e in attacked.epochs for k in (*e.updates_refused, *e.devices_lost)}
    assert named == {BAD}


@pytest.mark.slow
@pytest.mark.usefixtures("without_arrival_judge")
async def test_without_them_the_update_judge_still_holds_x1e6(
        poison: Any, clean: RunResult) -> None:
    """Default options: the replica that trained on x1e6 activations moves ~1e12 times
    the round's median, and the update judge refuses it ([Note: judging updates])."""
    poison(1e6)
    attacked = await _run(CONFIG)
    assert attacked.final.accuracy >= clean.final.accuracy - 0.02, (attacked.final, clean.final)
    assert {k for e in attacked.epochs for k in e.updates_refused} == {BAD}


@pytest.mark.slow
@pytest.mark.usefixtures("without_arrival_judge")
async def test_without_them_or_the_judge_the_attack_ruins_the_model(
        poison: Any, monkeypatch: pytest.MonkeyPatch, clean: RunResult) -> None:
    """The attack is real: with the update judge switched off, x1e6 ruins the model."""
    monkeypatch.setattr(UpdateJudge, "refusals", lambda self, norms, start: {})
    monkeypatch.setattr(UpdateJudge, "aggregate_problem", lambda self, *args: "")
    poison(1e6)
    attacked = await _run(CONFIG)
    assert attacked.final.accuracy < clean.final.accuracy - 0.1
