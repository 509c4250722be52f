"""The fork server ([Note: fork server] in aiopipe/forkserver.py): a forked node is set up
as ``python -m`` would set it up, its exit status and signals are a process's, and the
server's end kills what still runs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
from forked import forked

from aiopipe.forkserver import ForkServer, available

pytestmark = [pytest.mark.skipif(not available(), reason="forking needs Linux"),
              pytest.mark.timeout(120)]

TESTS = Path(__file__).resolve().parent


async def _run(env: dict[str, str], cwd: Path) -> tuple[int, list[str]]:
    process, stdout = await forked(["fork_probe", "a", "--b"], env, cwd)
    lines = [line.decode().rstrip() for line in await asyncio.wait_for(_lines(stdout), 60)]
    return await process.wait(), lines


async def _lines(stream: asyncio.StreamReader) -> list[bytes]:
    out = []
    while line := await stream.readline():
        out.append(line)
    return out


@pytest.mark.slow
async def test_a_forked_node_is_set_up_as_python_m_would_set_it_up(tmp_path: Path) -> None:
    env = {**os.environ, "PROBE": "seen", "PROBE_EXIT": "3", "PYTHONPATH": str(TESTS)}
    code, lines = await _run(env, tmp_path)
    assert code == 3
    seen = json.loads(lines[0])
    assert seen["argv"] == ["a", "--b"]
    assert seen["cwd"] == str(tmp_path) == seen["path0"]
    assert seen["probe"] == "seen"
    assert seen["torch_loaded"]  # imported once, by the server: the point of it
    assert seen["sigpipe_ignored"]
    assert seen["sigint_raises"]
    assert lines[1] == "to stderr"


@pytest.mark.slow
async def test_a_signal_ends_it_as_a_process_and_closing_the_server_kills_the_rest(
        tmp_path: Path) -> None:
    env = {**os.environ, "PROBE_SLEEP": "60", "PYTHONPATH": str(TESTS)}
    server = ForkServer.launch({**os.environ, "PYTHONPATH": str(TESTS.parent)})
    try:
        read_end, write_end = os.pipe()
        killed = await server.start(["fork_probe"], env=env, cwd=str(tmp_path),
                                    stdout=write_end, stderr=write_end)
        left = await server.start(["fork_probe"], env=env, cwd=str(tmp_path),
                                  stdout=write_end, stderr=write_end)
        os.close(write_end)
        killed.send_signal(signal.SIGKILL)
        assert await asyncio.wait_for(killed.wait(), 30) == -signal.SIGKILL
        assert left.returncode is None
        await asyncio.to_thread(server.close)
        assert await asyncio.wait_for(left.wait(), 30) == -signal.SIGKILL
    finally:
        server.close()
        os.close(read_end)


@pytest.mark.slow  # (the fast subset's slowest: the full suite runs it)
async def test_without_its_module_it_fails_as_python_m_does(tmp_path: Path) -> None:
    code, lines = await _run({**os.environ, "PYTHONPATH": str(tmp_path)}, tmp_path)
    assert code == 1
    assert any("No module named" in line for line in lines)
