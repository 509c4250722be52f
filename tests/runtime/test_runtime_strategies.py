"""Strategies (aiopipe.strategies; issue 45, item 1): each built-in against a plain
reference of its update rule, today's names giving today's numbers, the server's state
staged until installed and carried through a checkpoint, frozen entries left alone, and
a bad ``module:Class`` refused in one line."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from aiopipe import RunConfig, SystemClock
from aiopipe.errors import ConfigError
from aiopipe.runtime.aggregation import aggregate, fedavg
from aiopipe.runtime.checkpoint import load_checkpoint, save_checkpoint
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.strategies import (
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedYogi,
    MultiKrum,
    ServerOptimizer,
    Strategy,
    build_strategy,
    uploaded_aggregate,
)
from aiopipe.testing import joined

State = dict[str, torch.Tensor]


def _states(n: int, seed: int, *, scale: float = 1.0) -> dict[int, State]:
    gen = torch.Generator().manual_seed(seed)
    return {k: {"w": torch.randn(3, 4, generator=gen) * scale,
                "b": torch.randn(4, generator=gen) * scale,
                "n": torch.tensor(10 * k, dtype=torch.int64)} for k in range(n)}


WEIGHTS = {0: 100.0, 1: 300.0, 2: 50.0, 3: 80.0, 4: 70.0, 5: 20.0}


@pytest.mark.parametrize(("name", "kwargs"), [
    ("fedavg", {}), ("fedmedian", {}), ("trimmed-mean", {"trim": 0.2}),
    ("krum", {"byzantine": 1}), ("krum", {"byzantine": 3}),  # 5 < 3 + 3: the median
])
def test_todays_names_give_todays_numbers(name: str, kwargs: dict[str, object]) -> None:
    states = _states(5, 1)
    start = _states(1, 2)[0]
    weights = {k: WEIGHTS[k] for k in states}
    strategy = build_strategy(name, {}, **kwargs)  # type: ignore[arg-type]
    got = strategy.aggregate(start, states, weights)
    want = aggregate(states, weights, method=name, **kwargs)  # type: ignore[arg-type]
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
        assert got[key].dtype == want[key].dtype


def _pseudo_rounds(rounds: int) -> list[tuple[State, dict[int, State]]]:
    """Several rounds' devices, each round starting from what the previous one gave is
    filled in by the caller; here only the devices' states (round r's seed)."""
    return [({}, _states(3, 10 + r, scale=0.5)) for r in range(rounds)]


def _run(strategy: ServerOptimizer, start: State, rounds: int) -> list[State]:
    """The strategy over ``rounds`` rounds, each installed; the global states."""
    out, x = [], start
    for _, states in _pseudo_rounds(rounds):
        x = strategy.aggregate(x, states, {k: WEIGHTS[k] for k in states})
        strategy.installed()
        out.append(x)
    return out


def _reference(rule: str, start: State, rounds: int, *, eta: float, beta1: float = 0.9,
               beta2: float = 0.99, tau: float = 1e-3, beta: float = 0.9) -> list[State]:
    """Reddi et al. 2021 Algorithm 2 (and FedAvgM) in numpy float64, with
    Delta = average - x and x + eta m / (sqrt(v) + tau)."""
    x = {k: v.double().numpy() for k, v in start.items() if v.is_floating_point()}
    m = {k: np.zeros_like(v) for k, v in x.items()}
    v = {k: np.full_like(val, tau ** 2) for k, val in x.items()}
    momentum = {k: np.zeros_like(val) for k, val in x.items()}
    out = []
    for _, states in _pseudo_rounds(rounds):
        ids = sorted(states)
        total = sum(WEIGHTS[k] for k in ids)
        new = {}
        for key in x:
            average = sum(states[k][key].double().numpy() * WEIGHTS[k] for k in ids) / total
            delta = average - x[key]
            if rule == "fedavgm":
                momentum[key] = beta * momentum[key] - delta  # on g = -Delta
                new[key] = x[key] - eta * momentum[key]
                continue
            m[key] = beta1 * m[key] + (1 - beta1) * delta
            if rule == "fedadagrad":
                v[key] = v[key] + delta ** 2
            elif rule == "fedyogi":
                v[key] = v[key] - (1 - beta2) * delta ** 2 * np.sign(v[key] - delta ** 2)
            else:
                v[key] = beta2 * v[key] + (1 - beta2) * delta ** 2
            new[key] = x[key] + eta * m[key] / (np.sqrt(v[key]) + tau)
        # the strategy casts to float32 each round: so does the reference
        x = {k: val.astype(np.float32).astype(np.float64) for k, val in new.items()}
        out.append({k: torch.from_numpy(val).float() for k, val in x.items()})
    return out


@pytest.mark.parametrize(("rule", "strategy", "kwargs"), [
    ("fedavgm", FedAvgM, {"eta": 0.7, "beta": 0.9}),
    ("fedadam", FedAdam, {"eta": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}),
    ("fedyogi", FedYogi, {"eta": 0.05, "beta1": 0.8, "beta2": 0.95, "tau": 1e-2}),
    ("fedadagrad", FedAdagrad, {"eta": 0.05, "beta1": 0.5, "tau": 1e-3}),
])
def test_server_optimizers_follow_their_rules_over_several_rounds(
        rule: str, strategy: type[ServerOptimizer], kwargs: dict[str, float]) -> None:
    start = _states(1, 3)[0]
    got = _run(strategy(**kwargs), start, 4)
    want = _reference(rule, start, 4, **kwargs)
    for r, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        for key in theirs:
            torch.testing.assert_close(mine[key], theirs[key], rtol=1e-6, atol=1e-7,
                                       msg=f"{rule} round {r} {key}")
        # an integer entry takes FedAvg's average (rounded)
        assert torch.equal(mine["n"], fedavg([_pseudo_rounds(4)[r][1][k] for k in range(3)],
                                             [WEIGHTS[k] for k in range(3)])["n"])


def test_fedavgm_with_eta_one_and_no_momentum_is_fedavg() -> None:
    start, states = _states(1, 4)[0], _states(3, 5)
    weights = {k: WEIGHTS[k] for k in states}
    got = FedAvgM(eta=1.0, beta=0.0).aggregate(start, states, weights)
    want = fedavg([states[k] for k in range(3)], [weights[k] for k in range(3)])
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7)


def test_moments_are_staged_until_installed() -> None:
    """The judge may aggregate a round several times ([Note: judging updates]): only
    the installed aggregate moves the server's state."""
    strategy, start, states = FedAdam(eta=0.1), _states(1, 6)[0], _states(3, 7)
    weights = {k: WEIGHTS[k] for k in states}
    first = strategy.aggregate(start, states, weights)
    strategy.aggregate(start, {0: states[0]}, weights)  # a trial without two devices
    assert strategy.state_dict() == {}
    again = strategy.aggregate(start, states, weights)
    for key in first:
        assert torch.equal(first[key], again[key])
    strategy.installed()
    assert sorted(strategy.state_dict()) == ["m/b", "m/w", "v/b", "v/w"]
    # restored elsewhere, the next round is the same
    other = FedAdam(eta=0.1)
    other.load_state_dict(strategy.state_dict())
    nxt = _states(3, 8)
    one, two = (s.aggregate(again, nxt, weights) for s in (strategy, other))
    for key in one:
        assert torch.equal(one[key], two[key])
    with pytest.raises(ConfigError, match="keeps no state 'q/w'"):
        other.load_state_dict({"q/w": torch.zeros(1)})


