"""FTPipeHD's chain replication pieces (aiopipe.runtime.systems.ftpipehd.chain): what a
device holds and accepts from its peer, what it answers, and how the coordinator gathers
a whole state."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from aiopipe import models
from aiopipe.errors import RemoteProtocolError
from aiopipe.protocol import Replica, ReplicaRequest, state_to_wire
from aiopipe.runtime.stage import check_tensors
from aiopipe.runtime.systems.ftpipehd.chain import (
    ChainReplicas,
    expected_tensors,
    gather,
    gather_from,
)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def _state(model: nn.Sequential, first: int, stop: int) -> dict[str, Any]:
    stage = models.units_of(model, first, stop)
    state = {k: v.clone() for k, v in stage.state_dict().items()}
    state.update({f"momentum:{k}": torch.zeros_like(p) for k, p in stage.named_parameters()})
    return state_to_wire(state)


def _assignment(**fields: Any) -> Any:
    """Stage 1 (units 2..3) of 2, round 7, 10 batches; device0 runs stage 0."""
    values = {"stage": 1, "version": 7, "parallel_batches": 10, "first_unit": 2, **fields}
    return SimpleNamespace(**values, peer_at=lambda stage: "device0" if stage == 0 else None)


def test_a_peer_s_replica_is_held_and_answered() -> None:
    model = _model()
    chain = ChainReplicas(model, momentum=True, every=3)
    for batches in (3, 6, 9):
        chain.accept("device0", Replica(7, 0, batches, 0.0, 0, _state(model, 0, 2)),
                     _assignment())
    assert sorted(chain.held[0]) == [6, 9]  # the latest two
    held, missing = chain.answer(ReplicaRequest(7, 9, (0, 1)))
    assert held.batches == 9
    assert set(held.tensors) == set(_state(model, 0, 2))
    assert (missing.stage, missing.tensors) == (1, {})
    assert not chain.answer(ReplicaRequest(6, 9, (0,)))[0].tensors  # another round's


def test_a_replica_of_an_attempt_given_up_on_is_dropped() -> None:
    model = _model()
    chain = ChainReplicas(model, momentum=True, every=3)
    chain.accept("device0", Replica(6, 0, 3, 0.0, 0, _state(model, 0, 2)), _assignment())
    assert chain.held == {}


@pytest.mark.parametrize(("sender", "replica", "match"), [
    ("device5", Replica(7, 0, 3, 0.0, 0, {}), "does not run the stage before ours"),
    # (the protocol's round 7 is the log's round 8: people count from 1)
    ("device0", Replica(8, 0, 3, 0.0, 0, {}), "not of stage 0 in round 8"),
    ("device0", Replica(7, 1, 3, 0.0, 0, {}), "not of stage 0 in round 8"),
    ("device0", Replica(7, 0, 4, 0.0, 0, {}), "not at a chain point"),
    ("device0", Replica(7, 0, 0, 0.0, 0, {}), "not at a chain point"),
    ("device0", Replica(7, 0, 12, 0.0, 0, {}), "not at a chain point"),
])
def test_a_replica_that_breaks_the_plan_is_refused(sender: str, replica: Replica,
                                                   match: str) -> None:
    chain = ChainReplicas(_model(), momentum=True, every=3)
    with pytest.raises(RemoteProtocolError, match=match):
        chain.accept(sender, replica, _assignment())
    assert chain.held == {}


def _tampered(model: nn.Sequential, how: str) -> Mapping[str, Any]:
    state = dict(_state(model, 0, 2))
    if how == "ours":  # tensors of our own units
        state.update(_state(model, 2, 4))
    elif how == "missing":
        del state["1.running_mean"]
    elif how == "shape":
        state["0.bias"] = state_to_wire({"x": torch.zeros(7)})["x"]
    elif how == "nan":
        state["0.weight"] = state_to_wire({"x": torch.full((6, 4), float("nan"))})["x"]
    elif how == "name":
        state["evil"] = state["0.bias"]
    return state


@pytest.mark.parametrize(("how", "match"), [
    ("ours", "not of a unit before unit 2"), ("missing", "does not hold its stage's tensors"),
    ("shape", "0.bias is float32"), ("nan", "NaN or Inf"), ("name", "not of a unit")])
def test_a_replica_whose_tensors_are_not_the_stage_s_is_refused(how: str, match: str) -> None:
    model = _model()
    chain = ChainReplicas(model, momentum=True, every=3)
    with pytest.raises(RemoteProtocolError, match=match):
        chain.accept("device0", Replica(7, 0, 3, 0.0, 0, _tampered(model, how)), _assignment())


def _member(**fields: Any) -> Any:
    """Asteroid: device1, the first member of stage 1 (units 2..3) of 2, in round 7 of
    iterations 4..13; ``groups``: each stage's members (default device0 alone runs
    stage 0, devices 1 and 2 stage 1)."""
    groups = fields.pop("groups", {0: ["device0"], 1: ["device1", "device2"]})
    values = {"me": "device1", "round": 7, "stage": 1, "stages": 2, "first_unit": 2,
              "first_iteration": 4, "iterations": 10, **fields}
    return SimpleNamespace(**values, members_at=lambda stage: [
        (name, (i, i + 1)) for i, name in enumerate(groups.get(stage, []))])


def test_a_backup_of_the_stage_before_is_held_by_its_backup_node() -> None:
    """Asteroid's stage backups ([Note: stage backups]): the only device of the stage
    before ours backs it up to us, the first member of ours; the last stage's goes to
    the first stage's first member."""
    model = _model()
    chain = ChainReplicas(model, momentum=True, every=3)
    chain.accept_backup("device0", Replica(7, 0, 6, 0.0, 0, _state(model, 0, 2)), _member())
    assert sorted(chain.held[0]) == [6]
    first = _member(me="device0", stage=0, first_unit=0,
                    groups={0: ["device0", "device3"], 1: ["device1"]})
    chain.accept_backup("device1", Replica(7, 1, 9, 0.0, 0, _state(model, 2, 4)), first)
    assert sorted(chain.held[1]) == [9]
    chain.accept_backup("device1", Replica(6, 1, 12, 0.0, 0, _state(model, 2, 4)), first)
    assert sorted(chain.held[1]) == [9]  # of an attempt given up on: dropped
    assert chain.own(1, 9, 7) is not None
    assert chain.own(1, 9, 6) is None


