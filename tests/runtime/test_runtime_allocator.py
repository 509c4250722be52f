"""The C allocator's settings ([Note: allocator] in aiopipe/runtime/allocator.py): tuned
once per process where glibc is the allocator and the user chose nothing else."""

from __future__ import annotations

import platform

import pytest

from aiopipe.runtime import allocator
from aiopipe.runtime.allocator import malloc_choice, tune_malloc


def test_glibc_is_tuned_unless_the_user_chose_otherwise() -> None:
    assert malloc_choice({}, "glibc") == ""
    assert malloc_choice({"AIOPIPE_TUNE_MALLOC": "1"}, "glibc") == ""
    assert malloc_choice({"AIOPIPE_TUNE_MALLOC": "0"}, "glibc") == "AIOPIPE_TUNE_MALLOC=0"
    assert malloc_choice({"AIOPIPE_TUNE_MALLOC": "off"}, "glibc") == "AIOPIPE_TUNE_MALLOC=0"
    assert "not glibc" in malloc_choice({}, "")
    assert "musl" in malloc_choice({}, "musl")
    assert "MALLOC_ARENA_MAX" in malloc_choice({"MALLOC_ARENA_MAX": "2"}, "glibc")
    assert "MALLOC_TRIM_THRESHOLD_" in malloc_choice({"MALLOC_TRIM_THRESHOLD_": "0"}, "glibc")
    assert "GLIBC_TUNABLES" in malloc_choice(
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "glibc")
    assert malloc_choice({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, "glibc") == ""
    assert "LD_PRELOAD" in malloc_choice({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "glibc")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_tuning_happens_once_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AIOPIPE_TUNE_MALLOC", "LD_PRELOAD", "GLIBC_TUNABLES",
                 "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "_tuned", None)
    assert tune_malloc() is True
    monkeypatch.setenv("AIOPIPE_TUNE_MALLOC", "0")
    assert tune_malloc() is True  # decided once per process: the thresholds are set
    monkeypatch.setattr(allocator, "_tuned", None)
    assert tune_malloc() is False
