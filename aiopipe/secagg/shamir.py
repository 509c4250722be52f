"""Shamir's t-of-n secret sharing over the prime field GF(2^521 - 1).

Arithmetic only (no keys): a secret s (at most 64 bytes, read as an integer) is the
constant term of a random polynomial f of degree t - 1; holder i gets f(i) (i >= 1).
Any t shares give s back by Lagrange interpolation at 0; fewer say nothing about it.
The coefficients come from the operating system's randomness (`secrets`).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping

__all__ = ["PRIME", "SHARE_BYTES", "ShamirError", "combine", "split"]

#: The field's modulus: a Mersenne prime above every 64-byte secret.
PRIME = (1 << 521) - 1
#: A share's value as bytes (big-endian, fixed width).
SHARE_BYTES = 66


class ShamirError(ValueError):
    """Shares that cannot give a secret back: too few, duplicated or out of the field."""


def split(secret: bytes, threshold: int, holders: Iterable[int]) -> dict[int, int]:
    """Shares of ``secret`` for each of ``holders`` (ids >= 1), any ``threshold`` of
    which give it back.

    Raises:
        ShamirError: the threshold is not in [1, holders], an id is < 1 or repeated, or
            the secret is longer than 64 bytes.
    """
    ids = list(holders)
    if len(set(ids)) != len(ids) or any(i < 1 or i >= PRIME for i in ids):
        raise ShamirError(f"holder ids must be distinct and >= 1, got {ids}")
    if not 1 <= threshold <= len(ids):
        raise ShamirError(f"threshold {threshold} for {len(ids)} holders")
    if len(secret) > 64:
        raise ShamirError(f"a secret of {len(secret)} bytes (at most 64)")
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return {i: _evaluate(coefficients, i) for i in ids}


def combine(shares: Mapping[int, int], threshold: int, size: int) -> bytes:
    """The ``size``-byte secret from at least ``threshold`` of its shares (the first
    ``threshold`` by holder id are used).

    Raises:
        ShamirError: fewer than ``threshold`` shares, or a share outside the field.
    """
    if len(shares) < threshold:
        raise ShamirError(f"{len(shares)} shares, {threshold} needed")
    points = sorted(shares.items())[:threshold]
    if any(not 0 <= y < PRIME or x < 1 for x, y in points):
        raise ShamirError("a share outside the field")
    secret = 0
    for j, (xj, yj) in enumerate(points):
        numerator, denominator = 1, 1
        for m, (xm, _) in enumerate(points):
            if m != j:
                numerator = numerator * (-xm) % PRIME
                denominator = denominator * (xj - xm) % PRIME
        secret = (secret + yj * numerator * pow(denominator, -1, PRIME)) % PRIME
    if secret >= 1 << (8 * size):
        raise ShamirError("the shares do not give a secret of that size back")
    return secret.to_bytes(size, "big")


def _evaluate(coefficients: list[int], x: int) -> int:
    """f(x) mod PRIME by Horner's rule."""
    value = 0
    for c in reversed(coefficients):
        value = (value * x + c) % PRIME
    return value
