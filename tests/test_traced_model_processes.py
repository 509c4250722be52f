"""A user's model that is not an ``nn.Sequential``, named ``module:function``, trained
by ``python -m aiopipe`` between real processes: every process traces it into the same
units (the server and the devices agree on its digest), the planner splits it, and the
loss falls (issue 44, item 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from real_processes import child_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, num_classes, in_shape):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(in_shape[0], 8, 3, padding=1), nn.ReLU(),
                                      nn.MaxPool2d(2))
        self.more = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.classifier = nn.Linear(8 * 16, num_classes)

    def forward(self, x):
        y = self.features(x)
        y = self.more(y) + y  # a skip inside one unit
        return self.classifier(torch.flatten(self.pool(y), 1))


def net(num_classes, in_shape):
    return Net(num_classes, in_shape)
'''


def test_a_traced_model_trains_between_processes(tmp_path: Path) -> None:
    (tmp_path / "skipnet.py").write_text(MODEL)
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "aiopipe", "--model", "skipnet:net", "--devices", "2",
         "--epochs", "3", "--samples-per-device", "200", "--batch-size", "20",
         "--split-point", "auto", "--parallel-batches", "auto", "--out-dir", str(out)],
        env=child_env({"PYTHONPATH": str(tmp_path)}), capture_output=True, text=True,
        timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "planned pipar" in done.stderr
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in epochs]
    assert losses[-1] < losses[0], losses
    [plan] = {tuple(p["split_point"] for p in e["plan"]) for e in epochs}
    assert all(1 <= p <= 3 for p in plan)  # among the four traced units' cuts


UNTRACEABLE = '''
from torch import nn


class Branching(nn.Module):
    def __init__(self, num_classes, in_shape):
        super().__init__()
        self.flat = nn.Flatten()
        self.a = nn.Linear(3 * 32 * 32, 16)
        self.b = nn.Linear(16, num_classes)

    def forward(self, x):
        h = self.a(self.flat(x))
        if h.mean() > 0:  # branching on data in the top-level forward: fx cannot trace it
            h = h * 2
        return self.b(h)


def net(num_classes, in_shape):
    return Branching(num_classes, in_shape)
'''


def test_a_model_that_cannot_be_traced_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "branching.py").write_text(UNTRACEABLE)
    done = subprocess.run(
        [sys.executable, "-m", "aiopipe", "--model", "branching:net", "--devices", "2",
         "--epochs", "1", "--out-dir", str(tmp_path / "run")],
        env=child_env({"PYTHONPATH": str(tmp_path)}), capture_output=True, text=True,
        timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    [line] = [line for line in done.stderr.splitlines() if "error:" in line]
    assert "cannot split Branching: torch.fx cannot trace its forward" in line
    assert "Traceback" not in done.stderr
