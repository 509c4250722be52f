"""A run's initial weights are a function of its config alone (issue 42, item 1):
[Note: initial weights] in aiopipe/runtime/factories.py, docs/design.md §Initial weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aiopipe import RunConfig
from aiopipe.data import DataKind
from aiopipe.errors import ConfigError
from aiopipe.runtime.factories import build_model, model_template, parameters_not_reset
from aiopipe.testing import assert_same_weights, run_undisturbed

SHAPE = (3, 32, 32)  # synthetic-cifar10


def _model() -> nn.Sequential:
    """Two split units for 3x32x32 inputs, 10 classes: cheap to train."""
    return nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16), nn.ReLU()),
                         nn.Linear(16, 10))


def _config(model: object = None, **changes: object) -> RunConfig:
    """A new module per call, as a user's config function builds one; 2 devices x 20
    samples, B = 10: 2 iterations of 1 epoch."""
    return RunConfig(mode="pipar", model=_model() if model is None else model, devices=2,
                     samples_per_device=20, batch_size=10, epochs=1, split_point=1,
                     parallel_batches=2, test_samples=0, **changes)  # type: ignore[arg-type]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


async def test_two_configs_of_one_function_train_alike_whatever_the_generator() -> None:
    torch.manual_seed(1)
    first = await run_undisturbed(_config())
    torch.manual_seed(2)  # what other code does to the global generator in between
    torch.randn(1000)
    second = await run_undisturbed(_config())
    assert_same_weights(second, first)  # bit for bit
    third = await run_undisturbed(_config(seed=7))
    with pytest.raises(AssertionError, match="the weights differ"):
        assert_same_weights(third, first)  # the seed is what sets them


def test_seed_redraws_a_users_module_and_given_keeps_it() -> None:
    torch.manual_seed(3)
    model = _model()
    own = _state(model)
    seeded = build_model(_config(model), num_classes=10, in_shape=SHAPE)
    assert not torch.equal(seeded.state_dict()["1.weight"], own["1.weight"])
    torch.manual_seed(4)
    again = build_model(_config(_model()), num_classes=10, in_shape=SHAPE)
    assert_same_weights(again, seeded)
    given = build_model(_config(model, initial_weights="given"), num_classes=10,
                        in_shape=SHAPE)
    assert_same_weights(given, model)
    assert given is not model  # a copy: the user's module is never trained
    for name, value in own.items():
        assert torch.equal(model.state_dict()[name], value), name  # left as it was


async def test_a_run_with_given_weights_starts_from_them() -> None:
    """Devices get the user's module too (`Device(model=...)`): with "given" they build
    from its weights, and two runs of one module train alike."""
    torch.manual_seed(5)
    model = _model()
    config = _config(model, initial_weights="given")
    first = await run_undisturbed(config)
    template = model_template(config, DataKind.classified(SHAPE, 10)).model
    assert torch.equal(template.state_dict()["1.weight"], model.state_dict()["1.weight"])
    with torch.no_grad():
        dict(model.named_parameters())["1.weight"].mul_(2.0)  # loaded before the next run
    second = await run_undisturbed(config)
    with pytest.raises(AssertionError, match="the weights differ"):
        assert_same_weights(second, first)


class _Scale(nn.Module):
    """A bare parameter and no reset_parameters: nothing can draw it again."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class _ResetScale(_Scale):
    def reset_parameters(self) -> None:
        nn.init.uniform_(self.gain, 0.5, 1.5)


def test_a_parameter_no_reset_covers_is_refused_naming_it_and_the_ways_out() -> None:
    model = nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4), _Scale(4)),
                          nn.Linear(4, 10))
    assert parameters_not_reset(model) == ["0.2.gain"]
    with pytest.raises(ConfigError) as refused:
        _config(model)
    message = str(refused.value)
    for part in ("'model'", "0.2.gain", "_Scale", "reset_parameters()", "factory",
                 'initial_weights="given"'):
        assert part in message
    assert _config(model, initial_weights="given").model is model  # its weights as they are
    fixed = nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4),
                                        _ResetScale(4)), nn.Linear(4, 10))
    torch.manual_seed(6)
    built = build_model(_config(fixed), num_classes=10, in_shape=SHAPE)
    assert not torch.equal(built.state_dict()["0.2.gain"], torch.ones(4))  # drawn again


class _Attention(nn.Module):
    """nn.MultiheadAttention in a user's wrapper (its initialiser is private)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.attention(x, x, x, need_weights=False)[0]
        return out


def _layers() -> nn.Sequential:
    return nn.Sequential(nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8)), _Attention(),
                         nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4 * 8),
                                       nn.Linear(4 * 8, 10)))


def test_torchs_common_layers_are_drawn_again_as_construction_draws_them() -> None:
    model = _layers()
    assert parameters_not_reset(model) == []
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(7.0)
        dict(model.named_buffers())["2.1.running_mean"].fill_(7.0)
    config = _config(model)
    built = build_model(config, num_classes=10, in_shape=(4,))
    torch.randn(100)
    assert_same_weights(build_model(_config(_layers()), num_classes=10, in_shape=(4,)), built)
    for name, value in built.state_dict().items():
        if value.is_floating_point():
            assert not bool((value == 7.0).all()), name  # every one drawn again
    state = built.state_dict()
    assert torch.equal(state["1.attention.out_proj.bias"], torch.zeros(8))  # the parent's,
    assert torch.equal(state["1.attention.in_proj_bias"], torch.zeros(24))  # last
    assert torch.equal(state["0.1.weight"], torch.ones(8))  # LayerNorm as constructed
    assert torch.equal(state["2.1.running_mean"], torch.zeros(32))  # and its statistics
    torch.manual_seed(config.seed)
    assert_same_weights(built, _layers())  # children first: the draws of a construction


def _factory(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    size = in_shape[0] * in_shape[1] * in_shape[2]
    return nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(size, 16), nn.ReLU()),
                         nn.Linear(16, num_classes))


async def test_a_callable_model_is_the_in_process_factory() -> None:
    config = _config(_factory)
    assert config.to_mapping()["model"] == "custom"
    assert "custom" in config.to_toml()
    torch.manual_seed(config.seed)
    want = _factory(10, SHAPE)  # called under the seed, with what it declares
    built = build_model(config, num_classes=10, in_shape=SHAPE)
    assert_same_weights(built, want)
    template = model_template(config, DataKind.classified(SHAPE, 10))
    assert model_template(_config(_factory), DataKind.classified(SHAPE, 10)) is template
    result = await run_undisturbed(config)  # devices build it too
    assert_same_weights(await run_undisturbed(_config(_factory)), result)
    assert_same_weights(await run_undisturbed(_config()), result)  # the module, drawn alike
    assert _config(lambda: _factory(10, SHAPE)).model is not None  # declares nothing


@pytest.mark.parametrize(("model", "weights", "key"), [
    ("vgg5", "given", "initial_weights"),
    ("mylab:net", "given", "initial_weights"),
    (_factory, "given", "initial_weights"),
    (None, "pretrained", "initial_weights"),
    # (any module is a model now, traced into units: issue 44; a tensor is not)
    (torch.zeros(2), "seed", "model"),
    (42, "seed", "model"),
])
def test_bad_models_and_initial_weights_are_config_errors(
        model: object, weights: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        _config(model, initial_weights=weights)


def test_a_factory_that_returns_no_units_is_named() -> None:
    with pytest.raises(ConfigError, match="_no_units"):
        build_model(_config(_no_units), num_classes=10, in_shape=SHAPE)


def _no_units() -> object:
    return 3
