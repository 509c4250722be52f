"""A fork server for the tests' node processes: one process per pytest worker imports
torch and aiopipe once, and forks each ``python -m aiopipe.server`` / ``aiopipe.device``
that a test starts (tests/real_processes.py, `ProcessFleet.start`).

Why: a node process spends about 3.5 CPU-seconds importing torch, torch's first-use
imports (``torch._dynamo``, which the first optimizer imports) and aiopipe before it
does anything, and the suite starts over a hundred of them on two cores. A forked child
has all of that already: it starts in milliseconds and costs only what it runs.

What a child gets, as from ``python -m MODULE ARGS`` with ``env`` in ``cwd``: its own
process (a real pid: signals, SIGSTOP and SIGKILL reach it; its exit status comes back
as asyncio's ``returncode`` would be, -N for signal N), stdin from /dev/null, stdout and
stderr on the pipe the test passed, ``os.environ`` = ``env``, ``sys.path[0]`` = ``cwd``
(as ``-m`` puts it) after the entries of ``env``'s PYTHONPATH, ``sys.argv`` as ``-m``
makes it, Python's default signal handlers, and a ``sitecustomize`` module on ``env``'s
PYTHONPATH imported first, as interpreter startup does. What differs: modules imported here are not
imported again (environment variables read at import time were read here; aiopipe reads
its own when it runs) and torch runs one thread until the run sets its own count (the
node does: ``torch_threads``). No OpenMP thread exists here before a fork, so a child's
first parallel region starts a pool of its own.

Protocol (one connection per child, on a Unix socket): the test sends one JSON line
``{"args": [...], "env": {...}, "cwd": "..."}`` with the pipe's write end attached
(SCM_RIGHTS); the server answers ``pid N`` once forked and ``exit CODE`` once the child
is reaped. A connection closed before its child exited kills the child. The server ends
when the test process that started it closes its control pipe (the server's stdin).

    python tests/zygote.py SOCKET_PATH       (tests/real_processes.py starts it)
"""

from __future__ import annotations

import array
import atexit
import contextlib
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import traceback

if __name__ == "__main__":
    import torch

    import aiopipe.api
    import aiopipe.device
    import aiopipe.server  # noqa: F401
    from aiopipe.runtime.compute import warm_up_torch

    torch.set_num_threads(1)  # no OpenMP pool before a fork
    warm_up_torch()


def _receive_request(conn: socket.socket) -> tuple[dict[str, object], int]:
    """The request's JSON and the pipe's write end."""
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        chunk, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(fds.itemsize))
        if not chunk:
            raise ConnectionError("closed before its request")
        data += chunk
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if len(fds) != 1:
        raise ConnectionError("a request carries one file descriptor")
    return json.loads(data), fds[0]


def _child(request: dict[str, object], output: int, closing: list[int]) -> None:
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
        os.dup2(output, 1)
        os.dup2(output, 2)
        for fd in {null, output} - {0, 1, 2}:
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        env = dict(request["env"])  # type: ignore[call-overload]
        os.environ.clear()
        os.environ.update(env)
        cwd = str(request["cwd"])
        os.chdir(cwd)
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [cwd, *extra, *[p for p in sys.path[1:] if p not in extra]]
        if any(os.path.exists(os.path.join(p, "sitecustomize.py")) for p in extra):
            sys.modules.pop("sitecustomize", None)  # as interpreter startup imports it
            importlib.import_module("sitecustomize")
        args = [str(a) for a in request["args"]]  # type: ignore[attr-defined]
        module, sys.argv = args[0], args
        for name in [m for m in sys.modules if m == module]:
            del sys.modules[name]  # run afresh as __main__, as -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(path: str) -> None:
    """Fork a child per request on ``path`` until stdin closes."""
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
                _reap(children, selector)
            elif key.data == "accept":
                conn, _ = listener.accept()
                _fork(conn, children, selector, closing=[listener.fileno(), wake_r, wake_w])
            elif isinstance(key.data, int):  # a child's connection closed early
                pid = key.data
                if not key.fileobj.recv(1):  # type: ignore[union-attr]
                    selector.unregister(key.fileobj)
                    _kill(pid)
        _reap(children, selector)


def _fork(conn: socket.socket, children: dict[int, socket.socket],
          selector: selectors.BaseSelector, closing: list[int]) -> None:
    try:
        request, output = _receive_request(conn)
    except (OSError, ValueError) as exc:
        conn.sendall(f"error {exc}\n".encode())
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        _child(request, output, [*closing, conn.fileno(),
                                 *(c.fileno() for c in children.values())])
    os.close(output)
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


if __name__ == "__main__":
    serve(sys.argv[1])
