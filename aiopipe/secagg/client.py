"""A client's half of a SecAgg+ round ([Note: secagg rounds] in aiopipe.secagg.protocol):
a state machine with one method per step, fed what the server sent and returning what
to send back. No I/O: the device half of a system carries its values over the link.

Each method checks what it is given against what the round allows (a server may only
name this client's neighbours, only ones the earlier steps had) and raises
`RemoteProtocolError` otherwise; a step that cannot go on safely (too few neighbours
left to hide this client's input) raises `SecureAggregationError`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from aiopipe.errors import RemoteProtocolError, SecureAggregationError
from aiopipe.secagg import keys, shamir
from aiopipe.secagg.fixed_point import Ring
from aiopipe.secagg.protocol import PublicKeys, RoundSetup, UnmaskRequest

__all__ = ["Client", "pair_sign"]

_SHARE = shamir.SHARE_BYTES


def pair_sign(owner: int, other: int) -> int:
    """+1 when ``owner`` adds the mask it shares with ``other``, -1 when it takes it
    away: the lower id adds, so the pair's masks cancel in a sum."""
    return 1 if owner < other else -1


class Client:
    """Client ``client_id``'s half of the round ``setup``."""

    def __init__(self, setup: RoundSetup, client_id: int) -> None:
        if client_id not in setup.clients:
            raise ValueError(f"client {client_id} is not in the round")
        self.setup = setup
        self.id = client_id
        self.neighbours = setup.graph()[client_id]
        self._cipher = keys.KeyPair()
        self._mask = keys.KeyPair()
        self._seed = keys.random_seed()
        self._keys: dict[int, PublicKeys] = {}  # neighbours that advertised (U1)
        #: shares this client holds, by owner: (of the owner's seed, of its mask key)
        self._held: dict[int, tuple[bytes, bytes]] = {}
        #: the neighbours whose shares did not open in step 2 ([Note: secagg blame])
        self.blamed: frozenset[int] = frozenset()
        self._step = 0

    def _expect(self, step: int) -> None:
        if self._step != step:
            raise RemoteProtocolError(f"secure aggregation step {step} out of order "
                                      f"(this client is at step {self._step})")
        self._step = step + 1

    # -- step 0 --------------------------------------------------------------------------

    def advertise(self) -> PublicKeys:
        """This round's two public keys."""
        self._expect(0)
        return PublicKeys(self._cipher.public, self._mask.public)

    # -- step 1 --------------------------------------------------------------------------

    def share(self, advertised: Mapping[int, PublicKeys]) -> dict[int, bytes]:
        """Shares of this client's seed and mask key for each of its neighbours who
        advertised (``advertised``, by id), each sealed for it; this client keeps its own.

        Raises:
            RemoteProtocolError: a non-neighbour, a malformed or a repeated key.
            SecureAggregationError: fewer holders than the threshold.
        """
        self._expect(1)
        if not set(advertised) <= self.neighbours:
            raise RemoteProtocolError(f"keys of non-neighbours "
                                      f"{sorted(set(advertised) - self.neighbours)}")
        seen = {self._cipher.public, self._mask.public}
        for v, found in advertised.items():
            try:  # (a key no one can agree with would fail this client below)
                keys.check_public(found.cipher)
                keys.check_public(found.mask)
                if found.cipher in seen or found.mask in seen:
                    raise ValueError("repeated")
            except ValueError:
                raise RemoteProtocolError(f"client {v}'s advertised keys are malformed or "
                                          "repeated") from None
            seen |= {found.cipher, found.mask}
        holders = sorted({*advertised, self.id})
        self._check_holders(len(holders), "share its secrets")
        self._keys = dict(advertised)
        t = self.setup.threshold
        seed_shares = shamir.split(self._seed, t, [h + 1 for h in holders])
        key_shares = shamir.split(self._mask.private, t, [h + 1 for h in holders])
        sealed = {}
        for v in holders:
            plain = (seed_shares[v + 1].to_bytes(_SHARE, "big")
                     + key_shares[v + 1].to_bytes(_SHARE, "big"))
            if v == self.id:
                self._held[v] = (plain[:_SHARE], plain[_SHARE:])
                continue
            secret = self._cipher.agree(advertised[v].cipher, self.setup.purpose(b"seal"))
            sealed[v] = keys.seal(secret, plain, (self.setup.round_no, self.id, v))
        return sealed

    # -- step 2 --------------------------------------------------------------------------

    def masked_input(self, sealed: Mapping[int, bytes], encoded: Ring) -> Ring:
        """This client's ``encoded`` vector masked (module docstring of
        aiopipe.secagg.protocol), after opening the shares its neighbours sealed for it
        (``sealed``, by sender: the neighbours that shared, U2).

        [Note: secagg blame] Shares that do not open (or open to the wrong length) were
        sealed wrong by their sender, or changed on their way: this client cannot hold
        them, so it leaves that sender out, with no pairwise mask with it, and names it
        in `blamed` for the server, which leaves the sender out of the round. One
        broken neighbour costs this client nothing but that pair.

        Raises:
            RemoteProtocolError: shares from a client that did not advertise.
            SecureAggregationError: fewer neighbours' shares opened than the threshold
                needs.
        """
        self._expect(2)
        if not set(sealed) <= set(self._keys):
            raise RemoteProtocolError(f"shares from {sorted(set(sealed) - set(self._keys))}, "
                                      "who advertised no keys to this client")
        vector = np.asarray(encoded, dtype=np.uint32)
        if vector.shape != (self.setup.length,):
            raise ValueError(f"an input of shape {vector.shape}, the round sums "
                             f"{self.setup.length}")
        opened, blamed = [], set()
        for u, box in sorted(sealed.items()):
            secret = self._cipher.agree(self._keys[u].cipher, self.setup.purpose(b"seal"))
            try:
                plain = keys.open_sealed(secret, box, (self.setup.round_no, u, self.id))
            except ValueError:
                blamed.add(u)
                continue
            if len(plain) != 2 * _SHARE:
                blamed.add(u)
                continue
            self._held[u] = (plain[:_SHARE], plain[_SHARE:])
            opened.append(u)
        self.blamed = frozenset(blamed)
        self._check_holders(len(opened) + 1, "mask its input")
        masked = vector + keys.mask(self._seed, self.setup.length)
        for v in opened:
            pair = self._mask.agree(self._keys[v].mask, self.setup.purpose(b"mask"))
            stream = keys.mask(pair, self.setup.length)
            masked = masked + stream if pair_sign(self.id, v) > 0 else masked - stream
        return masked.astype(np.uint32)

    # -- step 3 --------------------------------------------------------------------------

    def unmask(self, request: UnmaskRequest) -> dict[int, bytes]:
        """The shares the server needs: of the seed of each neighbour that survived
        (this client included), of the mask key of each that dropped out; never both
        of one client.

        Raises:
            RemoteProtocolError: the request does not split exactly the neighbours that
                shared (and this client) into survivors and dropped.
            SecureAggregationError: fewer than threshold - 1 of its neighbours survived:
                its input would be unmasked by its own seed alone.
        """
        self._expect(3)
        shared = set(self._held)
        survivors, dropped = set(request.survivors), set(request.dropped)
        if (survivors & dropped or survivors | dropped != shared
                or self.id not in survivors):
            raise RemoteProtocolError("an unmasking request that does not split this "
                                      "client's neighbourhood into survivors and dropped")
        self._check_holders(len(survivors), "unmask")
        return {**{v: self._held[v][0] for v in survivors},
                **{d: self._held[d][1] for d in dropped}}

    def _check_holders(self, holders: int, step: str) -> None:
        t = self.setup.threshold
        if holders < t:
            raise SecureAggregationError(
                f"client {self.id} cannot {step}: {holders} of its neighbourhood "
                f"(itself included) take part, the threshold is {t}")