@pytest.mark.parametrize(("sender", "member", "replica", "match"), [
    ("device2", {}, Replica(7, 0, 6, 0.0, 0, {}), "not its backup node"),
    ("device0", {"me": "device2"}, Replica(7, 0, 6, 0.0, 0, {}), "not its backup node"),
    ("device0", {"groups": {0: ["device0", "device5"], 1: ["device1"]}},
     Replica(7, 0, 6, 0.0, 0, {}), "not its backup node"),
    ("device0", {}, Replica(7, 1, 6, 0.0, 0, {}), "not of stage 0"),
    ("device0", {}, Replica(7, 0, 4, 0.0, 0, {}), "at a backup point of batches 4..13"),
    ("device0", {}, Replica(7, 0, 5, 0.0, 0, {}), "at a backup point"),
    ("device0", {}, Replica(7, 0, 15, 0.0, 0, {}), "at a backup point"),
])
def test_a_backup_that_breaks_the_plan_is_refused(sender: str, member: dict[str, Any],
                                                  replica: Replica, match: str) -> None:
    chain = ChainReplicas(_model(), momentum=True, every=3)
    with pytest.raises(RemoteProtocolError, match=match):
        chain.accept_backup(sender, replica, _member(**member))
    assert chain.held == {}


@pytest.mark.parametrize(("how", "match"), [
    ("ours", "not of a unit before unit 2"), ("missing", "does not hold its stage's tensors"),
    ("nan", "NaN or Inf")])
def test_a_backup_whose_tensors_are_not_the_stage_s_is_refused(how: str, match: str) -> None:
    model = _model()
    chain = ChainReplicas(model, momentum=True, every=3)
    with pytest.raises(RemoteProtocolError, match=match):
        chain.accept_backup("device0", Replica(7, 0, 6, 0.0, 0, _tampered(model, how)),
                            _member())


def test_the_frame_limit_fits_the_whole_model_and_momentum() -> None:
    model = _model()
    chain = ChainReplicas(model, momentum=True, every=3)
    whole = 4 * (sum(p.numel() for p in model.parameters()) * 2 + 2 * 6) + 8
    assert whole < chain.frame_limit < whole + 64 * 1024


