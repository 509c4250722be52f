"""The coordinator's own work failing: `ServerFaults` keeps the first such failure and
stops the work under way when it comes ([Note: server faults] in coordinator.py).

A failure of the coordinator's work for a device (a server half's pass that ran out of
memory, a bug) is not the device's doing and would happen again on every resend, so the
run stops with it instead of going on without the device.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiopipe.errors import TrainingError
from aiopipe.runtime.tasks import first_error

__all__ = ["ServerFaults"]

log = logging.getLogger("aiopipe.server")

T = TypeVar("T")


class ServerFaults:
    """The first failure of the coordinator's own work (``failure``), and work that is
    cancelled when one comes."""

    def __init__(self) -> None:
        #: why the coordinator's own work failed; the run stops with it
        self.failure: TrainingError | None = None
        self._failed = asyncio.Event()

    def fail(self, device_id: int, error: BaseException) -> TrainingError:
        """The coordinator's work for device ``device_id`` raised ``error``: log it with
        its traceback, keep it if it is the first, and return it as a `TrainingError`."""
        cause = first_error(error) if isinstance(error, BaseExceptionGroup) else error
        failure = TrainingError(f"the server's work for device {device_id} failed: "
                                f"{type(cause).__name__}: {cause}")
        log.error("%s", failure, exc_info=cause)
        if self.failure is None:
            self.failure = failure
            self._failed.set()
        return failure

    async def unless_failed(self, work: Coroutine[Any, Any, T]) -> T:
        """``work``'s result, unless the coordinator's own work fails first: then
        ``work`` is cancelled and the failure raised.

        Raises:
            TrainingError: the coordinator's work failed.
        """
        task = asyncio.ensure_future(work)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.failure is not None:
            raise self.failure
        return task.result()
