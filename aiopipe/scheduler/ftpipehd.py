"""FTPipeHD's dynamic model partition (paper §III-D, Eqs. 1–7), pure.

Workers report the average execution time of their sub-model; the central node turns each
report into a computing *capacity* relative to its own profile of the same units
(Eqs. 1–2: ``C_i = Te_i / sum of T0_{e,j} over worker i's units``; ``C_0 = 1``) and
estimates worker i's time for any unit as ``T0_{e,j} × C_i`` (Eq. 3). The partition is
PipeDream's dynamic program extended with those capacities and each link's bandwidth
(Eqs. 5–7): with ``A(j, n)`` the best slowest-part time of units ``0..j`` on the first
``n`` devices,

    A(j, 1) = C_0 × T0(0, j)
    A(j, n) = min over l of max( A(l, n − 1),
                                 2 × D_l / B_{n−2, n−1},
                                 C_{n−1} × T0(l + 1, j) )

where ``D_l`` is unit l's output per batch (it goes forward and its gradient comes back:
the factor 2) and ``B_{k, k+1}`` the bandwidth from device k to the next. A pipeline's
steady-state time per batch is its slowest part, so ``A(Q − 1, S)`` estimates it.

Choices where the paper is open (docs/design.md, FTPipeHD): every device gets at least
one unit (``n − 2 ≤ l ≤ j − 1``; the paper's ``1 ≤ l ≤ j`` would allow empty stages);
ties go to the earliest cut; PipeDream's homogeneous partition is the same program with
every capacity 1 (`ftpipehd_partition` with ``capacities=None``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from aiopipe.errors import ConfigError

__all__ = ["Partition", "capacities", "ftpipehd_partition", "pipeline_time"]


@dataclass(frozen=True, slots=True)
class Partition:
    """A partition of Q units into S stages.

    Attributes:
        cuts: the S − 1 units where stages 1..S−1 start (increasing, in 1..Q−1).
        time_s: the estimated time per batch: the slowest stage or link.
    """

    cuts: tuple[int, ...]
    time_s: float

    def bounds(self, units: int) -> list[tuple[int, int]]:
        """Each stage's units as (first, stop)."""
        edges = [0, *self.cuts, units]
        return list(itertools.pairwise(edges))


def capacities(unit_times: Sequence[float], bounds: Sequence[tuple[int, int]],
               measured: Sequence[float]) -> list[float]:
    """Each device's computing capacity (Eqs. 1–2): the time it reported for its units
    (``measured[i]``, per batch, counted as ``unit_times`` is) over the central node's
    profile of the same units; the central node (device 0) is 1.0 by definition.

    Raises:
        ConfigError: lengths differ, a stage is empty, or a time is not positive.
    """
    if len(bounds) != len(measured):
        raise ConfigError(f"{len(measured)} measured times for {len(bounds)} stages")
    result = [1.0]
    for (first, stop), seconds in zip(bounds[1:], measured[1:], strict=True):
        reference = math.fsum(unit_times[first:stop])
        if not stop > first or not reference > 0 or not seconds > 0:
            raise ConfigError(f"cannot tell a capacity from units {first}..{stop - 1} "
                              f"taking {seconds} s (profile {reference} s)")
        result.append(seconds / reference)
    return result


def ftpipehd_partition(unit_times: Sequence[float], output_bytes: Sequence[float],
                       stages: int, *, capacities: Sequence[float] | None = None,
                       bandwidths: Sequence[float] | None = None) -> Partition:
    """The partition of Eqs. 5–7 (module docstring).

    ``unit_times[j]``: the central node's time of unit j per batch (forward, backward
    and the update that follows every batch);
    ``output_bytes[j]``: unit j's output per batch; ``capacities[i]``: device i's (default
    all 1: PipeDream's homogeneous partition); ``bandwidths[k]``: bytes per second from
    device k to device k + 1 (default: transfers are free).

    Raises:
        ConfigError: fewer units than stages, lists of the wrong length, or a capacity or
            bandwidth that is not positive.
    """
    q = len(unit_times)
    if not 1 <= stages <= q:
        raise ConfigError(f"cannot cut a model of {q} units into {stages} non-empty stages")
    if len(output_bytes) != q:
        raise ConfigError(f"{len(output_bytes)} output sizes for {q} units")
    cap = list(capacities) if capacities is not None else [1.0] * stages
    bw = list(bandwidths) if bandwidths is not None else [math.inf] * (stages - 1)
    if len(cap) != stages or len(bw) != stages - 1:
        raise ConfigError(f"{stages} stages need {stages} capacities and {stages - 1} "
                          f"bandwidths, got {len(cap)} and {len(bw)}")
    if not all(c > 0 for c in cap) or not all(b > 0 for b in bw):
        raise ConfigError("capacities and bandwidths must be > 0")
    prefix = [0.0]
    for t in unit_times:
        prefix.append(prefix[-1] + t)

    def span(first: int, last: int) -> float:  # T0(first, last), units inclusive
        return prefix[last + 1] - prefix[first]

    # best[n][j]: A(j, n); cut[n][j]: the l that attains it
    best = [[math.inf] * q for _ in range(stages + 1)]
    cut = [[-1] * q for _ in range(stages + 1)]
    for j in range(q):
        best[1][j] = cap[0] * span(0, j)
    for n in range(2, stages + 1):
        link = bw[n - 2]
        for j in range(n - 1, q):
            for ell in range(n - 2, j):
                value = max(best[n - 1][ell], 2 * output_bytes[ell] / link,
                            cap[n - 1] * span(ell + 1, j))
                if value < best[n][j]:
                    best[n][j], cut[n][j] = value, ell
    cuts: list[int] = []
    j = q - 1
    for n in range(stages, 1, -1):
        ell = cut[n][j]
        cuts.append(ell + 1)
        j = ell
    return Partition(tuple(reversed(cuts)), best[stages][q - 1])


def pipeline_time(unit_times: Sequence[float], output_bytes: Sequence[float],
                  cuts: Sequence[int], *, capacities: Sequence[float] | None = None,
                  bandwidths: Sequence[float] | None = None) -> float:
    """The slowest stage or link of the partition ``cuts`` under ``capacities`` and
    ``bandwidths`` (as `ftpipehd_partition` counts them): how a partition chosen under
    one assumption does under another.

    Raises:
        ConfigError: the cuts are not increasing within 1..Q−1, or the lists do not fit.
    """
    q, stages = len(unit_times), len(cuts) + 1
    edges = [0, *cuts, q]
    if any(b <= a for a, b in itertools.pairwise(edges)):
        raise ConfigError(f"cuts {list(cuts)} are not increasing within 1..{q - 1}")
    cap = list(capacities) if capacities is not None else [1.0] * stages
    bw = list(bandwidths) if bandwidths is not None else [math.inf] * (stages - 1)
    if len(cap) != stages or len(bw) != stages - 1:
        raise ConfigError(f"{stages} stages need {stages} capacities and {stages - 1} "
                          "bandwidths")
    parts = [cap[i] * math.fsum(unit_times[a:b])
             for i, (a, b) in enumerate(itertools.pairwise(edges))]
    parts += [2 * output_bytes[c - 1] / bw[i] for i, c in enumerate(cuts)]
    return max(parts)
