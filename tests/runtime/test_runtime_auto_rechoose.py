"""Mode auto's second look ([Note: re-choosing the system] in
aiopipe.runtime.systems.star.rechoose), in virtual time: with a planning profile that
believes the server ten times faster than it runs, auto first picks pipar, tries fl and
sfl for a round each and runs on with fl; a trial that measures slower goes back to the
first choice and its plans; ``rechoose = false`` keeps the first choice; a first choice
far ahead of every other candidate is kept without a trial; systems measured within
the close margin of each other run one more round each before the choice. And the
measured epoch of a round leaves out warm-up but not the schedule's waits."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import pytest

import aiopipe.runtime.systems.star.coordinator as star_coordinator
from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.metrics.results import RunResult
from aiopipe.metrics.trace import Slice
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.plan import DevicePlan
from aiopipe.runtime.systems.star.rechoose import (
    Measured,
    close_calls,
    fastest_measured,
    pooled,
    steady_epoch,
)
from aiopipe.scheduler import CostTable
from aiopipe.testing import joined, open_fleet

COSTS = dataclasses.replace(
    CostTable.uniform(5, forward=0.002, backward=0.004, step=0.001, batch=1),
    aggregate=(0.003, 0.002),
)
#: eight server halves on one server: fl trains in parallel and is fastest
FLEET = RunConfig(devices=8, samples_per_device=48, batch_size=12, epochs=3,
                  test_samples=100, device_slowdown=1.0, network="wifi", seed=1)


@pytest.fixture
def server_believed_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planning profile's server table at a tenth of what the server is charged
    (the devices keep their own, true, table: ``server_cost_table``)."""
    real = star_coordinator.model_profile

    def fast(*args: Any, **kwargs: Any) -> Any:
        profile = real(*args, **kwargs)
        return dataclasses.replace(profile, costs=profile.costs.scaled(0.1))

    monkeypatch.setattr(star_coordinator, "model_profile", fast)


async def _run(config: RunConfig) -> RunResult:
    return await simulate(config, clock=VirtualClock(), cost_table=COSTS,
                          server_cost_table=COSTS)


def _modes(result: RunResult) -> list[str]:
    """Each epoch's system, from its plans (fl: the whole model on every device)."""
    return ["fl" if {p["split_point"] for p in epoch.plan or ()} == {5} else "split"
            for epoch in result.epochs]


@pytest.mark.slow
@pytest.mark.usefixtures("server_believed_fast")
async def test_a_misled_first_choice_is_corrected_by_trial_rounds(
        caplog: pytest.LogCaptureFixture) -> None:
    """Misled, auto runs pipar first; from round 1's speeds fl and sfl are both
    predicted within the margin of pipar's measured epoch, so each is tried for a
    round, and fl, measured fastest, runs on."""
    fleet = FLEET.replace(epochs=4)
    with caplog.at_level(logging.INFO, logger="aiopipe.server"):
        auto = await _run(fleet.replace(mode="auto"))
    fl = await _run(fleet.replace(mode="fl"))
    first = next(r.getMessage() for r in caplog.records if "auto chose " in r.getMessage())
    assert first.startswith("auto chose pipar")  # misled
    changes = [change for epoch in auto.epochs for change in epoch.changes]
    assert [(c["mode"], c["round"]) for c in changes] == [("fl", 1), ("sfl", 2), ("fl", 3)]
    # before: the running system's epoch as its round measured it; a trial's after: its
    # prediction from round 1's speeds; both the runs' own in virtual time
    assert changes[0]["estimated_epoch_before_s"] == pytest.approx(auto.epochs[0].time_s,
                                                                   rel=1e-3)
    assert changes[0]["estimated_epoch_after_s"] == pytest.approx(fl.epochs[1].time_s,
                                                                  rel=0.02)
    # sfl's trial ran the plan predicted from round 1's speeds (the forced sfl run is
    # planned from the misleading profile), and measured what it was predicted to
    assert changes[2]["estimated_epoch_before_s"] == pytest.approx(
        changes[1]["estimated_epoch_after_s"], rel=0.02)
    assert auto.epochs[2].time_s == pytest.approx(changes[1]["estimated_epoch_after_s"],
                                                  rel=0.02)
    assert auto.epochs[1].time_s == pytest.approx(fl.epochs[1].time_s, rel=1e-3)
    assert auto.epochs[3].time_s == pytest.approx(fl.epochs[3].time_s, rel=1e-3)
    assert _modes(auto)[3] == "fl"
    assert any(r.getMessage().startswith("auto goes back to fl after trying pipar, sfl")
               for r in caplog.records)
    assert math.isfinite(auto.final.loss)


