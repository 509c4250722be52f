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
def test_the_testing_kit_example_passes_whole_and_each_test_alone(tmp_path: Path) -> None:
    """The whole file in one pytest process, as a user runs it, and each test but the
    first in a fresh pytest process of its own (the first is alone in a fresh process in
    the whole file's run already): none leans on what an earlier test left in the
    process (the global torch generator, say), nor breaks a later one. All at once."""
    source = EXAMPLE.read_text()
    assert "aiopipe.testing" in source
    assert "from aiopipe.runtime" not in source  # the public kit only
    assert "from aiopipe.testing import" in source
    names = [node.name for node in ast.parse(source).body
             if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef)
             and node.name.startswith("test_")]
    assert len(names) == 3
    targets = {"the whole file": (str(EXAMPLE), "3 passed")}
    targets |= {name: (f"{EXAMPLE}::{name}", "1 passed") for name in names[1:]}
    runs = {what: subprocess.Popen(
        [sys.executable, "-m", "pytest", target, "-q", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", os.devnull],  # none of this repo's settings
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}) for what, (target, _) in targets.items()}
    failed = []
    try:
        for what, run in runs.items():
            out, _ = run.communicate(timeout=240)
            if run.returncode != 0 or targets[what][1] not in out:
                failed.append(f"{what} (exit {run.returncode}):\n{out}")
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
    assert not failed, "\n\n".join(failed)
