"""Tracing a model into split units: the units compute exactly the model, bit for bit,
share its parameters and buffers, and cut only where one tensor crosses."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from aiopipe.errors import ConfigError
from aiopipe.models import merge_states, model_digest, split, unit_count, units_of
from aiopipe.models.trace import split_here, split_units

IMAGES = (4, 3, 16, 16)


class Classifier(nn.Module):
    """torchvision's shape: features, avgpool, a flatten in forward, classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Dropout(0.5),
                                        nn.Linear(16, 10))

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1),
                                  nn.BatchNorm2d(channels))

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.body(x) + x)  # a skip inside a child: the child is one unit


class SmallResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block1 = Residual(8)
        self.block2 = Residual(8)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block2(self.block1(self.stem(x))))


class Three(nn.Module):
    """Three linear children ``a``, ``b``, ``c`` joined by ``join`` in forward."""

    def __init__(self, join: Callable[[Three, Tensor], Tensor]) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(12, 12), nn.Linear(12, 12), nn.Linear(12, 5)
        self.join = join

    def forward(self, x: Tensor) -> Tensor:
        return self.join(self, x)


def add_before_c(m: Three, x: Tensor) -> Tensor:
    y = m.a(x)
    z = m.b(y)
    return m.c(z + y)


def add_after_c(m: Three, x: Tensor) -> Tensor:
    y = m.a(x)
    z = m.b(y)
    return m.c(z) + y[:, :5]


def skip_everything(m: Three, x: Tensor) -> Tensor:
    return m.c(m.b(m.a(x))) + x[:, :5]


