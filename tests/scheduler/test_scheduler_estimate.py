"""The iteration and epoch estimator: hand-computed DAGs, the runtime's critical path,
and properties of the list schedule."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim.optimizer import register_optimizer_step_pre_hook

from aiopipe import RunConfig
from aiopipe.errors import ConfigError
from aiopipe.protocol import Activation, Gradient, TensorData, encode
from aiopipe.runtime.plan import build_model
from aiopipe.scheduler import (
    CostTable,
    DeviceProfile,
    FleetEstimate,
    ModelProfile,
    alone_iteration_end,
    estimate_epoch,
    estimate_iteration,
    estimate_steady_iteration,
    measure_costs,
    select_plans,
)
from aiopipe.scheduler.chain import alone_floor
from aiopipe.scheduler.estimate import StageCache
from aiopipe.transport.network import LinkSpec


def unit_model(
    forward: Sequence[float],
    backward: Sequence[float],
    step: Sequence[float],
    activation: Sequence[int],
    state: Sequence[int] | None = None,
) -> ModelProfile:
    """Per-unit seconds at micro-batch size 1 (proportional to the size), no frame
    overhead and no labels, so hand-computed wire times are exact."""
    q = len(forward)
    costs = CostTable(
        {u: {1: forward[u]} for u in range(q)},
        {u: {1: backward[u]} for u in range(q)},
        {u: step[u] for u in range(q)},
    )
    return ModelProfile(
        costs,
        tuple(activation),
        tuple(state or [0] * q),
        label_bytes_per_sample=0,
        frame_overhead=0,
    )


def device(
    slowdown: float, up: float | None, down: float | None, *, latency: float = 0.0, samples: int = 1
) -> DeviceProfile:
    return DeviceProfile(slowdown, LinkSpec(up, latency), LinkSpec(down, latency), samples)


# -- golden DAGs, computed by hand ---------------------------------------------------------


def test_one_device_one_micro_batch() -> None:
    # f = 1, u = 250 B * 8 / 1000 bps = 2, s = 1 + 2 = 3, d = 2000 bits / 2000 bps = 1,
    # b = 2, device step 0.25, server step 0.5, latency 0.5 each way.
    #   f 0-1 | u 1-3, arrives 3.5 | s 3.5-6.5 | replica step 6.5-7 | d 6.5-7.5, arrives 8
    #   b 8-10 | device step 10-10.25
    model = unit_model([1, 1], [2, 2], [0.25, 0.5], [250, 0], state=[125, 0])
    dev = device(1.0, 1000, 2000, latency=0.5, samples=3)
    est = estimate_iteration(model, [dev], [(1, 1)], 1)
    assert est == FleetEstimate(
        time_s=10.25,
        device_end_s=(10.25,),
        replica_end_s=(7.0,),
        compute_busy_s=(3.25,),
        uplink_busy_s=(2.0,),
        downlink_busy_s=(1.0,),
        server_busy_s=3.5,
    )
    assert est.busy_by_track() == {
        "server/compute": 3.5,
        "device0/compute": 3.25,
        "device0/uplink": 2.0,
        "device0/downlink": 1.0,
    }
    assert alone_iteration_end(model, dev, (1, 1), 1) == 10.25
    # 3 iterations of 10.25; the device half (125 B = 1000 bits) goes down (1000/2000 + 0.5)
    # and up (1000/1000 + 0.5): 1.0 + 30.75 + 1.5
    assert estimate_epoch(model, [dev], [(1, 1)], 1) == 33.25
    # the server's aggregation closes the round: 0.5 s fixed + 0.25 s for the one device
    slow_round = dataclasses.replace(model, costs=dataclasses.replace(model.costs,
                                                                         aggregate=(0.5, 0.25)))
    assert estimate_epoch(slow_round, [dev], [(1, 1)], 1) == 34.0


def test_one_device_three_micro_batches_bound_by_the_uplink() -> None:
    # B = 3, N = 3, B' = 1: f = 1, u = 3000 bits / 1000 bps = 3, s = 1, d = 3000 / 6000 =
    # 0.5, b = 1, no latency, no steps.
    #   f: 0-1, 1-2, 2-3        u: 1-4, 4-7, 7-10      s: 4-5, 7-8, 10-11
    #   d: 5-5.5, 8-8.5, 11-11.5                     b: 5.5-6.5, 8.5-9.5, 11.5-12.5
    model = unit_model([1, 0.5], [1, 0.5], [0, 0], [375, 0])
    dev = device(1.0, 1000, 6000)
    est = estimate_iteration(model, [dev], [(1, 3)], 3)
    assert est.time_s == 12.5
    assert est.device_end_s == (12.5,)
    assert est.replica_end_s == (11.0,)
    assert est.uplink_busy_s == (9.0,)
    assert est.compute_busy_s == (6.0,)
    # without pipelining (N = 1, B' = 3) every stage is 3x as long and nothing overlaps:
    # 3 + 9 + 3 + 1.5 + 3
    assert estimate_iteration(model, [dev], [(1, 1)], 3).time_s == 19.5


def test_two_devices_contend_for_the_server_in_request_order() -> None:
    # 3 units, each forward 1, backward 1, step 0.5; u = d = 1 for both; N = 1, B = 1.
    # A: P = 1, f = b = 1, device step 0.5, s = 4, replica step 1.0
    # B: P = 2, f = b = 2, device step 1.0, s = 2, replica step 0.5
    #   A: f 0-1, u 1-2, s 2-6, asks for its replica step at 6
    #   B: f 0-2, u 2-3, asks at 3, so goes before A's step: s 6-8
    #   server: A step 8-9, B step 9-9.5
    #   A: d 6-7, b 7-8, step 8-8.5 (replica done at 9: cycle 9)
    #   B: d 8-9, b 9-11, step 11-12
    model = unit_model([1, 1, 1], [1, 1, 1], [0.5, 0.5, 0.5], [125, 125, 0], state=[125, 125, 0])
    a, b = device(1.0, 1000, 1000, samples=3), device(1.0, 1000, 1000, samples=1)
    est = estimate_iteration(model, [a, b], [(1, 1), (2, 1)], 1)
    assert est.device_end_s == (8.5, 12.0)
    assert est.replica_end_s == (9.0, 9.5)
    assert est.time_s == 12.0
    assert est.server_busy_s == 7.5
    # alone, neither waits: A 8.5 (replica 7), B: f 0-2 u 2-3 s 3-5 d 5-6 b 6-8 step 8-9
    assert alone_iteration_end(model, a, (1, 1), 1) == 8.5
    assert alone_iteration_end(model, b, (2, 1), 1) == 9.0
    # epoch: A runs 3 iterations, B 1. Phase 1 (both): A 9, B 12; phase 2 (A alone, 2
    # iterations): 8.5 each. Model halves: A 125 B = 1 s each way, B 250 B = 2 s each way.
    # A: 1 + 9 + 17 + 1 = 28; B: 2 + 12 + 2 = 16.
    assert estimate_epoch(model, [a, b], [(1, 1), (2, 1)], 1) == 28.0


def test_a_steady_iteration_is_shorter_than_the_first_when_devices_collide_only_once() -> None:
    # 2 units: device f = b = 1 (unit 0), server s = 0.5 + 0.5 = 1 (unit 1), no steps,
    # unshaped links (u = d = 0), N = 1, B = 1. Both devices start at 0:
    #   A: f 0-1, s 1-2, b 2-3 (step ends 3);  B: f 0-1, s waits for A: 2-3, b 3-4 (4)
    # back to back: A: f 3-4, s 4-5, b 5-6;  B: f 4-5, s 5-6, b 6-7: they are out of
    # phase, neither waits again, and each iteration takes f + s + b = 3.
    model = unit_model([1, 0.5], [1, 0.5], [0, 0], [0, 0])
    fleet = [device(1.0, None, None), device(1.0, None, None)]
    plans = [(1, 1), (1, 1)]
    assert estimate_iteration(model, fleet, plans, 1).time_s == 4.0
    assert estimate_steady_iteration(model, fleet, plans, 1) == 3.0
    # one device never collides: every iteration is its first
    alone = estimate_iteration(model, fleet[:1], plans[:1], 1).time_s
    assert estimate_steady_iteration(model, fleet[:1], plans[:1], 1) == alone == 3.0


def test_a_slower_link_can_shorten_a_fleet_iteration() -> None:
    # Graham's anomaly, which FIFO service has and the runtime has too. P = 1 for both,
    # s = 1, no steps, no latency. A (slowdown 2): f = b = 0.5, d = 1. B (slowdown 4):
    # f = b = 1, u = 0.25, d = 1000 bits / 250 bps = 4.
    #   A's uplink at 2000 bps (u = 0.5): A arrives at 1.0, before B (1.25): A s 1-2,
    #   B s 2-3, B d 3-7, b 7-8.
    #   A's uplink at 1000 bps (u = 1): A arrives at 1.5, after B: B s 1.25-2.25,
    #   d 2.25-6.25, b 6.25-7.25; A s 2.25-3.25, d 3.25-4.25, b 4.25-4.75.
    model = unit_model([0.25, 0.5], [0.25, 0.5], [0, 0], [125, 0])
    b = device(4.0, 4000, 250)
    fast = estimate_iteration(model, [device(2.0, 2000, 1000), b], [(1, 1), (1, 1)], 1)
    slow = estimate_iteration(model, [device(2.0, 1000, 1000), b], [(1, 1), (1, 1)], 1)
    assert (fast.time_s, fast.device_end_s) == (8.0, (3.5, 8.0))
    assert (slow.time_s, slow.device_end_s) == (7.25, (4.75, 7.25))


# -- the runtime's critical path (tests/runtime/test_runtime_overlap.py) -------------------

UP_MBPS, DOWN_MBPS, LATENCY_MS = 10.0, 25.0, 5.0
N, BATCH, P = 4, 20, 2
MICRO = BATCH // N
COSTS = CostTable.uniform(5, forward=0.04, backward=0.03, step=0.001, batch=MICRO)


def _critical_path(
    f: float, u: float, s: float, d: float, b: float, step: float, latency: float
) -> float:
    """Verbatim from tests/runtime/test_runtime_overlap.py."""
    f_end, u_end, s_end, d_end, b_end = [0.0] * N, [0.0] * N, [0.0] * N, [0.0] * N, [0.0] * N
    for n in range(N):
        f_end[n] = (f_end[n - 1] if n else 0.0) + f
        u_end[n] = max(f_end[n], u_end[n - 1] if n else 0.0) + u
        s_end[n] = max(u_end[n] + latency, s_end[n - 1] if n else 0.0) + s
        d_end[n] = max(s_end[n], d_end[n - 1] if n else 0.0) + d
    for n in range(N):
        b_end[n] = max(d_end[n] + latency, b_end[n - 1] if n else f_end[-1]) + b
    return b_end[-1] + step


def test_matches_the_critical_path_the_runtime_takes_exactly() -> None:
    config = RunConfig(
        mode="pipar",
        devices=1,
        samples_per_device=BATCH,
        batch_size=BATCH,
        epochs=1,
        split_point=P,
        parallel_batches=N,
        test_samples=20,
        network={"up_mbps": UP_MBPS, "down_mbps": DOWN_MBPS, "latency_ms": LATENCY_MS},
    )
    model = build_model(config, num_classes=10, in_shape=(3, 32, 32))
    x = torch.zeros(MICRO, 3, 32, 32)
    for unit in list(model.children())[:P]:
        x = unit(x)
    shape = tuple(x.shape)
    tensor = TensorData("float32", shape, bytes(x.numel() * 4))
    labels = TensorData("int64", (MICRO,), bytes(MICRO * 8))
    act_bytes = len(encode(Activation(0, 0, 0, 0, 0, 0, "device0", "server", (tensor,), labels)))
    grad_bytes = len(encode(Gradient(0, 1, 0, 0, 0, 0, "server", "device0", (tensor,))))
    f = COSTS.forward_time(0, P, MICRO)
    s = COSTS.forward_time(P, 5, MICRO) + COSTS.backward_time(P, 5, MICRO)
    b = COSTS.backward_time(0, P, MICRO)
    u = act_bytes * 8 / (UP_MBPS * 1e6)
    d = grad_bytes * 8 / (DOWN_MBPS * 1e6)
    expected = _critical_path(f, u, s, d, b, COSTS.step_time(0, P), LATENCY_MS / 1000)

    per_sample = x.numel() * 4 // MICRO
    profile = ModelProfile(
        COSTS,
        (0, per_sample, 0, 0, 0),
        (0,) * 5,
        frame_overhead=grad_bytes - MICRO * per_sample,
        activation_frame_overhead=act_bytes - MICRO * (per_sample + 8),
    )
    assert profile.activation_frame_bytes(P, MICRO) == act_bytes
    assert profile.gradient_frame_bytes(P, MICRO) == grad_bytes
    latency = LATENCY_MS / 1000
    dev = DeviceProfile(
        1.0, LinkSpec(UP_MBPS * 1e6, latency), LinkSpec(DOWN_MBPS * 1e6, latency), BATCH
    )
    est = estimate_iteration(profile, [dev], [(P, N)], BATCH)
    assert est.device_end_s == (expected,)  # bit for bit: same terms, same order
    assert est.time_s == expected
    assert alone_iteration_end(profile, dev, (P, N), BATCH) == pytest.approx(expected, rel=1e-12)


# -- validation ------------------------------------------------------------------------------


def test_bad_inputs_are_config_errors() -> None:
    model = unit_model([1, 1], [1, 1], [0, 0], [4, 4])
    dev = device(1.0, None, None, samples=4)
    with pytest.raises(ConfigError, match=r"split point 2 outside 1\.\.1"):
        estimate_iteration(model, [dev], [(2, 1)], 4)
    with pytest.raises(ConfigError, match=r"5 micro-batches outside 1\.\.4"):
        estimate_iteration(model, [dev], [(1, 5)], 4)
    with pytest.raises(ConfigError, match="must be two ints"):
        estimate_iteration(model, [dev], [("auto", 1)], 4)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="2 plans for 1 devices"):
        estimate_iteration(model, [dev], [(1, 1), (1, 1)], 4)
    with pytest.raises(ConfigError, match="no devices"):
        estimate_iteration(model, [], [], 4)
    with pytest.raises(ConfigError, match="batch size"):
        estimate_iteration(model, [dev], [(1, 1)], 0)
    with pytest.raises(ConfigError, match="device 0 holds 4 samples, fewer than one iteration"):
        estimate_epoch(model, [dev], [(1, 1)], 8)
    with pytest.raises(ConfigError, match="slowdown"):
        device(0.0, None, None)
    with pytest.raises(ConfigError, match="samples"):
        device(1.0, None, None, samples=-1)
    with pytest.raises(ConfigError, match="activation_bytes has 1 entries"):
        ModelProfile(model.costs, (4,), (0, 0))
    with pytest.raises(ConfigError, match="at least 2 units"):
        ModelProfile(CostTable.uniform(1, forward=1, backward=1), (4,), (0,))


# -- properties ------------------------------------------------------------------------------


@st.composite
def fleets(
    draw: st.DrawFn, max_devices: int = 3
) -> tuple[ModelProfile, list[DeviceProfile], list[tuple[int, int]], int]:
    q = draw(st.integers(2, 5))
    seconds = st.floats(0.0, 0.05, allow_nan=False)
    costs = CostTable(
        {u: {1: draw(seconds)} for u in range(q)},
        {u: {1: draw(seconds)} for u in range(q)},
        {u: draw(st.floats(0.0, 0.01)) for u in range(q)},
    )
    model = ModelProfile(
        costs,
        tuple(draw(st.lists(st.integers(0, 100_000), min_size=q, max_size=q))),
        tuple(draw(st.lists(st.integers(0, 10**6), min_size=q, max_size=q))),
        frame_overhead=draw(st.integers(0, 300)),
    )
    batch = draw(st.integers(1, 32))
    link = st.builds(LinkSpec, st.one_of(st.none(), st.floats(1e4, 1e8)), st.floats(0.0, 0.05))
    devices = draw(
        st.lists(
            st.builds(
                DeviceProfile, st.floats(0.25, 8.0), link, link, st.integers(batch, 10 * batch)
            ),
            min_size=1,
            max_size=max_devices,
        )
    )
    plans = [(draw(st.integers(1, q - 1)), draw(st.integers(1, batch))) for _ in devices]
    return model, devices, plans, batch


def _sequential(
    model: ModelProfile,
    devices: Sequence[DeviceProfile],
    plans: Sequence[tuple[int, int]],
    batch: int,
) -> float:
    """Every stage of every device one after the other, latencies included."""
    cache = StageCache(model)
    total = 0.0
    for dev, (p, n) in zip(devices, plans, strict=True):
        s = cache.stages(dev, p, n, batch)
        total += (
            n * (s.f + s.u + s.up_latency + s.s + s.d + s.down_latency + s.b)
            + s.device_step
            + s.server_step
        )
    return total


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(fleets())
def test_estimate_lies_between_the_busiest_resource_and_the_sequential_sum(
    fleet: tuple[ModelProfile, list[DeviceProfile], list[tuple[int, int]], int],
) -> None:
    model, devices, plans, batch = fleet
    est = estimate_iteration(model, devices, plans, batch)
    slack = 1e-9 * est.time_s + 1e-12
    for busy in est.busy_by_track().values():
        assert est.time_s >= busy - slack
    assert est.time_s <= _sequential(model, devices, plans, batch) + slack
    assert est.time_s == max(max(est.device_end_s), max(est.replica_end_s))


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_no_device_is_faster_in_the_fleet_than_alone(
    fleet: tuple[ModelProfile, list[DeviceProfile], list[tuple[int, int]], int],
) -> None:
    # the lower bound select_plans prunes with; alone it is the closed form, exactly
    model, devices, plans, batch = fleet
    est = estimate_iteration(model, devices, plans, batch)
    for k, (dev, plan) in enumerate(zip(devices, plans, strict=True)):
        alone = alone_iteration_end(model, dev, plan, batch)
        assert max(est.device_end_s[k], est.replica_end_s[k]) >= alone * (1 - 1e-9)
        solo = estimate_iteration(model, [dev], [plan], batch).time_s
        assert solo == pytest.approx(alone, rel=1e-9, abs=1e-15)


@settings(max_examples=150, deadline=None)
@given(fleets(max_devices=1), st.floats(0.01, 1.0), st.sampled_from(["up", "down", "unshaped"]))
def test_one_device_is_never_faster_on_a_slower_link(
    fleet: tuple[ModelProfile, list[DeviceProfile], list[tuple[int, int]], int],
    factor: float,
    which: str,
) -> None:
    model, (dev,), plans, batch = fleet
    before = estimate_iteration(model, [dev], plans, batch).time_s

    def slower(link: LinkSpec) -> LinkSpec:
        bw = 1e5 if link.bandwidth_bps is None else link.bandwidth_bps * factor
        return LinkSpec(bw, link.latency_s)

    if which == "up":
        dev = DeviceProfile(dev.slowdown, slower(dev.uplink), dev.downlink, dev.samples)
    elif which == "down":
        dev = DeviceProfile(dev.slowdown, dev.uplink, slower(dev.downlink), dev.samples)
    else:
        dev = DeviceProfile(dev.slowdown, slower(dev.uplink), slower(dev.downlink), dev.samples)
    after = estimate_iteration(model, [dev], plans, batch).time_s
    assert after >= before * (1 - 1e-12)


@settings(max_examples=100, deadline=None)
@given(fleets())
def test_epoch_is_at_least_every_device_alone_and_the_servers_work(
    fleet: tuple[ModelProfile, list[DeviceProfile], list[tuple[int, int]], int],
) -> None:
    model, devices, plans, batch = fleet
    epoch = estimate_epoch(model, devices, plans, batch)
    cache = StageCache(model)
    server = 0.0
    for dev, (p, n) in zip(devices, plans, strict=True):
        iterations = dev.samples // ((batch // n) * n)
        nbytes = model.model_frame_bytes(p)
        st = cache.stages(dev, p, n, batch)
        alone = (
            dev.downlink.transfer_time(nbytes)
            + dev.uplink.transfer_time(nbytes)
            + iterations * alone_floor(st)
        )
        assert epoch >= alone * (1 - 1e-9)
        server += iterations * (n * st.s + st.server_step)
    assert epoch >= server * (1 - 1e-9)


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_a_steady_iteration_is_no_faster_than_any_device_alone(
    fleet: tuple[ModelProfile, list[DeviceProfile], list[tuple[int, int]], int],
) -> None:
    # each iteration starts when the device has stepped and lasts at least its alone floor
    model, devices, plans, batch = fleet
    steady = estimate_steady_iteration(model, devices, plans, batch)
    cache = StageCache(model)
    for dev, (p, n) in zip(devices, plans, strict=True):
        floor = alone_floor(cache.stages(dev, p, n, batch))
        if math.isfinite(floor):
            assert steady >= floor * (1 - 1e-9) - 1e-12


# -- measuring a cost table ------------------------------------------------------------------


def _bn_model() -> torch.nn.Sequential:
    """Three units; the second pools to 1x1 and normalizes: it cannot train on 1 sample."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU()),
        torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.BatchNorm2d(4),
                            torch.nn.Flatten()),
        torch.nn.Linear(4, 3),
    )


