"""The C allocator's settings for torch on the CPU: keep freed memory for reuse.

[Note: allocator] Torch's CPU tensors come from the C library's ``malloc``. With glibc's
defaults a block above a moving threshold (128 KiB at first) is mapped from the kernel
and unmapped when freed, and free memory at the top of the heap is returned to the
kernel. A training pass frees and allocates the same large activations and gradients
over and over, so each pass pays page faults on memory it just gave back, and how much
depends on the order of frees: a pass costs well above what it does with freed memory
kept, and a different amount in every process (`bench/allocator.py` compares the two;
evidence: bench/results/2026-11-27-s20-allocator). The cost table then measured one
figure and the run paid another, and the planner chose by that noise.
`tune_malloc` sets glibc's mapping threshold to `MMAP_THRESHOLD` and its trim threshold
to `TRIM_THRESHOLD` (`mallopt`), so blocks up to 64 MiB are reused from the heap and up
to 256 MiB of free heap is kept. A node gives memory back to the kernel later (what it
freed below its peak stays mapped for reuse); the same bench reports the peak.

The thresholds hold for the main thread's heap, but torch runs in the node's compute
thread (aiopipe.runtime.compute), whose blocks come from an arena of its own: heaps of
at most 64 MiB mapped one after another, and glibc unmaps a heap as soon as nothing in
it is in use, whatever the trim threshold, unless its top padding would not fit in the
heap below. A pass's large activations fill a heap of their own, free it at the
backward, and map it again at the next forward: vgg5 at B = 100 paid 7,700 page faults
a pass in the compute thread against none in the main thread, 109 ms a pass against 96
(`bench/fl_floor.py`; bench/results/2026-11-29-s29-flower, FL against Flower). So
`tune_malloc` also sets the top padding (M_TOP_PAD) to `TOP_PAD`, a whole heap: no heap
is unmapped, and the compute thread reuses its memory as the main thread does. The
padding is address space, not memory: pages are touched only when used.

Nodes call it before they start (`aiopipe.runtime.compute.warm_up_torch`). It changes
the whole process, so it leaves the allocator alone where the user chose one: glibc's
own ``MALLOC_*_`` variables or ``GLIBC_TUNABLES`` set, another allocator preloaded
(``LD_PRELOAD``), or ``AIOPIPE_TUNE_MALLOC=0``. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Mapping
from typing import Final

__all__ = ["MMAP_THRESHOLD", "TOP_PAD", "TRIM_THRESHOLD", "malloc_choice", "tune_malloc"]

log = logging.getLogger("aiopipe.runtime")

#: Blocks of this many bytes and more are mapped from the kernel (glibc's M_MMAP_THRESHOLD).
MMAP_THRESHOLD: Final = 64 << 20
#: Free memory at the heap's top beyond this is returned to the kernel (M_TRIM_THRESHOLD).
TRIM_THRESHOLD: Final = 256 << 20
#: Padding kept at the top of a heap (M_TOP_PAD): a thread arena's heap is at most 64 MiB
#: (glibc's HEAP_MAX_SIZE on 64-bit hosts), so none is ever given back.
TOP_PAD: Final = 64 << 20
_M_TRIM_THRESHOLD: Final = -1  # glibc's malloc.h
_M_TOP_PAD: Final = -2
_M_MMAP_THRESHOLD: Final = -3

#: The environment variables through which a user sets glibc's allocator themselves.
_USERS_OWN: Final = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                     "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_")
_tuned: bool | None = None


def malloc_choice(environ: Mapping[str, str], libc: str) -> str:
    """Why the allocator is left alone, or "" when `tune_malloc` may tune it; ``libc``
    is ``platform.libc_ver()[0]``."""
    if environ.get("AIOPIPE_TUNE_MALLOC", "1").strip().lower() in ("0", "false", "no", "off"):
        return "AIOPIPE_TUNE_MALLOC=0"
    if libc != "glibc":
        return f"the C library is {libc or 'not glibc'}"
    own = [name for name in _USERS_OWN if environ.get(name)]
    if own:
        return f"{own[0]} is set"
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    if environ.get("LD_PRELOAD", "").strip():
        return "LD_PRELOAD is set (another allocator, perhaps)"
    return ""


def tune_malloc() -> bool:
    """Set glibc's thresholds as [Note: allocator] says, once per process; whether they
    are set. Safe to call from any thread, any number of times."""
    global _tuned
    if _tuned is not None:
        return _tuned
    reason = malloc_choice(os.environ, platform.libc_ver()[0])
    if reason:
        log.debug("allocator left as it is: %s", reason)
        _tuned = False
        return False
    try:
        libc = ctypes.CDLL(None)
        _tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                      and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
                      and libc.mallopt(_M_TOP_PAD, TOP_PAD))
    except (OSError, AttributeError) as exc:  # no mallopt in this process's C library
        log.debug("allocator left as it is: %s", exc)
        _tuned = False
    return _tuned