class Gate(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        if x.mean() > 0:  # data-dependent: fx could not trace this, but does not need to
            return x * 2
        return x - 1


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.a, self.b = Gate(), nn.Linear(12, 12), nn.Linear(12, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(self.gate(x)))


class Tied(nn.Module):
    """``a`` called twice, and a parameter that forward reads first and uses last."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(12, 12), nn.Linear(12, 12), nn.Linear(12, 5)
        self.pos = nn.Parameter(torch.randn(12))

    def forward(self, x: Tensor) -> Tensor:
        pos = self.pos  # no value crosses a cut: any unit reads it from the model
        x = self.a(self.b(self.a(x)))
        return self.c(x) + pos[:5]


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(12, 12) for _ in range(3))
        self.head = nn.Linear(12, 5)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _equivalent(model: nn.Module, x: Tensor, *, train: bool = True,
                at: Sequence[str] | None = None, several: bool = True) -> nn.Sequential:
    """Split ``model`` and check that its units compute it bit for bit: the output, the
    gradient of every parameter and (in train mode) the updated buffers."""
    model.zero_grad(set_to_none=True)
    reference = copy.deepcopy(model)
    units = split_units(model, at=at, several=several)
    for m in (model, units, reference):
        m.train(train)
    outputs = []
    for net in (reference, units):
        torch.manual_seed(7)  # the same dropout masks
        out = net(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outputs.append(out)
    assert torch.equal(outputs[1], outputs[0])
    for (key, got), (_, expected) in zip(model.named_parameters(),
                                          reference.named_parameters(), strict=True):
        assert got.grad is not None, key
        assert expected.grad is not None, key
        assert torch.equal(got.grad, expected.grad), key
    for (key, got), (_, expected) in zip(model.named_buffers(), reference.named_buffers(),
                                          strict=True):
        assert torch.equal(got, expected), key
    return units


def _children_of(units: nn.Sequential) -> list[list[str]]:
    return [list(unit._modules) for unit in units]


def _images() -> Tensor:
    return torch.randn(IMAGES)


@pytest.mark.parametrize("train", [True, False])
def test_a_classifier_is_three_units_and_the_flatten_joins_one(train: bool) -> None:
    torch.manual_seed(0)
    units = _equivalent(Classifier(), _images(), train=train)
    assert _children_of(units) == [["features"], ["avgpool"], ["classifier"]]
    flattens = [[n.target for n in unit.graph.nodes if n.target is torch.flatten]
                for unit in units]
    assert flattens == [[], [torch.flatten], []]
    assert all(isinstance(unit, fx.GraphModule) for unit in units)


def test_residual_blocks_as_children_are_one_unit_each() -> None:
    torch.manual_seed(0)
    units = _equivalent(SmallResNet(), _images())
    assert _children_of(units) == [["stem"], ["block1"], ["block2"], ["head"]]


def test_a_sum_of_two_values_before_a_child_is_cut_after_the_sum() -> None:
    torch.manual_seed(0)
    units = _equivalent(Three(add_before_c), torch.randn(4, 12))
    assert _children_of(units) == [["a"], ["b"], ["c"]]  # unit 1 is b(y) + y


def test_a_skip_across_a_cut_is_carried_or_with_one_tensor_merges_the_units() -> None:
    torch.manual_seed(0)
    units = _equivalent(Three(add_after_c), torch.randn(4, 12))
    assert _children_of(units) == [["a"], ["b"], ["c"]]  # (a, b) cross the second cut
    units = _equivalent(Three(add_after_c), torch.randn(4, 12), several=False)
    assert _children_of(units) == [["a"], ["b", "c"]]
    with pytest.raises(ConfigError, match=r"before 'c': 2 values cross it \(fx nodes a, b\)"):
        split_units(Three(add_after_c), at=["c"], several=False)


def test_a_skip_around_everything_is_carried_or_with_one_tensor_leaves_one_unit() -> None:
    torch.manual_seed(0)
    units = _equivalent(Three(skip_everything), torch.randn(4, 12))
    assert _children_of(units) == [["a"], ["b"], ["c"]]
    units = _equivalent(Three(skip_everything), torch.randn(4, 12), several=False)
    assert _children_of(units) == [["a", "b", "c"]]


def test_control_flow_inside_a_child_is_not_traced() -> None:
    torch.manual_seed(0)
    model = Gated()
    for x in (torch.rand(4, 12) + 1, -torch.rand(4, 12) - 1):  # both branches of the gate
        units = _equivalent(model, x)
        assert _children_of(units) == [["gate"], ["a"], ["b"]]


def test_a_module_called_twice_stays_in_one_unit_and_forward_reads_a_parameter() -> None:
    torch.manual_seed(0)
    model = Tied()
    units = _equivalent(model, torch.randn(4, 12))
    assert _children_of(units) == [["a", "b"], ["c"]]
    assert units[1].pos is model.pos
    # a unit's own attributes come before its children, as in any nn.Module
    assert list(units.state_dict()) == ["0.a.weight", "0.a.bias", "0.b.weight", "0.b.bias",
                                        "1.pos", "1.c.weight", "1.c.bias"]
    with pytest.raises(ConfigError, match=r"before 'b': 'a.weight' is used on both sides"):
        split_units(Tied(), at=["b"])


def test_entries_of_a_module_list_are_units() -> None:
    torch.manual_seed(0)
    units = _equivalent(Blocks(), torch.randn(4, 12))
    assert _children_of(units) == [["blocks"]] * 3 + [["head"]]
    assert [list(unit.blocks._modules) for unit in units[:3]] == [["0"], ["1"], ["2"]]


class Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 12)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:
            return self.a(x)
        return x


class DropsOnItsOwn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 12), nn.Linear(12, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(F.dropout(self.a(x), 0.5, self.training))


def test_control_flow_in_forward_itself_is_a_one_line_error() -> None:
    with pytest.raises(ConfigError, match=r"cannot split Branching: torch\.fx .*control flow"
                       ) as caught:
        split_units(Branching())
    assert "\n" not in str(caught.value)


def test_reading_self_training_in_forward_is_an_error_and_modes_are_kept() -> None:
    model = DropsOnItsOwn()
    model.a.eval()
    with pytest.raises(ConfigError, match=r"DropsOnItsOwn: its forward reads self\.training"):
        split_units(model)
    assert model.training
    assert not model.a.training
    assert model.b.training


class NoInput(nn.Module):
    def forward(self) -> Tensor:
        return torch.zeros(1)


class TwoTowers(nn.Module):
    """Two inputs, each through its own tower, joined by the head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 16)
        self.b = nn.Linear(5, 16)
        self.head = nn.Linear(32, 3)

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        h = torch.relu(self.a(x))
        g = torch.relu(self.b(z))
        return self.head(torch.cat([h, g], 1))


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 12)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.a(x), x


class Variadic(nn.Module):
    def forward(self, *xs: Tensor) -> Tensor:
        return xs[0]


