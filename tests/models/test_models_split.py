"""Splitting: halves compute the whole, share its modules and partition its state."""

from __future__ import annotations

import functools
from collections import OrderedDict

import pytest
import torch
from torch import nn

from aiopipe.errors import ConfigError
from aiopipe.models import (
    as_sequential,
    build,
    merge_states,
    partition,
    split,
    unit_count,
    units_of,
)


@functools.cache
def _model(name: str) -> nn.Sequential:
    torch.manual_seed(1)
    return build(name, num_classes=10, in_shape=(3, 32, 32))


def _split_points(name: str) -> list[int]:
    q = unit_count(_model(name))
    if name == "vgg5":
        return list(range(q + 1))
    return sorted({0, 1, 2, q // 2, q - 1, q})


SMALL = ("vgg5", "resnet18", "mobilenetv3-small")
LARGE = ("vgg16", "resnet101", "mobilenetv3-large")
CASES = [(name, p) for name in SMALL for p in _split_points(name)]
CASES += [(name, p) for name in LARGE for p in (1, 5)]


@pytest.mark.parametrize(("name", "p"), CASES)
def test_device_then_server_equals_whole(name: str, p: int) -> None:
    model = _model(name).train()
    device, server = split(model, p)
    assert (unit_count(device), unit_count(server)) == (p, unit_count(model) - p)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        whole = model(x)
        halves = server(device(x))
    assert torch.equal(whole, halves)


@pytest.mark.parametrize("p", range(6))
def test_split_backward_gives_the_whole_models_gradients(p: int) -> None:
    # The split-learning round trip: the device sends a detached activation, the server
    # returns its gradient, the device finishes the backward pass.
    model = _model("vgg5")
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    model.zero_grad(set_to_none=True)
    torch.autograd.backward(nn.functional.cross_entropy(model(x), y))
    expected = {k: v.grad.clone() for k, v in model.named_parameters() if v.grad is not None}
    model.zero_grad(set_to_none=True)

    device, server = split(model, p)
    activation = device(x)
    sent = activation.detach().requires_grad_(p > 0)
    torch.autograd.backward(nn.functional.cross_entropy(server(sent), y))
    if p > 0:
        assert sent.grad is not None
        torch.autograd.backward(activation, sent.grad)
    got = {k: v.grad for k, v in model.named_parameters() if v.grad is not None}
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize(("name", "p"), [(n, p) for n, p in CASES if p in (0, 1, 5)])
def test_halves_share_the_original_modules_and_parameters(name: str, p: int) -> None:
    model = _model(name)
    device, server = split(model, p)
    units = list(device) + list(server)
    assert len(units) == len(model)
    assert all(a is b for a, b in zip(units, model, strict=True))
    whole = dict(model.named_parameters())
    halves = dict(device.named_parameters()) | dict(server.named_parameters())
    assert halves.keys() == whole.keys()
    assert all(halves[k] is whole[k] for k in whole)
    with torch.no_grad():
        next(iter(model.parameters())).add_(1.0)  # a change through the whole ...
    first = next(iter((device if p > 0 else server).parameters()))
    assert first is next(iter(model.parameters()))  # ... is the halves' change too


@pytest.mark.parametrize(("name", "p"), CASES)
def test_halves_states_partition_and_merge_back(name: str, p: int) -> None:
    model = _model(name)
    device, server = split(model, p)
    whole, dev, srv = model.state_dict(), device.state_dict(), server.state_dict()
    assert not dev.keys() & srv.keys()
    assert list(dev) + list(srv) == list(whole)
    merged = merge_states(dev, srv)
    assert list(merged) == list(whole)
    assert all(merged[k].data_ptr() == whole[k].data_ptr() for k in whole)


def test_loading_a_merged_state_reproduces_the_model() -> None:
    source = _model("resnet18").eval()
    device, server = split(source, 4)
    state = merge_states(device.state_dict(), server.state_dict())
    torch.manual_seed(99)
    target = build("resnet18", num_classes=10, in_shape=(3, 32, 32)).eval()
    target.load_state_dict(state)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(source(x), target(x))


def test_batch_norm_buffers_travel_with_their_half() -> None:
    device, server = split(_model("resnet18"), 3)
    dev = device.state_dict()
    assert "0.1.running_mean" in dev
    assert dev["0.1.num_batches_tracked"].dtype == torch.int64
    assert any(k.endswith("running_var") for k in server.state_dict())


def test_merge_states_refuses_overlapping_keys() -> None:
    a = {"0.weight": torch.zeros(1)}
    with pytest.raises(ConfigError, match=r"'0\.weight'"):
        merge_states(a, {"1.weight": torch.zeros(1)}, dict(a))


def test_merge_states_of_nothing_is_empty() -> None:
    assert merge_states() == {}


def test_split_keeps_user_names() -> None:
    model = nn.Sequential(OrderedDict(a=nn.Linear(2, 3), act=nn.ReLU(), b=nn.Linear(3, 1)))
    device, server = split(model, 1)
    assert list(device.state_dict()) == ["a.weight", "a.bias"]
    assert list(server.state_dict()) == ["b.weight", "b.bias"]
    assert server.act is model.act


def test_split_keeps_a_module_used_twice() -> None:
    relu = nn.ReLU()
    model = nn.Sequential(nn.Linear(2, 2), relu, nn.Linear(2, 2), relu)
    device, server = split(model, 2)
    assert unit_count(device) == unit_count(server) == 2
    x = torch.randn(3, 2)
    with torch.no_grad():
        assert torch.equal(server(device(x)), model(x))


@pytest.mark.parametrize("p", [-1, 6, 100])
def test_split_point_out_of_range(p: int) -> None:
    with pytest.raises(ConfigError, match=r"out of range 0\.\.5"):
        split(_model("vgg5"), p)


@pytest.mark.parametrize("p", [True, 2.0, "2", None])
def test_split_point_must_be_an_integer(p: object) -> None:
    with pytest.raises(ConfigError, match="split point must be an integer"):
        split(_model("vgg5"), p)  # type: ignore[arg-type]


@pytest.mark.parametrize("model", [nn.Linear(2, 2), [nn.Linear(2, 2)], "vgg5"])
def test_split_needs_a_sequential(model: object) -> None:
    with pytest.raises(ConfigError, match=r"nn\.Sequential"):
        split(model, 0)  # type: ignore[arg-type]


def test_own_sequential_passes_through_and_splits() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))
    assert as_sequential(model) is model
    device, server = split(as_sequential(model), 2)
    x = torch.randn(5, 3, 2, 2)
    with torch.no_grad():
        assert torch.equal(server(device(x)), model(x))