@pytest.mark.slow
@pytest.mark.usefixtures("server_believed_fast")
async def test_a_resumed_run_goes_on_with_the_system_it_settled_on(tmp_path: Path) -> None:
    """Misled into pipar, auto settles on fl after its trials; a run resumed from the
    last checkpoint trains fl with the same plans, and looks no second time."""
    config = FLEET.replace(mode="auto", epochs=4)
    async with open_fleet(config, cost_table=COSTS, checkpoint_dir=tmp_path) as fleet:
        settled = await fleet.train()
    assert _modes(settled)[-1] == "fl"
    resumed = await joined(Coordinator(config, clock=VirtualClock(), cost_table=COSTS,
                                       checkpoint_dir=tmp_path, resume=True))
    star = resumed.system
    assert isinstance(star, star_coordinator.Star)
    assert star.config.mode == "fl"
    assert star.second_look is None
    assert star.plan_entries() == list(settled.epochs[-1].plan or ())


@pytest.mark.slow
async def test_trials_that_run_slower_go_back(caplog: pytest.LogCaptureFixture) -> None:
    """Four devices at 2x over wifi: pipar is fastest, and sfl and fl are predicted
    within twice its epoch, so each is tried for a round, measures slower, and pipar
    runs on with its plans."""
    fleet = FLEET.replace(devices=4, device_slowdown=2.0, epochs=4)
    with caplog.at_level(logging.INFO, logger="aiopipe.server"):
        auto = await _run(fleet.replace(mode="auto"))
    pipar = await _run(fleet.replace(mode="pipar", split_point="auto", parallel_batches="auto"))
    changes = [change for epoch in auto.epochs for change in epoch.changes]
    assert [c["mode"] for c in changes] == ["sfl", "fl", "pipar"]
    assert changes[-1]["plans"] == [[p["split_point"], p["parallel_batches"]]
                                    for p in pipar.epochs[0].plan or ()]
    assert min(e.time_s for e in auto.epochs[1:3]) > auto.epochs[0].time_s  # the trials
    assert auto.epochs[3].time_s == pytest.approx(pipar.epochs[3].time_s, rel=1e-3)
    assert not auto.epochs[3].changes
    assert any(r.getMessage().startswith("auto goes back to pipar after trying sfl, fl")
               for r in caplog.records)


@pytest.mark.slow
@pytest.mark.usefixtures("server_believed_fast")
async def test_rechoose_false_keeps_the_first_choice() -> None:
    kept = await _run(FLEET.replace(mode="auto", options={"rechoose": False}))
    assert _modes(kept) == ["split"] * 3
    assert all(not epoch.changes for epoch in kept.epochs)


