"""Schedules are data: generators, printing, validation."""

from __future__ import annotations

import pytest

from aiopipe.errors import ConfigError
from aiopipe.scheduler.schedule import Action, check_schedule, one_f_one_b, pipar_order


def _text(actions: tuple[Action, ...]) -> str:
    return " ".join(map(str, actions))


def test_pipar_order_is_all_forwards_then_all_backwards() -> None:
    assert _text(pipar_order(4)) == "F0 F1 F2 F3 B0 B1 B2 B3 STEP"
    assert _text(pipar_order(1)) == "F0 B0 STEP"


@pytest.mark.parametrize(("warmup", "expected"), [
    (1, "F0 B0 F1 B1 F2 B2 F3 B3 STEP"),
    (2, "F0 F1 B0 F2 B1 F3 B2 B3 STEP"),
    (4, "F0 F1 F2 F3 B0 B1 B2 B3 STEP"),
])
def test_one_f_one_b(warmup: int, expected: str) -> None:
    assert _text(one_f_one_b(4, warmup)) == expected


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_generated_schedules_are_valid(n: int) -> None:
    check_schedule(pipar_order(n), n)
    for warmup in range(1, n + 1):
        check_schedule(one_f_one_b(n, warmup), n)


@pytest.mark.parametrize(("actions", "match"), [
    ((Action("B", 0), Action("F", 0), Action("STEP")), "no forward"),
    ((Action("F", 0), Action("F", 0), Action("B", 0), Action("STEP")), "repeats a forward"),
    ((Action("F", 0), Action("STEP"), Action("B", 0)), "not the last"),
    ((Action("F", 0), Action("B", 0)), "end with STEP"),
    ((Action("F", 0), Action("F", 1), Action("B", 0), Action("STEP")), "all 2"),
    ((Action("F", 2), Action("B", 2), Action("STEP")), "outside"),
])
def test_broken_schedules_are_named(actions: tuple[Action, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_schedule(actions, 2)


def test_bad_counts() -> None:
    with pytest.raises(ConfigError):
        pipar_order(0)
    with pytest.raises(ConfigError):
        one_f_one_b(4, 5)
