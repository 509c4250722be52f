"""`examples/embed_server.py` runs end to end as a user runs it: a subprocess."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "embed_server.py"

EPOCH_LINE = re.compile(
    r"^epoch 1: time (?P<time>[\d.]+) s, loss (?P<loss>[\d.]+|nan|inf), "
    r"test accuracy (?P<acc>[\d.]+), train accuracy [\d.]+, (?P<samples>\d+) samples, "
    r"busy s: device [\d.]+, uplink [\d.]+, server [\d.]+, downlink [\d.]+, "
    r"[\d.]+ MB up, [\d.]+ MB down$",
    re.MULTILINE,
)


@pytest.mark.slow
def test_embed_server_example_trains_beside_the_apps_own_route() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert re.search(
        r"^app serving GET /hello and /aiopipe/\{ws,status,metrics\} at "
        r"http://127\.0\.0\.1:\d+$",
        out,
        re.MULTILINE,
    ), out
    epoch = EPOCH_LINE.search(out)
    assert epoch is not None, out
    assert math.isfinite(float(epoch["loss"]))
    assert float(epoch["time"]) > 0
    assert 0.0 <= float(epoch["acc"]) <= 1.0
    # 2 devices x 200 samples, 4 micro-batches of 10: 5 iterations of 40 per device
    assert int(epoch["samples"]) == 2 * 5 * 40
    # the example's settings draw no warning of their own (N divides B)
    assert "does not divide" not in out + done.stderr, done.stderr
    assert "GET /hello while 2 devices train: 200 hello from my app" in out
    assert "GET /hello after training: 200 hello from my app" in out
    assert "GET /aiopipe/status after training: 200, finished epochs [1]" in out
    assert "devices: 0: 200 samples; 1: 200 samples" in out
    assert re.search(r"^done: test accuracy [\d.]+ after epoch 1$", out, re.MULTILINE)
