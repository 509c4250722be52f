"""A device's side of a data-parallel group (aiopipe.runtime.groups): pieces cut and
joined by rows, the group's gradients checked before they are summed, and summed alike on
every member."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from aiopipe.errors import RemoteProtocolError
from aiopipe.models.crossing import single
from aiopipe.protocol import Activation, Gradient, GroupGradient, RoundStart, to_tensor_data
from aiopipe.protocol import to_torch as torch_of
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.groups import (
    GroupRoute,
    Pieces,
    check_group_gradient,
    gradients_of,
    rows_of,
    sum_gradients,
)

SHAPES = tuple(single(s) for s in ((3, 4, 4), (2, 4, 4), (5,)))
ACTIONS = "1RECV_F0 1F0 1SEND_F0 1RECV_B0 1B0 1SEND_B0 1REDUCE 1STEP"


def _assignment(me: str = "device1") -> Assignment:
    """Stage 1 of 3 (units 1..1), micro-batches of 6: device1 rows 0..3, device2 rows
    4..5; stage 0 on device0 (rows 0..1) and device3 (2..5); stage 2 on device4."""
    rows = {"device1": [0, 4], "device2": [4, 6]}
    peers = {"device0": {"stage": 0, "address": "", "rows": [0, 2]},
             "device3": {"stage": 0, "address": "", "rows": [2, 6]},
             "device4": {"stage": 2, "address": ""},
             **{name: {"stage": 1, "address": "", "rows": r} for name, r in rows.items()
                if name != me}}
    start = RoundStart(0, 0, 0, 2, {}, 1, 3, 1, 2, 1, 6, 10, ACTIONS, peers,
                       tuple(rows[me]))
    return Assignment.from_round_start(start, units=3, batch_size=6,
                                       crossings=SHAPES, me=me)


def _activation(source: str, first: int, stop: int, destination: str = "device1"
                ) -> Activation:
    rows = stop - first
    values = torch.arange(first, stop, dtype=torch.float32)[:, None, None, None].expand(
        rows, 3, 4, 4).contiguous()
    return Activation(7, 0, 0, 0, 0, 10, source, destination, (to_tensor_data(values),),
                      to_tensor_data(torch.arange(first, stop)))


def test_rows_of_a_tensor_are_a_slice_of_its_bytes() -> None:
    data = to_tensor_data(torch.arange(24, dtype=torch.float32).reshape(6, 4))
    assert torch.equal(torch_of(rows_of(data, 2, 5)),
                       torch.arange(8, 20, dtype=torch.float32).reshape(3, 4))


def test_pieces_from_the_previous_stage_are_joined_in_row_order() -> None:
    """device1 (rows 0..3) gets rows 0..1 from device0 and 2..3 from device3, whichever
    comes first; the joined activation is its rows, labels with them."""
    pieces = Pieces(_assignment())
    key = ("F", 0, 0, 0)
    assert pieces.join(key, "device3", _activation("device3", 2, 4)) is None
    joined = pieces.join(key, "device0", _activation("device0", 0, 2))
    assert isinstance(joined, Activation)
    assert torch.equal(torch_of(joined.labels), torch.arange(0, 4))
    assert torch.equal(torch_of(joined.tensors[0])[:, 0, 0, 0], torch.arange(0.0, 4.0))


def test_a_piece_sent_twice_is_refused() -> None:
    pieces = Pieces(_assignment())
    pieces.join(("F", 0, 0, 0), "device0", _activation("device0", 0, 2))
    with pytest.raises(RemoteProtocolError, match="twice"):
        pieces.join(("F", 0, 0, 0), "device0", _activation("device0", 0, 2))


def test_unfinished_pieces_of_too_many_micro_batches_are_refused() -> None:
    pieces = Pieces(_assignment())
    for iteration in range(6):  # 4N + 2 unfinished: as many as it keeps
        pieces.join(("F", 0, iteration, 0), "device0", _activation("device0", 0, 2))
    with pytest.raises(RemoteProtocolError, match="more micro-batches"):
        pieces.join(("F", 0, 6, 0), "device0", _activation("device0", 0, 2))


@dataclass
class _Posted:
    node: str
    sent: list[Activation | Gradient] = field(default_factory=list)

    def send(self, message: Activation | Gradient, name: str, *,
             ready_at: float | None) -> None:
        self.sent.append(message)


def test_a_group_route_sends_each_member_its_rows() -> None:
    """device3 (stage 0, rows 2..5) sends device1 rows 2..3 and device2 rows 4..5 (its
    own rows 0..1 and 2..3)."""
    one, two = _Posted("device1"), _Posted("device2")
    GroupRoute([(one, (0, 2)), (two, (2, 4))]).send(
        _activation("device3", 2, 6, destination="device1"), "u", ready_at=None)
    [a], [b] = one.sent, two.sent
    assert isinstance(a, Activation)
    assert isinstance(b, Activation)
    assert (a.destination, b.destination) == ("device1", "device2")
    assert torch.equal(torch_of(a.labels), torch.tensor([2, 3]))
    assert torch.equal(torch_of(b.labels), torch.tensor([4, 5]))


def _gradients(module: nn.Module, scale: float) -> dict[str, object]:
    return {name: to_tensor_data(torch.full_like(p, scale))
            for name, p in module.named_parameters()}


BAD_GROUP_GRADIENTS = ["a stranger", "another run", "a version off the plan",
                       "an iteration outside the round", "NaN", "a missing tensor"]


@pytest.mark.parametrize("what", BAD_GROUP_GRADIENTS)
def test_group_gradients_are_checked_against_the_plan(what: str) -> None:
    module = nn.Linear(3, 2)
    mine = {name: ("float32", tuple(p.shape)) for name, p in module.named_parameters()}
    a = _assignment()
    good = GroupGradient(7, 1, 0, 1, 11, "device2", "device1", _gradients(module, 1.0))
    check_group_gradient(good, a, mine, sender="device2", run_id=7)
    tensors = dict(good.tensors)
    message, sender = good, "device2"
    if what == "a stranger":
        sender = "device0"
    elif what == "another run":
        message = GroupGradient(8, 1, 0, 1, 11, "device2", "device1", tensors)
    elif what == "a version off the plan":
        message = GroupGradient(7, 1, 0, 1, 12, "device2", "device1", tensors)
    elif what == "an iteration outside the round":
        message = GroupGradient(7, 1, 0, 5, 15, "device2", "device1", tensors)
    elif what == "NaN":
        tensors["bias"] = to_tensor_data(torch.tensor([float("nan"), 0.0]))
        message = GroupGradient(7, 1, 0, 1, 11, "device2", "device1", tensors)
    else:
        del tensors["bias"]
        message = GroupGradient(7, 1, 0, 1, 11, "device2", "device1", tensors)
    with pytest.raises(RemoteProtocolError):
        check_group_gradient(message, a, mine, sender=sender, run_id=7)


def test_every_member_sums_the_group_gradients_in_row_order_to_the_same_bits() -> None:
    """Three members' gradients, summed by each member (its own from its module, the
    others' as received): every member ends with the same gradient, bit for bit."""
    torch.manual_seed(0)
    grads = {name: torch.randn(4, 3) * 10 ** i for i, name in enumerate(["m0", "m1", "m2"])}
    members = ["m0", "m1", "m2"]
    results = []
    for me in members:
        module = nn.Linear(3, 4, bias=False)
        module.weight.grad = grads[me].clone()
        mine = gradients_of(module)
        received = {m: GroupGradient(1, 0, 0, 0, 0, m, me,
                                     {"weight": to_tensor_data(grads[m])})
                    for m in members if m != me}
        sum_gradients(module, mine, members, me, received)
        assert module.weight.grad is not None
        results.append(module.weight.grad.clone())
    assert all(torch.equal(results[0], r) for r in results[1:])
    torch.testing.assert_close(results[0], grads["m0"] + grads["m1"] + grads["m2"])
