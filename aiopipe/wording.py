"""Small helpers for the words of messages a person reads (log lines, printed lines,
errors): counts with the right plural, lists of ids as ranges.

They exist so that "1 epoch" and "2 epochs" come from one place instead of each
message guessing (it used to print "1 epochs", "1 devices").
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["id_ranges", "plural"]


def plural(count: int, word: str, many: str | None = None) -> str:
    """``count`` and ``word``, plural unless ``count`` is 1: ``plural(1, "epoch")`` is
    ``"1 epoch"``, ``plural(2, "batch")`` ``"2 batches"``; ``many`` when the plural is
    irregular. A word that ends in s, x, z, sh, tch or nch takes "es" ("batches"), any
    other "s" ("epochs")."""
    if count == 1:
        return f"{count} {word}"
    if many is None:
        many = word + ("es" if word.endswith(("s", "x", "z", "sh", "tch", "nch")) else "s")
    return f"{count} {many}"


def id_ranges(ids: Iterable[int]) -> str:
    """Ids as short runs, sorted: ``[0, 1, 2, 5, 7, 8]`` is ``"0-2, 5, 7-8"``."""
    runs: list[list[int]] = []
    for i in sorted(set(ids)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
