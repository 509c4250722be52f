"""Network shapes: the bandwidth and latency of each direction of a device's link.

A `LinkSpec` describes one direction (bits per second, seconds of one-way latency); a
`NetworkSpec` pairs the uplink (device → server) with the downlink (server → device).
The named presets are the networks of PiPar §5.1 (DESIGN §6); `network_spec` resolves a
preset name or a config mapping into a `NetworkSpec`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from aiopipe.errors import ConfigError

__all__ = ["NETWORK_PRESETS", "LinkSpec", "NetworkSpec", "network_spec"]

_MEGABIT = 1e6


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One direction of a link: ``bandwidth_bps`` bits per second (None = unshaped) and
    ``latency_s`` seconds of one-way latency added to every frame.

    Raises:
        ConfigError: the bandwidth is not a positive finite number, or the latency is
            negative or not finite.
    """

    bandwidth_bps: float | None
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        bw = self.bandwidth_bps
        if bw is not None and (
            isinstance(bw, bool) or not isinstance(bw, int | float) or not math.isfinite(bw)
        ):
            raise ConfigError(f"bandwidth_bps must be a finite number or None, got {bw!r}")
        if bw is not None and bw <= 0:
            raise ConfigError(f"bandwidth_bps must be positive, got {bw!r}")
        lat = self.latency_s
        if isinstance(lat, bool) or not isinstance(lat, int | float) or not math.isfinite(lat):
            raise ConfigError(f"latency_s must be a finite number, got {lat!r}")
        if lat < 0:
            raise ConfigError(f"latency_s must not be negative, got {lat!r}")

    @property
    def shaped(self) -> bool:
        """Whether the bandwidth is limited."""
        return self.bandwidth_bps is not None

    def wire_time(self, nbytes: int) -> float:
        """Seconds ``nbytes`` occupy the wire at this bandwidth (0.0 when unshaped)."""
        if self.bandwidth_bps is None:
            return 0.0
        return nbytes * 8 / self.bandwidth_bps

    def transfer_time(self, nbytes: int) -> float:
        """Seconds from the start of sending ``nbytes`` on an idle link to their arrival."""
        return self.wire_time(nbytes) + self.latency_s


@dataclass(frozen=True, slots=True)
class NetworkSpec:
    """The two directions of a device's link: ``up`` (device → server), ``down`` (back).

    Raises:
        ConfigError: ``up`` or ``down`` is not a `LinkSpec`.
    """

    up: LinkSpec
    down: LinkSpec

    def __post_init__(self) -> None:
        for name in ("up", "down"):
            value = getattr(self, name)
            if not isinstance(value, LinkSpec):
                raise ConfigError(f"NetworkSpec.{name} must be a LinkSpec, got {value!r}")


def _mbps(up: float, down: float) -> NetworkSpec:
    return NetworkSpec(up=LinkSpec(up * _MEGABIT), down=LinkSpec(down * _MEGABIT))


NETWORK_PRESETS: Mapping[str, NetworkSpec] = MappingProxyType(
    {
        "4g": _mbps(10, 25),
        "4g+": _mbps(20, 40),
        "wifi": _mbps(50, 50),
        "lan": NetworkSpec(up=LinkSpec(None), down=LinkSpec(None)),
    }
)
"""The networks of PiPar §5.1 by name (bandwidths in bits per second, no latency)."""

_SPEC_KEYS = ("up_mbps", "down_mbps", "latency_ms")


def network_spec(name_or_spec: str | NetworkSpec | Mapping[str, object]) -> NetworkSpec:
    """Resolve a preset name, a `NetworkSpec`, or a mapping into a `NetworkSpec`.

    A mapping has ``up_mbps`` and ``down_mbps`` (megabits per second, 1 Mbit = 1e6 bits;
    None = unshaped) and optionally ``latency_ms`` (one-way, applied to both directions),
    for example ``{"up_mbps": 10, "down_mbps": 25, "latency_ms": 20}``.

    Raises:
        ConfigError: an unknown preset name (the message lists the presets), a mapping
            with missing, unknown or invalid entries, or a value of another type.
    """
    if isinstance(name_or_spec, NetworkSpec):
        return name_or_spec
    if isinstance(name_or_spec, str):
        try:
            return NETWORK_PRESETS[name_or_spec]
        except KeyError:
            known = ", ".join(repr(name) for name in NETWORK_PRESETS)
            raise ConfigError(
                f"unknown network {name_or_spec!r}; the presets are {known}, "
                "or give a mapping with up_mbps, down_mbps and optionally latency_ms"
            ) from None
    if isinstance(name_or_spec, Mapping):
        return _spec_from_mapping(name_or_spec)
    raise ConfigError(
        f"network must be a preset name or a mapping, got {type(name_or_spec).__name__}"
    )


def _spec_from_mapping(spec: Mapping[str, object]) -> NetworkSpec:
    unknown = sorted(str(key) for key in spec if key not in _SPEC_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown network setting(s) {', '.join(unknown)}; expected {', '.join(_SPEC_KEYS)}"
        )
    missing = [key for key in ("up_mbps", "down_mbps") if key not in spec]
    if missing:
        raise ConfigError(f"network mapping needs {' and '.join(missing)}")
    latency_ms = _number(spec, "latency_ms", default=0.0)
    if latency_ms is None:
        raise ConfigError("network latency_ms must be a number, got None")
    latency_s = latency_ms / 1000.0

    def direction(key: str) -> LinkSpec:
        mbps = _number(spec, key)
        return LinkSpec(None if mbps is None else mbps * _MEGABIT, latency_s)

    try:
        return NetworkSpec(up=direction("up_mbps"), down=direction("down_mbps"))
    except ConfigError as exc:
        raise ConfigError(f"invalid network {dict(spec)!r}: {exc}") from None


def _number(spec: Mapping[str, object], key: str, default: float | None = None) -> float | None:
    value = spec.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"network {key} must be a number, got {value!r}")
    return float(value)
