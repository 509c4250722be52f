"""The generic estimator: hand-computed timelines, PiPar's estimator reproduced, bounds."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aiopipe.errors import ConfigError
from aiopipe.scheduler.actions import Action
from aiopipe.scheduler.chain import Stages, chained_schedule
from aiopipe.scheduler.critical_path import (
    Executor,
    Span,
    Timeline,
    pipeline_executors,
    simulate,
)
from aiopipe.scheduler.schedule import (
    Schedule,
    gpipe,
    one_f_one_b,
    peak_live_activations,
    pipar,
    with_transfers,
)

# stage seconds of the hand-computed PiPar cases (binary fractions: the sums are exact)
F, U, UP_LAT, S, SERVER_STEP, D, DOWN_LAT, B, DEVICE_STEP = (
    1.0, 2.0, 0.5, 3.0, 0.25, 1.5, 0.25, 2.0, 0.5)


def _stages(n: int) -> Stages:
    return Stages(n=n, f=F, b=B, device_step=DEVICE_STEP, u=U, up_latency=UP_LAT, s=S,
                  server_step=SERVER_STEP, d=D, down_latency=DOWN_LAT)


def _pipar_fleet(fleet: Sequence[Stages], rounds: int = 1,
                 starts: Sequence[float] | None = None) -> Timeline:
    """PiPar's fleet as executors ([Note: PiPar as executors])."""
    executors: list[Executor] = []
    for k, stages in enumerate(fleet):
        schedule = with_transfers(pipar(stages.n))
        start = starts[k] if starts is not None else 0.0
        executors += pipeline_executors(schedule, [f"device{k}", "server"], pipeline=k,
                                        iterations=rounds, starts=[start, 0.0])

    def compute_time(e: Executor, a: Action) -> float:
        x = fleet[e.pipeline]
        if a.kind == "STEP":
            return x.device_step if e.stage == 0 else x.server_step
        return {"F": x.f, "B": x.b, "FB": x.s}[a.kind]

    def transfer_time(e: Executor, a: Action) -> tuple[float, float]:
        x = fleet[e.pipeline]
        return (x.u, x.up_latency) if a.kind == "SEND_F" else (x.d, x.down_latency)

    return simulate(executors, compute_time=compute_time, transfer_time=transfer_time)


def _spans(timeline: Timeline, resource: str) -> list[tuple[str, float, float]]:
    return [(str(s.action), s.start, s.end) for s in timeline.spans if s.resource == resource]


# -- hand-computed -----------------------------------------------------------------------------


def test_one_micro_batch_by_hand() -> None:
    # F0 [0, 1]; its activation on the wire [1, 3], arriving 3 + 0.5 = 3.5
    # FB0 [3.5, 6.5]; the gradient on the wire [6.5, 8], arriving 8 + 0.25 = 8.25
    # server STEP right after FB0: [6.5, 6.75]
    # B0 waits for the gradient: [8.25, 10.25]; device STEP [10.25, 10.75]
    t = _pipar_fleet([_stages(1)])
    assert _spans(t, "device0/compute") == [("0F0", 0, 1), ("0B0", 8.25, 10.25),
                                            ("0STEP", 10.25, 10.75)]
    assert _spans(t, "device0->server") == [("0SEND_F0", 1, 3)]
    assert _spans(t, "server/compute") == [("1FB0", 3.5, 6.5), ("1STEP", 6.5, 6.75)]
    assert _spans(t, "server->device0") == [("1SEND_B0", 6.5, 8)]
    assert t.step_ends == {(0, 0): (10.75,), (0, 1): (6.75,)}
    assert t.peak_live == {(0, 0): 1, (0, 1): 1}
    assert t.makespan == 10.75
    assert t.busy() == {"device0/compute": 3.5, "device0->server": 2.0,
                        "server/compute": 3.25, "server->device0": 1.5}


