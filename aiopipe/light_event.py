"""`LightEvent`: an `asyncio.Event` that makes its waiters' queue when first waited on;
`LightQueue`: an `asyncio.Queue` for one consumer, holding no queue while empty.

An `asyncio.Event` allocates its waiters' queue, a `collections.deque` of 760 bytes, as
it is made. A simulation of a large population makes a dozen events per device (each
direction of a memory link has four, each side's send queue one, each session two),
nearly all of them never waited on while the device is in no round: 10 KB a device,
1 GB for 100,000 devices. A `LightEvent` keeps its waiters in a list made at the first
`wait`; it is set, cleared and waited on as an `asyncio.Event` is, and wakes its
waiters in the same order, so a run's scheduling, and its virtual time, are unchanged.
An `asyncio.Queue` holds four such deques (its items, getters, putters, and an event's
waiters); a device's control queue, empty nearly all its life, needs none of them.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Generic, Literal, TypeVar

__all__ = ["LightEvent", "LightQueue"]

T = TypeVar("T")


class LightEvent:
    """As `asyncio.Event` (``set``, ``clear``, ``is_set``, ``wait``), its waiters' list
    made when first waited on (module docstring)."""

    __slots__ = ("_value", "_waiters")

    def __init__(self) -> None:
        self._value = False
        self._waiters: list[asyncio.Future[Literal[True]]] | None = None

    def __repr__(self) -> str:
        state = "set" if self._value else "unset"
        return f"<LightEvent [{state}, waiters:{len(self._waiters or ())}]>"

    def is_set(self) -> bool:
        """Whether the flag is set."""
        return self._value

    def set(self) -> None:
        """Set the flag and wake every waiter, in the order they began to wait."""
        if not self._value:
            self._value = True
            for future in self._waiters or ():
                if not future.done():
                    future.set_result(True)

    def clear(self) -> None:
        """Reset the flag: `wait` blocks until the next `set`."""
        self._value = False

    async def wait(self) -> Literal[True]:
        """Return True once the flag is set (at once when it is)."""
        if self._value:
            return True
        future: asyncio.Future[Literal[True]] = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(future)
        try:
            await future
            return True
        finally:
            self._waiters.remove(future)


class LightQueue(Generic[T]):
    """An unbounded `asyncio.Queue` for one consumer (`put_nowait`, `get`): the consumer
    is woken as an `asyncio.Queue`'s would be; its items' deque exists only while it
    holds some (module docstring)."""

    __slots__ = ("_getter", "_items")

    def __init__(self) -> None:
        self._items: collections.deque[T] | None = None
        self._getter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        """Add ``item``; wake the consumer if it waits."""
        if self._items is None:
            self._items = collections.deque()
        self._items.append(item)
        getter, self._getter = self._getter, None
        if getter is not None and not getter.done():
            getter.set_result(None)

    async def get(self) -> T:
        """The first item, once there is one.

        Raises:
            RuntimeError: another task is waiting already (one consumer only).
        """
        while not self._items:
            if self._getter is not None:
                raise RuntimeError("a LightQueue has one consumer")
            getter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._getter = getter
            try:
                await getter
            finally:
                if self._getter is getter:
                    self._getter = None
        item = self._items.popleft()
        if not self._items:
            self._items = None
        return item
