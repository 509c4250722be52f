"""A device takes its stage from each `RoundStart` (`Assignment.from_round_start`) and
refuses one that cannot be this run's, naming why."""

from __future__ import annotations

import re

import pytest

from aiopipe.errors import RemoteProtocolError
from aiopipe.models.crossing import single
from aiopipe.protocol import RoundStart
from aiopipe.runtime.assignment import Assignment

FIRST = "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0STEP"
SHAPES = tuple(single(s) for s in ((3, 32, 32), (32, 16, 16), (64, 8, 8), (128, 4, 4), (128, 2, 2),
                                    (10,)))


def _start(actions: str, **changes: object) -> RoundStart:
    fields: dict[str, object] = {
        "round": 0, "epoch": 0, "first_iteration": 0, "iterations": 2, "tensors": {},
        "stage": 0, "stages": 2, "first_unit": 0, "stop_unit": 2, "parallel_batches": 2,
        "micro_batch_size": 4, "version": 0, "actions": actions,
        "peers": {"device1": {"stage": 1, "address": "memory://device1"}}}
    fields.update(changes)
    return RoundStart(**fields)  # type: ignore[arg-type]


def _assign(message: RoundStart) -> Assignment:
    return Assignment.from_round_start(message, units=5, batch_size=8,
                                       crossings=SHAPES, me="device0")


def test_a_first_stage_is_taken_with_its_shapes_and_neighbour() -> None:
    assignment = _assign(_start(FIRST))
    assert (assignment.input, assignment.output) == (single((3, 32, 32)), single((64, 8, 8)))
    assert assignment.peer_at(1) == "device1"
    assert assignment.version_of(1) == 1
    # activations or gradients of (64, 8, 8) floats, 4 per micro-batch, with labels
    assert assignment.frame_limit() > 4 * 4 * 64 * 8 * 8


@pytest.mark.parametrize(("message", "reason"), [
    (_start(FIRST.replace("0STEP", "0REDUCE 0STEP")), "all-reduce (REDUCE) before their "
                                                      "STEP, and only they do"),
    (_start(FIRST, rows=(0, 2), peers={"device1": {"stage": 1, "address": ""},
                                       "device2": {"stage": 0, "address": "", "rows": [2, 4]}}),
     "all-reduce"),  # a group without its REDUCE
    (_start(FIRST.replace("0STEP", "0REDUCE 0STEP"), rows=(0, 2),
            peers={"device1": {"stage": 1, "address": ""},
                   "device2": {"stage": 0, "address": "", "rows": [3, 4]}}),
     "stage 0's members compute rows [[0, 2], [3, 4]], which do not split"),
    (_start(FIRST, peers={"device1": {"stage": 1, "address": "", "rows": [0, 3]}}),
     "stage 1's members compute rows [[0, 3]]"),
    (_start("0F0 0B0 0STEP"), "bad actions"),  # one micro-batch of the two
    (_start("0F0", stop_unit=5), "cannot be stage 0 of 2"),
    (_start("0F0", micro_batch_size=3), "do not make the run's batch size 8"),
    (_start(FIRST, peers={"device2": {"stage": 2, "address": ""}}), "not members "
                                                                    "of device0's stage"),
])
def test_a_round_start_that_cannot_be_this_runs_is_refused(message: RoundStart,
                                                           reason: str) -> None:
    with pytest.raises(RemoteProtocolError, match=re.escape(reason)):
        _assign(message)


def test_a_group_member_knows_its_rows_and_whom_it_exchanges_which_rows_with() -> None:
    """Stage 0 of two, run by device0 (rows 0..2 of each micro-batch of 4) and device2
    (2..4); stage 1 by device1 (0..1) and device3 (1..4)."""
    assignment = _assign(_start(
        FIRST.replace("0STEP", "0REDUCE 0STEP"), rows=(0, 2),
        peers={"device1": {"stage": 1, "address": "", "rows": [0, 1]},
               "device3": {"stage": 1, "address": "", "rows": [1, 4]},
               "device2": {"stage": 0, "address": "", "rows": [2, 4]}}))
    assert assignment.share == 2
    assert [m for m, _ in assignment.members_at(0)] == ["device0", "device2"]
    assert assignment.members_at(1) == [("device1", (0, 1)), ("device3", (1, 4))]
    assert assignment.rows_with("device1") == (0, 1)
    assert assignment.rows_with("device3") == (1, 2)
