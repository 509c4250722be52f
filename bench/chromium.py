"""A headless Chromium driven over the Chrome DevTools Protocol, with aiohttp only.

For the dashboard's browser test (tests/runtime/test_dashboard_browser.py) and its
screenshot (bench/dashboard_screenshot.py): `open_chromium` starts the distribution's
``chromium`` (``apt-get install chromium``) on a fresh profile and yields a `Page` that
navigates, evaluates JavaScript, waits for a condition and takes screenshots, and
collects what the page logged as an error (console errors, uncaught exceptions, failed
requests, CSP violations: CDP's ``Runtime`` and ``Log`` domains).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

__all__ = ["Page", "chromium_path", "open_chromium"]

#: The names Debian's and other distributions' packages install the browser as.
NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    """The browser's executable, or None when none is installed."""
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class Page:
    """One browser tab over its DevTools websocket."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self._socket = socket
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        #: what the page logged as an error, in order
        self.errors: list[str] = []

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Call a CDP method; its result.

        Raises:
            RuntimeError: the browser answered with an error.
        """
        number = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[number] = future
        await self._socket.send_json({"id": number, "method": method, "params": params})
        answer = await future
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-able).

        Raises:
            RuntimeError: it threw.
        """
        result = await self.send("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, seconds: float = 20.0) -> Any:
        """Evaluate ``expression`` every 50 ms until it is truthy; its value.

        Raises:
            TimeoutError: it was not within ``seconds``.
        """
        async with asyncio.timeout(seconds):
            while True:
                value = await self.evaluate(expression)
                if value:
                    return value
                await asyncio.sleep(0.05)

    async def navigate(self, url: str) -> None:
        """Open ``url`` in this tab and wait until it has loaded.

        Raises:
            RuntimeError: it could not be opened.
        """
        answer = await self.send("Page.navigate", url=url)
        if answer.get("errorText"):
            raise RuntimeError(f"cannot open {url}: {answer['errorText']}")
        await self.wait_for(f"document.readyState === 'complete' && "
                            f"location.href === {url!r}")

    async def screenshot(self, *, width: int, height: int) -> bytes:
        """A PNG of the page at ``width`` × ``height`` CSS pixels."""
        await self.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                        deviceScaleFactor=1, mobile=False)
        shot = await self.send("Page.captureScreenshot", format="png")
        return base64.b64decode(shot["data"])

    async def _read(self) -> None:
        """Answers to their callers, error events to `errors`."""
        async for message in self._socket:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            data = message.json()
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
                continue
            self._note(data.get("method", ""), data.get("params", {}))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the browser closed its DevTools socket"))

    def _note(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            said = " ".join(str(a.get("value", a.get("description", "")))
                            for a in params.get("args", []))
            self.errors.append(f"console.{params['type']}: {said}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            thrown = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"uncaught: {thrown}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}")


@contextlib.asynccontextmanager
async def open_chromium(*, executable: str | None = None,
                        start_timeout: float = 30.0) -> AsyncIterator[Page]:
    """A headless Chromium with one blank tab, its errors collected from the start; the
    browser is closed (and its profile removed) on exit.

    Raises:
        FileNotFoundError: no browser is installed.
        TimeoutError: it did not open its DevTools port within ``start_timeout``.
    """
    executable = executable or chromium_path()
    if executable is None:
        raise FileNotFoundError(f"none of {', '.join(NAMES)} is installed")
    with tempfile.TemporaryDirectory(prefix="aiopipe-chromium-") as profile:
        process = await asyncio.create_subprocess_exec(
            executable, "--headless=new", "--no-sandbox", "--disable-gpu",
            "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
            "--disable-extensions", "--disable-background-networking", "--hide-scrollbars",
            "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
            f"--user-data-dir={profile}", "--window-size=1280,1000", "about:blank",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        try:
            port = await _devtools_port(Path(profile), process, start_timeout)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as response:
                    targets = await response.json()
                url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
                async with http.ws_connect(url, max_msg_size=0) as socket:
                    page = Page(socket)
                    async with asyncio.TaskGroup() as tasks:
                        reader = tasks.create_task(page._read())
                        for domain in ("Runtime", "Log", "Page"):
                            await page.send(f"{domain}.enable")
                        try:
                            yield page
                        finally:
                            with contextlib.suppress(Exception):
                                await page.send("Browser.close")
                            await socket.close()
                            reader.cancel()
        finally:
            if process.returncode is None:
                process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _devtools_port(profile: Path, process: asyncio.subprocess.Process,
                         seconds: float) -> int:
    """The port Chromium wrote to ``DevToolsActivePort`` in its profile."""
    marker = profile / "DevToolsActivePort"
    async with asyncio.timeout(seconds):
        while True:
            if process.returncode is not None:
                raise RuntimeError(f"chromium exited with {process.returncode} at start")
            with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
                return int(marker.read_text().splitlines()[0])
            await asyncio.sleep(0.05)
