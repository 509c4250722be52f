"""HADFL's ring average (aiopipe.runtime.systems.hadfl.gossip): scatter-reduce then
all-gather over a directed ring gives every member the same bits, the members' mean,
each member moving 2 (N - 1) / N of a model; a message that breaks the ring's order is
refused."""

from __future__ import annotations

import pytest
import torch

from aiopipe.errors import RemoteProtocolError
from aiopipe.runtime.systems.hadfl.gossip import RingAverage, chunk_bounds


def _run(vectors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Every member's average, and the values each sent, exchanging step by step."""
    n = len(vectors)
    members = [RingAverage(v, r, n) for r, v in enumerate(vectors)]
    sent = [0] * n
    while not members[0].done:
        messages = [m.outgoing() for m in members]
        for r, (chunk, values) in enumerate(messages):
            sent[r] += values.numel()
            members[(r + 1) % n].incoming(chunk, values)
    return [m.average() for m in members], sent


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_every_member_ends_with_the_same_mean(n: int) -> None:
    torch.manual_seed(n)
    vectors = [torch.randn(17) for _ in range(n)]
    averages, sent = _run(vectors)
    for average in averages:
        assert torch.equal(average, averages[0])
    torch.testing.assert_close(averages[0], torch.stack(vectors).mean(0), rtol=1e-6,
                               atol=1e-6)
    for values in sent:  # 2 (N - 1) chunks of about 17 / N
        assert abs(values - 2 * (n - 1) * 17 / n) <= 2 * (n - 1)


def test_chunks_cover_the_vector_evenly() -> None:
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize(("chunk", "values", "match"), [
    (0, torch.zeros(5), "expected chunk 2"),
    (2, torch.zeros(6), r"expected chunk 2 of \(5,\)"),
    (2, torch.full((5,), float("nan")), "NaN or Inf"),
    (2, torch.zeros(5, dtype=torch.float64), "expected chunk 2"),
])
def test_a_message_that_breaks_the_ring_is_refused(chunk: int, values: torch.Tensor,
                                                   match: str) -> None:
    member = RingAverage(torch.zeros(17), 0, 3)  # step 0 expects its predecessor's chunk 2
    with pytest.raises(RemoteProtocolError, match=match):
        member.incoming(chunk, values)
    assert member.step == 0


def test_no_message_after_the_last_step() -> None:
    member = RingAverage(torch.ones(4), 0, 1)
    assert member.done
    assert torch.equal(member.average(), torch.ones(4))
    with pytest.raises(RemoteProtocolError):
        member.incoming(0, torch.zeros(4))