def test_measured_costs_cover_every_unit_and_size_and_leave_the_model_alone() -> None:
    model = _bn_model()
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    threads = torch.get_num_threads()
    costs = measure_costs(model, (3, 8, 8), [2, 4], repeats=2, warmup=1, threads=1)
    assert costs.units == 3
    for table in (costs.forward, costs.backward):
        for u in range(3):
            assert set(table[u]) == {2, 4}
            assert all(0 < t < 1 for t in table[u].values())
    assert all(t >= 0 for t in costs.step.values())
    assert costs.step[0] > 0  # the device's step item: hand-over and optimizer overhead
    assert costs.step[2] > 0  # the server's
    # weights, batch-norm statistics, gradients, mode and torch threads are as they were
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
    assert torch.get_num_threads() == threads


def test_a_batch_size_a_unit_cannot_train_at_costs_forever_and_is_never_planned() -> None:
    costs = measure_costs(_bn_model(), (3, 8, 8), [1, 2], repeats=1, warmup=0)
    assert math.isfinite(costs.forward[0][1])  # the first unit trains on one sample
    assert math.isinf(costs.forward[1][1])
    assert math.isinf(costs.backward[2][1])
    assert math.isfinite(costs.forward_time(0, 3, 2))
    model = ModelProfile(costs, (4 * 64 * 4, 16, 12), (0, 0, 0))
    dev = device(4.0, 1e7, 2.5e7, samples=8)
    assert math.isinf(estimate_iteration(model, [dev], [(1, 2)], 2).time_s)  # B' = 1
    assert math.isinf(estimate_epoch(model, [dev], [(1, 2)], 2))
    for fleet in ([dev], [dev, dev]):
        chosen = select_plans(model, fleet, 2, parallel_batches=[1, 2])
        assert all(n == 1 for _, n in chosen)
    assert CostTable.from_mapping(costs.to_mapping()) == costs


