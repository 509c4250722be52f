"""FTPipeHD's asynchronous pipeline on the stage runtime (``mode = "ftpipehd"``), in
virtual time: three devices, each holding only its stage, streaming an epoch's batches
through 1F1B without a flush, end with exactly the weights of one process applying the
rules in batch order (tests/runtime/async_reference.py), with and without weight
aggregation; every stage keeps at most S − p batches in flight."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from async_reference import delayed_sgd

from aiopipe import ConfigError, CostTable, RunConfig, VirtualClock, models, simulate
from aiopipe import data as datasets
from aiopipe.runtime.plan import build_model, device_indices, train_dataset
from aiopipe.scheduler.async_pipeline import one_f_one_b

COSTS = CostTable.uniform(5, forward=0.001, backward=0.002)
CONFIG = RunConfig(mode="ftpipehd", model="vgg5", devices=3, samples_per_device=80,
                   batch_size=8, epochs=2, learning_rate=0.05,
                   momentum=0.9, test_samples=20, seed=3, options={"partition": (1, 3)})


def _reference(config: RunConfig) -> dict[str, torch.Tensor]:
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    assert isinstance(config.options.partition, tuple)
    stages = models.partition(model, list(config.options.partition))
    batch = config.batch_size
    epochs = []
    for epoch in range(config.epochs):
        order = datasets.epoch_order(device_indices(config, dataset, 0), epoch=epoch,
                                     seed=config.seed)
        epochs.append([dataset.batch(order[b * batch:(b + 1) * batch])
                       for b in range(len(order) // batch)])
    final = delayed_sgd(stages, epochs, lr=config.learning_rate, momentum=config.momentum,
                        every=config.options.version_aggregation)
    with torch.no_grad():
        for stage, weights in zip(stages, final, strict=True):
            for name, param in stage.named_parameters():
                param.copy_(weights[name])
    return model.state_dict()


@pytest.mark.parametrize("every", [1, 0, 2])
async def test_ftpipehd_computes_what_its_rules_define(every: int) -> None:
    config = CONFIG.replace(options={"version_aggregation": every})
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert [e.samples for e in result.epochs] == [80, 80]
    want = _reference(config)
    got = result.model.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    plan = result.epochs[0].plan
    assert [p["in_flight"] for p in plan] == [3, 2, 1]
    assert [p["batches"] for p in plan] == [10, 10, 10]
    assert [s["peak_live"] for s in result.epochs[0].stages] == [3, 2, 1]


@pytest.mark.slow
async def test_ftpipehd_learns() -> None:
    """Stale weights and high momentum do not mix (with momentum 0.9 this run does not
    learn: docs/design.md, FTPipeHD); with 0.5 it does."""
    config = CONFIG.replace(samples_per_device=600, batch_size=20, epochs=3,
                            test_samples=300, learning_rate=0.02, momentum=0.5)
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    losses = [e.loss for e in result.epochs]
    assert losses == sorted(losses, reverse=True)
    assert result.final.accuracy > 0.3


@pytest.mark.parametrize(("changes", "message"), [
    ({"options": {"version_aggregation": -1}}, "version_aggregation"),
    ({"mode": "pipeline", "options": {"version_aggregation": 2}}, "version_aggregation"),
    ({"options": {"schedule": "gpipe"}}, "schedule"),
    ({"optimizer": "mypackage.opt:make"}, "optimizer"),
    ({"devices": 1, "options": {"partition": ()}}, "devices"),
])
def test_ftpipehd_config_is_checked(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CONFIG.replace(**changes)


@pytest.mark.slow
async def test_auto_cuts_give_a_10x_slower_device_less_and_the_epoch_is_shorter() -> None:
    """Four stages of five equal units, device 0 10x slower (declared:
    ``device_slowdown``): FTPipeHD's planner gives it one unit where PipeDream's
    homogeneous partition (the earliest of the balanced cuts) gives it two, and the
    asynchronous pipeline's epoch takes about half as long (its slowest stage sets the
    pace)."""
    base = CONFIG.replace(devices=4, device_slowdown=(10.0, 1.0, 1.0, 1.0),
                          samples_per_device=160, epochs=1, momentum=0.0,
                          options={"partition": "auto"})
    dynamic = await simulate(base, clock=VirtualClock(), cost_table=COSTS)
    units = [p["units"] for p in dynamic.epochs[0].plan]
    assert units[0] == [0, 1]
    homogeneous = await simulate(base.replace(options={"partition": (2, 3, 4)}),
                                 clock=VirtualClock(),
                                 cost_table=COSTS)
    ratio = homogeneous.epochs[0].time_s / dynamic.epochs[0].time_s
    assert 1.6 < ratio <= 2.0, ratio


async def test_the_trace_shows_each_stage_running_the_papers_1f1b_order() -> None:
    """The runtime's trace, per device, is the order of `one_f_one_b` with S − p batches in
    flight (the last stage's forward and backward one "s" slice): the order whose weight
    versions are the paper's Fig. 2 (golden: tests/scheduler/test_scheduler_async_pipeline.py;
    that each pass computes with its version: the bit-exact test above)."""
    config = CONFIG.replace(samples_per_device=72, epochs=1)  # 9 batches of 8
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    for p in range(3):
        slices = sorted((s for s in result.trace if s.track == f"device{p}/compute"
                         and s.name in ("f", "b", "s")), key=lambda s: s.start)
        seen = [(s.name, s.micro_batch) for s in slices]
        want = [(kind.lower(), b) for kind, b in one_f_one_b(3, p, 9)]
        if p == 2:  # F b then B b, fused
            want = [("s", b) for kind, b in want if kind == "f"]
        assert seen == want, (p, seen)


def _device_3_really_10x_slower(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device 3 runs 10x slower than its config declares (the others as declared)."""
    from aiopipe.runtime import device_node as device_module

    honest = device_module.DeviceNode._run_config

    def slow_device_3(self: Any, plan: Any) -> RunConfig:
        config = honest(self, plan)
        if self.device_id == 3:
            return config.replace(device_slowdown=(1.0, 1.0, 1.0, 10.0))
        return config

    monkeypatch.setattr(device_module.DeviceNode, "_run_config", slow_device_3)


