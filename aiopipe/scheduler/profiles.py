"""What the planner knows: a `ModelProfile` (the model's cost table and sizes, Q split
units) and a `DeviceProfile` per device (its speed, links, samples and own table).

Values, validated on construction; `aiopipe.scheduler.estimate` re-exports them, and the
estimates and the plan search take them in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from aiopipe.errors import ConfigError
from aiopipe.scheduler.cost_table import CostTable
from aiopipe.transport.network import LinkSpec

__all__ = ["DEFAULT_FRAME_OVERHEAD", "DeviceProfile", "ModelProfile"]

#: Default bytes a frame adds beyond its tensors (header, descriptors, alignment); the
#: codec's real figure for an Activation is about 112 and for a Gradient 80.
DEFAULT_FRAME_OVERHEAD = 200


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """What the planner knows about one device.

    ``slowdown``: the device's compute time over its table's (``costs``, or the
    server's when the device has none of its own) for the same work: a measured device
    has 1, an emulated one its emulation factor.
    ``uplink`` / ``downlink``: the device → server and server → device directions.
    ``samples``: training samples the device holds.
    ``costs``: the device's own cost table, measured where it runs (PiPar §3.3.1); None:
    the server's table x ``slowdown`` (a declared device).

    Raises:
        ConfigError: slowdown is not a positive finite number, a link is not a
            `LinkSpec`, samples is not an int >= 0, or costs is not a `CostTable`.
    """

    slowdown: float
    uplink: LinkSpec
    downlink: LinkSpec
    samples: int
    costs: CostTable | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.costs is not None and not isinstance(self.costs, CostTable):
            raise ConfigError(f"DeviceProfile.costs must be a CostTable, got "
                              f"{type(self.costs).__name__}")
        s = self.slowdown
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or s <= 0:
            raise ConfigError(f"device slowdown must be a positive number, got {s!r}")
        for name in ("uplink", "downlink"):
            if not isinstance(getattr(self, name), LinkSpec):
                raise ConfigError(
                    f"DeviceProfile.{name} must be a LinkSpec, got {getattr(self, name)!r}"
                )
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 0:
            raise ConfigError(f"device samples must be an int >= 0, got {self.samples!r}")


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What the planner knows about the model (Q split units).

    ``costs``: server-side compute seconds per unit (a device's are these x its slowdown).
    ``activation_bytes[q]``: per-sample output bytes of unit q (0-based), float32.
    ``label_bytes_per_sample``: labels riding with each activation (int64: 8).
    ``frame_overhead``: bytes a frame adds beyond its tensors (pass the codec's figure).
    ``state_bytes[q]``: parameter + buffer bytes of unit q (model transfer and memory).
    ``activation_frame_overhead``: the same for activation frames, which carry a second
    tensor (the labels); None means ``frame_overhead``.
    ``saved_bytes[q]``: per-sample bytes autograd keeps from unit q's forward for its
    backward (its input, intermediate tensors; `aiopipe.runtime.memory`), or None when
    not measured: the memory of a micro-batch in flight (Asteroid's Eq. 3).
    ``server_lanes``: server passes of different devices' replicas the server runs at
    once (its compute threads, or concurrent passes on a GPU: ``RunConfig.server_lanes``);
    each lane runs a pass in the table's time ([Note: server lanes]).
    ``frozen_bytes[q]``: the bytes of unit q's frozen parameters (``requires_grad``
    false), part of ``state_bytes[q]``: they hold no gradient and no optimizer state
    (Asteroid's memory, Eq. 3) and nothing of them is all-reduced; None: none frozen.

    Frame sizes for split point P at micro-batch size B'::

        activation = B' x activation_bytes[P-1] + B' x label_bytes_per_sample
                     + activation_frame_overhead
        gradient   = B' x activation_bytes[P-1] + frame_overhead

    Raises:
        ConfigError: fewer than 2 units, lengths that differ from ``costs.units``, or
            negative sizes.
    """

    costs: CostTable
    activation_bytes: tuple[int, ...]
    state_bytes: tuple[int, ...]
    label_bytes_per_sample: int = 8
    frame_overhead: int = DEFAULT_FRAME_OVERHEAD
    activation_frame_overhead: int | None = None
    saved_bytes: tuple[int, ...] | None = None
    server_lanes: int = 1
    frozen_bytes: tuple[int, ...] | None = None
    #: the fewest samples a pass of the model may train on: 2 where it normalises over
    #: the batch (a BatchNorm in training needs more than one value per channel)
    min_rows: int = 1

    def __post_init__(self) -> None:
        q = self.costs.units
        if (isinstance(self.server_lanes, bool) or not isinstance(self.server_lanes, int)
                or self.server_lanes < 1):
            raise ConfigError(f"ModelProfile.server_lanes must be an int >= 1, got "
                              f"{self.server_lanes!r}")
        if q < 2:
            raise ConfigError(f"a model needs at least 2 units to split, got {q}")
        for name in ("activation_bytes", "state_bytes", "saved_bytes", "frozen_bytes"):
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != q:
                raise ConfigError(
                    f"ModelProfile.{name} has {len(values)} entries, the cost table has {q} units"
                )
            if any(not isinstance(v, int) or v < 0 for v in values):
                raise ConfigError(f"ModelProfile.{name} must hold ints >= 0")
        for name in ("label_bytes_per_sample", "frame_overhead"):
            if getattr(self, name) < 0:
                raise ConfigError(f"ModelProfile.{name} must be >= 0")
        if self.activation_frame_overhead is not None and self.activation_frame_overhead < 0:
            raise ConfigError("ModelProfile.activation_frame_overhead must be >= 0")

    @property
    def units(self) -> int:
        """Q, the number of split units."""
        return self.costs.units

    def activation_frame_bytes(self, split_point: int, micro_batch: int) -> int:
        """Bytes of one activation frame (activation + labels) at split point P."""
        over = (
            self.frame_overhead
            if self.activation_frame_overhead is None
            else self.activation_frame_overhead
        )
        return (
            micro_batch * self.activation_bytes[split_point - 1]
            + micro_batch * self.label_bytes_per_sample
            + over
        )

    def gradient_frame_bytes(self, split_point: int, micro_batch: int) -> int:
        """Bytes of one gradient frame at split point P."""
        return micro_batch * self.activation_bytes[split_point - 1] + self.frame_overhead

    def model_frame_bytes(self, split_point: int) -> int:
        """Bytes of the device half's weights in one frame (sent down and up per epoch)."""
        return sum(self.state_bytes[:split_point]) + self.frame_overhead
