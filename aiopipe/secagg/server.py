"""The server's half of a SecAgg+ round ([Note: secagg rounds] in
aiopipe.secagg.protocol): a state machine that takes each client's message of a step
(`take_*`), closes the step when the transport says everyone who will answer has
(`close_*`, returning what each client is sent next), and ends with the sum.

Clients that do not answer a step are left out of the next ones: one that advertised
but did not share is as if never there; one that shared but sent no masked input
(dropped mid-protocol) has its pairwise masks rebuilt from its neighbours' shares of
its mask key. Malformed messages raise `RemoteProtocolError` (the caller drops that
client, as lost); a round whose survivors cannot rebuild what the sum needs raises
`SecureAggregationError` naming the step, the client and the count.

The server holds masked inputs only (`masked`); it never stores a client's input, and
what it reconstructs (survivors' seeds, the dropped clients' mask keys) unmasks the
sum only (see aiopipe.secagg.protocol).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from aiopipe.errors import RemoteProtocolError, SecureAggregationError
from aiopipe.secagg import keys, shamir
from aiopipe.secagg.client import pair_sign
from aiopipe.secagg.fixed_point import Ring
from aiopipe.secagg.protocol import PublicKeys, RoundSetup, UnmaskRequest

__all__ = ["Server"]


class Server:
    """The server's half of the round ``setup``."""

    def __init__(self, setup: RoundSetup) -> None:
        self.setup = setup
        self.graph = setup.graph()
        self.keys: dict[int, PublicKeys] = {}  # U1
        self._sealed: dict[int, dict[int, bytes]] = {}  # U2: by sender, by receiver
        #: masked inputs by client (U3): the only vectors a client sends
        self.masked: dict[int, Ring] = {}
        #: shares revealed in step 3, by owner, by the holder that revealed them
        self._seed_shares: dict[int, dict[int, int]] = {}
        self._key_shares: dict[int, dict[int, int]] = {}
        self._requests: dict[int, UnmaskRequest] = {}
        self._answered: set[int] = set()
        #: by client, the neighbours whose shares did not open for it ([Note: secagg
        #: blame] in aiopipe.secagg.client): it holds no pairwise mask with them
        self.blamed: dict[int, frozenset[int]] = {}
        self._step = 0

    @property
    def step(self) -> int:
        """The step whose messages the server takes now (4: the sum was given)."""
        return self._step

    @property
    def survivors(self) -> list[int]:
        """The clients whose masked input the sum holds (U3), once step 2 is closed."""
        return sorted(self._requests)

    def _at(self, step: int, sender: int, earlier: Mapping[int, object] | set[int]) -> None:
        if self._step != step:
            raise RemoteProtocolError(f"client {sender}: a step-{step} message at step "
                                      f"{self._step}")
        if sender not in earlier:
            raise RemoteProtocolError(f"client {sender} is not in step {step} of the round")

    # -- step 0 --------------------------------------------------------------------------

    def take_keys(self, sender: int, advertised: PublicKeys) -> None:
        """Client ``sender``'s public keys.

        Raises:
            RemoteProtocolError: out of step, not a client of the round, a second time
                or malformed (not 32 bytes, or a key no one can agree with).
        """
        self._at(0, sender, set(self.setup.clients) - set(self.keys))
        try:  # (a key no one can agree with would fail every neighbour at step 1)
            keys.check_public(advertised.cipher)
            keys.check_public(advertised.mask)
        except ValueError as exc:
            raise RemoteProtocolError(f"client {sender}'s public keys: {exc}") from None
        self.keys[sender] = advertised

    def close_keys(self) -> dict[int, dict[int, PublicKeys]]:
        """Step 0 is over: each advertiser's neighbours' keys, to send it.

        Raises:
            SecureAggregationError: fewer advertised than the threshold.
        """
        self._step = 1
        self._enough(len(self.keys), "advertised keys")
        return {u: {v: self.keys[v] for v in self.graph[u] if v in self.keys}
                for u in self.keys}

    # -- step 1 --------------------------------------------------------------------------

    def take_shares(self, sender: int, sealed: Mapping[int, bytes]) -> None:
        """Client ``sender``'s sealed shares, by receiver: one for each neighbour that
        advertised, no other.

        Raises:
            RemoteProtocolError: out of step, a client that did not advertise or already
                shared, or shares for the wrong clients.
        """
        self._at(1, sender, set(self.keys) - set(self._sealed))
        expected = {v for v in self.graph[sender] if v in self.keys}
        if set(sealed) != expected:
            raise RemoteProtocolError(f"client {sender} sealed shares for {sorted(sealed)}, "
                                      f"its neighbours that advertised are {sorted(expected)}")
        self._sealed[sender] = dict(sealed)

    def close_shares(self) -> dict[int, dict[int, bytes]]:
        """Step 1 is over: for each client that shared, the shares sealed for it by
        the others that did, by sender.

        Raises:
            SecureAggregationError: fewer shared than the threshold.
        """
        self._step = 2
        self._enough(len(self._sealed), "shared their keys")
        return {v: {u: boxes[v] for u, boxes in self._sealed.items() if v in boxes}
                for v in self._sealed}

    # -- step 2 --------------------------------------------------------------------------

    def take_masked(self, sender: int, masked: Ring,
                    blamed: frozenset[int] = frozenset()) -> None:
        """Client ``sender``'s masked input, and the neighbours whose shares did not
        open for it (``blamed``: it masked without them; they are left out of the
        round at `close_masked`, [Note: secagg blame] in aiopipe.secagg.client).

        Raises:
            RemoteProtocolError: out of step, a client that did not share or already
                sent one, a vector of another length or type, or blame of a client
                that sealed it no shares.
        """
        self._at(2, sender, set(self._sealed) - set(self.masked))
        vector = np.asarray(masked)
        if vector.dtype != np.uint32 or vector.shape != (self.setup.length,):
            raise RemoteProtocolError(f"client {sender}'s masked input is {vector.dtype} "
                                      f"{vector.shape}, the round sums uint32 "
                                      f"({self.setup.length},)")
        senders = {u for u, boxes in self._sealed.items() if sender in boxes}
        if not blamed <= senders:
            raise RemoteProtocolError(f"client {sender} blames {sorted(blamed - senders)}, "
                                      "who sealed it no shares")
        self.masked[sender] = vector
        if blamed:
            self.blamed[sender] = frozenset(blamed)

    @property
    def left_out(self) -> list[int]:
        """The clients some neighbour blamed ([Note: secagg blame]): out of the round."""
        return sorted(set().union(*self.blamed.values())) if self.blamed else []

    def close_masked(self) -> dict[int, UnmaskRequest]:
        """Step 2 is over: what each client that sent a masked input is asked to
        reveal.

        Raises:
            SecureAggregationError: fewer masked inputs than the threshold.
        """
        self._step = 3
        for u in self.left_out:  # its input, if any, is not summed: it counts as dropped
            self.masked.pop(u, None)
        self._enough(len(self.masked), "sent a masked input")
        shared = set(self._sealed)
        for u in self.masked:
            holders = ((self.graph[u] & shared) - self.blamed.get(u, frozenset())) | {u}
            self._requests[u] = UnmaskRequest(frozenset(holders & set(self.masked)),
                                              frozenset(holders - set(self.masked)))
        return dict(self._requests)

    # -- step 3 --------------------------------------------------------------------------

    def take_unmasking(self, sender: int, shares: Mapping[int, bytes]) -> None:
        """Client ``sender``'s revealed shares, by owner: exactly what it was asked.

        Raises:
            RemoteProtocolError: out of step, not asked or answered already, other
                owners than asked, or shares that are not field elements.
        """
        self._at(3, sender, set(self._requests) - self._answered)
        request = self._requests[sender]
        if set(shares) != request.survivors | request.dropped:
            raise RemoteProtocolError(f"client {sender} revealed shares of {sorted(shares)}, "
                                      "not of those it was asked for")
        for owner, share in shares.items():
            value = int.from_bytes(share, "big")
            if len(share) != shamir.SHARE_BYTES or value >= shamir.PRIME:
                raise RemoteProtocolError(f"client {sender}'s share of {owner}'s secret is "
                                          "malformed")
            kept = self._seed_shares if owner in request.survivors else self._key_shares
            kept.setdefault(owner, {})[sender + 1] = value
        self._answered.add(sender)

    def result(self) -> Ring:
        """The sum of the survivors' inputs (mod 2^32), once step 3's answers are in.

        Raises:
            SecureAggregationError: a survivor's seed or a dropped client's mask key has
                fewer shares than the threshold.
        """
        if self._step != 3:
            raise RemoteProtocolError(f"the sum asked for at step {self._step}")
        self._step = 4
        length = self.setup.length
        total = np.zeros(length, dtype=np.uint32)
        for vector in self.masked.values():
            total += vector
        for u in self.survivors:
            seed = self._rebuild(self._seed_shares, u, "mask seed")
            total -= keys.mask(seed, length)
        dropped = set(self._sealed) - set(self.masked)
        for d in sorted(dropped):
            masked_with = sorted(u for u in self.graph[d] & set(self.masked)
                                 if d not in self.blamed.get(u, frozenset()))
            if not masked_with:  # (everyone it shared with blamed it: no mask to undo)
                continue
            private = X25519PrivateKey.from_private_bytes(
                self._rebuild(self._key_shares, d, "mask key"))
            for u in masked_with:
                pair = keys.agree(private, self.keys[u].mask, self.setup.purpose(b"mask"))
                stream = keys.mask(pair, length)
                # u added pair_sign(u, d) x stream: take it away
                total = total - stream if pair_sign(u, d) > 0 else total + stream
        return total

    def _rebuild(self, kept: Mapping[int, Mapping[int, int]], owner: int, what: str) -> bytes:
        shares = kept.get(owner, {})
        t = self.setup.threshold
        if len(shares) < t:
            raise SecureAggregationError(
                f"secure aggregation round {self.setup.round_no}: client {owner}'s {what} "
                f"has {len(shares)} shares from those who answered the unmasking, the "
                f"threshold is {t}")
        try:
            return shamir.combine(shares, t, keys.KEY_BYTES)
        except shamir.ShamirError as exc:
            raise SecureAggregationError(f"client {owner}'s {what}: {exc}") from None

    def _enough(self, count: int, did: str) -> None:
        t = self.setup.threshold
        if count < t:
            raise SecureAggregationError(
                f"secure aggregation round {self.setup.round_no}: {count} client"
                f"{'s' if count != 1 else ''} {did}, the threshold is {t}")
