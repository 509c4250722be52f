"""The docs' ten-minute tutorial (docs/tutorial.md) runs as written: its commands, the
real processes of a first run, a run on one's own data and model, a server and devices
started by hand, and a new project's test (about a minute on 2 cores: a ``*_processes``
test, so that the suite starts it early)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial.md"


def tutorial_steps(text: str) -> list[tuple[str, str]]:
    """The tutorial's tested blocks in order: ``("file", NAME)`` with a file's text for a
    ```` ```python ```` block after ``<!-- test: file NAME -->``, ``("run", SCRIPT)`` for
    a ```` ```bash ```` block after ``<!-- test -->``."""
    steps = []
    for marker, kind, body in re.findall(
            r"<!-- test(?::\s*file\s+(\S+))?\s*-->\n```(\w+)\n(.*?)```", text, re.S):
        steps.append((f"file:{marker}", body) if marker else ("run", body))
        assert kind == ("python" if marker else "bash"), (marker, kind)
    return steps


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_the_install_step_brings_what_the_steps_import() -> None:
    """The steps run in the suite's environment, which has every extra: the tutorial's
    own install must bring what they use beyond the library (matplotlib for the
    pictures; pytest for the new project's test), as a new user's venv has nothing else
    (a fresh clone's step 5 once failed: "No module named pytest")."""
    text = TUTORIAL.read_text(encoding="utf-8")
    install = re.search(r"<!-- install -->\n```bash\n(.*?)```", text, re.S)
    assert install is not None
    extras = set(re.search(r'-e "\.\[([\w,]+)\]"', install.group(1)).group(1).split(","))
    steps = " ".join(body for _, body in tutorial_steps(text))
    assert "plot" in extras  # timeline.png and overview.png
    if "pytest" in steps:
        assert "testing" in extras, extras


@pytest.mark.slow
def test_the_tutorials_commands_run(tmp_path: Path) -> None:
    """Every block of docs/tutorial.md marked for testing, in order, in an empty folder,
    as a user would type it (with this interpreter as ``python``, and the server's port
    8765 swapped for a free one); each run must finish and leave its results (about a
    minute and a half on 2 cores)."""
    steps = tutorial_steps(TUTORIAL.read_text(encoding="utf-8"))
    assert sum(kind == "run" for kind, _ in steps) >= 5, steps
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"  # (a wrapper: a symlink would lose a venv's packages)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n', encoding="utf-8")
    python.chmod(0o755)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": pythonpath, "AIOPIPE_LOG_LEVEL": "WARNING"}
    work = tmp_path / "work"
    work.mkdir()
    port = str(_free_port())
    for kind, body in steps:
        if kind.startswith("file:"):
            (work / kind.removeprefix("file:")).write_text(body, encoding="utf-8")
            continue
        script = "set -euo pipefail\n" + body.replace("8765", port)
        done = subprocess.run(["bash", "-c", script], cwd=work, env=env,
                              capture_output=True, text=True, timeout=240, check=False)
        assert done.returncode == 0, f"{body}\n---\n{done.stdout}\n{done.stderr}"
    for run in ("first", "mine", "real"):
        results = work / "runs" / run
        assert (results / "metrics.jsonl").is_file(), run
        assert not (results / "unfinished.txt").exists(), run
    assert (work / "demo" / "config.toml").is_file()
