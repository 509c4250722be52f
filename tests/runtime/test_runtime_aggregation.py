"""FedAvg with unequal sample counts equals the weighted average computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from aiopipe.errors import TrainingError
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
    assert clipped[3]["w"].tolist() == pytest.approx([12.0, 16.0])  # norm 20 = 10 x 2
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