def test_stage_overheads_are_charged_to_the_units_every_stage_holds() -> None:
    # no parameters in the first two units: their steps cost only what a step item adds
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(12, 3))
    bare = measure_costs(model, (12,), [2], repeats=1, warmup=0, stage_overheads=False)
    assert bare.step[0] == bare.step[1] == 0.0
    full = measure_costs(model, (12,), [2], repeats=1, warmup=0)
    assert full.step[0] > 0
    assert full.step[1] == 0.0
    assert full.step[2] > 0
    # loading a micro-batch is part of the device's forward, that is unit 0's
    slept: list[int] = []

    def load(batch: int) -> torch.Tensor:
        slept.append(batch)
        time.sleep(0.05)
        return torch.randn(batch, 12)

    loaded = measure_costs(model, (12,), [2], repeats=1, warmup=0, clock="wall",
                           load_batch=load)
    # twice: the one timed forward of unit 0 and the whole model's ([Note: units in
    # sequence]); repeats=1, warmup=0
    assert slept == [2, 2]
    assert loaded.forward[0][2] >= 0.045  # scaled to the whole pass, loading included
    assert loaded.forward[1][2] < 0.05


def test_runtime_overheads_are_charged_per_item_and_per_micro_batch() -> None:
    """[Note: per-stage costs]: a hand-over to every stage's item; a micro-batch's
    messages a quarter to the device's forward and backward, half to the server's pass."""
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(12, 3))
    kwargs = {"repeats": 1, "warmup": 0, "clock": "wall"}
    costs = measure_costs(model, (12,), [2], handover=0.2, message=0.8, **kwargs)
    assert 0.4 <= costs.forward[0][2] < 0.45  # 0.2 + 0.8 / 4
    assert 0.4 <= costs.backward[0][2] < 0.45
    assert 0.6 <= costs.backward[2][2] < 0.65  # 0.2 + 0.8 / 2
    assert costs.forward[1][2] < 0.05
    assert costs.forward[2][2] < 0.05
    assert costs.backward[1][2] < 0.05
    assert 0.2 <= costs.step[0] < 0.25
    assert 0.2 <= costs.step[2] < 0.25
    assert costs.step[1] == 0.0
    bare = measure_costs(model, (12,), [2], handover=0.2, message=0.8,
                         stage_overheads=False, **kwargs)
    assert bare.forward_time(0, 3, 2) < 0.05
    assert bare.step_time(0, 3) < 0.05
    with pytest.raises(ConfigError, match="hand-over and message seconds must be >= 0"):
        measure_costs(model, (12,), [2], message=-1.0, **kwargs)


