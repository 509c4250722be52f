"""``stdlib-text``: windows of bytes of the Python standard library's own source.

A text dataset that every machine already has, with nothing to download: the ``.py``
files under ``sysconfig.get_paths()["stdlib"]``, less the ``test``/``tests``,
``idlelib``, ``encodings`` (generated codec tables) and ``site-packages`` folders, in the
order of their sorted relative paths, concatenated and cut at `MAX_BYTES`. Opening reads
only those bytes (once per process: they are cached, read-only) and builds nothing else.
The bytes, hence every sample, are the same on every machine with the same Python
release; another release (even a patch release) may change a few files and every window
after them.

Sample ``i`` of the whole stream is the ``CONTEXT + 1`` bytes from ``i * CONTEXT``:
``x`` the first `CONTEXT` (int64 byte values), ``y`` the last `CONTEXT` (each position's
next byte), so the inputs of consecutive samples do not overlap. Unlike the image
datasets' float32 ``x``, ``x`` here is int64 token ids. Splits are carved without
randomness: the windows are taken in pages of `_PAGE` consecutive ones, and of every
20 pages, 18 go to ``"train"``, one to ``"val"``, one to ``"test"`` (90/5/5, spread
over the whole stream). ``size`` keeps the first ``size`` windows of the split.

Labels (`StdlibText.labels`): a window's last target byte, the byte that follows it,
so labels are in ``[0, 256)`` like the targets. IID partitioning needs nothing more
(only how many samples there are); Dirichlet label skew then gives devices windows
that end before different bytes (one device sees windows followed by newlines, another
by spaces or letters): a mild skew in where windows end, not a split by file or topic.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from aiopipe.data.dataset import SPLITS, check_indices, check_size, check_split
from aiopipe.errors import ConfigError

__all__ = ["CONTEXT", "MAX_BYTES", "TEXT_NAME", "VOCAB", "ByteWindows", "StdlibText",
           "stdlib_bytes", "stdlib_files"]

TEXT_NAME: Final = "stdlib-text"
"""The name `aiopipe.data.open_dataset` opens this dataset by."""

CONTEXT: Final = 64
"""Bytes per sample (the model's context length T)."""

MAX_BYTES: Final = 4 << 20
"""How much source is read: enough for tens of thousands of windows, little to open."""

VOCAB: Final = 256
"""Byte values."""

_SKIPPED: Final = frozenset({"test", "tests", "idlelib", "encodings", "site-packages",
                             "__pycache__"})
_PAGE: Final = 16  # windows per page; a split takes whole pages
_SPLIT_OF_PAGE: Final = (0,) * 18 + (1, 2)  # index into SPLITS of each page, cyclically


@functools.cache
def stdlib_bytes() -> npt.NDArray[np.uint8]:
    """The first `MAX_BYTES` of the standard library's source (see the module docstring),
    read-only.

    Raises:
        ConfigError: the standard library's directory cannot be read, or holds less
            than one window of source.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    try:
        for path in stdlib_files(root):
            chunks.append(path.read_bytes())
            total += len(chunks[-1])
            if total >= MAX_BYTES:
                break
    except OSError as exc:
        raise ConfigError(f"{TEXT_NAME}: cannot read the standard library's source "
                          f"in {root}: {exc}") from None
    stream = np.frombuffer(b"".join(chunks)[:MAX_BYTES], dtype=np.uint8)
    if stream.size <= CONTEXT:
        raise ConfigError(f"{TEXT_NAME}: found only {stream.size} bytes of Python source "
                          f"in {root}")
    return stream


def stdlib_files(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` outside `_SKIPPED` folders, by relative path."""
    found: list[str] = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _SKIPPED]
        base = Path(folder).relative_to(root)
        found += [(base / name).as_posix() for name in files if name.endswith(".py")]
    return [root / relative for relative in sorted(found)]


def _split_windows(split: str, windows: int) -> npt.NDArray[np.int64]:
    """Indices into the whole stream's windows of the windows of ``split``, in order."""
    pages = np.arange(windows, dtype=np.int64) // _PAGE
    owner = np.asarray(_SPLIT_OF_PAGE, dtype=np.int64)[pages % len(_SPLIT_OF_PAGE)]
    return np.flatnonzero(owner == SPLITS.index(split)).astype(np.int64)


class ByteWindows:
    """One split of a byte stream as a language model's data: windows of ``CONTEXT``
    bytes and their next bytes, carved in pages as ``stdlib-text`` is (the module
    docstring).

    ``x`` from `batch` is int64 ``[b, CONTEXT]`` of byte values; ``y`` is int64
    ``[b, CONTEXT]``, the byte after each position (``x`` shifted left by one, plus the
    next byte), the targets of a language model.

    Raises:
        ConfigError: ``split`` is unknown, or ``size`` is not a positive integer or None.
    """

    __slots__ = ("_name", "_split", "_starts", "_stream")

    def __init__(self, stream: npt.NDArray[np.uint8], *, name: str, split: str = "train",
                 size: int | None = None) -> None:
        self._name = name
        self._split = check_split(split)
        size = check_size(size)
        self._stream = stream
        windows = _split_windows(self._split, (self._stream.size - 1) // CONTEXT)
        self._starts = windows[:size] * CONTEXT
        self._starts.flags.writeable = False

    @property
    def name(self) -> str:
        """The name it was given."""
        return self._name

    @property
    def num_classes(self) -> int:
        """256: a target is a byte."""
        return VOCAB

    @property
    def in_shape(self) -> tuple[int]:
        """``(CONTEXT,)``: one sample is a window of bytes."""
        return (CONTEXT,)

    @property
    def split(self) -> str:
        """Which split this is: ``"train"``, ``"val"`` or ``"test"``."""
        return self._split

    @property
    def offsets(self) -> npt.NDArray[np.int64]:
        """Where each window starts in `stdlib_bytes` (read-only), in index order."""
        return self._starts

    def __len__(self) -> int:
        """The number of windows."""
        return int(self._starts.size)

    def __repr__(self) -> str:
        return f"ByteWindows({self._name!r}, split={self._split!r}, size={len(self)})"

    def labels(self) -> npt.NDArray[np.int64]:
        """Each window's last target byte, in index order (see the module docstring)."""
        return self._stream[self._starts + CONTEXT].astype(np.int64)

    def batch(
        self, indices: Sequence[int] | npt.NDArray[np.integer]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows at ``indices`` as ``(x, y)``, int64 ``[b, CONTEXT]`` each.

        Raises:
            ConfigError: an index is out of range or not an integer.
        """
        idx = check_indices(indices, len(self))
        offsets = np.arange(CONTEXT + 1, dtype=np.int64)
        windows = torch.from_numpy(
            self._stream[self._starts[idx][:, None] + offsets].astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class StdlibText(ByteWindows):
    """One split of ``stdlib-text``: byte windows of the standard library's source."""

    __slots__ = ()

    def __init__(self, *, split: str = "train", size: int | None = None) -> None:
        """Read the source (once per process) and carve ``split``'s windows; ``size``
        keeps the first ``size`` of them (None: all).

        Raises:
            ConfigError: ``split`` is unknown, ``size`` is not a positive integer or None,
                or the standard library's source cannot be read.
        """
        super().__init__(stdlib_bytes(), name=TEXT_NAME, split=split, size=size)