@pytest.mark.parametrize(("model", "message"), [
    (NoInput(), r"^cannot split NoInput: its forward takes no input$"),
    (Variadic(), r"^cannot split Variadic: its forward takes \*xs; "),
    (Pair(), r"^cannot split Pair: its forward returns a tuple; "),
])
def test_a_forward_not_of_one_tensor_to_one_tensor_is_refused(model: nn.Module,
                                                               message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        split_units(model)


def test_at_cuts_only_before_the_children_it_names() -> None:
    torch.manual_seed(0)
    units = _equivalent(Classifier(), _images(), at=["classifier"])
    assert _children_of(units) == [["features", "avgpool"], ["classifier"]]


@pytest.mark.parametrize(("at", "message"), [
    (["head"], r"before 'head': it is not a child \(its children: features, avgpool, "),
    (["features"], r"before 'features': it is the first child called"),
])
def test_at_naming_no_possible_cut_is_an_error(at: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        split_units(Classifier(), at=at)


def test_a_sequential_comes_back_as_it_is() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    assert split_units(model) is model
    with pytest.raises(ConfigError, match="already split units"):
        split_units(model, at=["1"])


def test_units_share_the_models_parameters_and_buffers() -> None:
    model = Classifier()
    units = split_units(model)
    assert {id(p) for p in units.parameters()} == {id(p) for p in model.parameters()}
    assert {id(b) for b in units.buffers()} == {id(b) for b in model.buffers()}
    assert units[0].features is model.features
    assert [key.split(".", 1)[1] for key in units.state_dict()] == list(model.state_dict())


def test_units_work_with_the_split_helpers() -> None:
    torch.manual_seed(0)
    model, x = SmallResNet().eval(), _images()
    units = split_units(model)
    whole = model(x)
    q = unit_count(units)
    assert q == 4
    for p in range(q + 1):
        first, rest = units_of(units, 0, p), units_of(units, p, q)
        assert (unit_count(first), unit_count(rest)) == (p, q - p)
        assert torch.equal(rest(first(x)), whole)
        device, server = split(units, p)
        assert list(merge_states(device.state_dict(), server.state_dict())) == list(
            units.state_dict())
    copied = copy.deepcopy(units)
    assert torch.equal(copied(x), whole)
    assert model_digest(copied) == model_digest(units)


class Marked(nn.Module):
    """Three children; ``forward`` marks one cut with `split_here`, inside no child."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        h = split_here(h)
        return self.c(h)


class MarkedAcrossASkip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        y = self.a(x)
        z = split_here(torch.relu(y))
        return self.b(z) + y


def test_split_here_marks_the_only_cuts() -> None:
    units = _equivalent(Marked(), torch.randn(5, 6))
    assert _children_of(units) == [["a", "b"], ["c"]]
    x = torch.randn(2, 6)
    assert split_here(x) is x  # outside a trace: nothing


def test_a_mark_that_more_than_one_value_crosses_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"split_here\(\) mark 1: a cross it too") as info:
        split_units(MarkedAcrossASkip(), several=False)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="choose one"):
        split_units(Marked(), at=["c"])


class UNetLike(nn.Module):
    """Skips across cuts: ``up1(up2(down2(down1(x))) + d2) + d1``-style, on vectors."""

    def __init__(self) -> None:
        super().__init__()
        self.down1 = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.down2 = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.middle = nn.Linear(8, 8)
        self.up2 = nn.Linear(8, 8)
        self.up1 = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        d1 = self.down1(x)
        d2 = self.down2(d1)
        m = torch.relu(self.middle(d2))
        u2 = self.up2(m + d2)
        return self.up1(u2 + d1)


def test_with_several_a_cut_passes_a_tuple_and_the_units_compute_the_model() -> None:
    model = UNetLike()
    one = split_units(model, several=False)
    several = split_units(model)
    assert len(one) < len(several) == 5  # one tensor a cut: the skips merge units
    x = torch.randn(4, 6)
    values = x
    crossing = []
    for unit in several:
        values = unit(values)
        crossing.append(len(values) if isinstance(values, tuple) else 1)
    assert crossing == [1, 2, 2, 1, 1]  # d1, (d1, d2), (d1, m + d2), u2 + d1, output
    reference = copy.deepcopy(model)
    out, want = several(x), reference(x)
    assert torch.equal(out, want)
    out.sum().backward()
    want.sum().backward()
    for (key, got), (_, expected) in zip(model.named_parameters(),
                                          reference.named_parameters(), strict=True):
        assert got.grad is not None
        assert expected.grad is not None
        assert torch.equal(got.grad, expected.grad), key


def test_several_lets_a_marked_cut_pass_what_crosses_it() -> None:
    model = MarkedAcrossASkip()
    units = split_units(model)
    x = torch.randn(3, 6)
    assert len(units) == 2
    assert isinstance(units[0](x), tuple)
    assert torch.equal(units(x), model(x))


def test_a_model_of_two_inputs_takes_them_as_one_tuple_and_carries_the_other_across() -> None:
    torch.manual_seed(0)
    model = TwoTowers()
    reference = copy.deepcopy(model)
    units = split_units(model)
    assert _children_of(units) == [["a"], ["b"], ["head"]]
    x, z = torch.randn(4, 12), torch.randn(4, 5)
    first = units[0]((x, z))
    assert isinstance(first, tuple)
    assert len(first) == 2
    out, want = units((x, z)), reference(x, z)
    assert torch.equal(out, want)
    out.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
