"""Secure aggregation, SecAgg+ (Bell et al. 2020, on Bonawitz et al. 2017): the server
learns the sum of the devices' vectors and nothing else of any one of them; devices
that drop out mid-round are recovered up to a threshold.

A pure library: `fixed_point` (reals into Z_{2^32}, with its error bound), `shamir`
(t-of-n sharing), `graph` (the sparse neighbour graph), `keys` (X25519, HKDF,
ChaCha20-Poly1305 and AES-CTR from the `cryptography` package: the extra
``aiopipe[secagg]``), and the round's two halves, `Client` and `Server`, state machines
that a transport drives ([Note: secagg rounds] in `aiopipe.secagg.protocol`).
"""

from aiopipe.secagg.client import Client
from aiopipe.secagg.fixed_point import FixedPoint
from aiopipe.secagg.protocol import PublicKeys, RoundSetup, UnmaskRequest
from aiopipe.secagg.server import Server

__all__ = ["Client", "FixedPoint", "PublicKeys", "RoundSetup", "Server", "UnmaskRequest"]
