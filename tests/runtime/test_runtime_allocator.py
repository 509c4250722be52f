"""The C allocator's settings ([Note: allocator] in aiopipe/runtime/allocator.py): tuned
once per process where glibc is the allocator and the user chose nothing else."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

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


_COMPUTE_THREAD_PASSES = """
import resource, threading
import torch
from aiopipe.runtime.allocator import tune_malloc

def one_pass():  # a pass's activations (MiB), held together, then freed
    held = [torch.ones(n << 18) for n in (26, 26, 13, 6, 6, 3)]
    del held

def passes():
    for _ in range(3):
        one_pass()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(10):
        one_pass()
    print((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / 10)

assert tune_malloc()
thread = threading.Thread(target=passes)
thread.start()
thread.join()
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or sys.platform != "linux",
                    reason="glibc's arenas; per-thread fault counts")
def test_a_compute_threads_freed_memory_is_reused_not_mapped_again() -> None:
    # [Note: allocator]: a thread's arena unmapped each emptied heap, so every pass paid
    # a page fault per page of its activations again (3,300 here before TOP_PAD)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "AIOPIPE_TUNE")) and k not in (
               "LD_PRELOAD", "GLIBC_TUNABLES")}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", _COMPUTE_THREAD_PASSES], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    assert float(done.stdout.split()[-1]) < 100  # faults per pass
