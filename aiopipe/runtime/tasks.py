"""Small helpers for structured concurrency in the nodes."""

from __future__ import annotations

from aiopipe.errors import AiopipeError

__all__ = ["first_error"]


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The most telling exception of a task group: the first aiopipe error, else the first.

    A TaskGroup wraps what its tasks raised; callers of a node want the one error that
    says what went wrong, not the group.
    """
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for exc in leaves:
        if isinstance(exc, AiopipeError):
            return exc
    return leaves[0]
