"""The zoo: unit counts, shapes, forward/backward, determinism and argument checks."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from aiopipe.errors import ConfigError
from aiopipe.models import MIN_SIDE, MODEL_NAMES, build, unit_count
from aiopipe.models.mobilenet import InvertedResidual
from aiopipe.models.resnet import BasicBlock, Bottleneck

UNITS = {
    "vgg5": 5,
    "resnet18": 10,
    "mobilenetv3-small": 15,
    "vgg16": 16,
    "resnet101": 35,
    "mobilenetv3-large": 19,
}
SHAPES = [(1, 28, 28), (3, 32, 32), (3, 64, 64)]


@functools.cache
def _model(name: str, in_shape: tuple[int, int, int], num_classes: int = 10) -> nn.Sequential:
    torch.manual_seed(0)
    return build(name, num_classes=num_classes, in_shape=in_shape)


def test_model_names_are_the_six_and_the_language_model_sorted() -> None:
    assert tuple(sorted([*UNITS, "gpt-tiny"])) == MODEL_NAMES
    assert isinstance(MODEL_NAMES, tuple)


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_count_matches_the_paper(name: str) -> None:
    model = _model(name, (3, 32, 32))
    assert isinstance(model, nn.Sequential)
    assert unit_count(model) == len(model) == UNITS[name]


@pytest.mark.parametrize("in_shape", [  # (64x64: the fast subset leaves those out)
    *SHAPES[:-1], pytest.param(SHAPES[-1], marks=pytest.mark.slow)],
    ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(UNITS))
def test_forward_and_backward_on_every_input_shape(
    name: str, in_shape: tuple[int, int, int]
) -> None:
    model = _model(name, in_shape)
    model.train()
    model.zero_grad(set_to_none=True)
    x = torch.randn(2, *in_shape)
    out = model(x)
    assert out.shape == (2, 10)
    assert torch.isfinite(out).all()
    torch.autograd.backward(nn.functional.cross_entropy(out, torch.tensor([0, 1])))
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    # The first unit (farthest from the loss) really receives a gradient.
    first = next(iter(model[0].parameters()))
    assert first.grad is not None
    assert first.grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(UNITS))
def test_num_classes_sets_the_output_width(name: str) -> None:
    model = _model(name, (3, 32, 32), num_classes=100)
    with torch.no_grad():
        assert model.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 100)


@pytest.mark.parametrize("name", sorted(UNITS))
def test_smallest_side_is_accepted(name: str) -> None:
    model = _model(name, (2, MIN_SIDE, MIN_SIDE + 3))
    with torch.no_grad():
        assert model.eval()(torch.randn(1, 2, MIN_SIDE, MIN_SIDE + 3)).shape == (1, 10)


def test_blocks_are_whole_units() -> None:
    r18 = _model("resnet18", (3, 32, 32))
    assert [type(u) for u in list(r18)[1:9]] == [BasicBlock] * 8
    r101 = _model("resnet101", (3, 32, 32))
    assert [type(u) for u in list(r101)[1:34]] == [Bottleneck] * 33
    small = _model("mobilenetv3-small", (3, 32, 32))
    assert [type(u) for u in list(small)[1:12]] == [InvertedResidual] * 11
    large = _model("mobilenetv3-large", (3, 32, 32))
    assert [type(u) for u in list(large)[1:16]] == [InvertedResidual] * 15
    # No other unit hides a block: blocks live only at the top level.
    for model in (r18, r101, small, large):
        for unit in model:
            inner = list(unit.modules())[1:]
            assert not any(isinstance(m, BasicBlock | Bottleneck | InvertedResidual) for m in inner)


def test_vgg5_has_no_batch_norm_and_vgg16_has() -> None:
    vgg5 = _model("vgg5", (3, 32, 32))
    assert not any(isinstance(m, nn.BatchNorm2d) for m in vgg5.modules())
    assert not list(vgg5.buffers())
    vgg16 = _model("vgg16", (3, 32, 32))
    assert sum(isinstance(m, nn.BatchNorm2d) for m in vgg16.modules()) == 13


@pytest.mark.slow
def test_no_dropout_anywhere() -> None:
    for name in MODEL_NAMES:
        model = build(name, num_classes=10, in_shape=(64,) if name == "gpt-tiny" else (3, 32, 32))
        assert not any(isinstance(m, nn.Dropout) for m in model.modules()), name


def test_vgg5_activation_shapes_per_unit() -> None:
    model = _model("vgg5", (3, 32, 32))
    x = torch.randn(2, 3, 32, 32)
    shapes = []
    with torch.no_grad():
        for unit in model:
            x = unit(x)
            shapes.append(tuple(x.shape[1:]))
    assert shapes == [(32, 16, 16), (64, 8, 8), (64, 8, 8), (128,), (10,)]


@pytest.mark.parametrize("name", ["vgg5", "resnet18", "mobilenetv3-small"])
def test_initialization_is_deterministic_under_manual_seed(name: str) -> None:
    states = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        states.append(build(name, num_classes=10, in_shape=(3, 32, 32)).state_dict())
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not all(torch.equal(states[0][k], states[2][k]) for k in states[0])


def test_in_shape_may_be_a_list() -> None:
    model = build("vgg5", num_classes=10, in_shape=[1, 28, 28])  # type: ignore[arg-type]
    assert unit_count(model) == 5


def test_unknown_name_lists_the_known_names() -> None:
    with pytest.raises(ConfigError, match="unknown model 'vgg19'") as info:
        build("vgg19", num_classes=10, in_shape=(3, 32, 32))
    for name in MODEL_NAMES:
        assert name in str(info.value)


def test_non_string_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown model"):
        build(5, num_classes=10, in_shape=(3, 32, 32))  # type: ignore[arg-type]


@pytest.mark.parametrize("num_classes", [0, -1, True, 2.0, "10", None])
def test_bad_num_classes(num_classes: object) -> None:
    with pytest.raises(ConfigError, match="num_classes"):
        build("vgg5", num_classes=num_classes, in_shape=(3, 32, 32))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "in_shape",
    [
        (3, 32),
        (3, 32, 32, 1),
        (0, 32, 32),
        (3, MIN_SIDE - 1, 32),
        (3, 32, 0),
        (3.0, 32, 32),
        (True, 32, 32),
        "abc",
        None,
        32,
    ],
)
def test_bad_in_shape(in_shape: object) -> None:
    with pytest.raises(ConfigError, match="in_shape"):
        build("resnet18", num_classes=10, in_shape=in_shape)  # type: ignore[arg-type]