def test_multi_krum_averages_the_m_lowest_scores() -> None:
    """Blanchard et al. 2017: score_i = sum of squared distances to the n - f - 2
    nearest others; Multi-Krum averages the m best; one outlier is never chosen."""
    states = _states(6, 9)
    states[5] = {key: v * 50 if v.is_floating_point() else v for key, v in states[5].items()}
    f, m = 1, 3
    flat = {k: np.concatenate([s["w"].double().numpy().ravel(), s["b"].double().numpy()])
            for k, s in states.items()}
    scores = {i: sum(sorted(float(np.sum((flat[i] - flat[j]) ** 2))
                            for j in flat if j != i)[:len(flat) - f - 2]) for i in flat}
    best = sorted(flat, key=lambda i: (scores[i], i))[:m]
    assert 5 not in best
    got = MultiKrum(byzantine=f, keep=m).aggregate({}, states, WEIGHTS)
    for key in ("w", "b"):
        want = torch.stack([states[i][key].double() for i in best]).mean(0).float()
        torch.testing.assert_close(got[key], want, rtol=0, atol=1e-7)
    # keep 0: n - f models; too few left: the median
    assert MultiKrum(byzantine=f).chosen(6) == 5
    few = {k: states[k] for k in range(3)}
    median = aggregate(few, WEIGHTS, method="fedmedian")
    assert torch.equal(MultiKrum(byzantine=1).aggregate({}, few, WEIGHTS)["w"], median["w"])