@pytest.mark.slow
async def test_a_device_slower_than_declared_gets_less_from_the_next_epoch(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Every device declared alike, but device 3 really 10x slower: the first epoch runs
    the homogeneous cuts, the coordinator measures the capacities from the epoch's trace
    and re-partitions (§III-D), and the next epoch takes about half as long. The
    re-partition is recorded (``/status``'s replans)."""
    _device_3_really_10x_slower(monkeypatch)
    config = CONFIG.replace(devices=4, samples_per_device=160, epochs=3,
                            momentum=0.0,
                            options={"partition": "auto", "first_repartition_after": 0})
    with caplog.at_level(logging.INFO, logger="aiopipe.server"):
        result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    first, second, third = result.epochs
    (line,) = [r.getMessage() for r in caplog.records if "re-partitioned" in r.getMessage()]
    # declared alike: balanced cuts, device 3 with two units; measured: it gets one
    assert line.startswith("re-partitioned after round 1 (epoch 1): "
                           "cuts [1, 2, 3] -> [1, 2, 4]"), line
    assert [p["units"] for p in first.plan][3] == [4, 5]  # (the plan as the epoch ended)
    assert third.plan == second.plan  # no flapping
    assert 1.6 < first.time_s / second.time_s <= 2.0, (first.time_s, second.time_s)
    assert third.time_s == pytest.approx(second.time_s)


async def test_a_neighbour_s_next_round_may_come_before_ours_with_a_new_cut(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Devices 1-3 declared 10x slower, but really device 0 is: the first round gives
    device 0 two of vgg5's units and device 1 one (its input: 4096 values a sample); the
    re-partition gives device 0 one unit, so device 1's input is unit 1's output (8192).
    Device 1's RoundStart crawls down a slow link while device 0 already sends the new
    round's activations ([Note: early activations]): twice the size the old cut allowed,
    they must be taken, not refused as too large."""
    from aiopipe.runtime import device_node as device_module

    honest = device_module.DeviceNode._run_config

    def really(self: Any, plan: Any) -> RunConfig:
        return honest(self, plan).replace(device_slowdown=(10.0, 1.0, 1.0, 1.0))

    monkeypatch.setattr(device_module.DeviceNode, "_run_config", really)
    fast = {"up_mbps": 1000.0, "down_mbps": 1000.0}
    config = CONFIG.replace(devices=4, samples_per_device=160, epochs=2,
                            momentum=0.0, device_slowdown=(1.0, 10.0, 10.0, 10.0),
                            network=[fast, {"up_mbps": 1000.0, "down_mbps": 2.0}, fast, fast],
                            options={"partition": "auto"})
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    first, second = result.epochs
    (change,) = first.changes
    assert change["before"][0] == 2
    assert change["after"][0] == 1
    assert second.changes == ()  # no replay: nothing was refused
    assert [e.samples for e in result.epochs] == [160, 160]


def test_a_device_told_to_keep_weights_it_does_not_hold_refuses_the_round() -> None:
    """[Note: kept weights]: a RoundStart with no tensors means "keep your stage's
    weights"; a device that has not run that stage (a fresh process, another stage)
    refuses the round instead of training from its untrained weights."""
    from aiopipe.errors import RemoteProtocolError
    from aiopipe.protocol import Plan, RoundStart
    from aiopipe.runtime.holdings import Holdings
    from aiopipe.runtime.systems.ftpipehd.device import STAGE_RULES

    config = CONFIG
    plan = Plan(1, "ftpipehd", {}, 1 << 63, inputs=(("float32", (3, 32, 32)),), num_classes=10)
    holdings = Holdings.open(config, plan, None, torch.device("cpu"))
    from aiopipe.scheduler import schedule

    actions = " ".join(map(str, schedule.with_transfers(
        schedule.one_f_one_b(3, 4, [3, 2, 1])).actions[1]))
    start = RoundStart(0, 0, 0, 1, {}, 1, 3, 1, 3, 4, config.batch_size, 0, actions,
                       {"device0": {"stage": 0, "address": "a"},
                        "device2": {"stage": 2, "address": "b"}})
    with pytest.raises(RemoteProtocolError, match="keep weights it does not hold"):
        holdings.assign(start, None, None, rules=STAGE_RULES)


async def test_every_batch_s_update_is_charged_and_planned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FTPipeHD updates a stage's weights after every batch: virtual time charges each
    backward its step (a round's closing STEP only installs the latest weights: nothing),
    and the planner counts the step in a unit's time, so a device declared alike but
    really 10x slower measures a capacity of 10, even where the update costs more than
    the compute (here twice forward and backward together)."""
    _device_3_really_10x_slower(monkeypatch)
    costs = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.048)
    config = CONFIG.replace(devices=4, samples_per_device=160, epochs=1, momentum=0.0,
                            options={"partition": (1, 2, 3)})
    result = await simulate(config, clock=VirtualClock(), cost_table=costs)
    backward = [s.duration for s in result.trace if s.track == "device0/compute"
                and s.name == "b"]
    assert backward == [pytest.approx(0.002 * 8 + 0.048)] * 20  # 20 batches of 8, one unit
    assert not any(s.duration for s in result.trace if s.name == "step")
    replanned = await simulate(config.replace(options={"partition": "auto"}),
                               clock=VirtualClock(), cost_table=costs)
    (change,) = replanned.epochs[0].changes
    assert change["capacities"] == pytest.approx([1.0, 1.0, 1.0, 10.0])
