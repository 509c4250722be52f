"""A user's model that ``torch.fx`` cannot trace, named ``module:function``, refused by
``python -m aiopipe`` with one line naming the construct and exit 2 (issue 44, item 1).
A traced model trained between real processes, every process tracing it into the same
units and the planner splitting it from measured costs: `gpt-tiny` in
tests/test_language_model_processes.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from real_processes import child_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

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