class _AfterTheLinear(torch.nn.Module):
    """Stands in for memory effects: slow (30 ms) on the first call after the layer
    before it ran, fast (1 ms) when called again on its own; one parameter."""

    def __init__(self, before: torch.nn.Linear) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.before = [before]  # a list: not a submodule
        self.seen = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        calls = int(self.before[0].calls)  # type: ignore[call-overload]
        time.sleep(0.03 if calls != self.seen else 0.001)
        self.seen = calls
        return x * self.scale


class _BurstInSequence(torch.nn.Module):
    """Stands in for a neighbour's burst of load: 40 ms slower on the whole model's
    passes number ``burst`` (1-based; a pass in sequence gets the first unit's own
    output, a pass alone a copy of it)."""

    def __init__(self, before: torch.nn.Module, burst: set[int]) -> None:
        super().__init__()
        self.burst = burst
        self.in_sequence = 0
        self.first_output: list[torch.Tensor] = []
        before.register_forward_hook(self._seen)

    def _seen(self, module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        self.first_output[:] = [output]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first_output and x is self.first_output[0]:
            self.in_sequence += 1
            if self.in_sequence in self.burst:
                time.sleep(0.04)
        return x * 1.0


def test_a_short_burst_of_load_does_not_land_on_one_batch_size() -> None:
    """[Note: units in sequence]: the sizes take turns. One warm-up pass before each of
    three timed passes per size: run in blocks (a warm-up, then three timed), passes 6
    and 7 would be two of size 4's three timed passes (its median 40 ms slow); in turns
    they are one timed pass of size 2 and a warm-up of size 4."""
    first = torch.nn.Linear(4, 3)
    burst = _BurstInSequence(first, {6, 7})
    model = torch.nn.Sequential(first, burst)
    costs = measure_costs(model, (4,), [2, 4], repeats=3, warmup=1, clock="wall")
    assert burst.in_sequence == 12
    assert costs.forward_time(0, 2, 2) < 0.02
    assert costs.forward_time(0, 2, 4) < 0.02


class _SlowAfterAnotherSize(torch.nn.Module):
    """Stands in for what a change of shape costs: 30 ms on a call whose batch size
    differs from the previous call's, 1 ms otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.previous = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03 if len(x) != self.previous else 0.001)
        self.previous = len(x)
        return x * 1.0


def test_each_timed_pass_follows_a_pass_of_its_own_size() -> None:
    """A run's passes follow passes of the same shape; taking turns must not time each
    pass right after another size's."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), _SlowAfterAnotherSize())
    costs = measure_costs(model, (4,), [2, 4], repeats=3, warmup=1, clock="wall")
    assert costs.forward_time(0, 2, 2) < 0.02
    assert costs.forward_time(0, 2, 4) < 0.02


def test_units_are_scaled_to_the_whole_model_run_in_sequence() -> None:
    """[Note: units in sequence]: a unit timed alone runs warm; the run's stages run the
    units one after another. Without the whole model's timing the forward would sum to
    about 1 ms here, and the step to what one unit's optimizer costs."""
    first = torch.nn.Linear(4, 3)
    first.calls = 0  # type: ignore[assignment]
    first.register_forward_hook(lambda m, i, o: setattr(m, "calls", m.calls + 1))
    second = _AfterTheLinear(first)
    model = torch.nn.Sequential(first, second)

    def slow_when_whole(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        held = {id(p) for group in opt.param_groups for p in group["params"]}
        if id(first.weight) in held and id(second.scale) in held:
            time.sleep(0.03)  # a step over every unit's parameters at once

    handle = register_optimizer_step_pre_hook(slow_when_whole)
    try:
        costs = measure_costs(model, (4,), [2], repeats=3, warmup=1, clock="wall")
        bare = measure_costs(model, (4,), [2], repeats=3, warmup=1, clock="wall",
                             stage_overheads=False)
    finally:
        handle.remove()
    assert costs.forward_time(0, 2, 2) >= 0.025
    assert costs.step_time(0, 2) >= 0.025
    # how the time divides among units still comes from the units alone
    assert costs.forward[1][2] > costs.forward[0][2]
    assert bare.forward_time(0, 2, 2) < 0.02
    assert bare.step_time(0, 2) < 0.02


def test_bad_profiling_arguments_are_config_errors() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for kwargs, match in [
        ({"batch_sizes": []}, "batch sizes"),
        ({"batch_sizes": [0]}, "batch sizes"),
        ({"repeats": 0}, "repeats >= 1"),
        ({"warmup": -1}, "warmup >= 0"),
        ({"threads": 0}, "threads"),
        ({"clock": "sundial"}, "clock"),
    ]:
        args = {"batch_sizes": [1], **kwargs}
        with pytest.raises(ConfigError, match=match):
            measure_costs(model, (2,), **args)  # type: ignore[arg-type]


def test_a_cost_table_keeps_its_aggregation_cost() -> None:
    costs = CostTable.uniform(2, forward=1.0, backward=2.0, step=0.5)
    assert costs.aggregate_time(4) == 0.0  # not measured
    costs = dataclasses.replace(costs, aggregate=(0.1, 0.02))
    assert costs.aggregate_time(4) == pytest.approx(0.18)
    assert costs.scaled(2.0).aggregate_time(4) == pytest.approx(0.36)
    assert CostTable.from_mapping(costs.to_mapping()) == costs
    older = {k: v for k, v in costs.to_mapping().items() if k != "aggregate"}
    assert CostTable.from_mapping(older).aggregate == (0.0, 0.0)  # tables saved before it
    with pytest.raises(ConfigError, match="aggregate times must be finite and >= 0"):
        CostTable.from_mapping({**older, "aggregate": {"fixed": -1.0, "per_device": 0.0}})


def test_the_aggregation_is_timed_fixed_and_per_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Work that costs 1 ms plus 4 ms per device comes out as exactly those two parts,
    from timings of 1 and 2 devices. The CPU clock is the test's own (each call of the
    work advances it by its cost): real CPU seconds of any work move by a third beside
    the suite's other worker, which once swapped the parts and once made the fixed part
    negative."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    calls: list[int] = []
    seconds = [0.0]
    monkeypatch.setattr(time, "thread_time", lambda: seconds[0])

    def aggregate(devices: int) -> None:
        calls.append(devices)
        seconds[0] += 0.001 + 0.004 * devices

    costs = measure_costs(model, (12,), [2], repeats=1, warmup=0, aggregate=aggregate,
                          clock="cpu")
    fixed, per_device = costs.aggregate
    assert set(calls) == {1, 2}
    assert math.isclose(fixed, 0.001, rel_tol=1e-6)
    assert math.isclose(per_device, 0.004, rel_tol=1e-6)
    assert measure_costs(model, (12,), [2], repeats=1, warmup=0).aggregate == (0.0, 0.0)


def test_profiling_off_the_cpu_times_elapsed_seconds_only() -> None:
    """Where the work is not the calling thread's (a GPU; here the meta device stands
    in), CPU-time clocks cannot time it: refused, naming the clock."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).to("meta")
    for clock in ("cpu", "shared"):
        with pytest.raises(ConfigError, match='clock must be "auto" or "wall"'):
            measure_costs(model, (4,), [1], clock=clock)
