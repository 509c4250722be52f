"""Placement: PiPar's star and a chain as stages of unit ranges on member nodes."""

from __future__ import annotations

import pytest

from aiopipe.errors import ConfigError
from aiopipe.scheduler.placement import Pipeline, Placement, Stage, chain, star


def test_pipar_is_two_stage_pipelines_sharing_the_server() -> None:
    placement = star([2, 3, 5], 5)
    first, second, third = placement.pipelines
    assert first.stages == (Stage(0, 2, ("device0",)), Stage(2, 5, ("server",)))
    assert second.stages == (Stage(0, 3, ("device1",)), Stage(3, 5, ("server",)))
    assert third.stages == (Stage(0, 5, ("device2",)),)  # fl: the whole model on it
    assert placement.nodes() == ["device0", "server", "device1", "device2"]
    assert first.neighbours("device0") == [(1, "server")]
    assert first.stage_of("server") == 1


def test_a_chain_puts_stage_p_on_node_p() -> None:
    placement = chain([1, 3], 5, ["a", "b", "c"])
    (pipeline,) = placement.pipelines
    assert [(s.first_unit, s.stop_unit, s.members) for s in pipeline.stages] == [
        (0, 1, ("a",)), (1, 3, ("b",)), (3, 5, ("c",))]
    assert pipeline.neighbours("b") == [(0, "a"), (2, "c")]
    assert pipeline.neighbours("a") == [(1, "b")]


def test_a_stage_may_be_a_group_whose_neighbours_are_every_member() -> None:
    group = Pipeline((Stage(0, 2, ("a",)), Stage(2, 4, ("b1", "b2")), Stage(4, 5, ("c",))))
    Placement(5, (group,))
    assert group.neighbours("a") == [(1, "b1"), (1, "b2")]
    assert group.neighbours("b2") == [(0, "a"), (2, "c")]


@pytest.mark.parametrize(("make", "match"), [
    (lambda: chain([3, 2], 5, ["a", "b", "c"]), "not increasing"),
    (lambda: chain([0], 5, ["a", "b"]), "not increasing"),
    (lambda: chain([5], 5, ["a", "b"]), "not increasing"),
    (lambda: chain([2], 5, ["a"]), "need 2 nodes"),
    (lambda: star([0], 5), "outside 1..5"),
    (lambda: Placement(5, (Pipeline((Stage(0, 2, ("a",)), Stage(3, 5, ("b",)))),)),
     "do not cover"),
    (lambda: Placement(5, (Pipeline((Stage(0, 4, ("a",)),)),)), "do not cover"),
    (lambda: Stage(2, 2, ("a",)), "needs units"),
    (lambda: Stage(0, 2, ("a", "a")), "distinct members"),
    (lambda: Pipeline((Stage(0, 1, ("a",)),)).stage_of("b"), "runs no stage"),
])
def test_bad_placements_are_refused_with_the_reason(make: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()  # type: ignore[operator]
