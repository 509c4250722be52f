"""Learnable synthetic image datasets, generated lazily and deterministically per sample.

Theory of operation: each dataset has, per class, a few *prototypes*: smooth random
images (a coarse random field shared by the class plus a finer per-prototype variation,
with correlated colour channels) drawn once from the seed. They are the same for every
split. Sample ``i`` of a split is generated on demand from its own random stream, keyed by
(seed, dataset name, split, i), never by its neighbours in a batch:

1. its label comes from a per-block permutation: indices ``[bC, (b+1)C)`` hold each of the
   ``C`` classes exactly once, in an order hashed from (seed, split, b), so labels are
   balanced, cheap to list, and independent of the dataset's size;
2. it takes one prototype of its class and mixes in a prototype of another random class
   with a weight up to `_MAX_MIX` (the mild class overlap);
3. it shifts, scales, rotates (and for colour sets, flips) the mix with one bilinear
   resample, changes contrast and brightness, and adds uniform pixel noise.

Everything but the per-sample random numbers runs vectorized over the batch. A dataset of
any size costs only its prototypes until a batch is asked for.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from aiopipe.data.dataset import SPLITS, check_indices, check_seed, check_split, seed_words
from aiopipe.errors import ConfigError

__all__ = ["SYNTHETIC_SPECS", "SyntheticDataset", "SyntheticSpec"]


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """The shape of one synthetic dataset, mirroring a real one.

    ``split_sizes`` are the default (train, val, test) sizes: pipar.txt Table 4.
    ``flip`` says whether samples may be mirrored (not for digit-like data).
    """

    name: str
    num_classes: int
    in_shape: tuple[int, int, int]
    split_sizes: tuple[int, int, int]
    flip: bool


SYNTHETIC_SPECS: Final[dict[str, SyntheticSpec]] = {
    spec.name: spec
    for spec in (
        SyntheticSpec("synthetic-cifar10", 10, (3, 32, 32), (50_000, 2_000, 8_000), True),
        SyntheticSpec("synthetic-cifar100", 100, (3, 32, 32), (50_000, 2_000, 8_000), True),
        SyntheticSpec("synthetic-mnist", 10, (1, 28, 28), (60_000, 2_000, 8_000), False),
        SyntheticSpec("synthetic-tinyimagenet", 200, (3, 64, 64), (100_000, 2_000, 8_000), True),
    )
}
"""Every synthetic dataset by name."""

# Difficulty knobs, tuned so that a small CNN learns a 10-class set well above chance in
# a few epochs on 2,000 samples, but not perfectly (see tests/data/test_data_learn.py).
_PROTOTYPES_PER_CLASS: Final = 4
_CLASS_GRID: Final = 4  # the class's shared pattern: a 4x4 random field, smoothed
_VARIANT_GRID: Final = 6  # each prototype's own variation: a finer 6x6 field
_VARIANT_WEIGHT: Final = 1.2
_CHROMA_WEIGHT: Final = 0.25  # colour channels = luminance + this much per-channel field
_MAX_MIX: Final = 0.45  # weight of another class's prototype: uniform in [0, _MAX_MIX]
_MAX_SHIFT: Final = 0.125  # of the image side, each direction
_SCALE: Final = (0.85, 1.2)
_MAX_ROTATE: Final = math.radians(15.0)
_CONTRAST: Final = (0.7, 1.3)
_BRIGHTNESS: Final = 0.2  # standard deviation of the brightness offset
_NOISE: Final = 0.7  # standard deviation of the pixel noise
_NOISE_SPAN: Final = _NOISE * math.sqrt(12.0)  # width of the uniform noise with that std
# E[x^2] before scaling: contrast^2 * E[mix^2] + brightness^2 + noise^2, where a mix of two
# unit-variance prototypes with weight w ~ U(0, m) has E[(1-w)^2 + w^2] = 1 - m + 2m^2/3.
_SCALE_OUT: Final = 1.0 / math.sqrt(
    (1.0 + (_CONTRAST[1] - _CONTRAST[0]) ** 2 / 12.0) * (1.0 - _MAX_MIX + 2.0 * _MAX_MIX**2 / 3.0)
    + _BRIGHTNESS**2
    + _NOISE**2
)
_UNIFORMS: Final = 10  # uniforms drawn per sample, then its brightness, then its noise

_TAG_PROTOTYPES: Final = 0x70726F74
_TAG_STREAMS: Final = 0x73616D70


class SyntheticDataset:
    """One split of a synthetic dataset; see the module docstring for how samples arise.

    Sample ``i`` depends only on (spec, seed, split, i): a larger ``size`` only appends
    samples, and the splits draw from disjoint random streams over the same prototypes.
    """

    __slots__ = ("_label_key", "_prototypes", "_seed", "_size", "_spec", "_split", "_stream_key")

    def __init__(self, spec: SyntheticSpec, *, split: str, size: int, seed: int) -> None:
        """Build the prototypes of ``spec`` for ``seed``; no sample is generated yet.

        Raises:
            ConfigError: ``split`` is unknown, ``size`` is not positive or ``seed`` is not
                an integer.
        """
        self._spec = spec
        self._split = check_split(split)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"size: expected a positive integer, got {size!r}")
        self._size = size
        self._seed = check_seed(seed)
        name_word = zlib.crc32(spec.name.encode())
        streams = np.random.SeedSequence(
            [_TAG_STREAMS, *seed_words(seed), name_word, SPLITS.index(split)]
        ).generate_state(3, np.uint64)
        self._stream_key = (int(streams[0]), int(streams[1]))
        self._label_key = np.uint64(streams[2])
        self._prototypes = _make_prototypes(
            spec, np.random.SeedSequence([_TAG_PROTOTYPES, *seed_words(seed), name_word])
        )

    @property
    def name(self) -> str:
        """The dataset's name, e.g. ``"synthetic-cifar10"``."""
        return self._spec.name

    @property
    def num_classes(self) -> int:
        """How many classes the labels range over."""
        return self._spec.num_classes

    @property
    def in_shape(self) -> tuple[int, int, int]:
        """The shape of one sample: (channels, height, width)."""
        return self._spec.in_shape

    @property
    def seed(self) -> int:
        """The seed every prototype and sample derives from."""
        return self._seed

    @property
    def split(self) -> str:
        """Which split this is: ``"train"``, ``"val"`` or ``"test"``."""
        return self._split

    def __len__(self) -> int:
        """The number of samples."""
        return self._size

    def __repr__(self) -> str:
        return (
            f"SyntheticDataset({self.name!r}, split={self._split!r}, size={self._size}, "
            f"seed={self.seed})"
        )

    def labels(self) -> npt.NDArray[np.int64]:
        """All labels in index order; each run of ``num_classes`` indices is balanced."""
        classes = self._spec.num_classes
        blocks = np.arange(-(-self._size // classes), dtype=np.uint64)
        return self._block_orders(blocks).reshape(-1)[: self._size]

    def batch(
        self, indices: Sequence[int] | npt.NDArray[np.integer]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Generate the samples at ``indices`` as ``(x, y)``.

        Raises:
            ConfigError: an index is out of range or not an integer.
        """
        idx = check_indices(indices, self._size)
        classes = self._spec.num_classes
        blocks = (idx // classes).astype(np.uint64)
        y = self._block_orders(blocks)[np.arange(idx.size), idx % classes]
        channels, height, width = self._spec.in_shape
        if idx.size == 0:
            return torch.empty(0, channels, height, width), torch.empty(0, dtype=torch.int64)
        params = np.empty((idx.size, _UNIFORMS + 1), dtype=np.float64)
        noise = np.empty((idx.size, channels * height * width), dtype=np.float32)
        key0, key1 = self._stream_key
        for row, i in enumerate(idx.tolist()):
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([key0, key1, i])))
            rng.random(out=params[row, :_UNIFORMS])
            params[row, _UNIFORMS] = rng.standard_normal()
            rng.random(out=noise[row], dtype=np.float32)
        x = self._render(y, params)
        # Uniform noise (cheaper to draw than normal), scaled to standard deviation
        # _NOISE; _render already subtracted its mean.
        noise_t = torch.from_numpy(noise).view(idx.size, channels, height, width)
        x.add_(noise_t, alpha=_NOISE_SPAN).mul_(_SCALE_OUT)
        return x, torch.from_numpy(y)

    def _block_orders(self, blocks: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """For each block, the class at each of its ``num_classes`` positions."""
        classes = self._spec.num_classes
        with np.errstate(over="ignore"):
            cells = np.add.outer(
                np.multiply(blocks, np.uint64(classes)), np.arange(classes, dtype=np.uint64)
            )
            keys = _mix64(np.bitwise_xor(cells, self._label_key))
        return np.argsort(keys, axis=1, kind="stable").astype(np.int64)

    def _render(self, y: npt.NDArray[np.int64], params: npt.NDArray[np.float64]) -> torch.Tensor:
        """The noise-free samples for labels ``y`` and per-sample numbers ``params``.

        Columns of ``params``: 0 own prototype, 1 other class, 2 its prototype, 3 mix
        weight, 4 scale, 5 rotation, 6 flip, 7-8 shift, 9 contrast (uniforms in [0, 1));
        10 brightness (standard normal).
        """
        spec, k, count, u = self._spec, _PROTOTYPES_PER_CLASS, y.size, params
        own = y * k + _pick(u[:, 0], k)
        other_class = (y + 1 + _pick(u[:, 1], spec.num_classes - 1)) % spec.num_classes
        other = other_class * k + _pick(u[:, 2], k)
        mix = _column(u[:, 3] * _MAX_MIX)
        protos = self._prototypes
        img = (1.0 - mix) * protos[torch.from_numpy(own)] + mix * protos[torch.from_numpy(other)]
        # Maps output to input pixel positions in grid_sample's [-1, 1] coordinates, so it
        # zooms by the inverse of the scale; a full side is 2 units long.
        zoom = 1.0 / (_SCALE[0] + (_SCALE[1] - _SCALE[0]) * u[:, 4])
        angle = (2.0 * u[:, 5] - 1.0) * _MAX_ROTATE
        mirror = np.where(u[:, 6] < 0.5, -1.0, 1.0) if spec.flip else np.ones(count)
        shift = (2.0 * u[:, 7:9] - 1.0) * (2.0 * _MAX_SHIFT)
        cos, sin = zoom * np.cos(angle), zoom * np.sin(angle)
        theta = np.stack(
            [
                np.stack([cos * mirror, -sin, shift[:, 0]], axis=1),
                np.stack([sin * mirror, cos, shift[:, 1]], axis=1),
            ],
            axis=1,
        )
        size = [count, *spec.in_shape]
        grid = F.affine_grid(torch.from_numpy(theta).float(), size, align_corners=False)
        out = F.grid_sample(
            img, grid, mode="bilinear", padding_mode="reflection", align_corners=False
        )
        out *= _column(_CONTRAST[0] + (_CONTRAST[1] - _CONTRAST[0]) * u[:, 9])
        out += _column(_BRIGHTNESS * u[:, 10] - _NOISE_SPAN / 2)  # and centres the noise
        return out


def _pick(u: npt.NDArray[np.float64], n: int) -> npt.NDArray[np.int64]:
    """Uniforms in [0, 1) to integers in [0, n)."""
    return np.minimum((u * n).astype(np.int64), n - 1)


def _column(values: npt.NDArray[np.float64]) -> torch.Tensor:
    """Per-sample values shaped to broadcast over ``[b, C, H, W]``."""
    return torch.from_numpy(values).float().view(-1, 1, 1, 1)


def _mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finalizer: a bijection on 64-bit words that scrambles every bit."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _make_prototypes(spec: SyntheticSpec, seq: np.random.SeedSequence) -> torch.Tensor:
    """``[num_classes * K, C, H/2, W/2]`` smooth prototypes, each of zero mean, unit std."""
    rng = np.random.Generator(np.random.PCG64(seq))
    channels, height, width = spec.in_shape
    side = (max(height, width) + 1) // 2
    count = spec.num_classes * _PROTOTYPES_PER_CLASS
    base = _smooth_field(rng, spec.num_classes, channels, _CLASS_GRID, side)
    base = base.repeat_interleave(_PROTOTYPES_PER_CLASS, dim=0)
    variant = _smooth_field(rng, count, channels, _VARIANT_GRID, side)
    protos = base + _VARIANT_WEIGHT * variant
    protos -= protos.mean(dim=(1, 2, 3), keepdim=True)
    protos /= protos.std(dim=(1, 2, 3), keepdim=True)
    return protos.contiguous()


def _smooth_field(
    rng: np.random.Generator, count: int, channels: int, grid: int, side: int
) -> torch.Tensor:
    """``count`` random fields of ``channels`` correlated channels, bicubic from a grid."""
    luminance = rng.standard_normal((count, 1, grid, grid))
    chroma = rng.standard_normal((count, channels, grid, grid)) if channels > 1 else 0.0
    coarse = torch.from_numpy(luminance + _CHROMA_WEIGHT * chroma).float()
    return F.interpolate(coarse, size=(side, side), mode="bicubic", align_corners=False)
