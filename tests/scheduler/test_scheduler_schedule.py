"""Schedules are data: actions, generators, transfers, validation, grids."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from aiopipe.errors import ConfigError
from aiopipe.scheduler.actions import COMPUTE_KINDS, TRANSFER_KINDS, Action
from aiopipe.scheduler.schedule import (
    Schedule,
    check_schedule,
    check_stage_actions,
    format_grid,
    gpipe,
    one_f_one_b,
    peak_live_activations,
    pipar,
    with_reductions,
    with_transfers,
)

GOLDEN = Path(__file__).parent / "golden"


def _text(actions: tuple[Action, ...]) -> str:
    return " ".join(map(str, actions))


def _schedule(*stages: str, n: int = 2, name: str = "hand") -> Schedule:
    """A schedule from one text per stage, e.g. ``"0F0 0B0 0STEP"``."""
    return Schedule(name, n, tuple(tuple(Action.parse(t) for t in s.split()) for s in stages))


# -- actions -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "0F3", "1B2", "3FB0", "2SEND_F1", "1RECV_B0", "0STEP", "1REDUCE", "12RECV_F10",
    "4SEND_B7",
])
def test_action_text_round_trips(text: str) -> None:
    action = Action.parse(text)
    assert str(action) == text
    assert Action.parse(str(action)) == action


def test_action_fields_and_kinds() -> None:
    assert Action.parse("3FB0") == Action(3, "FB", 0)
    assert Action.parse("0STEP") == Action(0, "STEP")
    assert Action(0, "STEP").micro_batch == -1
    for kind in COMPUTE_KINDS:
        mb = -1 if kind in ("STEP", "REDUCE") else 0
        assert Action(0, kind, mb).is_compute
        assert not Action(0, kind, mb).is_transfer
    for kind in TRANSFER_KINDS:
        assert Action(1, kind, 0).is_transfer
        assert not Action(1, kind, 0).is_compute


@pytest.mark.parametrize("text", ["", "F0", "0F", "0STEP1", "0X1", "0F-1", "a0F1", "0 F1",
                                  "0FB", "0SEND1"])
def test_bad_action_text_is_refused(text: str) -> None:
    with pytest.raises(ConfigError):
        Action.parse(text)


@pytest.mark.parametrize(("args", "match"), [
    ((-1, "F", 0), "stage"),
    ((True, "F", 0), "stage"),
    ((0, "X", 0), "unknown action kind"),
    ((0, "F"), "needs a micro-batch"),
    ((0, "SEND_F", -2), "needs a micro-batch"),
    ((0, "STEP", 0), "has no micro-batch"),
    ((0, "REDUCE", 1), "has no micro-batch"),
])
def test_bad_actions_are_refused(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Action(*args)  # type: ignore[arg-type]


# -- generators ----------------------------------------------------------------------------


def test_pipar_is_all_forwards_then_all_backwards_and_server_passes() -> None:
    s = pipar(4)
    assert (s.name, s.micro_batches, s.stages) == ("pipar", 4, 2)
    assert _text(s.actions[0]) == "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0STEP"
    assert _text(s.actions[1]) == "1FB0 1FB1 1FB2 1FB3 1STEP"
    assert _text(pipar(1).actions[0]) == "0F0 0B0 0STEP"


def test_pipar_with_transfers() -> None:
    s = with_transfers(pipar(2))
    assert _text(s.actions[0]) == "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0STEP"
    assert _text(s.actions[1]) == "1RECV_F0 1FB0 1SEND_B0 1RECV_F1 1FB1 1SEND_B1 1STEP"
    assert s.has_transfers()
    assert not pipar(2).has_transfers()
    assert s.compute_only() == pipar(2)


def test_gpipe() -> None:
    s = gpipe(3, 2)
    assert [_text(a) for a in s.actions] == [
        "0F0 0F1 0B0 0B1 0STEP", "1F0 1F1 1B0 1B1 1STEP", "2F0 2F1 2B0 2B1 2STEP"]
    assert _text(with_transfers(s).actions[1]) == (
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 "
        "1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1 1STEP")


def test_one_f_one_b_default_warmup() -> None:
    s = one_f_one_b(3, 8)
    assert _text(s.actions[0]) == (
        "0F0 0F1 0F2 0F3 0F4 0B0 0F5 0B1 0F6 0B2 0F7 0B3 0B4 0B5 0B6 0B7 0STEP")
    assert _text(s.actions[1]) == "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 " \
                                  "1B6 1B7 1STEP"
    assert _text(s.actions[2]) == "2FB0 2FB1 2FB2 2FB3 2FB4 2FB5 2FB6 2FB7 2STEP"
    # capped at N
    assert _text(one_f_one_b(3, 2).actions[0]) == "0F0 0F1 0B0 0B1 0STEP"
    assert _text(one_f_one_b(1, 2).actions[0]) == "0FB0 0FB1 0STEP"


@pytest.mark.parametrize(("warmup", "expected"), [
    ((4, 1), "1FB0 1FB1 1FB2 1FB3 1STEP"),
    ((4, 2), "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3 1STEP"),
    ((4, 4), "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3 1STEP"),
])
def test_one_f_one_b_given_warmup(warmup: tuple[int, int], expected: str) -> None:
    assert _text(one_f_one_b(2, 4, warmup).actions[1]) == expected


@pytest.mark.parametrize(("warmup", "match"), [
    ((1,), "one value per stage"),
    ((3, 0), r"stage 1 must be an int in 1\.\.3"),
    ((4, 1), r"stage 0 must be an int in 1\.\.3"),
    ((2, 3), "grows from stage 0 .2. to stage 1 .3."),
])
def test_bad_warmups_are_refused(warmup: tuple[int, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        one_f_one_b(2, 3, warmup)


@pytest.mark.parametrize("call", [
    lambda: pipar(0), lambda: gpipe(0, 1), lambda: gpipe(1, 0), lambda: one_f_one_b(0, 1),
    lambda: one_f_one_b(2, True),
])
def test_bad_counts_are_refused(call: object) -> None:
    with pytest.raises(ConfigError, match="at least one"):
        call()  # type: ignore[operator]


@pytest.mark.parametrize(("stages", "n"), list(itertools.product(range(1, 6), range(1, 9))))
def test_generated_schedules_pass_every_check(stages: int, n: int) -> None:
    for s in (gpipe(stages, n), one_f_one_b(stages, n)):
        check_schedule(s)
        check_schedule(with_transfers(s))


@pytest.mark.parametrize("n", list(range(1, 17)))
def test_pipar_passes_every_check(n: int) -> None:
    check_schedule(pipar(n))
    check_schedule(with_transfers(pipar(n)))


@pytest.mark.parametrize(("stages", "n"), [(2, 3), (3, 3), (3, 4), (4, 2)])
def test_every_allowed_warmup_passes_and_a_growing_one_deadlocks(stages: int, n: int) -> None:
    for warmup in itertools.product(range(1, n + 1), repeat=stages):
        if all(a >= b for a, b in itertools.pairwise(warmup)):
            check_schedule(with_transfers(one_f_one_b(stages, n, warmup)))
        else:
            with pytest.raises(ConfigError, match="grows"):
                one_f_one_b(stages, n, warmup)


@pytest.mark.parametrize(("stages", "n"), list(itertools.product(range(1, 6), range(1, 9))))
def test_peak_live_activations(stages: int, n: int) -> None:
    for actions in with_transfers(gpipe(stages, n)).actions:
        assert peak_live_activations(actions) == n
    for p, actions in enumerate(with_transfers(one_f_one_b(stages, n)).actions):
        assert peak_live_activations(actions) == min(2 * (stages - p) - 1, n)
    device, server = with_transfers(pipar(n)).actions
    assert (peak_live_activations(device), peak_live_activations(server)) == (n, 1)


# -- the schedule value --------------------------------------------------------------------


@pytest.mark.parametrize(("args", "match"), [
    (("", 1, ((Action(0, "STEP"),),)), "name"),
    (("x", 0, ((Action(0, "STEP"),),)), "micro-batch"),
    (("x", 1, ()), "at least one stage"),
    (("x", 1, [(Action(0, "STEP"),)]), "at least one stage"),
    (("x", 1, ([Action(0, "STEP")],)), "stage 0 is not a tuple"),
    (("x", 1, (("0STEP",),)), "stage 0 is not a tuple"),
])
def test_bad_schedule_values_are_refused(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Schedule(*args)  # type: ignore[arg-type]


def test_transfers_are_added_once() -> None:
    with pytest.raises(ConfigError, match="already has transfers"):
        with_transfers(with_transfers(pipar(2)))


def _reduce_inline(schedule: Schedule, groups: list[tuple[int, ...]]) -> Schedule:
    """What Asteroid's ``_schedule`` did inline before `with_reductions` (kept as the
    reference it must match)."""
    actions = tuple(
        tuple(a for b in stage_actions for a in (
            (Action(p, "REDUCE"), b) if b.kind == "STEP" and len(groups[p]) > 1
            else (b,)))
        for p, stage_actions in enumerate(schedule.actions))
    return Schedule(schedule.name, schedule.micro_batches, actions)


@pytest.mark.parametrize("groups", [
    [(0, 1), (2,), (3, 4, 5)], [(0,), (1,), (2,)], [(0, 1), (2, 3), (4, 5)],
])
def test_reductions_match_asteroids_inline_pass(groups: list[tuple[int, ...]]) -> None:
    schedule = with_transfers(one_f_one_b(3, 4))
    grouped = {p for p, group in enumerate(groups) if len(group) > 1}
    reduced = with_reductions(schedule, grouped)
    assert reduced == _reduce_inline(schedule, groups)
    check_schedule(reduced)
    assert reduced.compute_only() == with_reductions(schedule.compute_only(), grouped)
    for p, (before, after) in enumerate(zip(schedule.actions, reduced.actions, strict=True)):
        assert after == ((*before[:-1], Action(p, "REDUCE"), before[-1]) if p in grouped
                         else before)


def test_reductions_refuse_unknown_stages_and_a_second_pass() -> None:
    schedule = one_f_one_b(2, 2)
    assert with_reductions(schedule, ()) == schedule
    with pytest.raises(ConfigError, match=r"stages 0..1, not \[2\]"):
        with_reductions(schedule, [0, 2])
    with pytest.raises(ConfigError, match="stage 1 already has a REDUCE"):
        with_reductions(with_reductions(schedule, [1]), [0, 1])


def test_reduce_before_step_is_allowed() -> None:
    check_schedule(_schedule("0F0 0F1 0B0 0B1 0REDUCE 0STEP", "1FB0 1FB1 1REDUCE 1STEP"))
    check_schedule(with_transfers(_schedule("0F0 0B0 0REDUCE 0STEP", "1FB0 1STEP", n=1)))


# -- broken schedules, one per rule ------------------------------------------------------------

PIPAR_1 = ("0F0 0SEND_F0 0RECV_B0 0B0 0STEP", "1RECV_F0 1FB0 1SEND_B0 1STEP")


@pytest.mark.parametrize(("stages", "match"), [
    # every action's stage is its stage's index
    (("0F0 0F1 1B0 0B1 0STEP", "1FB0 1FB1 1STEP"),
     r"stage 0 position 2 \(1B0\): an action of stage 1 in stage 0's list"),
    # micro-batches in 0..N-1
    (("0F0 0F2 0B0 0B2 0STEP", "1FB0 1FB1 1STEP"), r"stage 0 position 1 .*outside 0\.\.1"),
    # forwarded once
    (("0F0 0F1 0F0 0B0 0B1 0STEP", "1FB0 1FB1 1STEP"),
     "stage 0 position 2 .*micro-batch 0 is forwarded twice"),
    (("0F0 0F1 0B0 0B1 0STEP", "1FB0 1FB1 1FB1 1STEP"),
     "stage 1 position 2 .*micro-batch 1 is forwarded twice"),
    # backwarded after the forward
    (("0F0 0B1 0F1 0B0 0STEP", "1FB0 1FB1 1STEP"),
     "stage 0 position 1 .*backward of micro-batch 1 before its forward"),
    # backwarded once (FB counts as both)
    (("0F0 0F1 0B0 0B1 0B1 0STEP", "1FB0 1FB1 1STEP"),
     "stage 0 position 4 .*micro-batch 1 is backwarded twice"),
    (("0F0 0F1 0B0 0B1 0STEP", "1FB0 1B0 1FB1 1STEP"),
     "stage 1 position 1 .*micro-batch 0 is backwarded twice"),
    # FB only on the last stage
    (("0FB0 0FB1 0STEP", "1FB0 1FB1 1STEP"), r"stage 0 position 0 .*FB only on the last stage"),
    # every micro-batch forwarded and backwarded
    (("0F0 0B0 0STEP", "1FB0 1FB1 1STEP"), r"stage 0: micro-batches \[1\] are never forwarded"),
    (("0F0 0F1 0B0 0STEP", "1FB0 1FB1 1STEP"),
     r"stage 0: micro-batches \[1\] are never backwarded"),
    # STEP exactly once and last
    (("0F0 0F1 0B0 0STEP 0B1", "1FB0 1FB1 1STEP"),
     "stage 0 position 3 .*STEP is not the last action"),
    (("0F0 0F1 0B0 0B1 0STEP 0STEP", "1FB0 1FB1 1STEP"),
     "stage 0 position 4 .*STEP is not the last action"),
    (("0F0 0F1 0B0 0B1", "1FB0 1FB1 1STEP"), "stage 0: does not end with STEP"),
    # REDUCE at most once, right before STEP
    (("0F0 0F1 0B0 0REDUCE 0B1 0STEP", "1FB0 1FB1 1STEP"),
     "stage 0 position 3 .*REDUCE is not right before STEP"),
    (("0F0 0F1 0B0 0B1 0REDUCE 0REDUCE 0STEP", "1FB0 1FB1 1STEP"),
     "stage 0 position 4 .*REDUCE is not right before STEP"),
    (("0F0 0F1 0B0 0B1 0STEP", "1FB0 1FB1 1REDUCE 1STEP 1REDUCE"),
     "stage 1 position 3 .*STEP is not the last action"),
])
def test_broken_compute_rules_are_named(stages: tuple[str, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_schedule(_schedule(*stages))


@pytest.mark.parametrize(("stages", "match"), [
    # stage 0 has no RECV_F / SEND_B
    (("0RECV_F0 0F0 0SEND_F0 0RECV_B0 0B0 0STEP", PIPAR_1[1]),
     r"stage 0 position 0 \(0RECV_F0\): stage 0 is the first stage: there is no stage -1"),
    (("0F0 0SEND_F0 0RECV_B0 0B0 0SEND_B0 0STEP", PIPAR_1[1]),
     r"stage 0 position 4 \(0SEND_B0\): stage 0 is the first stage"),
    # the last stage has no SEND_F / RECV_B
    ((PIPAR_1[0], "1RECV_F0 1FB0 1SEND_B0 1SEND_F0 1STEP"),
     r"stage 1 position 3 \(1SEND_F0\): stage 1 is the last stage: there is no stage 2"),
    # each SEND matched by a RECV on the neighbour (a missing RECV_F)
    ((PIPAR_1[0], "1FB0 1SEND_B0 1STEP"),
     r"stage 1 position 0: 1RECV_F0 is missing, found 1FB0 \(a RECV_F goes right before"),
    # ... and each RECV by a SEND (a missing SEND_F)
    (("0F0 0RECV_B0 0B0 0STEP", PIPAR_1[1]),
     r"stage 0 position 1: 0SEND_F0 is missing, found 0RECV_B0 \(a SEND_F goes right after"),
    # a missing SEND_B at the end of the list
    ((PIPAR_1[0], "1RECV_F0 1FB0 1STEP"), "stage 1 position 2: 1SEND_B0 is missing"),
    # RECV_F after the forward that needs it
    ((PIPAR_1[0], "1FB0 1RECV_F0 1SEND_B0 1STEP"), r"stage 1 position 0: 1RECV_F0 is missing"),
    # SEND_F before the forward that makes it
    (("0SEND_F0 0F0 0RECV_B0 0B0 0STEP", PIPAR_1[1]),
     r"stage 0 position 0 \(0SEND_F0\): 0SEND_F0 is misplaced or repeated; expected 0F0"),
    # a repeated send
    (("0F0 0SEND_F0 0SEND_F0 0RECV_B0 0B0 0STEP", PIPAR_1[1]),
     r"stage 0 position 2 \(0SEND_F0\): 0SEND_F0 is misplaced or repeated; expected 0RECV_B0"),
    # RECV_B far ahead of its backward
    (("0RECV_B0 0F0 0SEND_F0 0B0 0STEP", PIPAR_1[1]),
     r"stage 0 position 0 \(0RECV_B0\): 0RECV_B0 is misplaced .*a RECV_B goes right before"),
])
def test_broken_transfer_rules_are_named(stages: tuple[str, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_schedule(_schedule(*stages, n=1))


def test_a_deadlock_names_each_stuck_stage() -> None:
    # 1F1B with a warm-up growing towards the last stage (K = 1, 2), which the generator
    # refuses: stage 0 waits for gradient 0, stage 1 for activation 1.
    broken = _schedule("0F0 0B0 0F1 0B1 0STEP", "1F0 1F1 1B0 1B1 1STEP", name="grown")
    with pytest.raises(ConfigError, match=(
            r"schedule 'grown' deadlocks in a dry run .*positions count the transfers added.*"
            r"stage 0 iteration 0 waits at position 2 on 0RECV_B0; "
            r"pipeline 0 stage 1 iteration 0 waits at position 2 on 1RECV_F1")):
        check_schedule(broken)
    with pytest.raises(ConfigError, match="deadlocks"):
        check_schedule(with_transfers(broken))
    with pytest.raises(ConfigError, match="never come"):
        format_grid(broken)


# -- grids -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "schedule"), [
    ("pipar_2x8", pipar(8)),
    ("gpipe_4x8", gpipe(4, 8)),
    ("1f1b_4x8", one_f_one_b(4, 8)),
])
def test_golden_grids(name: str, schedule: Schedule) -> None:
    grid = format_grid(with_transfers(schedule))
    assert grid == format_grid(schedule)
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("AIOPIPE_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(grid, encoding="utf-8")
    assert path.exists(), f"{path} is missing: run with AIOPIPE_UPDATE_GOLDEN=1"
    assert grid == path.read_text(encoding="utf-8"), (
        f"{path} differs (AIOPIPE_UPDATE_GOLDEN=1 rewrites it):\n{grid}")


def _columns(grid: str) -> list[list[str]]:
    rows = [line.split() for line in grid.splitlines()[1:]]
    return [[row[1 + p] for row in rows] for p in range(len(rows[0]) - 1)]


def test_grid_layout() -> None:
    grid = format_grid(pipar(2))
    assert grid == (
        "step  stage 0  stage 1\n"
        "   0  F0       .\n"
        "   1  F1       FB0\n"
        "   2  B0       FB1\n"
        "   3  B1       STEP\n"
        "   4  STEP     .\n")
    lines = format_grid(gpipe(3, 12)).splitlines()
    assert lines[0] == "step  stage 0  stage 1  stage 2"
    assert all(line == line.rstrip() for line in lines)
    assert lines[-1] == "  28  STEP     .        ."


def test_1f1b_grid_shows_the_warmups() -> None:
    columns = _columns(format_grid(one_f_one_b(4, 8)))
    for p, column in enumerate(columns):
        work = [c for c in column if c != "."]
        first_backward = next(i for i, c in enumerate(work) if c.startswith("B") or c[:2] == "FB")
        assert work[:first_backward] == [f"F{i}" for i in range(first_backward)]
        if p < 3:
            assert first_backward == min(2 * (4 - p) - 1, 8)
    assert [c for c in columns[3] if c != "."] == [*(f"FB{i}" for i in range(8)), "STEP"]


def test_grid_shows_a_broken_but_runnable_schedule() -> None:
    # FB on stage 0 breaks a rule but does not deadlock: the grid still shows it
    grid = format_grid(_schedule("0FB0 0STEP", "1STEP", n=1))
    assert grid.splitlines()[1:] == ["   0  FB0      STEP", "   1  STEP     ."]


@pytest.mark.parametrize(("make", "stages"), [
    (lambda: pipar(3), 2), (lambda: gpipe(3, 4), 3), (lambda: one_f_one_b(4, 6), 4),
    (lambda: gpipe(1, 1), 1),
])
def test_each_stage_of_a_generated_schedule_passes_on_its_own(
        make: Callable[[], Schedule], stages: int) -> None:
    schedule = with_transfers(make())
    for p, actions in enumerate(schedule.actions):
        check_stage_actions(actions, p, stages, schedule.micro_batches)


@pytest.mark.parametrize(("text", "stage", "match"), [
    ("0F0 0B0 0STEP", 0, "0SEND_F0"),  # a multi-stage list must carry its transfers
    ("0F0 0SEND_F0 0RECV_B0 0B0", 0, "does not end with STEP"),
    ("1RECV_F0 1FB0 1SEND_B0 1STEP", 0, "an action of stage 1"),
    ("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B1 0RECV_B0 0B0 0STEP", 0, None),
    ("1RECV_F0 1FB0 1STEP", 1, "1SEND_B0"),
    ("0RECV_F0 0F0 0SEND_F0 0RECV_B0 0B0 0SEND_B0 0STEP", 0, "found 0RECV_F0"),
])
def test_a_single_stage_list_is_checked_on_its_own(text: str, stage: int,
                                                   match: str | None) -> None:
    actions = tuple(Action.parse(t) for t in text.split())
    if match is None:  # backwards in another order are a valid choice of the sender
        check_stage_actions(actions, stage, 2, 2)
        return
    with pytest.raises(ConfigError, match=match):
        check_stage_actions(actions, stage, 2, 2 if "F1" in text else 1)