def test_frozen_entries_are_not_seen_and_stay_bit_for_bit() -> None:
    start, states = _states(1, 11)[0], _states(3, 12)
    for state in states.values():
        state["frozen"] = start["frozen"] = torch.linspace(0, 1, 7)
    seen: list[set[str]] = []

    class Spy(FedAdam):
        def aggregate(self, start: Mapping[str, torch.Tensor],
                      states: Mapping[int, Mapping[str, torch.Tensor]],
                      weights: Mapping[int, float]) -> State:
            seen.append(set(start) | {key for s in states.values() for key in s})
            return super().aggregate(start, states, weights)

    spy = Spy(eta=0.5)
    got = uploaded_aggregate(spy, start, states, WEIGHTS, frozen={"frozen"})
    assert seen == [{"w", "b", "n"}]
    assert got["frozen"] is start["frozen"]
    spy.installed()
    assert not [k for k in spy.state_dict() if k.endswith("frozen")]


def test_a_strategy_is_configured_by_name_with_its_options() -> None:
    config = RunConfig(mode="fl", devices=4, byzantine_devices=1, options={
        "aggregation": "multi-krum", "aggregation_options": {"keep": 2}})
    from aiopipe.strategies import make_strategy

    strategy = make_strategy(config)
    assert isinstance(strategy, MultiKrum)
    assert isinstance(strategy, Strategy)
    assert (strategy.byzantine, strategy.keep) == (1, 2)
    prox = make_strategy(RunConfig(mode="fl", options={
        "aggregation": "fedprox", "aggregation_options": {"mu": 0.3}}))
    assert prox.configure_round(0) == {"proximal_mu": 0.3}


@pytest.mark.parametrize(("options", "match"), [
    ({"aggregation": "no_such_module_anywhere:Mine"},
     r"^config key 'aggregation': aggregation 'no_such_module_anywhere:Mine': cannot import "
     r"no_such_module_anywhere: ModuleNotFoundError"),
    ({"aggregation": "aiopipe.strategies:Nope"},
     r"^config key 'aggregation': aggregation 'aiopipe.strategies:Nope': aiopipe.strategies "
     r"has no Nope$"),
    ({"aggregation": "math:pi"}, r"'aggregation'.*is not callable"),
    ({"aggregation": "collections:OrderedDict"}, r"is not a strategy \(it lacks "
                                                r"configure_round, aggregate"),
    ({"aggregation": "fedadam", "aggregation_options": {"eta": 0}}, r"eta must be"),
    ({"aggregation": "fedavgm", "aggregation_options": {"momentum": 0.9}},
     r"^config key 'aggregation_options': fedavgm\(momentum=0.9\) failed: TypeError"),
])
def test_a_bad_strategy_is_one_config_error_line(options: dict[str, object],
                                                 match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        RunConfig(mode="fl", options=options)
    assert "\n" not in str(caught.value)


CHECKPOINTED = RunConfig(mode="fl", devices=2, samples_per_device=40, batch_size=20,
                         epochs=1, split_point=2, parallel_batches=2, test_samples=20,
                         options={"aggregation": "fedyogi"})


async def test_the_server_optimizers_state_survives_a_checkpoint(tmp_path: Path) -> None:
    node = Coordinator(CHECKPOINTED, clock=SystemClock(), checkpoint_dir=tmp_path)
    node.system.prepare([40, 40])
    star = node.system
    start = {k: v.clone() for k, v in star.model.state_dict().items()}
    moved = {k: {key: v + 0.01 * (k + 1) if v.is_floating_point() else v
                 for key, v in start.items()} for k in range(2)}
    star.strategy.aggregate(start, moved, {0: 1.0, 1: 1.0})
    star.strategy.installed()
    saved = star.strategy.state_dict()
    assert saved
    assert all(math.isfinite(float(t.abs().max())) for t in saved.values())
    save_checkpoint(tmp_path, star.checkpoint_tensors(), node._checkpoint_meta(1, 0, 0.0))
    tensors, _ = load_checkpoint(tmp_path)
    assert {f"strategy/{k}" for k in saved} <= set(tensors)
    resumed = await joined(Coordinator(CHECKPOINTED, clock=SystemClock(),
                                       checkpoint_dir=tmp_path, resume=True))
    restored = resumed.system.strategy.state_dict()
    assert restored.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(restored[key], value), key
