"""A language model and a regression between real processes (``python -m aiopipe`` and
``python -m aiopipe.server`` / ``aiopipe.device``): gpt-tiny (embed, 4 blocks, norm,
head: 7 units; the padding mask crosses every cut beside the residual stream) on
stdlib-text, per-token next-byte targets, in pipar (the planner splits it among its
blocks from the devices' own measurements); and a float-target regression with
``--loss mse`` and a metric of the user's own (``module:function``). (gpt-tiny in
FTPipeHD between processes, re-partitioned between whole blocks after a device is
excluded: tests/test_poisoned_peer_processes.py; in HADFL's rings:
tests/runtime/test_runtime_traced_models.py.)

Small sizes: each run takes seconds an epoch on two busy cores."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from real_processes import REPO, child_env

pytestmark = pytest.mark.slow

#: gpt-tiny's units: embed, blocks 1-4, norm, head; a cut c puts units 0..c-1 before it
UNITS = 7
GPT = ("--model", "gpt-tiny", "--dataset", "stdlib-text")


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _launch(tmp_path: Path, *args: str, pictures: bool = False, timeout: float = 150
            ) -> subprocess.CompletedProcess[str]:
    """``python -m aiopipe ARGS`` in ``tmp_path`` (which the command can import from)."""
    return subprocess.run(
        [sys.executable, "-m", "aiopipe", *args],
        env=child_env({"PYTHONPATH": str(tmp_path)}, pictures=pictures),
        capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


@pytest.mark.timeout(200)
def test_gpt_tiny_in_pipar_is_split_among_its_blocks_from_measured_costs(
        tmp_path: Path) -> None:
    """``--split-point auto --parallel-batches auto``: each device profiles itself, the
    planner splits gpt-tiny between two of its units (the mask and the residual stream
    cross that cut), perplexity falls epoch over epoch, and the trace has its tracks."""
    out = tmp_path / "run"
    done = _launch(tmp_path, "--mode", "pipar", *GPT, "--devices", "2", "--epochs", "2",
                   "--samples-per-device", "192", "--batch-size", "16",
                   "--test-samples", "64", "--split-point", "auto",
                   "--parallel-batches", "auto", "--learning-rate", "0.05",
                   "--out-dir", str(out))
    log = done.stderr
    assert done.returncode == 0, log[-4000:]
    epochs = _metrics(out)
    assert len(epochs) == 2
    perplexities = [e["perplexity"] for e in epochs]
    assert all(math.isfinite(p) for p in perplexities), perplexities
    assert all(b < a for a, b in itertools.pairwise(perplexities)), perplexities
    for e in epochs:
        assert e["perplexity"] == pytest.approx(math.exp(e["loss"]))
        assert 0.0 <= e["accuracy"] <= 1.0  # per-token, on the test windows
    # planned from the devices' own measurements: each profiled itself, then the plan
    lines = log.splitlines()
    planned = [i for i, line in enumerate(lines) if "planned pipar" in line]
    assert planned, log[-4000:]
    for d in range(2):
        profiled = [i for i, line in enumerate(lines) if f"device {d} profiled itself" in line]
        assert profiled, log[-4000:]
        assert profiled[0] < planned[0], log[-4000:]
    # a split among the transformer's units, the same for the whole run
    [plan] = {tuple(p["split_point"] for p in e["plan"]) for e in epochs}
    assert len(plan) == 2
    assert all(1 <= p <= UNITS - 1 for p in plan), plan
    # one line for the fleet, or one per device when their measured speeds differ
    assert re.search(r"planned pipar[^\n]*(\n[^\n]*device \d: )?[^\n]*\(split \d\)", log), (
        log[-4000:])
    # the run's trace has the pipar tracks (timeline.png drawn from one:
    # tests/test_cli.py)
    trace = json.loads((out / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"device0/compute", "device1/compute", "server/compute"} <= tracks, tracks
    print(f"perplexity {[round(p, 2) for p in perplexities]}, split points {plan}")


@pytest.mark.timeout(150)
def test_a_regression_from_the_command_line_reports_the_users_metric_or_none(
        tmp_path: Path) -> None:
    """``--dataset regression_data:dataset --model regression_data:model --loss mse``:
    with ``--metric regression_data:metric`` the accuracies are the user's (the share of
    samples predicted within 0.25: the saved model scores the test split as the last
    epoch says). (``--metric none``: null accuracies in ``metrics.jsonl``,
    tests/runtime/test_runtime_targets.py.)"""
    (tmp_path / "regression_data.py").write_text(
        (REPO / "tests" / "regression_data.py").read_text())
    common = ["--mode", "fl", "--dataset", "regression_data:dataset",
              "--model", "regression_data:model", "--loss", "mse", "--devices", "2",
              "--batch-size", "20", "--learning-rate", "0.05", "--test-samples", "100"]
    runs = {"metric": [*common, "--metric", "regression_data:metric", "--epochs", "3",
                       "--samples-per-device", "200"]}
    started = {name: subprocess.Popen(
        [sys.executable, "-m", "aiopipe", *args, "--out-dir", str(tmp_path / name)],
        env=child_env({"PYTHONPATH": str(tmp_path)}), cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name, args in runs.items()}
    for name, process in started.items():
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, (name, stderr[-4000:])

    epochs = _metrics(tmp_path / "metric")
    losses = [e["loss"] for e in epochs]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    for e in epochs:
        for key in ("train_accuracy", "accuracy"):
            assert isinstance(e[key], float), (key, e[key])
            assert 0.0 <= e[key] <= 1.0, (key, e[key])
        assert e["accuracy"] * 100 == pytest.approx(round(e["accuracy"] * 100))  # of 100
    # the user's metric: the final model's share of test samples within 0.25
    import regression_data  # tests/ is on the path, as for real_processes
    import torch
    from safetensors.torch import load_file

    model = regression_data.model(0, (regression_data.FEATURES,))
    model.load_state_dict(load_file(tmp_path / "metric" / "model.safetensors"))
    x, y = regression_data.dataset("test", 0).batch(range(100))
    with torch.no_grad():
        within = int(regression_data.within(model(x), y))
    assert epochs[-1]["accuracy"] == pytest.approx(within / 100)

    print(f"loss {[round(v, 3) for v in losses]}, train accuracy "
          f"{[e['train_accuracy'] for e in epochs]}, test accuracy "
          f"{[e['accuracy'] for e in epochs]}")
