"""[Note: cost cache]: virtual time is deterministic without a table from the caller;
the table is measured once per machine and model and kept on disk."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fleet import vgg5_shaped

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.runtime import plan as plan_module
from aiopipe.runtime.cost_cache import cache_directory, cached_costs, cost_key
from aiopipe.runtime.plan import build_model
from aiopipe.scheduler.costs import CostTable

# vgg5's stand-in: measuring its table takes a tenth of vgg5's time
CONFIG = RunConfig(mode="pipar", model=vgg5_shaped, devices=2, samples_per_device=40,
                   batch_size=20, epochs=2, split_point="auto", parallel_batches="auto",
                   test_samples=20, network="4g")


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tables `simulate` measured."""
    calls: list[int] = []
    real = plan_module.measure_planning_costs

    def counting(*args: object, **kwargs: object) -> CostTable:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(plan_module, "measure_planning_costs", counting)
    return calls


@pytest.mark.slow
async def test_two_default_simulations_are_alike_in_every_field_timing_included(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured: list[int]) -> None:
    monkeypatch.setenv("AIOPIPE_COST_CACHE", str(tmp_path / "cache"))
    first = await simulate(CONFIG, clock=VirtualClock())
    second = await simulate(CONFIG, clock=VirtualClock())
    assert measured == [1]  # the second read the first's table
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    assert first.epochs == second.epochs
    assert [e.time_s for e in first.epochs] == [e.time_s for e in second.epochs]
    assert first.trace == second.trace
    for (key, a), (_, b) in zip(first.model.state_dict().items(),
                                second.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), key


@pytest.mark.slow
async def test_off_measures_every_time(monkeypatch: pytest.MonkeyPatch,
                                       measured: list[int]) -> None:
    monkeypatch.setenv("AIOPIPE_COST_CACHE", "off")
    config = CONFIG.replace(epochs=1, split_point=2, parallel_batches=2)
    await simulate(config, clock=VirtualClock())
    await simulate(config, clock=VirtualClock())
    assert measured == [1, 1]


def _table(seconds: float) -> CostTable:
    return CostTable.uniform(3, forward=seconds, backward=seconds, step=seconds, batch=1)


def _at(seconds: float) -> Callable[[Sequence[int]], CostTable]:
    """A measurement: a table at the sizes asked for, ``seconds`` a sample."""
    def measure(sizes: Sequence[int]) -> CostTable:
        asked.append(list(sizes))
        rows = {u: {b: seconds * b for b in sizes} for u in range(3)}
        return CostTable(forward=rows, backward=rows, step=dict.fromkeys(range(3), seconds))

    asked: list[list[int]] = []
    measure.asked = asked  # type: ignore[attr-defined]
    return measure


def test_a_kept_table_is_read_and_a_broken_one_replaced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert cached_costs("k", lambda _: _table(0.001), [1], tmp_path) == _table(0.001)
    # read, not measured again
    assert cached_costs("k", lambda _: _table(0.5), [1], tmp_path) == _table(0.001)
    (tmp_path / "k.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="aiopipe.runtime"):
        assert cached_costs("k", lambda _: _table(0.002), [1], tmp_path) == _table(0.002)
    assert caplog.text.count("cannot be read") == 1  # said once, not before and under the lock
    assert CostTable.from_mapping(json.loads((tmp_path / "k.json").read_text())) == _table(0.002)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_directory_that_cannot_be_written_loses_nothing_but_the_cache(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="aiopipe.runtime"):
        assert cached_costs("k", lambda _: _table(0.001), [1], blocker / "costs") == _table(0.001)
    assert "AIOPIPE_COST_CACHE" in caplog.text


def test_the_directory_follows_the_environment(tmp_path: Path) -> None:
    assert cache_directory({"AIOPIPE_COST_CACHE": "OFF"}) is None
    assert cache_directory({"AIOPIPE_COST_CACHE": str(tmp_path)}) == tmp_path
    assert cache_directory({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "aiopipe" / "costs"
    assert cache_directory({}) == Path("~/.cache/aiopipe/costs").expanduser()


def test_a_kept_table_serves_the_sizes_it_holds_and_grows_for_others(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Mode auto asks for every candidate's sizes, a forced sfl run for the batch alone:
    the forced run reads auto's table; a run asking for a size the table lacks measures
    the union, so the file serves both afterwards."""
    measure = _at(0.001)
    auto = cached_costs("k", measure, [50, 10, 5, 10], tmp_path)
    assert auto.batch_sizes == (5, 10, 50)
    with caplog.at_level(logging.INFO, logger="aiopipe.runtime"):
        assert cached_costs("k", measure, [50], tmp_path) == auto  # read
        assert "read from" in caplog.text
        grown = cached_costs("k", measure, [25, 50], tmp_path)
    assert measure.asked == [[5, 10, 50], [5, 10, 25, 50]]  # type: ignore[attr-defined]
    assert caplog.text.count("lacks batch sizes 25") == 1
    assert grown.batch_sizes == (5, 10, 25, 50)
    assert cached_costs("k", measure, [5, 25], tmp_path) == grown
    assert len(measure.asked) == 2  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AIOPIPE_COST_CACHE", "off")
        cached_costs("k", measure, [7, 7], None)
    assert measure.asked[-1] == [7]  # type: ignore[attr-defined]


def test_two_processes_that_miss_one_key_at_once_measure_it_once(tmp_path: Path) -> None:
    """The second waits on the first's lock file and reads its table (two threads here:
    each opens the lock file itself, so their locks exclude each other as two processes'
    do)."""
    started = threading.Barrier(2)
    measured: list[Sequence[int]] = []

    def slow(sizes: Sequence[int]) -> CostTable:
        measured.append(list(sizes))
        time.sleep(0.5)  # the other thread has asked by now
        return _at(0.001)(sizes)

    def ask() -> CostTable:
        started.wait()
        return cached_costs("k", slow, [10, 20], tmp_path)

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: ask(), range(2))
    assert measured == [[10, 20]]
    assert first == second
    assert (tmp_path / "k.lock").exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_the_key_changes_with_what_the_table_depends_on_but_the_sizes() -> None:
    vgg5 = build_model(RunConfig(model="vgg5"), num_classes=10, in_shape=(3, 32, 32))
    resnet = build_model(RunConfig(model="resnet18"), num_classes=10, in_shape=(3, 32, 32))
    settings = {"threads": 1, "learning_rate": 0.02, "momentum": 0.9}
    key = cost_key(vgg5, (3, 32, 32), "synthetic-cifar10", settings)
    assert key == cost_key(vgg5, (3, 32, 32), "synthetic-cifar10", dict(settings))
    others = [cost_key(resnet, (3, 32, 32), "synthetic-cifar10", settings),
              cost_key(vgg5, (3, 32, 32), "synthetic-mnist", settings),
              cost_key(vgg5, (3, 32, 32), "synthetic-cifar10", {**settings, "threads": 2})]
    assert len({key, *others}) == 4