def test_two_micro_batches_by_hand() -> None:
    # F0 [0, 1], F1 [1, 2]
    # uplink: activation 0 [1, 3] arrives 3.5; activation 1 posted at 2 waits for the
    #   link: [3, 5], arrives 5.5
    # server: FB0 [3.5, 6.5]; activation 1 is there, so FB1 [6.5, 9.5]; STEP [9.5, 9.75]
    # downlink: gradient 0 [6.5, 8] arrives 8.25; gradient 1 [9.5, 11] arrives 11.25
    # device: B0 [8.25, 10.25]; B1 waits for gradient 1: [11.25, 13.25];
    #   STEP [13.25, 13.75]
    t = _pipar_fleet([_stages(2)])
    assert _spans(t, "device0/compute") == [
        ("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 8.25, 10.25), ("0B1", 11.25, 13.25),
        ("0STEP", 13.25, 13.75)]
    assert _spans(t, "device0->server") == [("0SEND_F0", 1, 3), ("0SEND_F1", 3, 5)]
    assert _spans(t, "server/compute") == [
        ("1FB0", 3.5, 6.5), ("1FB1", 6.5, 9.5), ("1STEP", 9.5, 9.75)]
    assert _spans(t, "server->device0") == [("1SEND_B0", 6.5, 8), ("1SEND_B1", 9.5, 11)]
    assert t.step_ends == {(0, 0): (13.75,), (0, 1): (9.75,)}
    assert t.peak_live == {(0, 0): 2, (0, 1): 1}
    assert t.makespan == 13.75
    assert t.spans[0] == Span(0, 0, 0, Action(0, "F", 0), "device0/compute", 0.0, 1.0)


def test_two_iterations_and_a_late_start_by_hand() -> None:
    # One micro-batch, two iterations, the device starting at 1: iteration 0 is the
    # first case shifted by 1 (device STEP ends 11.75, server STEP 7.75). Iteration 1:
    # F0 [11.75, 12.75], wire [12.75, 14.75], arrives 15.25; FB0 [15.25, 18.25];
    # server STEP [18.25, 18.5]; gradient [18.25, 19.75] arrives 20; B0 [20, 22];
    # device STEP [22, 22.5].
    t = _pipar_fleet([_stages(1)], rounds=2, starts=[1.0])
    assert t.step_ends == {(0, 0): (11.75, 22.5), (0, 1): (7.75, 18.5)}
    assert [s.iteration for s in t.spans if s.resource == "server/compute"] == [0, 0, 1, 1]


def test_a_node_serves_the_earliest_request_then_the_first_executor() -> None:
    # gpipe(2, 1), both stages on one node, instant transfers, one second per action:
    # 0F0 [0, 1]; 1F0 [1, 2]; 1B0 [2, 3]. At 3 two requests are made: stage 1's STEP
    # (when 1B0 ends) and stage 0's B0 (when gradient 0 arrives, an event handled after
    # that end). The earlier-listed executor goes first ([Note: one instant at a time]):
    # 0B0 [3, 4], then 1STEP, requested at 3, before 0STEP, requested at 4.
    schedule = with_transfers(gpipe(2, 1))

    def run(executors: list[Executor]) -> list[tuple[str, float, float]]:
        t = simulate(executors, compute_time=lambda e, a: 1.0,
                     transfer_time=lambda e, a: (9.0, 9.0))  # never asked: one node
        return _spans(t, "n/compute")

    executors = pipeline_executors(schedule, ["n", "n"])
    assert run(executors) == [("0F0", 0, 1), ("1F0", 1, 2), ("1B0", 2, 3), ("0B0", 3, 4),
                              ("1STEP", 4, 5), ("0STEP", 5, 6)]
    assert run(executors[::-1]) == [("0F0", 0, 1), ("1F0", 1, 2), ("1B0", 2, 3),
                                    ("1STEP", 3, 4), ("0B0", 4, 5), ("0STEP", 5, 6)]


def test_a_link_carries_one_message_at_a_time_in_post_order() -> None:
    # Two pipelines whose first stages share node "a" and last stages node "b". Their
    # F0s take no time, so both activations are posted at 0 on link a->b: pipeline 0's
    # first (its F0 was served first, being listed first): [0, 2], then pipeline 1's
    # [2, 4]; each arrives 1 second after its slot.
    executors = [
        *pipeline_executors(with_transfers(pipar(1)), ["a", "b"], pipeline=0),
        *pipeline_executors(with_transfers(pipar(1)), ["a", "b"], pipeline=1),
    ]
    t = simulate(executors, compute_time=lambda e, a: 0.0 if a.kind == "F" else 1.0,
                 transfer_time=lambda e, a: (2.0, 1.0))
    assert [(s.pipeline, s.start, s.end) for s in t.spans if s.resource == "a->b"] == [
        (0, 0.0, 2.0), (1, 2.0, 4.0)]
    assert [(s.pipeline, s.start) for s in t.spans if s.action.kind == "FB"] == [
        (0, 3.0), (1, 5.0)]


# -- deadlock and misuse -------------------------------------------------------------------


def test_a_deadlock_names_each_stuck_executor() -> None:
    device = tuple(map(Action.parse, ["0RECV_B0", "0F0", "0SEND_F0", "0B0", "0STEP"]))
    server = tuple(map(Action.parse, ["1RECV_F0", "1FB0", "1SEND_B0", "1STEP"]))
    executors = [Executor(3, 0, "device", device), Executor(3, 1, "server", server)]
    with pytest.raises(ConfigError, match=(
            "pipeline 3 stage 0 iteration 0 waits at position 0 on 0RECV_B0; "
            "pipeline 3 stage 1 iteration 0 waits at position 0 on 1RECV_F0")):
        simulate(executors, compute_time=lambda e, a: 1.0,
                 transfer_time=lambda e, a: (1.0, 0.0))


def test_a_stage_running_more_iterations_than_its_neighbour_is_stuck() -> None:
    device, server = with_transfers(pipar(1)).actions
    executors = [Executor(0, 0, "d", device, iterations=2), Executor(0, 1, "s", server)]
    with pytest.raises(ConfigError, match=(
            r"never come: pipeline 0 stage 0 iteration 1 waits at position 2 on 0RECV_B0$")):
        simulate(executors, compute_time=lambda e, a: 1.0,
                 transfer_time=lambda e, a: (1.0, 0.0))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"pipeline": -1}, "pipeline"),
    ({"stage": True}, "stage"),
    ({"node": ""}, "node"),
    ({"actions": [Action(0, "STEP")]}, "tuple"),
    ({"actions": (Action(1, "STEP"),)}, "not an action of stage 0"),
    ({"iterations": 0}, "iterations"),
    ({"start": -1.0}, "start"),
    ({"start": math.inf}, "start"),
])
def test_bad_executors_are_refused(kwargs: dict[str, object], match: str) -> None:
    fields: dict[str, object] = {"pipeline": 0, "stage": 0, "node": "n",
                                 "actions": (Action(0, "STEP"),)}
    with pytest.raises(ConfigError, match=match):
        Executor(**{**fields, **kwargs})  # type: ignore[arg-type]


