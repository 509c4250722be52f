"""Training that starts in seconds: the devices' profiles and the server's planning table
come from the cost cache on a second run ([Note: device profiles], [Note: cost cache]),
and the first epoch's metrics say how long the run took to start ([Note: startup
figures])."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from fleet import vgg5_shaped
from test_runtime_profiling import CONFIG, _run

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.metrics.epoch import EpochMetrics
from aiopipe.metrics.trace import Slice
from aiopipe.runtime import plan as plan_module
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.plan import build_model, planning_cost_key, train_dataset
from aiopipe.runtime.startup import Startup, first_micro_batch_end
from aiopipe.scheduler.costs import CostTable


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Whose tables were measured, in order: "server" (the coordinator's evaluation set)
    or "device" (a device's own data)."""
    calls: list[str] = []
    real = plan_module.measure_planning_costs

    def counting(config: RunConfig, model: object, inputs: object, dataset: object,
                 **kwargs: object) -> CostTable:
        # the server loads its evaluation set, a device its own samples
        calls.append("server" if len(dataset) == CONFIG.test_samples else "device")  # type: ignore[arg-type]
        return real(config, model, inputs, dataset, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(plan_module, "measure_planning_costs", counting)
    return calls


def _kept(directory: Path) -> list[Path]:
    """The tables kept in the cache ``directory``."""
    return sorted(directory.glob("*.json"))


async def _profiled_run() -> list[CostTable | None]:
    """One "auto" run whose devices profile themselves; the tables it planned with."""
    clock = VirtualClock()
    node = Coordinator(CONFIG, clock=clock)
    await _run(node, clock, profile=True)
    return [p.costs for p in node.system.live]


@pytest.mark.slow
async def test_a_second_run_reads_every_profile_from_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured: list[str],
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("AIOPIPE_COST_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="aiopipe.runtime"):
        first = await _profiled_run()
    # the server's table and device 0's; device 1 (same machine, same key) reads 0's
    assert sorted(measured) == ["device", "server"]
    assert "device 0's profile measured in" in caplog.text
    assert "device 1's profile read from" in caplog.text
    assert len(_kept(tmp_path)) == 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="aiopipe.runtime"):
        second = await _profiled_run()
    assert len(measured) == 2  # nothing measured again
    assert second == first  # the planner got the very tables
    assert f"device 0's profile read from {tmp_path}" in caplog.text
    assert "the server's cost table read from" in caplog.text
    for path in _kept(tmp_path):  # broken files are measured again
        path.write_text("{broken")
    await _profiled_run()
    assert sorted(measured[2:]) == ["device", "server"]


@pytest.mark.slow
async def test_off_profiles_every_device_every_time(
        monkeypatch: pytest.MonkeyPatch, measured: list[str],
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("AIOPIPE_COST_CACHE", "off")
    with caplog.at_level(logging.INFO, logger="aiopipe.runtime"):
        await _profiled_run()
    assert sorted(measured) == ["device", "device", "server"]
    assert "device 1's profile measured in" in caplog.text
    assert "AIOPIPE_COST_CACHE=off" in caplog.text


def test_the_profile_key_changes_with_the_model_and_whose_data() -> None:
    """(Not with the sizes: a kept table serves every request whose sizes it holds,
    `cached_costs`.)"""
    config = RunConfig(model="vgg5", torch_threads=1)
    vgg5 = build_model(config, num_classes=10, in_shape=(3, 32, 32))
    other = vgg5_shaped(10, (3, 32, 32))
    data = train_dataset(config.replace(devices=1, samples_per_device=10))

    def key(**changes: object) -> str:
        args: dict[str, object] = {"config": config, "model": vgg5,
                                   "role": "device"} | changes
        return planning_cost_key(args["config"], args["model"], (3, 32, 32), data,  # type: ignore[arg-type]
                                 role=args["role"])  # type: ignore[arg-type]

    keys = {key(), key(model=other), key(role="server"),
            key(config=config.replace(torch_threads=2)),
            key(config=config.replace(learning_rate=0.5)),
            key(config=config.replace(dataset="synthetic-mnist"))}
    assert len(keys) == 6


async def test_the_startup_figures_are_the_phases_and_the_first_micro_batch() -> None:
    clock = VirtualClock()
    startup = Startup(clock)
    await clock.sleep(2.0)
    startup.joined()
    with startup.timed("profiling_s"):
        await clock.sleep(3.0)
    await clock.sleep(0.25)  # (between phases: in neither)
    with startup.timed("planning_s"):
        await clock.sleep(0.5)
    await clock.aclose()
    slices = [Slice("device0/uplink", "u", 5.6, 5.7, 0, 0, 0),
              Slice("server/compute", "s", 6.0, 6.5, 0, 0, 0),
              Slice("device1/compute", "f", 5.8, 6.25, 0, 0, 0),
              Slice("server/compute", "aggregate", 5.5, 5.6)]
    assert first_micro_batch_end(slices) == 6.25
    assert first_micro_batch_end(slices[-1:]) == 5.6
    assert first_micro_batch_end(slices[:1]) is None
    figures = {"startup_s": 6.25, "join_s": 2.0, "profiling_s": 3.0, "planning_s": 0.5}
    assert startup.figures(slices) == figures
    epoch = EpochMetrics(epoch=1, time_s=1.0, busy_s={}, idle_s={}, loss=0.0, accuracy=0.0,
                         train_accuracy=0.0, samples=0, bytes_up=0, bytes_down=0, plan=())
    assert startup.stamp(epoch, slices).startup == figures
    assert startup.stamp(epoch, slices).startup == {}  # the next epoch: none
    assert startup.stamp(epoch, slices).to_mapping()["startup"] == {}


@pytest.mark.slow
async def test_a_runs_metrics_say_how_long_it_took_to_start(tmp_path: Path) -> None:
    config = RunConfig(mode="pipar", model=vgg5_shaped, devices=2, samples_per_device=40,
                       batch_size=20, epochs=2, split_point="auto",
                       parallel_batches="auto", test_samples=20,
                       out_dir=str(tmp_path / "run"))
    began = time.perf_counter()
    await simulate(config)  # wall clock: real compute, real start
    took = time.perf_counter() - began
    lines = [json.loads(line) for line in
             (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, second = lines[0]["startup"], lines[1]["startup"]
    assert set(first) == {"startup_s", "join_s", "profiling_s", "planning_s"}
    assert second == {}
    phases = first["join_s"] + first["profiling_s"] + first["planning_s"]
    assert 0 < phases < first["startup_s"] < min(took, lines[0]["time_s"] + first["startup_s"])
    assert first["planning_s"] > 0  # the server planned (its table: cached or measured)
