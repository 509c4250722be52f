"""The error for config keys that `RunConfig` does not have, with the keys likely meant.

A mapping, a TOML file or a command's ``--config`` may hold a misspelt key; the error
names every unknown one at once, each with a guess where one is close, so that a user
fixes them all in one go.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

__all__ = ["unknown_keys"]


def unknown_keys(unknown: Sequence[object], known: set[str]) -> str:
    """The error for keys that no `RunConfig` field has: each one named, with the known
    key it likely meant (`_likely_keys`), and the known keys listed when one of them has
    no such guess; e.g. ``unknown config keys 'epoch' (did you mean 'epochs'?), 'lr'
    (did you mean 'learning_rate'?)``."""
    names = sorted(known)
    said, unguessed = [], False
    for key in unknown:
        guesses = _likely_keys(key, names)
        meant = " or ".join(map(repr, guesses))
        said.append(f"{key!r} (did you mean {meant}?)" if guesses else repr(key))
        unguessed = unguessed or not guesses
    text = f"unknown config {'key' if len(unknown) == 1 else 'keys'} {', '.join(said)}"
    return text + (f"; known keys: {', '.join(names)}" if unguessed else "")


def _likely_keys(key: object, names: Sequence[str]) -> list[str]:
    """The known keys ``key`` likely meant: itself in lower case with underscores
    ("Batch-Size"), those whose words' initials it is ("lr": learning_rate; "bs":
    batch_size or buffer_size), or the closest spelling (`difflib.get_close_matches`:
    "epoch", "split_pont"); none when none is close."""
    if not isinstance(key, str):
        return []
    plain = key.strip().lower().replace("-", "_")
    if plain in names:
        return [plain]
    initials = [n for n in names if "_" in n and "".join(w[:1] for w in n.split("_")) == plain]
    return initials or difflib.get_close_matches(plain, names, n=1)
