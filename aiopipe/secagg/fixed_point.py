"""Fixed-point encoding of real vectors into the ring Z_{2^32}, where masks cancel.

A device's vector x (float) is clipped to [-clip, clip], scaled by ``scale`` and rounded:
q = round(clip(x) * scale) mod 2^32. Sums of encodings are sums mod 2^32; as long as the
true integer sum stays inside the signed range (|sum| < 2^31) the sum decodes exactly to
sum_i round(clip(x_i) * scale), so that

    |decode(sum_i q_i) - sum_i clip(x_i)| <= n / (2 * scale)   per coordinate   [bound]

for n summands (each rounding is off by at most 1/2 a step), plus float64 rounding of
x * scale, which is below 2^-52 relative. `FixedPoint.for_sum` picks the largest scale
for which n clipped values can never leave the signed range:
scale = ((2^31 - 1) / n - 1) / clip, so n * (clip * scale + 1/2) < 2^31 - 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["MODULUS_BITS", "FixedPoint", "Ring"]

#: Encodings live in Z_{2^32}: one uint32 per coordinate, as many bytes as float32.
MODULUS_BITS = 32
_HALF = 1 << (MODULUS_BITS - 1)

#: A vector of ring elements.
Ring = npt.NDArray[np.uint32]


@dataclass(frozen=True, slots=True)
class FixedPoint:
    """An encoding of values in [-clip, clip] with step 1/scale, for sums of at most
    ``summands`` vectors (module docstring)."""

    clip: float
    scale: float
    summands: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip must be a finite number > 0, got {self.clip!r}")
        if not (self.summands >= 1 and math.isfinite(self.scale) and self.scale > 0):
            raise ValueError("scale must be > 0 and summands >= 1")
        if self.summands * (self.clip * self.scale + 0.5) >= _HALF - 1:
            raise ValueError(f"{self.summands} values of up to {self.clip} at scale "
                             f"{self.scale} can overflow the signed 32-bit range")

    @classmethod
    def for_sum(cls, clip: float, summands: int) -> FixedPoint:
        """The finest encoding of values in [-clip, clip] whose sum of ``summands``
        never wraps (module docstring).

        Raises:
            ValueError: ``clip`` is not > 0, or ``summands`` is not >= 1 or so large
                that no step fits.
        """
        if summands < 1:
            raise ValueError(f"summands must be >= 1, got {summands}")
        scale = ((_HALF - 1) / summands - 1) / clip
        if not scale > 0:
            raise ValueError(f"{summands} summands do not fit 32 bits")
        return cls(clip, scale, summands)

    @property
    def error_bound(self) -> float:
        """The most a decoded sum of ``summands`` encodings is off the sum of the clipped
        values, per coordinate: summands / (2 scale) ([bound])."""
        return self.summands / (2 * self.scale)

    def encode(self, values: npt.ArrayLike) -> Ring:
        """``values`` clipped to [-clip, clip] and rounded to the ring."""
        x = np.clip(np.asarray(values, dtype=np.float64), -self.clip, self.clip)
        return np.rint(x * self.scale).astype(np.int64).astype(np.uint32)

    def decode_sum(self, total: Ring) -> npt.NDArray[np.float64]:
        """The sum of at most ``summands`` encodings, ``total`` (mod 2^32), as floats."""
        signed = np.asarray(total, dtype=np.uint32).view(np.int32).astype(np.float64)
        return signed / self.scale

    def clipped(self, values: npt.ArrayLike) -> int:
        """How many of ``values`` lie outside [-clip, clip] (they are clipped)."""
        x = np.asarray(values, dtype=np.float64)
        return int(np.count_nonzero(np.abs(x) > self.clip))