class _Source:
    """The coordinator as `gather` sees it: the last stage's replicas, and each device's
    holdings (stage -> batches)."""

    def __init__(self, last: dict[int, Replica], holdings: dict[int, dict[int, set[int]]],
                 model: nn.Sequential, bounds: list[tuple[int, int]]) -> None:
        self.last, self.holdings, self.model, self.bounds = last, holdings, model, bounds
        self.asked: list[tuple[int, ReplicaRequest]] = []

    def chained(self, round_no: int) -> Mapping[int, Replica]:
        return self.last if round_no == 7 else {}

    async def replicas(self, device_id: int, request: ReplicaRequest) -> list[Replica]:
        self.asked.append((device_id, request))
        answers = []
        for stage in request.stages:
            held = request.batches in self.holdings.get(device_id, {}).get(stage, set())
            answers.append(Replica(7, stage, request.batches, 0.0, 0,
                                   _state(self.model, *self.bounds[stage]) if held else {}))
        return answers


def _gather(source: _Source, alive: list[int], check: Any = None) -> Any:
    return asyncio.run(gather(source, 7, [0, 1, 2], alive,
                              check or (lambda stage, replica: True)))


def _three_stages(holdings: dict[int, dict[int, set[int]]], last: tuple[int, ...] = (3, 6)
                  ) -> _Source:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3))
    bounds = [(0, 1), (1, 2), (2, 3)]
    return _Source({b: Replica(7, 2, b, 1.5, 2, _state(model, 2, 3)) for b in last},
                   holdings, model, bounds)


def test_gather_takes_the_latest_point_every_stage_reached() -> None:
    source = _three_stages({0: {0: {3, 6}}, 1: {1: {3, 6}, 0: {3, 6}}, 2: {1: {3, 6}}})
    batches, replicas = _gather(source, [0, 1, 2])
    assert batches == 6
    assert [r.stage for r in replicas] == [0, 1, 2]
    assert replicas[2].loss_sum == 1.5  # the last stage's, from the coordinator
    assert {d for d, _ in source.asked} == {0, 1}  # the owners answered: no one else asked


def test_gather_falls_back_to_the_point_before_when_the_first_stage_lags() -> None:
    source = _three_stages({0: {0: {3}}, 1: {1: {3, 6}}})
    batches, _ = _gather(source, [0, 1, 2])
    assert batches == 3


def test_gather_asks_the_next_stage_s_device_for_a_lost_one_s_stage() -> None:
    source = _three_stages({0: {0: {6}}, 2: {1: {6}}})  # device 1 is gone
    batches, replicas = _gather(source, [0, 2])
    assert batches == 6
    assert replicas[1].stage == 1
    assert (2, ReplicaRequest(7, 6, (1,))) in source.asked


def test_gather_finds_nothing_when_a_stage_and_its_next_are_both_gone() -> None:
    source = _three_stages({0: {0: {3, 6}}})
    assert _gather(source, [0]) is None


def test_gather_leaves_out_what_check_refuses() -> None:
    source = _three_stages({0: {0: {3, 6}}, 1: {1: {3, 6}}})
    batches, _ = _gather(source, [0, 1, 2], check=lambda stage, r: not (
        stage == 0 and r.batches == 6))
    assert batches == 3


def test_check_tensors_names_what_differs() -> None:
    model = _model()
    expected = expected_tensors(models.units_of(model, 0, 2), momentum=False)
    with pytest.raises(RemoteProtocolError, match="missing"):
        check_tensors({}, expected, "it")


def test_gather_skips_to_the_latest_point_the_holders_say_they_have() -> None:
    """A holder that lacks a point answers with the latest it holds below it: after one
    miss the coordinator asks for that point at once, not for every one between."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    bounds = [(0, 1), (1, 2)]
    chains = {d: ChainReplicas(model, momentum=True, every=5) for d in (0, 1)}
    for d in (0, 1):
        for batches in (15, 20):
            chains[d].keep(Replica(7, d, batches, 0.0, 0, _state(model, *bounds[d])))
    asked: list[int] = []

    class Devices:
        def chained(self, round_no: int) -> Mapping[int, Replica]:
            return {}

        async def replicas(self, device_id: int, request: ReplicaRequest) -> list[Replica]:
            asked.append(request.batches)
            return chains[device_id].answer(request)

    points = list(range(95, 0, -5))
    found = asyncio.run(gather_from(Devices(), 7, points, [[0], [1]], [0, 1],
                                    lambda stage, replica: True))
    assert found is not None
    assert found[0] == 20
    assert sorted(set(asked)) == [20, 95]  # one miss, then the point they hold
