"""bench/gpu_server.py: the two servers side by side, or one per process, from a GPU's
table. The figures are never asserted; these tests check that it runs, writes what it
ran, and refuses a server it does not know."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_server.py"
COSTS = REPO / "bench" / "results" / "2026-11-26-s18-gpu-costs"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--gpu-costs", str(COSTS / "costs-cuda.json"),
         "--cpu-costs", str(COSTS / "costs-cpu-this-host.json"), "--model", "vgg5",
         "--devices", "1", "--samples", "100", *args],
        capture_output=True, text=True, env=env, timeout=240, check=False)


@pytest.mark.slow
def test_both_servers_run_and_are_written_side_by_side(tmp_path: Path) -> None:
    done = _run("--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "gpu-server-vgg5-k1-4g.json").read_text())
    assert list(rows) == ["CPU server (this machine)", "GPU server (NVIDIA H200)"]
    for row in rows.values():
        assert set(row) >= {"epoch_s", "server_busy_s", "device_busy_s", "uplink_busy_s",
                            "downlink_busy_s", "plans"}
        assert sum(row["plans"].values()) == 1
    table = (tmp_path / "gpu-server-vgg5-k1-4g.md").read_text()
    assert "CPU server ÷ GPU server, epoch time:" in table


@pytest.mark.slow
def test_one_server_per_process_is_written_apart(tmp_path: Path) -> None:
    done = _run("--servers", "gpu", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "gpu-server-vgg5-k1-4g-gpu.json").read_text())
    assert list(rows) == ["GPU server (NVIDIA H200)"]
    assert "÷" not in (tmp_path / "gpu-server-vgg5-k1-4g-gpu.md").read_text()


def _refusal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
             *args: str) -> str:
    """What the script's ``main`` says on stderr, in this process (its options are checked
    before anything runs: no need to start a Python for them), when it exits with 2."""
    script = load_bench("gpu_server")
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--gpu-costs", str(COSTS / "costs-cuda.json"),
                                      *args])
    with pytest.raises(SystemExit) as exited:
        script.main()
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_an_unknown_server_or_device_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    err = _refusal(monkeypatch, capsys, "--servers", "cpu,tpu")
    assert "--servers: of cpu,gpu, not 'cpu,tpu'" in err
    err = _refusal(monkeypatch, capsys, "--compute-on", "cuda:99")
    assert "--compute-on: " in err
    assert "cuda:99" in err
