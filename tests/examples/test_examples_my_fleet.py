"""`examples/test_my_fleet.py` passes as a user runs it: pytest in a subprocess, the
example written against `aiopipe.testing` alone."""

from __future__ import annotations

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
