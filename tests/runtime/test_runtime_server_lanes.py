"""The server's lanes (``server_lanes``, PiPar §3.2.3 Fig. 3c): several devices' replica
passes at once, each replica's in order, the same weights as passes in turn."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from fleet import COSTS

from aiopipe import RunConfig, SystemClock, VirtualClock, simulate
from aiopipe.metrics.trace import Recorder
from aiopipe.runtime.compute import Compute
from aiopipe.scheduler.chain import Stages, chained_schedule

#: four devices whose server passes are most of each iteration: the server is the
#: busiest resource, so lanes shorten the epoch
CONFIG = RunConfig(mode="pipar", model="vgg5", devices=4, samples_per_device=40,
                   batch_size=10, epochs=2, split_point=1, parallel_batches=2,
                   test_samples=0, network="lan", learning_rate=0.05)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


async def test_items_run_on_as_many_lanes_at_once_and_exclusive_ones_alone() -> None:
    clock, recorder = VirtualClock(), Recorder()
    compute = Compute(clock, recorder, "server/compute", charge_costs=True, lanes=2)

    async def item(name: str, exclusive: bool = False) -> float:
        await compute.run(name, lambda: None, cost=1.0, exclusive=exclusive)
        return clock.now()

    ends = list(await asyncio.gather(item("a"), item("b"), item("c"),
                                     item("ckpt", exclusive=True), item("d")))
    # a, b together; c alone on a lane; the exclusive one waits for both lanes; d after it
    assert ends == [1.0, 1.0, 2.0, 3.0, 4.0]
    assert recorder.busy("server/compute", 0.0, 4.0) == 4.0  # the union, not the sum


def test_lanes_are_refused_for_a_slowed_device_and_below_one() -> None:
    with pytest.raises(ValueError, match="lanes"):
        Compute(VirtualClock(), Recorder(), "device0/compute", slowdown=2.0, lanes=2)
    with pytest.raises(ValueError, match="lanes"):
        Compute(VirtualClock(), Recorder(), "server/compute", lanes=0)


def test_busy_seconds_are_the_union_of_a_track_s_slices() -> None:
    recorder = Recorder()
    for start, end in ((0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (0.5, 1.0)):
        recorder.add("server/compute", "s", start, end)
    recorder.add("device0/compute", "f", 0.0, 1.0)
    assert recorder.busy("server/compute", 0.0, 10.0) == 4.0
    assert recorder.busy("server/compute", 2.5, 5.5) == 1.0
    assert recorder.busy_by_track(0.0, 10.0) == {"server/compute": 4.0,
                                                 "device0/compute": 1.0}


@pytest.mark.slow
async def test_lanes_in_virtual_time_train_the_same_weights_in_a_shorter_epoch() -> None:
    one = await simulate(CONFIG, clock=VirtualClock(), cost_table=COSTS)
    two = await simulate(CONFIG.replace(options={"server_lanes": 2}), clock=VirtualClock(),
                         cost_table=COSTS)
    _same_weights(one.model, two.model)
    before, after = one.epochs[-1], two.epochs[-1]
    assert after.time_s < 0.9 * before.time_s
    # the same passes, charged alike: what the server did is the same work in less time
    assert after.busy_s["server"] < before.busy_s["server"]
    assert math.isclose(after.busy_s["device"], before.busy_s["device"], rel_tol=1e-9)


async def test_lanes_on_real_threads_train_the_same_weights_as_passes_in_turn() -> None:
    config = CONFIG.replace(epochs=1)
    one = await simulate(config, clock=SystemClock())
    three = await simulate(config.replace(options={"server_lanes": 3}), clock=SystemClock())
    _same_weights(one.model, three.model)


@pytest.mark.slow  # (about 2 s)
async def test_the_planner_plans_with_the_server_s_lanes() -> None:
    """With the server the bottleneck, more lanes let the plan keep less on the devices
    (or the same), and the estimate it chose by is never longer."""
    config = CONFIG.replace(split_point="auto", parallel_batches="auto", device_slowdown=4.0,
                            epochs=1)
    one = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    four = await simulate(config.replace(options={"server_lanes": 4}), clock=VirtualClock(),
                          cost_table=COSTS)
    points = [min(p["split_point"] for p in r.epochs[0].plan) for r in (one, four)]
    assert points[1] <= points[0]
    assert four.epochs[0].time_s <= one.epochs[0].time_s


async def test_an_item_cancelled_while_it_waits_for_a_lane_leaves_none_taken() -> None:
    clock = VirtualClock()
    compute = Compute(clock, Recorder(), "server/compute", charge_costs=True, lanes=2)
    first = asyncio.ensure_future(compute.run("a", lambda: None, cost=1.0))
    waiting = asyncio.ensure_future(compute.run("all", lambda: None, cost=1.0,
                                                exclusive=True))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await first
    # both lanes are free again: two items run at once
    await asyncio.gather(*(compute.run(n, lambda: None, cost=1.0) for n in "bc"))
    assert clock.now() == 2.0


def _stages(n: int, s: float) -> Stages:
    return Stages(n=n, f=0.0, b=0.0, device_step=0.0, u=0.0, up_latency=0.0, s=s,
                  server_step=0.0, d=0.0, down_latency=0.0)


def test_the_estimate_runs_as_many_replicas_passes_at_once_as_the_server_has_lanes() -> None:
    fleet = [_stages(1, 1.0), _stages(1, 1.0), _stages(2, 1.0)]
    one, _ = chained_schedule(fleet, 1)  # when each device's iteration ends
    two, _ = chained_schedule(fleet, 1, lanes=2)
    assert [r[0] for r in one] == [1.0, 2.0, 4.0]  # in turn
    # two at once; the third device's two passes stay one after the other
    assert [r[0] for r in two] == [1.0, 1.0, 3.0]
    alone, _ = chained_schedule([_stages(3, 1.0)], 1, lanes=4)
    assert alone == [[3.0]]  # one replica's passes never overlap
