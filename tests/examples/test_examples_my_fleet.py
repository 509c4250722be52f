"""`examples/test_my_fleet.py` passes as a user runs it: pytest in a subprocess, the
example written against `aiopipe.testing` alone; and each of its tests alone, in a fresh
process (`-k stalled`), since a run's initial weights depend on its config alone (issue
42, docs/design.md §Initial weights)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "test_my_fleet.py"


@pytest.mark.slow
def test_the_testing_kit_example_passes(tmp_path: Path) -> None:
    source = EXAMPLE.read_text()
    assert "aiopipe.testing" in source
    assert "from aiopipe.runtime" not in source  # the public kit only
    assert "from aiopipe.testing import" in source
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(EXAMPLE), "-q", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", os.devnull],  # none of this repo's settings
        cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout


@pytest.mark.slow
def test_each_test_of_the_example_passes_alone(tmp_path: Path) -> None:
    """Each test in a fresh pytest process of its own (the three at once): none leans on
    what an earlier test left in the process (the global torch generator, say)."""
    names = [node.name for node in ast.parse(EXAMPLE.read_text()).body
             if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef)
             and node.name.startswith("test_")]
    assert len(names) == 3
    runs = {name: subprocess.Popen(
        [sys.executable, "-m", "pytest", f"{EXAMPLE}::{name}", "-q", "-p",
         "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}) for name in names}
    failed = []
    try:
        for name, run in runs.items():
            out, _ = run.communicate(timeout=240)
            if run.returncode != 0 or "1 passed" not in out:
                failed.append(f"{name} (exit {run.returncode}):\n{out}")
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
    assert not failed, "\n\n".join(failed)
