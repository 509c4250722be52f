"""Plans, re-plans and device profiles in the log read as lines per device
(aiopipe.runtime.plan_text), not as the dicts ``metrics.jsonl`` keeps: every mode's
plan, HADFL's (which used to log ``planned: []``), PiPar's re-plans and a device's
profile."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
from fleet import COSTS

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.protocol import Profile
from aiopipe.runtime.plan_text import MAX_LINES, change_lines, log_plan, plan_lines, profile_text
from aiopipe.runtime.profiling import profile_fleet
from aiopipe.runtime.systems.star import between_rounds as star_module
from aiopipe.scheduler.estimate import DeviceProfile
from aiopipe.transport import LinkSpec

CONFIG = RunConfig(devices=2, samples_per_device=40, batch_size=20, epochs=1, test_samples=0)


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "aiopipe.server"]


def test_a_star_fleet_alike_is_one_line() -> None:
    entries = [{"device": k, "split_point": 2, "parallel_batches": 4} for k in range(3)]
    assert plan_lines(entries, units=5, batch_size=48, iterations=lambda k: 41) == (
        "", ["devices 0-2: units 0-1 on the device, units 2-4 on the server (split 2), "
             "4 micro-batches of 12, 41 iterations an epoch"])


def test_what_every_line_would_repeat_goes_into_the_header(
        caplog: pytest.LogCaptureFixture) -> None:
    """Asteroid's entries: a data-parallel first stage splits each micro-batch's rows."""
    entries = [{"stage": 0, "device": 0, "units": [0, 2], "rows": [0, 8], "parallel_batches": 4,
                "schedule": "1f1b", "estimate_s": 0.25},
               {"stage": 0, "device": 1, "units": [0, 2], "rows": [8, 12],
                "parallel_batches": 4, "schedule": "1f1b"},
               {"stage": 1, "device": 2, "units": [2, 5], "rows": [0, 12],
                "parallel_batches": 4, "schedule": "1f1b"}]
    with caplog.at_level(logging.INFO):
        log_plan(logging.getLogger("aiopipe.server"), logging.INFO, "planned asteroid", entries,
                 units=5, batch_size=48, notes=["est. 0.25 s an iteration"])
    assert _messages(caplog) == [
        "planned asteroid (est. 0.25 s an iteration, 4 micro-batches of 12, 1f1b):",
        "  stage 0, device 0: units 0-1, rows 0-7 of each",
        "  stage 0, device 1: units 0-1, rows 8-11 of each",
        "  stage 1, device 2: units 2-4"]


def test_a_large_fleet_s_plan_is_cut_short() -> None:
    entries = [{"device": k, "split_point": 1 + k % 4, "parallel_batches": 1 + k}
               for k in range(40)]
    _, lines = plan_lines(entries, units=5, batch_size=48)
    assert len(lines) == MAX_LINES
    assert lines[-1] == "... and 29 more lines like these (metrics.jsonl's plan has them all)"


def test_a_re_plan_names_what_changed() -> None:
    before = [{"device": k, "split_point": 2, "parallel_batches": 4} for k in range(4)]
    after = [dict(e) for e in before]
    after[1].update(split_point=3, parallel_batches=2)
    after[3].update(split_point=3, parallel_batches=2)
    assert change_lines(before, after) == ["devices 1, 3: split 2 -> 3, 4 -> 2 micro-batches"]
    assert change_lines(before, before) == ["no change"]
    stages = [{"stage": 0, "device": 0, "units": [0, 2]}, {"stage": 1, "device": 1,
                                                          "units": [2, 5]}]
    moved = [{"stage": 0, "device": 0, "units": [0, 3]}, {"stage": 1, "device": 1,
                                                         "units": [3, 5]}]
    assert change_lines(stages, moved) == ["device 0: units 0-1 -> units 0-2",
                                           "device 1: units 2-4 -> units 3-4"]
    assert change_lines(moved[1:], [{"stage": 1, "device": 1, "units": [4, 5]}]) == [
        "device 1: units 3-4 -> unit 4"]


def test_a_profile_in_words() -> None:
    figures = {"seconds": 2.128, "train_s_per_sample": 0.0009989159684987954,
               "uplink_mbps": 1399.058, "downlink_mbps": None}
    assert profile_text(figures) == ("trains a sample through the whole model in 0.999 ms; "
                                     "uplink 1399 Mbit/s, downlink too fast to time")


class _Measured:
    """A device that measured itself: its table, 2 s of profiling, an unshaped downlink."""

    def __init__(self, costs: CostTable) -> None:
        self.costs = costs

    async def profile(self, batch_sizes: tuple[int, ...]) -> tuple[Profile, float]:
        return Profile(self.costs.to_mapping(), 2.0, 0.0), 0.5


async def test_a_device_s_profile_is_logged_in_words(caplog: pytest.LogCaptureFixture) -> None:
    sizes = (5, 10)
    costs = CostTable({u: {s: 1e-3 * s for s in sizes} for u in range(5)},
                      {u: {s: 2e-3 * s for s in sizes} for u in range(5)},
                      {u: 0.0 for u in range(5)})
    declared = [DeviceProfile(1.0, LinkSpec(None, 0.0), LinkSpec(None, 0.0), 40, None)]
    clock = VirtualClock()
    with caplog.at_level(logging.INFO, logger="aiopipe.server"):
        await profile_fleet({0: _Measured(costs)}, {0: "host"}, declared, sizes=sizes,
                            units=5, clock=clock)
    await clock.aclose()
    [line] = [m for m in _messages(caplog) if "profiled itself" in m]
    assert line == ("device 0 profiled itself in 2.0 s: trains a sample through the whole "
                    "model in 15 ms; uplink 16.8 Mbit/s, downlink too fast to time")


@pytest.mark.parametrize(("config", "want"), [
    (CONFIG, ["planned pipar: devices 0-1: units 0-1 on the device, units 2-4 on the "
              "server (split 2), 4 micro-batches of 5, 2 iterations an epoch"]),
    (CONFIG.replace(mode="fl"), ["planned fl: devices 0-1: the whole model (units 0-4), "
                                 "batches of 20, 2 iterations an epoch"]),
    (CONFIG.replace(mode="pipeline", options={"partition": [2]}), [
        "planned pipeline (4 micro-batches of 5, 1f1b, 2 iterations an epoch):",
        "  stage 0, device 0: units 0-1", "  stage 1, device 1: units 2-4"]),
], ids=["pipar", "fl", "pipeline"])
async def test_a_run_logs_its_plan_a_line_per_device(
        config: RunConfig, want: list[str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="aiopipe.server"):
        await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    said = _messages(caplog)
    first = next(i for i, m in enumerate(said) if m.startswith("planned"))
    assert said[first:first + len(want)] == want
    assert not any("{" in m or "[(" in m for m in said if "plan" in m)


async def test_hadfl_says_what_it_plans(caplog: pytest.LogCaptureFixture) -> None:
    """No more ``planned: []``: the negotiation first, then the strategy it led to."""
    with caplog.at_level(logging.INFO, logger="aiopipe.server"):
        await simulate(CONFIG.replace(mode="hadfl"), clock=VirtualClock(), cost_table=COSTS)
    said = _messages(caplog)
    assert "planned: []" not in said
    assert ("planned hadfl: a mutual negotiation of 1 epoch first (every device trains "
            "its data once an epoch, then all average), then local steps by each device's "
            "measured speed") in said
    [strategy] = [m for m in said if m.startswith("hadfl's strategy")]
    assert strategy.startswith("hadfl's strategy from the negotiation (1 round an epoch, "
                               "rings of 2 devices): devices 0-1: 2 local steps a round, ")
    assert strategy.endswith(" a step")


async def test_a_pipar_re_plan_is_logged_as_what_changed(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The planner's re-selection stubbed to move device 1's split one unit on; it used
    to be logged as ``(P, N) = [(2, 4), (3, 4)]``."""
    def reselect(auto: RunConfig, profile: Any, live: Any,
                 current: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int]], float, float]:
        (p0, n0), (p1, n1) = current
        return [(p0, n0), (p1 + 1 if p1 < 4 else p1 - 1, n1)], 2.0, 1.5

    monkeypatch.setattr(star_module, "live_profiles", lambda *a, **_: (None, a[4]))
    monkeypatch.setattr(star_module, "reselect", reselect)
    config = CONFIG.replace(split_point="auto", parallel_batches="auto",
                            aggregation_every=1, epochs=1, options={"replan": True})
    with caplog.at_level(logging.INFO, logger="aiopipe.server"):
        await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    [line] = [m for m in _messages(caplog) if m.startswith("re-planned")]
    assert line.startswith("re-planned after round 1: estimated epoch 2 s -> 1.5 s: "
                           "device 1: split ")
    assert "(P, N)" not in line
