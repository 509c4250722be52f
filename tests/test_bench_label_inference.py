"""bench/label_inference.py: what the simulated server really receives in PiPar and in
U-shaped split learning (examples/ushaped.py), the U-shaped option ``gradient_noise`` as
the server sees it, and the bench's table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_scripts import load_bench

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError

bench = load_bench("label_inference")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BATCH = 16


@pytest.fixture
def ushaped(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The example's module, importable by its mode name."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import ushaped as module

    return module


def _config(**changes: object) -> RunConfig:
    base = RunConfig(mode="ushaped:UShaped", model="vgg5", dataset="synthetic-cifar10",
                     devices=2, samples_per_device=2 * BATCH, batch_size=BATCH, epochs=1,
                     split_point=2, parallel_batches=2, test_samples=20, seed=3)
    return base.replace(**changes)


async def _traffic(config: RunConfig, route: Any) -> Any:
    with bench.capture_traffic(route) as traffic:
        await simulate(config, clock=VirtualClock())
    return traffic


@pytest.mark.slow
async def test_in_pipar_the_server_receives_the_labels(ushaped: Any) -> None:
    traffic = await _traffic(_config(mode="pipar"), ushaped._ToCoordinator)
    # devices x iterations x micro-batches
    assert len(traffic.truth) == len(traffic.labels_received) == 2 * 2 * 2
    assert all(torch.equal(traffic.labels_received[k], v) for k, v in traffic.truth.items())
    assert bench.labels_read(traffic) == 1.0
    assert traffic.gradients_received == {}  # the server's stage is the last
    assert set(traffic.gradients_sent) == set(traffic.truth)


@pytest.mark.parametrize("schedule", ["turns", "parallel"])
async def test_in_ushaped_the_server_receives_no_labels_but_the_tails_gradients(
        ushaped: Any, schedule: str) -> None:
    traffic = await _traffic(_config(options={"schedule": schedule}), ushaped._ToCoordinator)
    assert len(traffic.truth) == len(traffic.labels_received) == 2 * 2 * 2
    assert any(bool(labels.any()) for labels in traffic.truth.values())
    assert all(not bool(labels.any()) for labels in traffic.labels_received.values())
    # the tail's gradient (with respect to the middle's output: vgg5's 128 features)
    assert set(traffic.gradients_received) == set(traffic.truth)
    assert {g.shape for g in traffic.gradients_received.values()} == {(BATCH // 2, 128)}
    assert set(traffic.gradients_sent) == set(traffic.truth)
    # ... which give the labels away: the attacks, given one label per class
    scores = bench.attack(traffic.gradients_received, traffic.truth, known=1, seed=0,
                          binary=False)
    assert scores["direction"] > 0.9
    assert scores["cluster"] > 0.9


async def test_gradient_noise_changes_what_the_server_receives_reproducibly(
        ushaped: Any) -> None:
    clean = await _traffic(_config(), ushaped._ToCoordinator)
    noisy = await _traffic(_config(options={"gradient_noise": 1.0}), ushaped._ToCoordinator)
    again = await _traffic(_config(options={"gradient_noise": 1.0}), ushaped._ToCoordinator)
    other = await _traffic(_config(options={"gradient_noise": 1.0, "noise_seed": 1}),
                           ushaped._ToCoordinator)
    keys = sorted(clean.gradients_received)
    assert all(torch.equal(noisy.gradients_received[k], again.gradients_received[k])
               for k in keys)
    assert all(not torch.equal(noisy.gradients_received[k], other.gradients_received[k])
               for k in keys)
    # the first micro-batch is computed before any noise reached a weight: the difference
    # is the noise alone, of norm about sigma x the largest clean row's, per row
    first = keys[0]
    exact = clean.gradients_received[first]
    noise = noisy.gradients_received[first] - exact
    ratio = float(noise.norm(dim=1).mean() / exact.norm(dim=1).max())
    assert 0.8 < ratio < 1.2
    assert abs(float(noise.mean())) < 0.2 * float(noise.std())


async def test_negative_noise_is_refused(ushaped: Any) -> None:
    with pytest.raises(ConfigError, match="gradient_noise"):
        await simulate(_config(options={"gradient_noise": -1.0}), clock=VirtualClock())


def test_the_attack_scores_per_epoch_with_known_labels_left_out() -> None:
    labels = torch.arange(4).repeat(5)  # 20 samples, 4 classes
    gradients = torch.nn.functional.one_hot(labels, 4).double() * 3 - 1
    truth = {("device0", 0, 0, 0): labels[:10], ("device0", 0, 1, 0): labels[10:]}
    rows = {("device0", 0, 0, 0): gradients[:10], ("device0", 0, 1, 0): gradients[10:]}
    scores = bench.attack(rows, truth, known=1, seed=0, binary=False)
    assert scores == {"direction": 1.0, "cluster": 1.0}


@pytest.mark.slow
def test_the_bench_prints_and_writes_its_table(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(["--samples", "64", "--batch", "16", "--epochs", "1", "--noise", "1",
                "--tails", "", "--no-turns", "--out", str(tmp_path)])
    table = (tmp_path / "table.md").read_text()
    assert table in capsys.readouterr().out
    rows = json.loads((tmp_path / "results.json").read_text())
    # two tasks x (pipar: sent; u-shaped and noise 1: received and sent)
    assert [(r["task"], r["system"], r["gradient"]) for r in rows] == [
        (task, system, gradient) for task in ("classes", "binary")
        for system, gradient in [("pipar", "sent"), ("u-shaped", "received"),
                                 ("u-shaped", "sent"), ("u-shaped, noise 1", "received"),
                                 ("u-shaped, noise 1", "sent")]]
    assert all(r["labels_read"] == 1.0 for r in rows if r["system"] == "pipar")
    assert all("norm_auc" in r for r in rows if r["task"] == "binary")


def test_the_table_gives_means_ranges_and_failed_runs() -> None:
    def row(seed: int, direction: float, accuracy: float, failed: str = "") -> dict[str, Any]:
        return {"seed": seed, "task": "classes", "system": "u-shaped", "gradient": "received",
                "labels_read": 0.1, "direction": direction, "cluster": 0.5,
                "model_accuracy": accuracy, "failed": failed, "chance": 0.1}

    text = bench._table("title", [row(1, 0.5, 0.6), row(2, 0.7, 0.8, "without devices [1]"),
                                  row(3, 0.9, float("nan"), "every device was lost")])
    line = next(t for t in text.splitlines() if t.startswith("| classes"))
    assert line == ("| classes | u-shaped | received | 0.100 (0.10-0.10) | 0.700 (0.50-0.90) | "
                    "0.500 (0.50-0.50) | - | - | 0.700 (0.60-0.80), failed 1/3 (devices "
                    "lost) | 0.100 (0.10-0.10) |")
    assert text.endswith("classes, u-shaped, seed 2: without devices [1]\n"
                         "classes, u-shaped, seed 3: every device was lost")