@pytest.mark.parametrize("kind", [list, tuple, nn.ModuleList])
def test_list_of_modules_becomes_a_sequential_of_the_same_modules(kind: type) -> None:
    layers = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)]
    model = as_sequential(kind(layers))
    assert isinstance(model, nn.Sequential)
    assert unit_count(model) == 3
    assert all(a is b for a, b in zip(model, layers, strict=True))
    assert model(torch.randn(1, 4)).shape == (1, 2)


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (nn.Linear(2, 2), "got a Linear"),
        (nn.Sequential(), "at least one unit"),
        ([], "at least one unit"),
        ([nn.Linear(2, 2), "relu"], "unit 1 is a str"),
        ("vgg5", "got str"),
        (42, "got int"),
        (None, "got NoneType"),
    ],
)
def test_as_sequential_says_what_it_accepts(model: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        as_sequential(model)  # type: ignore[arg-type]
    if match != "at least one unit":
        assert "nn.Sequential" in str(info.value)


def test_unit_count_needs_a_sequential() -> None:
    assert unit_count(nn.Sequential()) == 0
    with pytest.raises(ConfigError, match=r"nn\.Sequential"):
        unit_count([nn.ReLU()])  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "cuts"), [
    ("vgg5", [1, 2, 3, 4]), ("vgg5", [2, 4]), ("vgg5", [0, 3, 5]), ("resnet18", [3, 6, 8]),
    ("mobilenetv3-small", [4, 9]),
])
def test_partition_stages_chain_to_the_whole(name: str, cuts: list[int]) -> None:
    model = _model(name).eval()
    stages = partition(model, cuts)
    assert [unit_count(s) for s in stages] == [
        b - a for a, b in zip([0, *cuts], [*cuts, unit_count(model)], strict=True)]
    x = torch.randn(2, 3, 32, 32)
    y = x
    for stage in stages:
        y = stage(y)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    # the stages' states partition the whole model's, in order, sharing its tensors
    merged = merge_states(*(s.state_dict() for s in stages))
    assert list(merged) == list(model.state_dict())
    assert all(merged[k].data_ptr() == v.data_ptr() for k, v in model.state_dict().items())


def test_partition_with_one_cut_is_split() -> None:
    model = _model("vgg5")
    for p in range(unit_count(model) + 1):
        assert [list(s.state_dict()) for s in partition(model, [p])] == [
            list(h.state_dict()) for h in split(model, p)]
    assert list(units_of(model, 1, 3).state_dict()) == list(
        partition(model, [1, 3])[1].state_dict())


@pytest.mark.parametrize("cuts", [[3, 2], [-1], [6], [1.5], [True]])
def test_partition_refuses_bad_cut_points(cuts: list[object]) -> None:
    with pytest.raises(ConfigError, match="cut point"):
        partition(_model("vgg5"), cuts)  # type: ignore[arg-type]
