"""Cost tables measured once per machine and model, kept on disk: deterministic virtual
time without a table from the caller.

[Note: cost cache] A virtual-time simulation charges compute from a cost table. Without
one from the caller, `simulate` measures it on the wall clock, and two calls of the same
config then differ in every timing figure (weights and losses are the same; issue 28).
So the measured table is kept in a cache directory under a key of everything it depends
on, and the next call on this machine reads it: the same config gives the same result
in every field, timing included, from the first call on. The key holds the machine
(host name, processor, CPU count), torch's and aiopipe's versions, torch threads, the
model's units (their text and parameter shapes), the input shape and what the batches
are loaded from, learning rate and momentum. What differs between machines is the
table, so virtual times do too; the weights do not.

The batch sizes are not in the key: a kept table serves every request whose sizes it
holds, and a request for a size it lacks measures the union of both (so the file only
grows) and replaces it. Runs of one model in different modes ask for different sizes
(mode auto for every candidate's, a forced sfl run for the batch alone); with the
sizes in the key each measured a table of its own, minutes apart on a loaded host, and
planned other cuts from it than the run it was compared with
(bench/results/2026-11-29-s32-auto). Chosen over merging the new sizes into the kept
table: one table is one measurement, taken under one load.

Real runs use the same cache for the tables their "auto" plans are made from
(`aiopipe.runtime.plan.cached_planning_costs`): the coordinator's own table, and each
device's profile ([Note: device profiles] in profiling.py). So a second run of a model
on the same machines starts training without profiling compute again, whichever
system it runs. One log line says whether a table was read (which file) or measured
(how long it took).

The directory is ``$AIOPIPE_COST_CACHE``, else ``$XDG_CACHE_HOME/aiopipe/costs``, else
``~/.cache/aiopipe/costs``; ``AIOPIPE_COST_CACHE=off`` measures every time. Delete a file
(or the directory) to measure again, e.g. after the machine's load changed for good. A
file that cannot be read is measured again and replaced (logged). Two processes that
miss the same key at once (two simulations started together, a test suite's workers)
measure it once: the second waits on the first's lock file (``<key>.lock``) and reads
what it kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiopipe._version import __version__
from aiopipe.errors import ConfigError
from aiopipe.models.crossing import Crossing, as_crossing
from aiopipe.scheduler.costs import CostTable

__all__ = ["cache_directory", "cached_costs", "cost_key"]

log = logging.getLogger("aiopipe.runtime")


def cache_directory(environ: Mapping[str, str] | None = None) -> Path | None:
    """Where measured tables are kept; None when ``AIOPIPE_COST_CACHE=off``."""
    env = os.environ if environ is None else environ
    chosen = env.get("AIOPIPE_COST_CACHE", "")
    if chosen.lower() == "off":
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "aiopipe" / "costs"


def cost_key(model: nn.Sequential, inputs: Crossing | Sequence[int], data: str,
             settings: Mapping[str, Any]) -> str:
    """A name for the tables of ``model`` on this machine: a hash of what they depend on
    but the batch sizes (`cached_costs` checks those).

    ``inputs``: the model's (`aiopipe.models.crossing.as_crossing`); ``data``: what the
    micro-batches are loaded from (its loading is charged);
    ``settings``: anything else the measurement used (threads, learning rate...).
    """
    described = {
        "machine": [platform.node(), platform.machine(), platform.processor(),
                    os.cpu_count()],
        "torch": torch.__version__, "aiopipe": __version__,
        "units": [[repr(unit), [list(p.shape) for p in unit.parameters()]]
                  for unit in model.children()],
        "inputs": [[dtype, list(shape)] for dtype, shape in as_crossing(inputs)],
        "data": data, "settings": dict(sorted(settings.items())),
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached_costs(key: str, measure: Callable[[Sequence[int]], CostTable],
                 sizes: Sequence[int], directory: Path | None = None, *,
                 what: str = "cost table") -> CostTable:
    """A table at (at least) batch sizes ``sizes``: the one kept under ``key`` in
    ``directory`` (default `cache_directory`) when it holds them all, else
    ``measure(sizes)``'s (with the kept table's sizes too, when there is one), then kept
    there. With no directory (caching off), ``measure(sizes)``. A directory that cannot
    be written is logged, and the measured table returned. Processes that miss the same
    key at once measure one after the other, each reading first what the one before
    kept (a lock file beside the table), so the table is measured once.

    One line says which it was: ``what`` (e.g. "device 1's profile") read from which
    file, or measured in how many seconds (and kept where).
    """
    wanted = sorted(set(sizes))
    directory = cache_directory() if directory is None else directory
    if directory is None:
        return _measured(partial(measure, wanted), what,
                         "the cache is off: AIOPIPE_COST_CACHE=off")
    path = directory / f"{key}.json"
    kept = _kept(path, wanted, what, say_why=False)  # (said once, under the lock)
    if isinstance(kept, CostTable):
        return kept
    with _measuring(directory, key):
        kept = _kept(path, wanted, what)  # another process may have kept it meanwhile
        if isinstance(kept, CostTable):
            return kept
        wanted = sorted(set(kept).union(wanted))
        started = time.perf_counter()  # a profiler's own wall clock, for the log line only
        table = measure(wanted)
        seconds = time.perf_counter() - started
        try:
            directory.mkdir(parents=True, exist_ok=True)
            partial_file = path.with_suffix(f".{os.getpid()}.tmp")
            partial_file.write_text(json.dumps(table.to_mapping()))
            partial_file.replace(path)  # whole or not at all, also with two writers
        except OSError as exc:  # the run goes on; the next one measures again
            log.warning("%s measured in %.1f s; cannot keep it in %s (%s): set "
                        "AIOPIPE_COST_CACHE to a writable directory, or to off", what,
                        seconds, directory, exc)
            return table
    log.info("%s measured in %.1f s and kept in %s", what, seconds, path)
    return table


def _kept(path: Path, wanted: Sequence[int], what: str, *, say_why: bool = True
          ) -> CostTable | tuple[int, ...]:
    """The table kept at ``path`` when it holds every size ``wanted`` (logged), else the
    sizes it holds (none when there is no readable file); ``say_why``: log why it does
    not serve."""
    if not path.exists():
        return ()
    try:
        kept = CostTable.from_mapping(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
        if say_why:
            log.warning("%s %s cannot be read (%s): measuring it again", what, path, exc)
        return ()
    held = set(kept.batch_sizes)
    if held.issuperset(wanted):
        log.info("%s read from %s", what, path)
        return kept
    if say_why:
        log.info("%s %s lacks batch sizes %s: measuring them with its own", what, path,
                 ", ".join(map(str, sorted(set(wanted) - held))))
    return tuple(sorted(held))


@contextlib.contextmanager
def _measuring(directory: Path, key: str) -> Iterator[None]:
    """Hold ``key``'s lock file while measuring: another process that misses the same
    key waits, then reads the table this one kept. Without locks (no ``fcntl``, or a
    directory that cannot be written) it goes on unlocked: at worst both measure, and
    the last to finish is kept, whole."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = (directory / f"{key}.lock").open("a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def _measured(measure: Callable[[], CostTable], what: str, why: str) -> CostTable:
    """``measure()``'s table, its time logged (``why`` it was not cached)."""
    started = time.perf_counter()
    table = measure()
    log.info("%s measured in %.1f s (%s)", what, time.perf_counter() - started, why)
    return table
