"""FTPipeHD's asynchronous pipeline rules (aiopipe/scheduler/async_pipeline.py): 1F1B
order, weight stashing, vertical sync and weight aggregation, as golden version tables.
The paper's Fig. 2 (3 stages) states: stage 0 forwards batch 3 with version 1 and
backwards batch 1 with version 0; it aggregates versions 1–3 into 4 and forwards batch 6
with version 5; stage 2 forwards batch 1 with version 0 although it is at version 1."""

from __future__ import annotations

import pytest

from aiopipe import ConfigError
from aiopipe.scheduler.async_pipeline import (
    aggregates_before,
    forward_weights,
    one_f_one_b,
    version_of,
    version_table,
)

#: 3 stages, 9 batches, aggregation every k_i updates: pass^version per stage
GOLDEN_3 = [
    "F0^0 F1^0 F2^0 B0^0 F3^1 B1^0 F4^2 B2^0 F5^3 B3^1 F6^5 B4^2 F7^6 B5^3 F8^7 B6^5 B7^6 B8^7",
    "F0^0 F1^0 B0^0 F2^0 B1^0 F3^1 B2^0 F4^2 B3^1 F5^4 B4^2 F6^5 B5^4 F7^7 B6^5 F8^8 B7^7 B8^8",
    "F0^0 B0^0 F1^0 B1^0 F2^0 B2^0 F3^1 B3^1 F4^2 B4^2 F5^3 B5^3 F6^4 B6^4 F7^5 B7^5 F8^6 B8^6",
]


def _row(stage_passes: list) -> str:  # type: ignore[type-arg]
    return " ".join(f"{p.kind}{p.batch}^{p.version}" for p in stage_passes)


def test_three_stages_as_in_the_papers_figure_2() -> None:
    table = version_table(3, 9)
    assert [_row(row) for row in table] == GOLDEN_3
    stage0 = {(p.kind, p.batch): p.version for p in table[0]}
    assert stage0["F", 3] == 1
    assert stage0["B", 1] == 0  # stashed: batch 1 went forward with version 0
    assert stage0["F", 5] == 3  # 3_f^1, 4_f^2, 5_f^3: the three versions aggregated ...
    assert version_of(3, 0, 2, 1) == 3
    assert aggregates_before(3, 0, 3, 1)  # ... into version 4, before batch 3's update
    assert version_of(3, 0, 3, 1) == 5
    assert stage0["F", 6] == 5
    stage2 = {(p.kind, p.batch): p.version for p in table[2]}
    assert stage2["F", 1] == 0  # vertical sync: batch 1 entered stage 0 with version 0
    assert version_of(3, 2, 0, 1) == 1  # though stage 2 is at version 1 after batch 0


def test_every_backward_uses_its_forwards_weights_and_every_stage_the_same_update() -> None:
    for stages in (1, 2, 3, 5):
        table = version_table(stages, 12, aggregate_every=2)
        for row in table:
            forward = {p.batch: p for p in row if p.kind == "F"}
            for p in row:
                if p.kind == "B":
                    assert (p.version, p.after_update) == (forward[p.batch].version,
                                                           forward[p.batch].after_update)
        for batch in range(12):  # vertical sync: one update index for the whole batch
            assert {p.after_update for row in table for p in row if p.batch == batch} == {
                forward_weights(stages, batch)}


def test_1f1b_keeps_n_minus_i_batches_in_flight() -> None:
    for stages in (1, 3, 4):
        for stage in range(stages):
            order = one_f_one_b(stages, stage, 10)
            assert sorted(order) == sorted([("F", b) for b in range(10)]
                                           + [("B", b) for b in range(10)])
            in_flight = peak = 0
            for kind, _ in order:
                in_flight += 1 if kind == "F" else -1
                peak = max(peak, in_flight)
            assert peak == stages - stage
            backwards = [b for kind, b in order if kind == "B"]
            assert backwards == sorted(backwards)  # updates in batch order


def test_without_aggregation_a_version_is_the_number_of_updates() -> None:
    assert [version_of(3, 0, j, 0) for j in range(-1, 5)] == [0, 1, 2, 3, 4, 5]
    assert not any(aggregates_before(3, s, j, 0) for s in range(3) for j in range(20))
    # the last stage has one version in flight: nothing to aggregate, ever
    assert not any(aggregates_before(3, 2, j, 1) for j in range(20))
    # every m x k updates: stage 1 of 3 (k = 2), m = 2 -> before updates 4, 8, ...
    assert [j for j in range(13) if aggregates_before(3, 1, j, 2)] == [4, 8, 12]


@pytest.mark.parametrize(("stages", "stage", "every"), [(0, 0, 1), (3, 3, 1), (3, -1, 1),
                                                        (3, 0, -1)])
def test_bad_arguments(stages: int, stage: int, every: int) -> None:
    with pytest.raises(ConfigError):
        version_of(stages, stage, 0, every)
