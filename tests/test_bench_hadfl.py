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


def test_relative_targets_are_fractions_of_the_best_run_and_retime_every_run() -> None:
    rows = [hadfl.summary("a", [_epoch(2.0, 0.3, []), _epoch(2.0, 0.5, [])], []),
            hadfl.summary("b", [_epoch(1.0, 0.4, []), _epoch(5.0, 0.6, [])], [])]
    targets = hadfl.absolute_targets(rows, [0.7, 0.8])
    assert targets == [0.42, 0.48]  # of b's 0.6
    hadfl.retimed(rows, targets)
    assert rows[0]["time_to_s"] == {"0.42": 4.0, "0.48": 4.0}
    assert rows[1]["time_to_s"] == {"0.42": 6.0, "0.48": 6.0}


def test_a_non_iid_fleet_of_another_dataset_and_model_is_configured_as_asked() -> None:
    fleet = hadfl.Fleet(epochs=3, samples=96, model="resnet18", dataset="synthetic-cifar100",
                        dirichlet=0.3)
    config = fleet.config({"mode": "fl"})
    assert (config.model, config.dataset, config.data_partition, config.dirichlet_alpha,
            config.mode) == ("resnet18", "synthetic-cifar100", "dirichlet", 0.3, "fl")
    assert config.device_slowdown == (1.0, 2.0, 2.0, 4.0)
    assert hadfl.Fleet(epochs=3, samples=96).config({}).data_partition == "iid"
    assert "(Dirichlet(0.3)) of synthetic-cifar100, resnet18" in fleet.title("virtual")
