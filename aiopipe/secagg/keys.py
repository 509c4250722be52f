"""The cryptography SecAgg+ rests on, all from the `cryptography` package: X25519 key
agreement, HKDF-SHA256 to derive keys from agreed secrets, ChaCha20-Poly1305 to seal the
shares a client sends another through the coordinator, and AES-256 in counter mode as
the pseudo-random generator that expands a 32-byte seed into a mask over Z_{2^32}.
"""

from __future__ import annotations

import os
import struct

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from aiopipe.secagg.fixed_point import Ring

__all__ = ["KEY_BYTES", "KeyPair", "agree", "check_public", "mask", "open_sealed", "random_seed",
           "seal"]

#: X25519 keys, agreed secrets and mask seeds are 32 bytes.
KEY_BYTES = 32
_NONCE_BYTES = 12


class KeyPair:
    """A fresh X25519 key pair: ``public`` travels, ``private`` (32 bytes) never does,
    except as Shamir shares."""

    def __init__(self, private: bytes | None = None) -> None:
        key = (X25519PrivateKey.generate() if private is None
               else X25519PrivateKey.from_private_bytes(private))
        self._key = key
        self.public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @property
    def private(self) -> bytes:
        """The private key's raw bytes (to be Shamir-shared)."""
        return self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def agree(self, public: bytes, purpose: bytes) -> bytes:
        """A 32-byte key for ``purpose`` that this pair and the owner of ``public``
        both derive (X25519, then HKDF-SHA256 with ``purpose`` as its info).

        Raises:
            ValueError: ``public`` is not a valid X25519 public key.
        """
        return agree(self._key, public, purpose)


def agree(private: X25519PrivateKey, public: bytes, purpose: bytes) -> bytes:
    """See `KeyPair.agree`."""
    if len(public) != KEY_BYTES:
        raise ValueError(f"a public key of {len(public)} bytes")
    shared = private.exchange(X25519PublicKey.from_public_bytes(public))
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=b"aiopipe secagg " + purpose).derive(shared)


def check_public(public: bytes) -> None:
    """Refuse what no key can be agreed with: a public key that is not 32 bytes, or a
    point of small order (every exchange with it gives the all-zero secret, which
    ``cryptography`` refuses), found by one exchange with a throwaway key.

    Raises:
        ValueError: it is such a key.
    """
    agree(X25519PrivateKey.generate(), public, b"check")


def random_seed() -> bytes:
    """A fresh 32-byte mask seed from the operating system."""
    return os.urandom(KEY_BYTES)


def mask(seed: bytes, length: int) -> Ring:
    """``length`` pseudo-random ring elements from ``seed``: AES-256-CTR's keystream
    from a zero counter, read as little-endian uint32."""
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    stream = encryptor.update(bytes(4 * length)) + encryptor.finalize()
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32)


def seal(key: bytes, plaintext: bytes, header: tuple[int, ...]) -> bytes:
    """``plaintext`` encrypted and authenticated under ``key``, bound to ``header``
    (round, sender, receiver): a random nonce, then the ciphertext and its tag."""
    nonce = os.urandom(_NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, _pack(header))


def open_sealed(key: bytes, sealed: bytes, header: tuple[int, ...]) -> bytes:
    """What `seal` sealed under ``key`` and ``header``.

    Raises:
        ValueError: the bytes were not sealed so (tampered, another header or key).
    """
    if len(sealed) < _NONCE_BYTES + 16:
        raise ValueError("sealed shares too short")
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:],
                                             _pack(header))
    except InvalidTag:
        raise ValueError("sealed shares fail authentication") from None


def _pack(header: tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(header)}q", *header)
