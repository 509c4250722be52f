"""The test side of the fork server (tests/zygote.py): `ForkedProcess`, a node process
forked warm, with what the tests use of `asyncio.subprocess.Process` (``pid``,
``returncode``, ``stdout``, ``send_signal``, ``kill``, ``terminate``, ``wait``).

One server per test process (a pytest-xdist worker), started at the first fork and
ended with that process (its stdin closes). ``AIOPIPE_TEST_ZYGOTE=0`` starts every node
as a new interpreter instead (`use_zygote`).
"""

from __future__ import annotations

import array
import asyncio
import atexit
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ForkedProcess", "use_zygote"]

_ZYGOTE = Path(__file__).with_name("zygote.py")
_REPO = Path(__file__).resolve().parents[1]
_server: tuple[subprocess.Popen[bytes], str] | None = None
_lock = threading.Lock()


def use_zygote() -> bool:
    """Whether nodes are forked from the fork server: under pytest on Linux, unless
    ``AIOPIPE_TEST_ZYGOTE=0`` (benches that use tests/real_processes.py start new
    interpreters, as users do, unless ``AIOPIPE_TEST_ZYGOTE=1``)."""
    default = "1" if "pytest" in sys.modules else "0"
    return (os.environ.get("AIOPIPE_TEST_ZYGOTE", default) != "0"
            and sys.platform == "linux")


def _socket_path() -> str:
    """The fork server's socket, started once per process (blocking: seconds, once)."""
    global _server
    with _lock:
        if _server is not None and _server[0].poll() is None:
            return _server[1]
        path = os.path.join(tempfile.mkdtemp(prefix="aiopipe-zygote-"), "fork.sock")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))}
        server = subprocess.Popen([sys.executable, str(_ZYGOTE), path], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=env)
        assert server.stdout is not None
        if server.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the fork server did not start (exit {server.wait()})")
        server.stdout.close()
        _server = (server, path)
        atexit.register(_stop, server)
        return path


def _stop(server: subprocess.Popen[bytes]) -> None:
    """End the fork server (it kills the children still running)."""
    assert server.stdin is not None
    server.stdin.close()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


class ForkedProcess:
    """A node forked by the fork server; see the module docstring."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader,
                 control: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._control = control
        self._writer = writer
        self._exited = asyncio.ensure_future(self._watch())

    @classmethod
    async def start(cls, args: Sequence[str], env: Mapping[str, str], cwd: Path
                    ) -> ForkedProcess:
        """Fork ``python -m ARGS`` with ``env`` in ``cwd``; its output (stdout and stderr
        together) on ``stdout``."""
        path = await asyncio.to_thread(_socket_path)
        loop = asyncio.get_running_loop()
        read_end, write_end = os.pipe()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await loop.sock_connect(sock, path)
            request = json.dumps({"args": list(args), "env": dict(env), "cwd": str(cwd)})
            sock.sendmsg([request.encode() + b"\n"],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                           array.array("i", [write_end]).tobytes())])
        finally:
            os.close(write_end)
        sock.setblocking(False)
        control, writer = await asyncio.open_unix_connection(sock=sock)
        answer = (await control.readline()).decode().split()
        if answer[:1] != ["pid"]:
            os.close(read_end)
            raise RuntimeError(f"the fork server refused: {' '.join(answer)}")
        stdout = asyncio.StreamReader(limit=1 << 20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout),
                                     os.fdopen(read_end, "rb", buffering=0))
        return cls(int(answer[1]), stdout, control, writer)

    async def _watch(self) -> None:
        line = (await self._control.readline()).decode().split()
        self.returncode = int(line[1]) if line[:1] == ["exit"] else -9
        self._writer.close()

    def send_signal(self, signum: int) -> None:
        """As `asyncio.subprocess.Process.send_signal`."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(9)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(15)

    async def wait(self) -> int:
        """Its exit status (-N for signal N)."""
        await asyncio.shield(self._exited)
        assert self.returncode is not None
        return self.returncode

