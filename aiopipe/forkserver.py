"""A fork server: one process imports torch and aiopipe once, then forks each node
process (``python -m aiopipe.device ...``) that the launcher (or a test) starts.

[Note: fork server] A node process spends about 3.5 CPU-seconds importing torch,
torch's first-use imports (``torch._dynamo``, which the first optimizer imports: 1.3 s)
and aiopipe before it does anything: K devices on a 2-core machine wait K x 1.75 s for
their interpreters. A forked child has all of that already: it starts in milliseconds
and costs only what it runs. `python -m aiopipe` starts the server process as it starts
(it imports while the launcher does), and forks its devices from it.

What a child gets, as from ``python -m MODULE ARGS`` with ``env`` in ``cwd``: its own
process (a real pid: signals, SIGSTOP and SIGKILL reach it; its exit status comes back
as asyncio's ``returncode`` would be, -N for signal N), stdin from /dev/null, stdout and
stderr on the descriptors the caller passed, ``os.environ`` = ``env``, ``sys.path[0]`` =
``cwd`` (as ``-m`` puts it) after the entries of ``env``'s PYTHONPATH, ``sys.argv`` as
``-m`` makes it, the interpreter's signal dispositions (SIGPIPE ignored, SIGINT raising
KeyboardInterrupt), and a ``sitecustomize`` module on ``env``'s PYTHONPATH imported first,
as interpreter startup does. What differs: modules the server imported are not imported
again (an environment variable read at import time was read by the server; aiopipe reads
its own when it runs), and torch runs one thread until the node sets its own count
(``torch_threads``): no OpenMP thread exists in the server at a fork, so a child's first
parallel region starts a pool of its own. Linux only (`available`); elsewhere callers
start new interpreters.

Protocol (one connection per child, on a Unix socket): the caller sends one JSON line
``{"args": [...], "env": {...}, "cwd": "..."}`` with its stdout and stderr descriptors
attached (SCM_RIGHTS); the server answers ``pid N`` once forked and ``exit CODE`` once
the child is reaped. A connection closed before its child exited kills the child. The
server ends, killing the children left, when its stdin closes (its starter ended).

    python -m aiopipe.forkserver SOCKET_PATH
"""

from __future__ import annotations

import array
import asyncio
import atexit
import contextlib
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ForkServer", "ForkedProcess", "available"]

_FDS = 2  # a request's descriptors: the child's stdout and stderr


def available() -> bool:
    """Whether nodes can be forked here (Linux)."""
    return sys.platform == "linux"


