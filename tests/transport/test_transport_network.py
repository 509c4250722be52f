"""Network presets and specs (DESIGN §6 names)."""

from __future__ import annotations

import math

import pytest

from aiopipe.errors import ConfigError
from aiopipe.transport import NETWORK_PRESETS, LinkSpec, NetworkSpec, network_spec


def test_presets_match_the_design() -> None:
    mbit = 1e6
    assert dict(NETWORK_PRESETS) == {
        "4g": NetworkSpec(up=LinkSpec(10 * mbit), down=LinkSpec(25 * mbit)),
        "4g+": NetworkSpec(up=LinkSpec(20 * mbit), down=LinkSpec(40 * mbit)),
        "wifi": NetworkSpec(up=LinkSpec(50 * mbit), down=LinkSpec(50 * mbit)),
        "lan": NetworkSpec(up=LinkSpec(None), down=LinkSpec(None)),
    }
    with pytest.raises(TypeError):
        NETWORK_PRESETS["5g"] = NETWORK_PRESETS["lan"]  # type: ignore[index]


def test_network_spec_resolves_names_specs_and_mappings() -> None:
    assert network_spec("4g") is NETWORK_PRESETS["4g"]
    custom = NetworkSpec(up=LinkSpec(1e6, 0.1), down=LinkSpec(None))
    assert network_spec(custom) is custom
    assert network_spec({"up_mbps": 10, "down_mbps": 25, "latency_ms": 20}) == NetworkSpec(
        up=LinkSpec(10e6, 0.02), down=LinkSpec(25e6, 0.02)
    )
    assert network_spec({"up_mbps": 2.5, "down_mbps": None}) == NetworkSpec(
        up=LinkSpec(2.5e6), down=LinkSpec(None)
    )


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ConfigError, match=r"'4g', '4g\+', 'wifi', 'lan'"):
        network_spec("5g")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"up_mbps": 10}, "down_mbps"),
        ({"up_mbps": 10, "down_mbps": 25, "jitter_ms": 3}, "jitter_ms"),
        ({"up_mbps": "fast", "down_mbps": 25}, "up_mbps"),
        ({"up_mbps": True, "down_mbps": 25}, "up_mbps"),
        ({"up_mbps": 0, "down_mbps": 25}, "positive"),
        ({"up_mbps": 10, "down_mbps": 25, "latency_ms": -1}, "negative"),
        ({"up_mbps": 10, "down_mbps": 25, "latency_ms": None}, "latency_ms"),
        (42, "preset name or a mapping"),
    ],
)
def test_invalid_network_specs_raise_config_error(spec: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        network_spec(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bandwidth", "latency"),
    [(0.0, 0.0), (-1.0, 0.0), (math.inf, 0.0), (math.nan, 0.0), (1e6, -0.1), (1e6, math.inf)],
)
def test_link_spec_validates(bandwidth: float, latency: float) -> None:
    with pytest.raises(ConfigError):
        LinkSpec(bandwidth, latency)


def test_link_spec_times() -> None:
    spec = LinkSpec(10e6, 0.02)
    assert spec.shaped
    assert spec.wire_time(1_250_000) == 1.0
    assert spec.transfer_time(1_250_000) == 1.02
    unshaped = LinkSpec(None, 0.005)
    assert not unshaped.shaped
    assert unshaped.wire_time(10**9) == 0.0
    assert unshaped.transfer_time(10**9) == 0.005


def test_network_spec_needs_link_specs() -> None:
    with pytest.raises(ConfigError, match="up"):
        NetworkSpec(up=10e6, down=LinkSpec(None))  # type: ignore[arg-type]
