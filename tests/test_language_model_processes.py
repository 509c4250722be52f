"""A language model and a regression between real processes (``python -m aiopipe`` and
``python -m aiopipe.server`` / ``aiopipe.device``): gpt-tiny (embed, 4 blocks, norm,
head: 7 units; the padding mask crosses every cut beside the residual stream) on
stdlib-text, per-token next-byte targets, in pipar (the planner splits it among its
blocks from the devices' own measurements; timeline.png drawn), ftpipehd (a worker
SIGKILLed: the round is played again on the other two, the cuts moved between whole
blocks) and hadfl (ring averages device to device); and a float-target regression with
``--loss mse`` and a metric of the user's own (``module:function``), or none.

Small sizes: each run takes seconds an epoch on two busy cores."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from real_processes import REPO, ProcessFleet, child_env

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: gpt-tiny's units: embed, blocks 1-4, norm, head; a cut c puts units 0..c-1 before it
UNITS = 7
GPT = ("--model", "gpt-tiny", "--dataset", "stdlib-text")


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG (its IHDR chunk)."""
    head = path.read_bytes()[:24]
    assert head.startswith(PNG_MAGIC), head
    width, height = struct.unpack(">II", head[16:24])
    return width, height


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
    cross that cut), perplexity falls epoch over epoch, and the run's timeline.png is
    drawn."""
    out = tmp_path / "run"
    done = _launch(tmp_path, "--mode", "pipar", *GPT, "--devices", "2", "--epochs", "2",
                   "--samples-per-device", "320", "--batch-size", "16",
                   "--test-samples", "160", "--split-point", "auto",
                   "--parallel-batches", "auto", "--learning-rate", "0.05",
                   "--out-dir", str(out), pictures=True)
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
    # the timeline: a PNG drawn from the run's trace, which has the pipar tracks
    width, height = _png_size(out / "timeline.png")
    assert width > 100
    assert height > 100
    trace = json.loads((out / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"device0/compute", "device1/compute", "server/compute"} <= tracks, tracks
    print(f"perplexity {[round(p, 2) for p in perplexities]}, split points {plan}, "
          f"timeline.png {width}x{height} ({(out / 'timeline.png').stat().st_size} bytes)")


#: 20 batches of 16 an epoch on device 0 (two rounds of 10; chain points every 5); the
#: kill below falls in epoch 2, device 1 given up about reconnect_grace later
FTPIPEHD = {"mode": "ftpipehd", "devices": 3, "model": "gpt-tiny", "dataset": "stdlib-text",
            "samples_per_device": 320, "batch_size": 16, "epochs": 4, "momentum": 0.5,
            "learning_rate": 0.05, "global_replication_every": 10,
            "chain_replication_every": 5, "test_samples": 96, "heartbeat_interval": 0.5,
            "device_timeout": 5.0, "reconnect_grace": 1.0}


@pytest.mark.timeout(200)
async def test_gpt_tiny_in_ftpipehd_is_re_partitioned_between_whole_blocks(
        tmp_path: Path) -> None:
    """Three device processes, "auto" cuts: three stages of gpt-tiny's units. Worker 1
    (the middle stage) SIGKILLed in epoch 2: the round is played again on devices 0 and
    2, re-partitioned: one cut instead of two, every cut between two of gpt-tiny's units
    (embed, a block, norm, head), so whole blocks move. The loss falls."""
    async with ProcessFleet(tmp_path, FTPIPEHD) as fleet:
        server = await fleet.start_server()
        devices = [await fleet.start_device(k, "--listen", "127.0.0.1:0") for k in range(3)]
        await server.output.wait_for(r"^\s+1\s", within=120)  # epoch 1's row: epoch 2 runs
        await asyncio.sleep(0.3)
        devices[1].send_signal(signal.SIGKILL)
        assert await devices[1].wait(30) == -signal.SIGKILL
        await server.output.wait_for(r"the pipeline runs on devices \[0, 2\]", within=60)
        await fleet.finish(server, [devices[0], devices[2]], within=150)
    epochs = fleet.metrics()
    assert len(epochs) == FTPIPEHD["epochs"]
    assert [e["samples"] for e in epochs] == [FTPIPEHD["samples_per_device"]] * len(epochs)
    losses = [e["loss"] for e in epochs]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses

    def cuts(plan: list[dict[str, Any]]) -> list[int]:
        return [p["units"][0] for p in plan[1:]]

    assert [p["device"] for p in epochs[0]["plan"]] == [0, 1, 2]
    assert [p["device"] for p in epochs[-1]["plan"]] == [0, 2]
    assert any(e["devices_lost"] == [1] for e in epochs), [e["devices_lost"] for e in epochs]
    # every change of the cuts, in turn: the recovery's, and any re-partition from
    # measurements (FTPipeHD's after a round, where it promises 5% less time a batch)
    moves = [c for e in epochs for c in e["changes"] if "after" in c]
    [change] = [c for c in moves if c.get("workers") == [0, 2]][:1]
    assert change["workers_before"] == [0, 1, 2], change
    assert len(change["before"]) == 2, change
    assert len(change["after"]) == 1, change
    assert change["before"] != change["after"]
    held = cuts(epochs[0]["plan"])
    for move in moves:  # each starts from the cuts the last one left
        assert move["before"] == held, moves
        held = move["after"]
    assert held == cuts(epochs[-1]["plan"]), (moves, epochs[-1]["plan"])
    for cut in (c for move in moves for c in (*move["before"], *move["after"])):
        assert 1 <= cut <= UNITS - 1  # between two units: embed, a block, norm, head
    for epoch in epochs:  # every unit on exactly one stage, in order
        bounds = [tuple(p["units"]) for p in epoch["plan"]]
        assert bounds[0][0] == 0, bounds
        assert bounds[-1][1] == UNITS, bounds
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds)), bounds
    before, after = change["before"], change["after"]
    repartitions = [(c["before"], c["after"]) for c in moves if "workers" not in c]
    print(f"loss {[round(v, 3) for v in losses]}, cuts {before} -> {after} "
          f"(recovery, round {change['round'] + 1}); measured re-partitions {repartitions}")


@pytest.mark.timeout(200)
def test_gpt_tiny_in_hadfl_averages_over_rings_and_learns(tmp_path: Path) -> None:
    """Three device processes train gpt-tiny whole on their own windows and average it
    over rings of all three, device to device; the loss falls."""
    out = tmp_path / "run"
    done = _launch(tmp_path, "--mode", "hadfl", *GPT, "--devices", "3", "--ring-size", "3",
                   "--epochs", "3", "--samples-per-device", "160", "--batch-size", "16",
                   "--test-samples", "96", "--learning-rate", "0.05",
                   "--out-dir", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    epochs = _metrics(out)
    assert len(epochs) == 3
    losses = [e["loss"] for e in epochs]
    assert all(math.isfinite(v) for v in losses), losses
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    rounds = [c for e in epochs for c in e["changes"]]
    assert rounds
    assert all(sorted(r["rings"][0]) == [0, 1, 2] for r in rounds), rounds
    assert all(sum(e["peer_bytes"]) > 0 for e in epochs)  # the averages went device to device
    print(f"loss {[round(v, 3) for v in losses]}, perplexity "
          f"{[round(e['perplexity'], 1) for e in epochs]}, rings {[r['rings'] for r in rounds]}")


@pytest.mark.timeout(150)
def test_a_regression_from_the_command_line_reports_the_users_metric_or_none(
        tmp_path: Path) -> None:
    """``--dataset regression_data:dataset --model regression_data:model --loss mse``:
    with ``--metric regression_data:metric`` the accuracies are the user's (the share of
    samples predicted within 0.25: the saved model scores the test split as the last
    epoch says); with ``--metric none`` they are null. Both runs at once."""
    (tmp_path / "regression_data.py").write_text(
        (REPO / "tests" / "regression_data.py").read_text())
    common = ["--mode", "fl", "--dataset", "regression_data:dataset",
              "--model", "regression_data:model", "--loss", "mse", "--devices", "2",
              "--batch-size", "20", "--learning-rate", "0.05", "--test-samples", "100"]
    runs = {
        "metric": [*common, "--metric", "regression_data:metric", "--epochs", "3",
                   "--samples-per-device", "200"],
        "none": [*common, "--metric", "none", "--epochs", "2", "--samples-per-device", "100"],
    }
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

    unscored = _metrics(tmp_path / "none")
    assert len(unscored) == 2
    for e in unscored:
        assert math.isfinite(e["loss"])
        assert e["accuracy"] is None, e
        assert e["train_accuracy"] is None, e
    print(f"loss {[round(v, 3) for v in losses]}, train accuracy "
          f"{[e['train_accuracy'] for e in epochs]}, test accuracy "
          f"{[e['accuracy'] for e in epochs]}; metric none: loss "
          f"{[round(e['loss'], 3) for e in unscored]}")