def test_misuse_is_refused() -> None:
    device, server = with_transfers(pipar(1)).actions

    def unit(e: Executor, a: Action) -> float:
        return 1.0

    def wire(e: Executor, a: Action) -> tuple[float, float]:
        return (1.0, 0.0)

    with pytest.raises(ConfigError, match="two executors for pipeline 0, stage 0"):
        simulate([Executor(0, 0, "a", device), Executor(0, 0, "b", device)],
                 compute_time=unit, transfer_time=wire)
    with pytest.raises(ConfigError, match="0SEND_F0 at position 1 needs an executor at stage 1"):
        simulate([Executor(0, 0, "a", device)], compute_time=unit, transfer_time=wire)
    both = [Executor(0, 0, "a", device), Executor(0, 1, "b", server)]
    with pytest.raises(ConfigError, match="compute time of 0F0 must be a number >= 0"):
        simulate(both, compute_time=lambda e, a: -1.0, transfer_time=wire)
    with pytest.raises(ConfigError, match="latency of 0SEND_F0"):
        simulate(both, compute_time=unit, transfer_time=lambda e, a: (1.0, math.nan))
    with pytest.raises(ConfigError, match="no transfers: pass with_transfers"):
        pipeline_executors(pipar(1), ["a", "b"])
    with pytest.raises(ConfigError, match="1 nodes for 2 stages"):
        pipeline_executors(with_transfers(pipar(1)), ["a"])
    with pytest.raises(ConfigError, match="1 starts for 2 stages"):
        pipeline_executors(with_transfers(pipar(1)), ["a", "b"], starts=[0.0])


def test_an_endless_action_ends_at_infinity() -> None:
    t = _pipar_fleet([_stages(1)._replace(s=math.inf)])
    assert t.step_ends[(0, 1)] == (math.inf,)
    assert t.makespan == math.inf


# -- PiPar's estimator, reproduced ---------------------------------------------------------

# Times from a small grid make ties (equal request times) common; free floats do not.
_TIME = st.one_of(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0]),
                  st.floats(0.001, 10.0, allow_nan=False, allow_infinity=False))
