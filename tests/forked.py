"""Nodes forked warm for the tests (`aiopipe.forkserver`, [Note: fork server]): one fork
server per test process (a pytest-xdist worker), launched at the first fork and ended
with that process; `forked` starts ``python -m ARGS`` from it with its output (stdout and
stderr together) on a pipe read as a stream.

``AIOPIPE_TEST_ZYGOTE=0`` starts every node as a new interpreter instead (`use_zygote`).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from aiopipe.forkserver import ForkedProcess, ForkServer, available

__all__ = ["forked", "use_zygote"]

_REPO = Path(__file__).resolve().parents[1]
_server: ForkServer | None = None
_lock = threading.Lock()


def use_zygote() -> bool:
    """Whether nodes are forked warm: under pytest where forking is available, unless
    ``AIOPIPE_TEST_ZYGOTE=0`` (benches that use tests/real_processes.py start new
    interpreters, as users do, unless ``AIOPIPE_TEST_ZYGOTE=1``)."""
    default = "1" if "pytest" in sys.modules else "0"
    return os.environ.get("AIOPIPE_TEST_ZYGOTE", default) != "0" and available()


def _fork_server() -> ForkServer:
    global _server
    with _lock:
        if _server is None:
            _server = ForkServer.launch({**os.environ, "PYTHONPATH": os.pathsep.join(
                filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))})
        return _server


async def forked(args: Sequence[str], env: Mapping[str, str], cwd: Path
                 ) -> tuple[ForkedProcess, asyncio.StreamReader]:
    """``python -m ARGS`` with ``env`` in ``cwd``, forked warm; its output stream."""
    read_end, write_end = os.pipe()
    try:
        process = await _fork_server().start(args, env=env, cwd=str(cwd), stdout=write_end,
                                             stderr=write_end)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    stdout = asyncio.StreamReader(limit=1 << 20)
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stdout), os.fdopen(read_end, "rb", buffering=0))
    return process, stdout