class ForkedProcess:
    """A node forked by a `ForkServer`: what callers use of `asyncio.subprocess.Process`
    (``pid``, ``returncode``, ``wait``, ``send_signal``, ``kill``, ``terminate``)."""

    def __init__(self, pid: int, control: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._control = control
        self._writer = writer
        self._exited = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        words = (await self._control.readline()).decode().split()
        self.returncode = int(words[1]) if words[:1] == ["exit"] else -signal.SIGKILL
        self._writer.close()

    async def wait(self) -> int:
        """Its exit status (-N for signal N)."""
        await asyncio.shield(self._exited)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` if it still runs."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)


class ForkServer:
    """A fork server process ([Note: fork server]): `launch` starts it and returns at
    once (it imports in the background); `start` forks a node from it."""

    def __init__(self, process: subprocess.Popen[bytes], path: str) -> None:
        self._process = process
        self._path = path
        self._ready: bool | None = None

    @classmethod
    def launch(cls, env: Mapping[str, str] | None = None) -> ForkServer:
        """Start a fork server with ``env`` (default: this process's environment)."""
        path = os.path.join(tempfile.mkdtemp(prefix="aiopipe-fork-"), "fork.sock")
        process = subprocess.Popen([sys.executable, "-m", "aiopipe.forkserver", path],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   env=dict(env) if env is not None else None)
        server = cls(process, path)
        atexit.register(server.close)
        return server

    def _wait_ready(self) -> bool:
        if self._ready is None:
            assert self._process.stdout is not None
            self._ready = self._process.stdout.readline().strip() == b"ready"
            self._process.stdout.close()
        return self._ready

    async def start(self, args: Sequence[str], *, env: Mapping[str, str], cwd: str,
                    stdout: int, stderr: int) -> ForkedProcess:
        """Fork ``python -m ARGS`` with ``env`` in ``cwd``, its output on ``stdout`` and
        ``stderr`` (descriptors of the caller's; the child gets its own copies).

        Raises:
            OSError: the fork server is not running, or refused.
        """
        if not await asyncio.to_thread(self._wait_ready):
            raise OSError(f"the fork server did not start (exit {self._process.poll()})")
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, self._path)
            request = json.dumps({"args": list(args), "env": dict(env), "cwd": cwd})
            sock.setblocking(True)
            sock.sendmsg([request.encode() + b"\n"], [(
                socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [stdout, stderr]))])
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        control, writer = await asyncio.open_unix_connection(sock=sock)
        words = (await control.readline()).decode().split()
        if words[:1] != ["pid"]:
            writer.close()
            raise OSError(f"the fork server refused: {' '.join(words) or 'no answer'}")
        return ForkedProcess(int(words[1]), control, writer)

    def close(self) -> None:
        """End the fork server (it kills the children still running); idempotent."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self._path)
            os.rmdir(os.path.dirname(self._path))


# -- the server's side ---------------------------------------------------------------


def _receive_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The request's JSON and its descriptors."""
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        chunk, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(_FDS * fds.itemsize))
        if not chunk:
            raise ConnectionError("closed before its request")
        data += chunk
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if len(fds) != _FDS:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"a request carries {_FDS} file descriptors, not {len(fds)}")
    request = json.loads(data)
    if not isinstance(request, dict):
        raise ValueError("a request is a JSON object")
    return request, list(fds)


def _child(request: Mapping[str, Any], outputs: Sequence[int], closing: Sequence[int]
           ) -> None:
    """Become ``python -m MODULE ARGS`` (module docstring); never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)  # the server's; the child's event loop sets its own
        for fd in closing:
            os.close(fd)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter starts
        null = os.open(os.devnull, os.O_RDONLY)  # (over the server's stdin: not closed)
        os.dup2(null, 0)
        os.dup2(outputs[0], 1)
        os.dup2(outputs[1], 2)
        for fd in {null, *outputs} - {0, 1, 2}:
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        env = {str(k): str(v) for k, v in dict(request["env"]).items()}
        os.environ.clear()
        os.environ.update(env)
        cwd = str(request["cwd"])
        os.chdir(cwd)
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [cwd, *extra, *[p for p in sys.path[1:] if p not in extra]]
        if any(os.path.exists(os.path.join(p, "sitecustomize.py")) for p in extra):
            sys.modules.pop("sitecustomize", None)  # as interpreter startup imports it
            importlib.import_module("sitecustomize")
        args = [str(a) for a in request["args"]]
        module, sys.argv = args[0], args
        sys.modules.pop(module, None)  # run afresh as __main__, as -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # as the interpreter would: the traceback, status 1
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(path: str) -> None:
    """Fork a child per request on ``path`` until stdin closes (module docstring)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin, selectors.EVENT_READ, "stop")
    children: dict[int, socket.socket] = {}  # pid -> its connection
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "stop" and not os.read(sys.stdin.fileno(), 1 << 10):
                for pid in children:
                    _kill(pid)
                return
            if key.data == "reap":
                os.read(wake_r, 1 << 10)
            elif key.data == "accept":
                _fork(listener.accept()[0], children, selector,
                      closing=[listener.fileno(), wake_r, wake_w])
            elif isinstance(key.data, int):  # a child's connection: closed early?
                early = children.get(key.data)
                if early is not None and not early.recv(1):
                    selector.unregister(early)
                    _kill(key.data)
        _reap(children, selector)


def _fork(conn: socket.socket, children: dict[int, socket.socket],
          selector: selectors.BaseSelector, closing: list[int]) -> None:
    try:
        request, outputs = _receive_request(conn)
    except (OSError, ValueError) as exc:
        with contextlib.suppress(OSError):
            conn.sendall(f"error {exc}\n".encode())
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        _child(request, outputs, [*closing, conn.fileno(),
                                  *(c.fileno() for c in children.values())])
    for fd in outputs:
        os.close(fd)
    children[pid] = conn
    selector.register(conn, selectors.EVENT_READ, pid)
    conn.sendall(f"pid {pid}\n".encode())


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(conn)
        with contextlib.suppress(OSError):
            conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
        conn.close()


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _preload() -> None:
    """What every node imports, and torch's first-use imports, on one thread."""
    import torch

    import aiopipe.api
    import aiopipe.device
    import aiopipe.server  # noqa: F401
    from aiopipe.runtime.compute import warm_up_torch

    torch.set_num_threads(1)  # no OpenMP pool before a fork
    warm_up_torch()


if __name__ == "__main__":
    _preload()
    serve(sys.argv[1])
