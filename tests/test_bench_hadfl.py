"""bench/hadfl.py's figures from a run's epochs: times to accuracy and Holt's error."""

from __future__ import annotations

import math

from bench_scripts import load_bench

hadfl = load_bench("hadfl")


def _epoch(time_s: float, accuracy: float, changes: list[dict[str, object]]) -> dict[str, object]:
    return {"time_s": time_s, "accuracy": accuracy, "samples": 10, "peer_bytes": [1, 2],
            "bytes_up": 3, "bytes_down": 4, "changes": changes}


def test_time_to_accuracy_is_the_first_epoch_end_at_or_above_it() -> None:
    epochs = [_epoch(2.0, 0.3, []), _epoch(2.0, 0.65, []), _epoch(3.0, 0.6, [])]
    row = hadfl.summary("x", epochs, [0.6, 0.65, 0.9])
    assert row["time_to_s"] == {"0.6": 4.0, "0.65": 4.0, "0.9": None}
    assert row["curve"] == [(2.0, 0.3), (4.0, 0.65), (7.0, 0.6)]
    assert row["peer_bytes"] == [3, 3, 3]


def test_holt_s_error_compares_each_prediction_with_the_versions_reached() -> None:
    rounds = [{"predicted": None, "versions": [1.0, 1.0]},
              {"predicted": [4.0, 2.0], "versions": [5.0, 3.0]},  # Eq. 6's: not Holt's
              {"predicted": [9.0, 5.0], "versions": [10.0, 5.0]}]
    errors = hadfl.prediction_errors(rounds)
    assert errors["rounds"] == 1
    assert errors["mean_abs_epochs"] == 0.5
    assert math.isclose(errors["mean_relative"], 0.05)
