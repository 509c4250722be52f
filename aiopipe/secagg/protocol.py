"""What the two halves of a SecAgg+ round agree on before it starts, and the few values
that pass between them (aiopipe.secagg.client, aiopipe.secagg.server).

[Note: secagg rounds] One round sums the clients' vectors in four steps (Bonawitz et
al. 2017, §4, with Bell et al. 2020's sparse graph):

    0 advertise   client -> server   two X25519 public keys (cipher, mask)
                  server -> client   its neighbours' keys (those who advertised: U1)
    1 share       client -> server   Shamir shares of its mask seed b and its mask
                                     key, sealed for each neighbour (ChaCha20-Poly1305)
                  server -> client   the sealed shares addressed to it (senders: U2)
    2 masked      client -> server   y = x + PRG(b) + sum over neighbours v in U2 of
                                     +-PRG(agreed(u, v))   (+ when u < v)
                  server -> client   who of its neighbours sent y (U3) and who did not
    3 unmask      client -> server   for each neighbour in U3 (itself too) its share of
                                     b; for each in U2 minus U3 its share of the mask key
                  server             sum of y over U3, minus every PRG(b), minus the
                                     pairwise masks survivors share with the dropped

The pairwise masks of two survivors cancel in the sum; the server learns each
survivor's b (not its mask key) and each dropped client's mask key (not its b), so
it never holds a survivor's x: y minus PRG(b) is still masked by the pairs with its
surviving neighbours (a client refuses step 3 unless at least threshold - 1 of them
survived), and a dropped client never sent a y.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiopipe.secagg.graph import degree_for, neighbours, threshold_for

__all__ = ["PublicKeys", "RoundSetup", "UnmaskRequest"]


@dataclass(frozen=True, slots=True)
class RoundSetup:
    """What every party of a round knows before it starts: its number (bound into the
    keys and seals), the seed of its graph, its clients (ids >= 0), the neighbourhood
    size, the threshold and the length of the vectors summed."""

    round_no: int
    seed: int
    clients: tuple[int, ...]
    length: int
    degree: int = -1  # -1: `degree_for(len(clients))`
    threshold: int = -1  # -1: `threshold_for(degree)`

    def __post_init__(self) -> None:
        clients = tuple(sorted(self.clients))
        if len(set(clients)) != len(clients) or any(c < 0 for c in clients):
            raise ValueError(f"clients must be distinct ids >= 0, got {self.clients}")
        if self.length < 1:
            raise ValueError(f"vectors of length {self.length}")
        object.__setattr__(self, "clients", clients)
        if self.degree < 0:
            object.__setattr__(self, "degree", degree_for(len(clients)))
        if self.threshold < 0:
            object.__setattr__(self, "threshold", threshold_for(self.degree))
        if not 1 <= self.threshold <= self.degree + 1:
            raise ValueError(f"threshold {self.threshold} for {self.degree + 1} holders")

    def graph(self) -> dict[int, frozenset[int]]:
        """Every client's neighbours (aiopipe.secagg.graph)."""
        return neighbours(self.clients, self.degree, self.seed)

    def purpose(self, what: bytes) -> bytes:
        """A key derivation's info for ``what`` in this round."""
        return what + b" round %d" % self.round_no


@dataclass(frozen=True, slots=True)
class PublicKeys:
    """A client's step-0 advertisement: the public key its sealed shares are agreed
    with (``cipher``) and the one its pairwise masks are agreed with (``mask``)."""

    cipher: bytes
    mask: bytes


@dataclass(frozen=True, slots=True)
class UnmaskRequest:
    """Step 3's question to a client: its neighbours (itself included) whose masked
    input arrived, for whom it reveals a share of the mask seed, and those who sent
    shares but no masked input, for whom it reveals a share of the mask key."""

    survivors: frozenset[int]
    dropped: frozenset[int]