@pytest.mark.slow
async def test_a_first_choice_far_ahead_is_kept_without_a_trial(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two devices at 8x over 4g: pipar's epoch is under half sfl's and fl's."""
    fleet = FLEET.replace(devices=2, device_slowdown=8.0, network="4g")
    with caplog.at_level(logging.INFO, logger="aiopipe.server"):
        result = await _run(fleet.replace(mode="auto"))
    assert _modes(result) == ["split"] * 3
    assert all(not epoch.changes for epoch in result.epochs)
    assert any(r.getMessage().startswith("auto keeps pipar after the first round")
               for r in caplog.records)


@pytest.mark.slow
async def test_a_close_call_runs_each_close_system_once_more(
        caplog: pytest.LogCaptureFixture) -> None:
    """Four devices over wifi: pipar measures 2.04 s, fl 2.22 s (within 20%) and sfl
    2.48 s. pipar and fl run one more round each (pipar first: the faster, since sfl,
    which ran last, is not close), sfl does not, and pipar runs on with its plans."""
    fleet = FLEET.replace(devices=4, epochs=7)
    with caplog.at_level(logging.INFO, logger="aiopipe.server"):
        auto = await _run(fleet.replace(mode="auto"))
    pipar = await _run(fleet.replace(mode="pipar", split_point="auto", parallel_batches="auto"))
    changes = [change for epoch in auto.epochs for change in epoch.changes]
    assert [(c["mode"], c["round"]) for c in changes] == [
        ("fl", 1), ("sfl", 2), ("pipar", 3), ("fl", 4), ("pipar", 5)]
    again = [r.getMessage() for r in caplog.records
             if "one more round" in r.getMessage()]
    assert [m.split(" one more")[0] for m in again] == ["auto runs pipar", "auto runs fl"]
    # the repeated rounds measure what the trials did (virtual time is exact)
    assert auto.epochs[3].time_s == pytest.approx(auto.epochs[0].time_s, rel=1e-3)
    assert auto.epochs[4].time_s == pytest.approx(auto.epochs[1].time_s, rel=1e-3)
    assert changes[-1]["plans"] == [[p["split_point"], p["parallel_batches"]]
                                    for p in pipar.epochs[0].plan or ()]
    assert [e.time_s for e in auto.epochs[5:]] == pytest.approx(
        [e.time_s for e in pipar.epochs[5:]], rel=1e-3)
    assert any(r.getMessage().startswith("auto goes back to pipar after trying fl, sfl")
               for r in caplog.records)


def test_close_calls_pool_each_systems_rounds() -> None:
    pipar, fl = Measured("pipar", ((4, 4),), 2.0), Measured("fl", ((5, 1),), 2.15)
    sfl = Measured("sfl", ((3, 1),), 2.5)
    # pipar and fl within 20%: both again, the one that ran last (fl) first
    assert close_calls([pipar, fl], running="fl") == (fl, pipar)
    assert close_calls([pipar, fl, sfl], running="sfl") == (pipar, fl)
    assert close_calls([pipar, sfl], running="sfl") == ()  # 25% apart: no doubt
    # pooled: the mean of a system's rounds, its first plans
    second = dataclasses.replace(pipar, plans=((3, 4),), epoch_s=2.4)
    assert pooled([pipar, fl, second]) == [Measured("pipar", ((4, 4),), 2.2), fl]
    assert fastest_measured([pipar, fl, second, fl]) == fl
    assert fastest_measured([pipar, fl, pipar, fl]) == pipar


def _slice(track: str, name: str, start: float, end: float, iteration: int) -> Slice:
    return Slice(track, name, start, end, 0, iteration)


def test_a_rounds_epoch_leaves_out_warm_up_but_keeps_waits() -> None:
    """Device 0: three iterations of f (1 s), a wait, b (1 s), step (0.5 s); its first
    forward took 3 s (warm-up: 2 s beyond the median), and its first iteration waited
    1 s more for the server (a wait: kept). A round of 14.5 s on the coordinator's
    clock; three iterations a round, six an epoch."""
    plan = DevicePlan(0, 2, 1, 10, iterations_per_epoch=6)
    track = "device0/compute"
    slices = [_slice("server/compute", "m", 0.0, 0.5, -1),
              _slice(track, "f", 0.5, 3.5, 0), _slice(track, "b", 5.5, 6.5, 0),
              _slice(track, "step", 6.5, 7.0, 0),
              _slice(track, "f", 7.0, 8.0, 1), _slice(track, "b", 9.0, 10.0, 1),
              _slice(track, "step", 10.0, 10.5, 1),
              _slice(track, "f", 10.5, 11.5, 2), _slice(track, "b", 12.5, 13.5, 2),
              _slice(track, "step", 13.5, 14.0, 2)]
    assert steady_epoch(14.5, slices, [plan]) == pytest.approx((14.5 - 2.0) * 6 / 3)
    assert steady_epoch(14.5, [], [plan]) is None
    # a device that claims a first forward of 100 s moves the figure by half the span
    claims = [_slice(track, "f", 0.5, 100.5, 0), *slices[2:]]
    assert steady_epoch(14.5, claims, [plan]) == pytest.approx(14.5 / 2 * 6 / 3)


def test_the_fastest_measured_runs_on_a_simpler_one_on_a_near_tie() -> None:
    pipar, sfl = Measured("pipar", ((2, 5),), 3.0), Measured("sfl", ((2, 1),), 3.05)
    fl = Measured("fl", ((5, 1),), 3.5)
    assert fastest_measured([pipar, sfl, fl]) == sfl  # simpler, within the tie margin
    assert fastest_measured([dataclasses.replace(sfl, epoch_s=3.1), pipar, fl]) == pipar
    assert fastest_measured([fl]) == fl


def test_rechoose_is_checked() -> None:
    with pytest.raises(ConfigError, match="rechoose"):
        RunConfig(mode="auto", options={"rechoose": "yes"})
