"""FedAvg with unequal sample counts equals the weighted average computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from aiopipe.errors import ConfigError, TrainingError
from aiopipe.runtime.aggregation import fedavg


def test_weighted_average_with_unequal_counts() -> None:
    gen = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(3, 4, generator=gen), "b": torch.randn(4, generator=gen),
               "n": torch.tensor(k * 10, dtype=torch.int64)} for k in range(3)]
    counts = [100, 300, 50]
    got = fedavg(states, counts)
    total = sum(counts)
    for key in ("w", "b"):
        want = sum(s[key].double() * c for s, c in zip(states, counts, strict=True)) / total
        torch.testing.assert_close(got[key], want.float(), rtol=1e-6, atol=1e-7)
        assert got[key].dtype == torch.float32
    # integer buffers: weighted mean, rounded: (0*100 + 10*300 + 20*50) / 450 = 8.89 -> 9
    assert got["n"].item() == 9
    assert got["n"].dtype == torch.int64


def test_zero_weight_device_is_ignored() -> None:
    a, b = {"w": torch.ones(2)}, {"w": torch.full((2,), 5.0)}
    assert torch.equal(fedavg([a, b], [1, 0])["w"], torch.ones(2))


@pytest.mark.parametrize(("states", "weights", "match"), [
    ([], [], "one weight per state"),
    ([{"w": torch.ones(1)}], [0], "positive sum"),
    ([{"w": torch.ones(1)}, {"v": torch.ones(1)}], [1, 1], "same parameters"),
    ([{"w": torch.ones(1)}, {"w": torch.ones(2)}], [1, 1], "shape"),
])
def test_bad_input_is_refused(states: list[dict[str, torch.Tensor]], weights: list[int],
                              match: str) -> None:
    with pytest.raises(TrainingError, match=match):
        fedavg(states, weights)


def test_inputs_are_left_alone_even_in_float64() -> None:
    a = {"w": torch.ones(3, dtype=torch.float64)}
    b = {"w": torch.full((3,), 3.0, dtype=torch.float64)}
    got = fedavg([a, b], [1, 1])
    assert torch.equal(got["w"], torch.full((3,), 2.0, dtype=torch.float64))
    assert torch.equal(a["w"], torch.ones(3, dtype=torch.float64))
    assert torch.equal(b["w"], torch.full((3,), 3.0, dtype=torch.float64))


# -- robust aggregators, against their definitions on small hand-made models -----------

def _model(*values: float, count: int = 7) -> dict[str, torch.Tensor]:
    """A state whose weight holds ``values`` and whose counter is ``count``."""
    return {"w": torch.tensor(values, dtype=torch.float32),
            "num_batches_tracked": torch.tensor(count)}


def test_the_median_is_taken_per_coordinate() -> None:
    from aiopipe.runtime.aggregation import fedmedian

    odd = fedmedian([_model(1, 10), _model(2, -5), _model(1e15, 0, count=9)])
    assert odd["w"].tolist() == [2.0, 0.0]  # the huge value cannot move it
    assert odd["num_batches_tracked"].item() == 7
    even = fedmedian([_model(1, 4), _model(3, 2), _model(5, 0), _model(100, 1)])
    assert even["w"].tolist() == [4.0, 1.5]  # the mean of the two middle values
    assert even["w"].dtype == torch.float32


def test_the_trimmed_mean_drops_the_extremes_per_coordinate() -> None:
    from aiopipe.runtime.aggregation import trimmed_mean

    states = [_model(v, -v) for v in (1.0, 2.0, 3.0, 4.0, 1e6)]
    got = trimmed_mean(states, 0.2)  # floor(0.2 x 5) = 1 dropped at each end
    assert got["w"].tolist() == [3.0, -3.0]  # each coordinate alike
    assert got["num_batches_tracked"].item() == 7
    assert trimmed_mean(states, 0.0)["w"][0].item() == pytest.approx((10 + 1e6) / 5)
    with pytest.raises(TrainingError, match="trim must be in"):
        trimmed_mean(states, 0.5)


def test_krum_picks_the_model_closest_to_its_neighbours() -> None:
    from aiopipe.runtime.aggregation import krum

    honest = [_model(0.0, 0.0), _model(0.1, 0.0), _model(0.0, 0.2), _model(0.1, 0.1)]
    poisoned = [_model(1e6, -1e6)]
    got, chosen = krum(honest + poisoned, byzantine=1)
    # scores, the 2 (n - f - 2) nearest squared distances: model 0: .01 + .02 = .03,
    # 1: .01 + .01 = .02, 2: .02 + .04 = .06, 3: .01 + .02 = .03, 4: huge
    assert chosen == [1]
    assert got["w"].tolist() == pytest.approx([0.1, 0.0])
    multi, chosen = krum(honest + poisoned, byzantine=1, keep=4)
    assert 4 not in chosen  # the poisoned model is never among the kept
    assert multi["w"].tolist() == pytest.approx([0.05, 0.075])
    with pytest.raises(TrainingError, match="needs n >= f \\+ 3"):
        krum(honest, byzantine=2)


def test_an_update_far_above_the_rounds_median_is_dropped_or_clipped() -> None:
    from aiopipe.runtime.aggregation import screen_updates

    start = _model(0.0, 0.0)
    states = {0: _model(1.0, 0.0), 1: _model(0.0, 2.0), 2: _model(2.0, 0.0),
              3: _model(300.0, 400.0)}  # norms 1, 2, 2, 500: median 2
    kept, outliers = screen_updates(states, start, action="drop", limit=10.0)
    assert sorted(kept) == [0, 1, 2]
    assert outliers == {3: 250.0}
    clipped, _ = screen_updates(states, start, action="clip", limit=10.0)
    assert clipped[3]["w"].tolist() == pytest.approx([1.2, 1.6])  # the median's norm, 2
    assert clipped[3]["num_batches_tracked"].item() == 7  # counters are not scaled
    assert screen_updates(states, start, action="keep", limit=10.0)[1] == {}
    two = {0: states[0], 3: states[3]}  # no median tells the outlier from the rest
    assert screen_updates(two, start, action="drop", limit=10.0)[1] == {}
    broken = {**states, 3: _model(math.nan, 0.0)}
    assert 3 not in screen_updates(broken, start, action="clip", limit=10.0)[0]


def test_aggregate_applies_the_runs_method() -> None:
    from aiopipe.runtime.aggregation import aggregate

    states = {0: _model(1.0), 1: _model(2.0), 2: _model(9.0)}
    weights = {0: 1.0, 1: 1.0, 2: 2.0}
    assert aggregate(states, weights, method="fedavg")["w"].item() == pytest.approx(5.25)
    assert aggregate(states, weights, method="fedmedian")["w"].item() == 2.0
    assert aggregate(states, weights, method="trimmed-mean", trim=0.34)["w"].item() == 2.0
    # krum for one bad device needs 4 models: with 3 it falls back to the median
    assert aggregate(states, weights, method="krum", byzantine=1)["w"].item() == 2.0
    with pytest.raises(TrainingError, match="unknown aggregation"):
        aggregate(states, weights, method="mean")


# -- the update judge, whatever the options ([Note: judging updates]) ------------------

def test_the_judge_refuses_what_is_not_finite_or_far_beyond_the_rounds_median() -> None:
    from aiopipe.runtime.aggregation import UpdateJudge, update_norms

    start = _model(0.0, 0.0)
    states = {0: _model(1.0, 0.0), 1: _model(0.0, 2.0), 2: _model(2.0, 0.0),
              3: _model(3000.0, 4000.0), 4: _model(math.nan, 0.0),
              5: _model(300.0, 0.0)}  # norms 1, 2, 2, 5000, NaN, 300: median 2
    refused = UpdateJudge().refusals(update_norms(states, start), start)
    assert sorted(refused) == [3, 4]  # 2500 x the median; NaN. (150 x is honest enough)
    assert "2.5e+03 x the round's median" in refused[3]
    assert "not finite" in refused[4]


def test_with_fewer_than_three_the_judge_goes_by_the_run_then_by_the_model() -> None:
    from aiopipe.runtime.aggregation import UpdateJudge

    judge = UpdateJudge(limit=100.0)
    start = _model(3.0, 4.0)  # its own norm: 5
    assert judge.scale({0: 1.0}, start) == (5.0, "the model's own norm")
    assert list(judge.refusals({0: 400.0, 1: 600.0}, start)) == [1]
    judge.accept([0.5, 0.1, math.inf, 0.1])  # the median of 0.1, 0.1, 0.5: 0.1
    assert judge.scale({0: 1.0}, start) == (0.1, "the run's recent updates")
    assert list(judge.refusals({0: 9.0, 1: 11.0}, start)) == [1]
    zeros = {"w": torch.zeros(2)}  # nothing gives a scale: only finiteness is judged
    assert UpdateJudge().refusals({0: 1e30, 1: math.inf}, zeros) == {
        1: "its update is not finite (norm inf)"}


def test_the_judge_refuses_an_aggregate_that_is_not_finite_or_too_far() -> None:
    from aiopipe.runtime.aggregation import UpdateJudge

    judge, start = UpdateJudge(), _model(0.0, 0.0)
    assert judge.aggregate_problem(_model(3.0, 4.0), start, 1.0) == ""
    assert "not finite" in judge.aggregate_problem(_model(math.inf, 0.0), start, 1.0)
    assert "x the round's scale" in judge.aggregate_problem(_model(3e3, 4e3), start, 1.0)
    with pytest.raises(ConfigError, match="must be a number > 1"):
        UpdateJudge(limit=1.0)


def test_an_aggregate_that_fails_is_installed_without_the_device_that_made_it_fail() -> None:
    from aiopipe.runtime.aggregation import UpdateJudge, judged_aggregate, update_norms

    probed: list[float] = []

    def probe(state: dict[str, torch.Tensor]) -> tuple[float, float]:
        """Loss: the largest weight (a blank model's: 1)."""
        probed.append(float(state["w"].abs().max()))
        return probed[-1], 1.0

    judge, start = UpdateJudge(probe=probe), _model(0.0, 0.0)
    states = {0: _model(1.0, 0.0), 1: _model(0.0, 2.0), 2: _model(2.0, 0.0),
              3: _model(0.0, 400.0)}  # 200 x the median: under the norm limit
    weights = dict.fromkeys(states, 1.0)
    norms = update_norms(states, start)
    state, left_out = judged_aggregate(states, weights, norms, start, judge=judge,
                                       scale=2.0, method="fedavg")
    assert list(left_out) == [3]
    assert "its loss on the coordinator's evaluation batch is 100" in left_out[3]
    assert state is not None
    assert state["w"].tolist() == pytest.approx([1.0, 2 / 3])
    assert len(probed) == 3  # the start's, the whole round's, and without device 3
    everyone_bad = {k: _model(50.0 + k, 0.0) for k in range(3)}
    state, left_out = judged_aggregate(everyone_bad, weights, update_norms(everyone_bad, start),
                                       start, judge=judge, scale=50.0, method="fedavg")
    assert state is None
    assert sorted(left_out) == [1, 2]  # the largest first; 0 stays


def test_the_evaluation_probe_leaves_the_model_as_it_was() -> None:
    from aiopipe.runtime.aggregation import evaluation_probe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 2))
    model[2].eval()  # modes are restored one module at a time
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = torch.randn(8, 3), torch.randint(0, 2, (8,))
    probe = evaluation_probe(model, torch.nn.functional.cross_entropy, batch)
    other = {k: v * 2 if v.is_floating_point() else v for k, v in before.items()}
    loss, blank = probe(other)
    assert math.isfinite(loss)
    assert blank == pytest.approx(math.log(2))
    assert [m.training for m in model.modules()] == [True, True, True, False]
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert probe(before)[0] != loss


def test_the_model_a_round_installed_is_not_probed_again_as_the_next_start() -> None:
    from aiopipe.runtime.aggregation import UpdateJudge

    probed: list[float] = []

    def probe(state: dict[str, torch.Tensor]) -> tuple[float, float]:
        probed.append(float(state["w"][0]))
        return 1.0, 1.0

    judge, start, state = UpdateJudge(probe=probe), _model(0.0, 0.0), _model(1.0, 0.0)
    assert judge.loss_ceiling(start) == 10.0
    assert judge.aggregate_problem(state, start, 1.0, 10.0) == ""
    judge.installed()
    assert judge.loss_ceiling(state) == 10.0
    assert probed == [0.0, 1.0]  # the start, the aggregate; not the aggregate again
    judge.forget()  # (a checkpoint was loaded)
    judge.loss_ceiling(start)
    assert probed == [0.0, 1.0, 0.0]