_WIRE = st.one_of(st.just(0.0), _TIME)


@st.composite
def _fleets(draw: st.DrawFn) -> tuple[list[Stages], int, list[float]]:
    count = draw(st.integers(1, 4))
    fleet = [Stages(n=draw(st.integers(1, 6)), f=draw(_TIME), b=draw(_TIME),
                    device_step=draw(_TIME), u=draw(_WIRE), up_latency=draw(_WIRE),
                    s=draw(_TIME), server_step=draw(_TIME), d=draw(_WIRE),
                    down_latency=draw(_WIRE))
             for _ in range(count)]
    starts = [draw(st.one_of(st.just(0.0), _TIME)) for _ in range(count)]
    return fleet, draw(st.integers(1, 3)), starts


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_fleets())
# At 2.75 device 1's replica asks for its STEP as device 0's next activation arrives over
# a link with no wire time nor latency: both requests compete, and device 0's goes first
# ([Note: one instant at a time]).
@pytest.mark.slow
@example(([Stages(1, 1.0, 0.25, 0.25, 0.0, 0.0, 0.25, 0.25, 0.0, 0.0),
           Stages(1, 1.0, 0.25, 0.25, 0.25, 1.0, 0.25, 0.25, 0.0, 0.0)], 2, [0.0, 0.25]))
def test_pipar_executors_reproduce_the_pipar_estimator(
        case: tuple[list[Stages], int, list[float]]) -> None:
    """Step ends equal `chained_schedule`'s to the last bit ([Note: PiPar as executors]),
    which is stronger than the 1e-12 relative the estimator's users need."""
    fleet, rounds, starts = case
    device_ends, replica_ends = chained_schedule(fleet, rounds, starts)
    t = _pipar_fleet(fleet, rounds, starts)
    for k in range(len(fleet)):
        assert t.step_ends[(k, 0)] == tuple(device_ends[k])
        assert t.step_ends[(k, 1)] == tuple(replica_ends[k])


# -- bounds ------------------------------------------------------------------------------------


@st.composite
def _runs(draw: st.DrawFn) -> tuple[list[Executor], dict[tuple[int, str], float],
                                    dict[tuple[int, str], tuple[float, float]]]:
    """Up to three pipelines of any generator, their stages on a few shared nodes."""
    executors: list[Executor] = []
    for pipeline in range(draw(st.integers(1, 3))):
        stages, n = draw(st.integers(1, 4)), draw(st.integers(1, 5))
        schedule: Schedule = draw(st.sampled_from([
            gpipe(stages, n), one_f_one_b(stages, n), pipar(n)]))
        nodes = [draw(st.sampled_from("abcd")) for _ in range(schedule.stages)]
        executors += pipeline_executors(with_transfers(schedule), nodes, pipeline=pipeline,
                                        iterations=draw(st.integers(1, 2)))
    compute = {(p, kind): draw(_TIME) for p in range(4) for kind in ("F", "B", "FB", "STEP")}
    wire = {(p, kind): (draw(_WIRE), draw(_WIRE)) for p in range(4)
            for kind in ("SEND_F", "SEND_B")}
    return executors, compute, wire


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_runs())
def test_bounds_and_peaks(case: tuple[list[Executor], dict[tuple[int, str], float],
                                      dict[tuple[int, str], tuple[float, float]]]) -> None:
    executors, compute, wire = case
    spent: list[float] = []

    def compute_time(e: Executor, a: Action) -> float:
        spent.append(compute[(e.stage, a.kind)])
        return spent[-1]

    def transfer_time(e: Executor, a: Action) -> tuple[float, float]:
        spent.extend(wire[(e.stage, a.kind)])
        return wire[(e.stage, a.kind)]

    t = simulate(executors, compute_time=compute_time, transfer_time=transfer_time)
    busy = t.busy()
    assert all(t.makespan >= b for b in busy.values())
    assert t.makespan <= sum(spent) * (1 + 1e-12)
    # every compute action ran once per iteration, and a resource does one thing at once
    assert sum(1 for s in t.spans if s.action.is_compute) == sum(
        e.iterations * sum(a.is_compute for a in e.actions) for e in executors)
    for resource in busy:
        spans = sorted((s.start, s.end) for s in t.spans if s.resource == resource)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    for e in executors:
        assert t.peak_live[e.key] == peak_live_activations(e.actions)
        assert len(t.step_ends[e.key]) == e.iterations
