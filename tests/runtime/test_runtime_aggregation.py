"""FedAvg with unequal sample counts equals the weighted average computed by hand."""

from __future__ import annotations

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
