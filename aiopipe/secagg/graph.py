"""SecAgg+'s sparse neighbour graph (Bell et al. 2020, §3): who masks with whom and who
holds whose shares.

Each client masks its input only with its k neighbours and shares its secrets only
among them (and itself), so a client's work and bytes grow with k = O(log n), not n.
As in the paper, the graph is a Harary graph H(k, n) (the ring of clients, each joined
to the k/2 nearest on each side) over a random order of the clients: here the order is
drawn from a seed every party knows (the round's), so the coordinator and every device
compute the same graph from the round's participants without a message. With few
clients (k >= n - 1) it is the complete graph, the original SecAgg of Bonawitz et al.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

__all__ = ["degree_for", "neighbours", "threshold_for"]


def degree_for(clients: int) -> int:
    """The neighbourhood size k for ``clients`` clients: an even 2 ceil(2 log2 n),
    as many as there are other clients when that is fewer (complete graph)."""
    if clients <= 1:
        return 0
    return min(clients - 1, 2 * math.ceil(2 * math.log2(clients)))


def threshold_for(degree: int) -> int:
    """Shares needed to rebuild a secret shared among a client's k neighbours and
    itself: more than half of the k + 1 holders, at least 2 (and at most k + 1).

    More than half: a client tells the coordinator either the shares of a neighbour's
    mask seed (it survived) or of its key (it dropped out), never both, so a majority
    rule means no consistent story yields both of one client's secrets (with exactly
    half, a coordinator telling half the holders "survived" and the other half
    "dropped" would get both, and the client's input). With k + 1 = 4 (4 devices) it
    is 3: one of four may drop out and the rest still unmask; with 5, 3 (two may)."""
    holders = degree + 1
    return min(holders, max(2, holders // 2 + 1))


def neighbours(clients: Sequence[int], degree: int, seed: int) -> dict[int, frozenset[int]]:
    """Each client's neighbours in the Harary graph H(degree, n) over ``clients`` in an
    order drawn from ``seed`` (module docstring); every client's set has ``degree``
    members when degree < n (an odd degree is taken as the next lower even one there),
    all others otherwise.

    Raises:
        ValueError: a client appears twice or the degree is negative.
    """
    ids = sorted(clients)
    if len(set(ids)) != len(ids) or degree < 0:
        raise ValueError(f"distinct clients and a degree >= 0, got {ids}, {degree}")
    n = len(ids)
    if degree >= n - 1:
        return {c: frozenset(ids) - {c} for c in ids}
    order = list(ids)
    random.Random(seed).shuffle(order)
    half = degree // 2
    graph: dict[int, set[int]] = {c: set() for c in ids}
    for at, c in enumerate(order):
        for step in range(1, half + 1):
            other = order[(at + step) % n]
            graph[c].add(other)
            graph[other].add(c)
    return {c: frozenset(found) for c, found in graph.items()}
