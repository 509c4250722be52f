"""Low-rank adapters (aiopipe/models/adapters.py): the adapted model starts as its base,
only the adapters train, merging gives the same function back, targets pick layers by
qualified name, and re-drawing from a seed is deterministic."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from aiopipe import RunConfig
from aiopipe.errors import ConfigError
from aiopipe.models import (
    LoRALinear,
    add_lora,
    as_units,
    frozen_parameters,
    lora_parameters,
    merge_lora,
)
from aiopipe.runtime.factories import build_model, parameters_not_reset, reinitialise


def _units() -> nn.Sequential:
    """Three units, as aiopipe's models are: Linear layers inside units, and a norm."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(12, 16), nn.ReLU()),
                         nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh()),
                         nn.Linear(16, 3))


class Block(nn.Module):
    """Any module, not a sequence of units: named Linear layers at two depths."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.inner = nn.ModuleDict({"fc1": nn.Linear(8, 8), "out": nn.Linear(8, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner["out"](torch.relu(self.inner["fc1"](self.fc1(x))))


def _trained_adapters(model: nn.Module) -> None:
    """Give B non-zero values, as training would, so that merging has work to do."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.normal_()


def test_the_adapted_model_starts_bit_for_bit_as_its_base() -> None:
    model = _units()
    x = torch.randn(5, 12)
    before = model(x)
    adapted = add_lora(model, rank=2)
    assert adapted is model
    assert torch.equal(adapted(x), before)
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 3


def test_names_stay_reachable_and_only_adapters_require_grad() -> None:
    model = add_lora(_units(), rank=3)
    keys = list(model.state_dict())
    assert "0.0.base.weight" in keys
    assert "2.base.bias" in keys
    assert lora_parameters(model) == ("0.0.lora_a", "0.0.lora_b", "1.0.lora_a",
                                      "1.0.lora_b", "2.lora_a", "2.lora_b")
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model))
    assert "1.1.weight" in frozen_parameters(model)  # the norm: not an adapter
    layer = model[1][0]
    assert isinstance(layer, LoRALinear)
    assert layer.lora_a.shape == (3, 16)
    assert layer.lora_b.shape == (16, 3)
    assert not layer.lora_b.any()


def test_freeze_base_false_freezes_only_the_wrapped_layers() -> None:
    model = add_lora(_units(), targets=["0.0"], freeze_base=False)
    frozen = frozen_parameters(model)
    assert frozen == {"0.0.base.weight", "0.0.base.bias"}


def test_an_sgd_step_changes_the_adapters_and_not_one_bit_of_the_base() -> None:
    model = add_lora(_units(), rank=2)
    base = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" not in k}
    adapters = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" in k}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):  # B moves first; A gets a gradient once B is not zero
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(8, 12)),
                                    torch.randint(0, 3, (8,))).backward()
        optimizer.step()
    state = model.state_dict()
    for key, value in base.items():
        assert torch.equal(state[key], value), key
    for key, value in adapters.items():
        assert not torch.equal(state[key], value), key
    assert len(optimizer.state) == len(adapters)  # momentum only for the adapters


def test_merge_gives_plain_linear_layers_computing_the_same() -> None:
    model = add_lora(_units(), rank=4, alpha=8.0)
    _trained_adapters(model)
    x = torch.randn(6, 12)
    adapted = model(x)
    state = copy.deepcopy(model.state_dict())
    merged = merge_lora(model)
    assert merged is model
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert list(merged.state_dict()) == list(_units().state_dict())  # names back
    assert torch.allclose(merged(x), adapted, atol=1e-6, rtol=0)
    scale = 8.0 / 4
    want = state["1.0.base.weight"] + scale * state["1.0.lora_b"] @ state["1.0.lora_a"]
    assert torch.allclose(merged.state_dict()["1.0.weight"], want, atol=1e-7)


def test_merge_draws_nothing_from_the_global_generator() -> None:
    model = add_lora(_units())
    torch.manual_seed(3)
    merge_lora(model)
    after = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(1), after)


def test_targets_are_fnmatch_patterns_on_qualified_names() -> None:
    model = add_lora(Block(), targets=["*fc1"])
    assert isinstance(model.fc1, LoRALinear)
    assert isinstance(model.inner["fc1"], LoRALinear)
    assert type(model.inner["out"]) is nn.Linear
    only = add_lora(Block(), targets=["inner.*"])
    assert type(only.fc1) is nn.Linear
    assert lora_parameters(only) == ("inner.fc1.lora_a", "inner.fc1.lora_b",
                                     "inner.out.lora_a", "inner.out.lora_b")
    units = add_lora(_units(), targets=["2"])
    assert [type(m).__name__ for m in (units[0][0], units[1][0], units[2])] == [
        "Linear", "Linear", "LoRALinear"]


def test_a_second_pass_does_not_wrap_the_wrapped_layers() -> None:
    model = add_lora(_units(), targets=["0.0"])
    add_lora(model, targets=["2"])
    assert isinstance(model[0][0].base, nn.Linear)  # not wrapped twice
    assert isinstance(model[2], LoRALinear)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model))  # the first pass's adapters too


def test_a_shared_linear_gets_one_shared_wrapper() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    add_lora(model)
    assert model[0] is model[2]
    assert isinstance(model[0], LoRALinear)


def test_a_bare_linear_is_refused_and_wrapped_by_hand() -> None:
    linear = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=r"LoRALinear\(layer\)"):
        add_lora(linear)
    adapted = LoRALinear(linear)
    with pytest.raises(ConfigError, match=r"merged\(\)"):
        merge_lora(adapted)
    x = torch.randn(3, 4)
    assert torch.equal(adapted.merged()(x), linear(x))  # B is zero: W + 0


@pytest.mark.parametrize("rank", [0, -1, 1.5, True])
def test_rank_must_be_an_integer_of_at_least_one(rank: object) -> None:
    with pytest.raises(ConfigError, match="rank"):
        add_lora(_units(), rank=rank)  # type: ignore[arg-type]


@pytest.mark.parametrize("alpha", [0, -1.0, float("nan"), float("inf")])
def test_alpha_must_be_finite_and_positive(alpha: float) -> None:
    with pytest.raises(ConfigError, match="alpha"):
        add_lora(_units(), alpha=alpha)


def test_a_target_that_matches_nothing_is_refused() -> None:
    model = _units()
    with pytest.raises(ConfigError, match=r"'3\.\*' matches no nn.Linear"):
        add_lora(model, targets=["0.0", "3.*"])
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # nothing done
    with pytest.raises(ConfigError, match="sequence of patterns"):
        add_lora(model, targets="0.0")
    with pytest.raises(ConfigError, match="no targets"):
        add_lora(model, targets=[])
    assert all(p.requires_grad for p in model.parameters())  # nothing frozen either


def test_reinitialising_from_a_seed_is_deterministic_and_starts_at_the_base() -> None:
    model = add_lora(_units())
    assert parameters_not_reset(model) == []
    _trained_adapters(model)
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(11)
    reinitialise(first)
    torch.manual_seed(11)
    reinitialise(second)
    for (key, a), b in zip(first.state_dict().items(), second.state_dict().values(),
                           strict=True):
        assert torch.equal(a, b), key
    assert not first[2].lora_b.any()
    assert not torch.equal(first[2].lora_a, model[2].lora_a)  # drawn again
    x = torch.randn(3, 12)
    assert torch.equal(first(x), merge_lora(copy.deepcopy(first))(x))
    trainable = {name for name, p in first.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(first))


def test_a_run_config_takes_an_adapted_module_and_builds_it_from_the_seed() -> None:
    config = RunConfig(mode="fl", model=add_lora(_units()), devices=1, seed=5)
    built = [build_model(config, num_classes=3, in_shape=(12,)) for _ in range(2)]
    for (key, a), b in zip(built[0].state_dict().items(), built[1].state_dict().values(),
                           strict=True):
        assert torch.equal(a, b), key
    assert frozen_parameters(built[0]) == frozen_parameters(config.model)


def test_any_module_with_adapters_is_traced_into_units_computing_the_same() -> None:
    torch.manual_seed(2)
    model = add_lora(Block(), targets=["*fc1"])
    _trained_adapters(model)
    x = torch.randn(4, 8)
    units = as_units(model)
    assert torch.equal(units(x), model(x))
    assert lora_parameters(units) == ("0.fc1.lora_a", "0.fc1.lora_b",
                                      "1.inner.fc1.lora_a", "1.inner.fc1.lora_b")
    trainable = {name for name, p in units.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(units))
