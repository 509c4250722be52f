"""`RunConfig`: validation naming the key, per-device views, TOML round trips."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiopipe.config import DATA_PARTITIONS, MODES, SCHEDULES, RunConfig
from aiopipe.errors import ConfigError
from aiopipe.runtime.systems.base import system_class
from aiopipe.runtime.systems.registry import option_owners


def _nested(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the systems' keys among them moved into ``options`` (the tables
    below name every key alike: `RunConfig`'s own and a system's)."""
    out = dict(values)
    owners = option_owners()
    options = {k: out.pop(k) for k in list(out) if k in owners}
    if options:
        given = out.get("options")
        out["options"] = {**(given if isinstance(given, dict) else {}), **options}
    return out


def _config(**values: Any) -> RunConfig:
    return RunConfig(**_nested(values))


def _value(config: RunConfig, key: str) -> Any:
    """``key``'s value: `RunConfig`'s own, or its system's option."""
    return getattr(config.options if key in option_owners() else config, key)


def test_defaults_are_valid() -> None:
    config = RunConfig()
    assert config.mode == "pipar"
    assert config.mode in MODES
    assert config.data_partition in DATA_PARTITIONS
    assert config.devices >= 1
    assert RunConfig.from_mapping(config.to_mapping()) == config


def test_is_frozen() -> None:
    config = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.devices = 3  # type: ignore[misc]


BAD_VALUES: list[tuple[str, Any, dict[str, Any]]] = [
    # (key, bad value, other fields it needs)
    ("mode", "nope", {}),
    ("mode", "PIPAR", {}),
    ("mode", 1, {}),
    ("model", 42, {}),
    ("model", "", {}),
    ("model", None, {}),
    ("dataset", "", {}),
    ("dataset", 3, {}),
    ("devices", 0, {}),
    ("devices", -1, {}),
    ("devices", True, {}),
    ("devices", 2.0, {}),
    ("devices", "2", {}),
    ("samples_per_device", 0, {}),
    ("batch_size", 0, {}),
    ("batch_size", False, {}),
    ("epochs", 0, {}),
    ("epochs", 1.5, {}),
    ("test_samples", -1, {}),
    ("test_samples", 1.5, {}),
    ("loss", "huber", {}),
    ("loss", "my lab:loss", {}),
    ("metric", "f1", {}),
    ("metric", "", {}),
    ("optimizer", "adam", {}),
    ("optimizer", 3, {}),
    ("profile_devices", "yes", {}),
    ("aggregation", "mean", {}),
    ("aggregation", "no_such_module_here:Strategy", {}),
    ("aggregation", "aiopipe.strategies:no_such_class", {}),
    ("aggregation_options", {"eta": -1.0}, {"aggregation": "fedadam"}),
    ("aggregation_options", {"no_such_argument": 1}, {"aggregation": "fedavgm"}),
    ("aggregation_options", "eta=1", {}),
    ("train_hook", "no colon", {}),
    ("train_hook", "aiopipe.strategies:ProximalHook", {"mode": "pipeline"}),
    ("trim_fraction", 0.5, {}),
    ("trim_fraction", -0.1, {}),
    ("byzantine_devices", -1, {}),
    ("byzantine_devices", 1, {"aggregation": "krum", "devices": 3}),  # krum needs n >= f+3
    ("outliers", "ignore", {}),
    ("outlier_limit", 1.0, {}),
    ("scale_limit", 1.0, {}),
    ("trim_fraction", 0.2, {"aggregation": "trimmed-mean", "devices": 4}),  # trims nothing
    ("trim_fraction", 0.0, {"aggregation": "trimmed-mean", "devices": 5}),
    ("trim_fraction", 0.2, {"aggregation": "trimmed-mean", "devices": 9,
                            "devices_per_round": 4}),
    ("version_aggregation", -1, {"mode": "ftpipehd", "devices": 2}),
    ("version_aggregation", True, {"mode": "ftpipehd", "devices": 2}),
    ("version_aggregation", 2, {}),  # for mode ftpipehd only
    ("global_replication_every", -1, {"mode": "ftpipehd", "devices": 2}),
    ("global_replication_every", 2.5, {"mode": "ftpipehd", "devices": 2}),
    ("global_replication_every", 50, {}),  # for mode ftpipehd only
    ("chain_replication_every", -1, {"mode": "ftpipehd", "devices": 2}),
    ("chain_replication_every", True, {"mode": "ftpipehd", "devices": 2}),
    ("chain_replication_every", 25, {}),  # for modes ftpipehd and asteroid only
    ("first_repartition_after", -3, {"mode": "ftpipehd", "devices": 2}),
    ("first_repartition_after", 5, {}),
    ("outlier_limit", math.inf, {}),
    ("samples_per_device", [10, 20], {"devices": 3}),
    ("samples_per_device", "auto", {}),
    ("network", ["4g", "wifi"], {"devices": 3}),
    ("network", ["4g", "nope"], {}),
    ("model", "my lab:net", {}),
    ("initial_weights", "pretrained", {}),
    ("initial_weights", "given", {}),  # a name has no weights of its own
    ("torch_threads", 0, {}),
    ("shape_links", "yes", {}),
    ("shape_links", 1, {}),
    ("heartbeat_interval", 0, {}),
    ("heartbeat_interval", math.inf, {}),
    ("device_timeout", -1, {}),
    ("device_timeout", 2.0, {"heartbeat_interval": 5.0}),
    ("reconnect_grace", 0, {}),
    ("reconnect_grace", math.nan, {}),
    ("replan", "no", {}),
    ("replan_threshold", 1.0, {}),
    ("replan_threshold", -0.1, {}),
    ("device_memory_mb", -1, {}),
    ("device_memory_mb", [1.0], {"devices": 2}),
    ("device_memory_mb", math.inf, {}),
    ("split_point", 0, {}),
    ("split_point", "nope", {}),
    ("split_point", True, {}),
    ("split_point", 1.5, {}),
    ("split_point", (2,), {"devices": 2}),
    ("split_point", (2, 2, 2), {"devices": 2}),
    ("split_point", (2, 0), {"devices": 2}),
    ("split_point", (2, "auto"), {"devices": 2}),
    ("split_point", {"a": 1}, {}),
    ("parallel_batches", 0, {}),
    ("parallel_batches", "many", {}),
    ("parallel_batches", (4,), {"devices": 3}),
    ("parallel_batches", 11, {"batch_size": 10}),
    ("parallel_batches", (2, 11), {"batch_size": 10, "devices": 2}),
    ("network", 42, {}),
    ("network", None, {}),
    ("network", ["4g"], {}),
    ("device_slowdown", 0.5, {}),
    ("device_slowdown", 0, {}),
    ("device_slowdown", -2.0, {}),
    ("device_slowdown", math.nan, {}),
    ("device_slowdown", math.inf, {}),
    ("device_slowdown", True, {}),
    ("device_slowdown", "2", {}),
    ("device_slowdown", (1.0,), {"devices": 2}),
    ("device_slowdown", (1.0, 0.5), {"devices": 2}),
    ("aggregation_every", -1, {}),
    ("aggregation_every", 1.5, {}),
    ("aggregation_every", True, {}),
    ("learning_rate", -0.1, {}),
    ("learning_rate", 0.0, {}),
    ("learning_rate", math.nan, {}),
    ("learning_rate", math.inf, {}),
    ("learning_rate", True, {}),
    ("learning_rate", "0.1", {}),
    ("momentum", -0.5, {}),
    ("momentum", math.nan, {}),
    ("momentum", "high", {}),
    ("dirichlet_alpha", -1.0, {}),
    ("dirichlet_alpha", 0.0, {}),
    ("dirichlet_alpha", math.inf, {}),
    ("data_partition", "nope", {}),
    ("data_partition", None, {}),
    ("partition", "dirichlet", {}),  # the data partition's old key: the error says so
    ("partition", "nope", {}),
    ("partition", [3, 2], {"mode": "pipeline", "devices": 3}),
    ("partition", [2, 3], {"mode": "pipeline", "devices": 2}),  # one cut per two stages
    ("partition", [0], {"mode": "pipeline", "devices": 2}),
    ("partition", [2], {}),  # pipar splits at split_point
    ("partition", [2], {"mode": "asteroid", "devices": 3}),  # with "auto" stage groups
    ("stage_groups", [[0, 1], [2]], {}),  # for mode asteroid only
    ("stage_groups", [[0, 1], [1]], {"mode": "asteroid", "devices": 2, "partition": [2]}),
    ("stage_groups", [[0], [5]], {"mode": "asteroid", "devices": 2, "partition": [2]}),
    ("partition", [2], {"mode": "asteroid", "devices": 2, "stage_groups": [[0, 1]]}),
    ("stage_groups", [[], [0, 1]], {"mode": "asteroid", "devices": 2, "partition": [2]}),
    ("stage_groups", "0,1/2", {"mode": "asteroid", "devices": 3}),
    ("rescheduling", "quick", {"mode": "asteroid", "devices": 2}),
    ("rescheduling", "heavy", {}),  # for mode asteroid only
    ("planner", "dapple", {"mode": "asteroid", "devices": 2}),
    ("planner", "equal-groups", {}),  # for mode asteroid only
    ("schedule", "2f2b", {"mode": "pipeline", "devices": 2}),
    ("aggregation_every", 2, {"mode": "pipeline", "devices": 2}),  # it aggregates nothing
    ("schedule", "gpipe", {}),
    ("seed", "0", {}),
    ("seed", 1.0, {}),
    ("seed", True, {}),
    ("out_dir", 3, {}),
    ("out_dir", None, {}),
    ("warmup_epochs", 2, {}),  # for mode hadfl only
    ("warmup_epochs", -1, {"mode": "hadfl"}),
    ("warmup_epochs", 0, {"mode": "hadfl"}),  # "capacity" steps need the negotiation
    ("warmup_learning_rate", 0.0, {"mode": "hadfl"}),
    ("warmup_learning_rate", 0.1, {}),
    ("local_steps", "fast", {"mode": "hadfl"}),
    ("local_steps", 0, {"mode": "hadfl"}),
    ("local_steps", 5, {}),
    ("sync_periods", 0, {"mode": "hadfl"}),
    ("ring_size", 3, {"mode": "hadfl", "devices": 2}),
    ("ring_size", 2, {}),
    ("version_smoothing", 1.0, {"mode": "hadfl"}),
    ("version_smoothing", math.nan, {"mode": "hadfl"}),
    ("ring_timeout", 0, {"mode": "hadfl"}),
    ("aggregation_every", 2, {"mode": "hadfl"}),  # its rounds are its periods
    ("privacy", "gaussian", {}),
    ("privacy", "classic", {"mode": "pipeline", "devices": 2}),
    ("privacy_noise", 0.0, {"privacy": "classic"}),
    ("privacy_noise", math.inf, {}),
    ("dp_noise_multiplier", 0.0, {"privacy": "dp-sgd"}),
    ("dp_noise_multiplier", 2.0, {"mode": "hadfl"}),
    ("dp_max_grad_norm", math.nan, {"privacy": "dp-sgd"}),
    ("dp_delta", 1.0, {}),
    ("dp_delta", 0, {"aggregation": "dp-fedavg"}),
    ("server_lanes", 0, {"mode": "pipar"}),
    ("server_lanes", 1.5, {"mode": "pipar"}),
    ("server_lanes", True, {"mode": "pipar"}),
    ("server_lanes", 2, {"mode": "fl"}),
    ("server_lanes", 2, {"mode": "sl"}),
    ("secure_aggregation", "yes", {}),
    ("secure_aggregation", True, {"mode": "sl"}),
    ("secure_aggregation", True, {"mode": "hadfl"}),
    ("secure_aggregation_clip", 0, {}),
    ("secure_aggregation_clip", math.inf, {}),
    ("local_optimizer", "momentum", {}),
    ("local_optimizer", True, {"mode": "pipar"}),
    ("devices_per_round", 3, {"devices": 2}),
    ("devices_per_round", 1.0, {}),
    ("devices_per_round", "all", {}),
    ("devices_per_round", 1, {"mode": "hadfl"}),
    ("group_size", -1, {"mode": "hadfl"}),
    ("group_size", 2, {}),
    ("inter_group_every", 0, {"mode": "hadfl"}),
    ("inter_group_every", 2, {}),
    ("buffer_size", 0, {"mode": "fedbuff"}),
    ("buffer_size", 2, {}),  # for mode fedbuff only
    ("server_learning_rate", 0.0, {"mode": "fedbuff"}),
    ("server_learning_rate", math.inf, {"mode": "fedbuff"}),
    ("server_learning_rate", 0.5, {}),
    ("staleness", "linear", {"mode": "fedbuff"}),
    ("staleness", "none", {}),
    ("concurrency", -1, {"mode": "fedbuff"}),
    ("concurrency", 99, {"mode": "fedbuff"}),
    ("concurrency", True, {"mode": "fedbuff"}),
    ("concurrency", 1, {}),  # for mode fedbuff only
    ("candidates", ["hadfl"], {"mode": "auto"}),
    ("candidates", [], {"mode": "auto"}),
    ("candidates", "fl", {"mode": "auto"}),
    ("candidates", ["fl"], {}),  # for mode auto only
    ("rechoose", "yes", {"mode": "auto"}),
    ("rechoose", False, {}),  # for mode auto only
    ("local_steps", 0, {"mode": "fedbuff"}),
    ("local_steps", "capacity", {"mode": "fedbuff"}),
    ("aggregation_every", 2, {"mode": "fedbuff"}),  # it updates every K arrivals
    ("devices_per_round", 1, {"mode": "fedbuff"}),  # every device trains all the time
    ("options", {"bogus": 1}, {}),  # a built-in system declares no option of its own
    ("options", "x", {}),
]


@pytest.mark.parametrize(
    ("key", "value", "others"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES]
)
def test_invalid_value_raises_config_error_naming_the_key(
    key: str, value: Any, others: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        _config(**others, **{key: value})
    with pytest.raises(ConfigError, match=f"'{key}'"):
        RunConfig.from_mapping(_nested(
            {**others, key: list(value) if isinstance(value, tuple) else value}))


def test_every_field_is_covered_by_the_bad_values_table() -> None:
    fields = {f.name for f in dataclasses.fields(RunConfig)} | set(option_owners())
    assert fields == {key for key, _, _ in BAD_VALUES}


GOOD_VALUES: list[tuple[str, Any, dict[str, Any]]] = [
    ("mode", "fl", {}),
    ("mode", "sl", {}),
    ("mode", "sfl", {}),
    ("mode", "hadfl", {}),
    ("local_steps", 1, {"mode": "hadfl", "warmup_epochs": 0, "ring_size": 2}),
    ("split_point", "auto", {}),
    ("parallel_batches", "auto", {}),
    ("parallel_batches", 10, {"batch_size": 10}),
    ("network", "4g", {}),
    ("network", ("4g", {"up_mbps": 1, "down_mbps": 2}), {}),
    ("samples_per_device", (10, 20), {}),
    ("test_samples", 0, {}),
    ("model", "mylab:net", {}),
    ("loss", "mylab.losses:smooth", {}),
    ("loss", "mse", {}),
    ("metric", "none", {}),
    ("metric", "mylab.metrics:within", {}),
    ("optimizer", "mylab:adam", {}),
    ("profile_devices", False, {}),
    ("aggregation", "krum", {"devices": 4}),
    ("aggregation", "trimmed-mean", {"devices": 5}),  # floor(0.2 x 5) = 1 at each end
    ("trim_fraction", 0.25, {"aggregation": "trimmed-mean", "devices": 4}),
    ("scale_limit", 50, {}),
    ("outliers", "drop", {}),
    ("outlier_limit", 3, {}),
    ("mode", "ftpipehd", {"devices": 3}),
    ("stage_groups", ((0, 1), (2,)), {"mode": "asteroid", "devices": 3, "partition": [2]}),
    ("stage_groups", ((2, 0, 1),), {"mode": "asteroid", "devices": 3, "partition": []}),
    ("rescheduling", "heavy", {"mode": "asteroid", "devices": 2}),
    ("planner", "equal-groups", {"mode": "asteroid", "devices": 2}),
    ("version_aggregation", 0, {"mode": "ftpipehd", "devices": 2}),
    ("version_aggregation", 4, {"mode": "ftpipehd", "devices": 2}),
    ("global_replication_every", 0, {"mode": "ftpipehd", "devices": 2}),
    ("global_replication_every", 7, {"mode": "ftpipehd", "devices": 2}),
    ("chain_replication_every", 0, {"mode": "ftpipehd", "devices": 2}),
    ("chain_replication_every", 4, {"mode": "asteroid", "devices": 2}),
    ("first_repartition_after", 0, {"mode": "ftpipehd", "devices": 2}),
    ("network", {"up_mbps": 10, "down_mbps": 25, "latency_ms": 20}, {}),
    ("device_slowdown", 1, {}),
    ("aggregation_every", 0, {}),
    ("momentum", 0, {}),
    ("data_partition", "dirichlet", {}),
    ("mode", "pipeline", {"devices": 3}),
    ("partition", (2,), {"mode": "pipeline", "devices": 2}),
    ("partition", (1, 3, 4), {"mode": "pipeline", "devices": 4}),
    *[("schedule", name, {"mode": "pipeline", "devices": 2}) for name in SCHEDULES],
    ("seed", -7, {}),
    ("out_dir", "", {}),
]


@pytest.mark.parametrize(
    ("key", "value", "others"), GOOD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in GOOD_VALUES]
)
def test_valid_values_are_accepted(key: str, value: Any, others: dict[str, Any]) -> None:
    config = _config(**others, **{key: value})
    assert _value(config, key) == value


def test_a_pipeline_takes_one_cut_point_as_an_int_and_names_the_data_partition_rename(
) -> None:
    assert RunConfig(mode="pipeline", devices=2, options={"partition": 3}).options.partition == (3,)
    with pytest.raises(ConfigError, match="now data_partition"):
        RunConfig(options={"partition": "iid"})
    with pytest.raises(ConfigError, match="one integer for a pipeline"):
        RunConfig(mode="pipeline", devices=2, parallel_batches=(2, 2))
    with pytest.raises(ConfigError, match="at least 2"):
        RunConfig(mode="pipeline", devices=1)


def test_numbers_are_normalized() -> None:
    # Lists (as TOML gives them) are accepted at run time and stored as tuples.
    slowdown: Any = [1, 3]
    config = RunConfig(devices=2, device_slowdown=slowdown, learning_rate=1, momentum=0)
    assert config.device_slowdown == (1.0, 3.0)
    assert isinstance(config.learning_rate, float)
    assert isinstance(config.momentum, float)
    assert RunConfig(device_slowdown=2).device_slowdown == 2.0
    split: Any = [1, 3]
    assert RunConfig(devices=2, split_point=split).split_point == (1, 3)


def test_custom_model_is_accepted_and_written_as_custom() -> None:
    from torch import nn

    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    config = RunConfig(model=model)
    assert config.model is model
    assert config.to_mapping()["model"] == "custom"


# -- per-device views ------------------------------------------------------------------


def test_per_device_accessors_with_one_value() -> None:
    config = RunConfig(devices=3, split_point=2, parallel_batches=5, device_slowdown=1.5)
    for k in range(3):
        assert config.device_split_point(k) == 2
        assert config.device_parallel_batches(k) == 5
        assert config.device_slowdown_of(k) == 1.5


def test_per_device_accessors_with_lists() -> None:
    config = RunConfig(
        devices=3,
        split_point=(1, 2, 3),
        parallel_batches=(4, 2, 1),
        device_slowdown=(1.0, 2.0, 4.0),
    )
    assert [config.device_split_point(k) for k in range(3)] == [1, 2, 3]
    assert [config.device_parallel_batches(k) for k in range(3)] == [4, 2, 1]
    assert [config.device_slowdown_of(k) for k in range(3)] == [1.0, 2.0, 4.0]


def test_per_device_accessors_with_auto() -> None:
    config = RunConfig(split_point="auto", parallel_batches="auto")
    assert config.device_split_point(1) == "auto"
    assert config.device_parallel_batches(0) == "auto"


def test_replace_validates_again() -> None:
    config = RunConfig(devices=2, split_point=(1, 2))
    assert config.replace(epochs=7).epochs == 7
    with pytest.raises(ConfigError, match="'devices'"):
        config.replace(devices=0)
    with pytest.raises(ConfigError, match="'split_point'"):
        config.replace(devices=3)  # the list no longer has one value per device


# -- TOML ------------------------------------------------------------------------------


def _everything_changed() -> RunConfig:
    return RunConfig(
        mode="sfl",
        model="resnet18",
        dataset='cifar10:C:\\data\\cifar "10"',
        devices=3,
        samples_per_device=123,
        batch_size=40,
        epochs=2,
        split_point=(1, 2, 3),
        parallel_batches=(4, 8, 1),
        network={"up_mbps": 12.5, "down_mbps": 30, "latency_ms": 7.25},
        device_slowdown=(1.0, 2.5, 1e3),
        aggregation_every=5,
        learning_rate=1e-05,
        momentum=0.0,
        data_partition="dirichlet",
        dirichlet_alpha=0.1,
        test_samples=77,
        seed=-42,
        out_dir="runs/odd name\twith\ttabs\nand a newline",
        torch_threads=2,
    )


@pytest.mark.parametrize("config", [RunConfig(), _everything_changed()], ids=["default", "all"])
def test_to_toml_from_toml_round_trip(tmp_path: Path, config: RunConfig) -> None:
    mapping = config.to_mapping()
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml(), encoding="utf-8")
    assert tomllib.loads(path.read_text(encoding="utf-8")) == mapping
    again = RunConfig.from_toml(path)
    assert again == config
    assert again.to_mapping() == mapping


text_without_surrogates = st.text(st.characters(codec="utf-8"), max_size=20)
positive = st.floats(min_value=1e-9, max_value=1e9, allow_nan=False, allow_infinity=False)


@st.composite
def configs(draw: st.DrawFn) -> RunConfig:
    devices = draw(st.integers(1, 4))
    batch_size = draw(st.integers(1, 256))
    per_device = st.integers(1, 8)
    network = draw(
        st.sampled_from(["4g", "4g+", "wifi", "lan"])
        | st.fixed_dictionaries(
            {"up_mbps": positive, "down_mbps": positive},
            optional={"latency_ms": st.floats(0, 1e4, allow_nan=False)},
        )
    )
    mode = draw(st.sampled_from([m for m in MODES if not system_class(m).links_devices]))
    return RunConfig(
        mode=mode,
        model=draw(text_without_surrogates.filter(lambda t: bool(t) and ":" not in t)
                   | st.sampled_from(["mylab:net", "pkg.nets:small_cnn"])),
        dataset=draw(text_without_surrogates.filter(bool)),
        devices=devices,
        samples_per_device=draw(st.integers(1, 10**6)),
        batch_size=batch_size,
        epochs=draw(st.integers(1, 100)),
        split_point=draw(st.just("auto") | per_device | st.tuples(*[per_device] * devices)),
        parallel_batches=draw(
            st.just("auto")
            | st.integers(1, batch_size)
            | st.tuples(*[st.integers(1, batch_size)] * devices)
        ),
        network=network,
        device_slowdown=draw(st.floats(1, 1e6) | st.tuples(*[st.floats(1, 1e6)] * devices)),
        # (fedbuff updates every buffer_size arrivals: it refuses aggregation_every)
        aggregation_every=0 if mode == "fedbuff" else draw(st.integers(0, 1000)),
        learning_rate=draw(positive),
        momentum=draw(st.floats(0, 1)),
        data_partition=draw(st.sampled_from(DATA_PARTITIONS)),
        dirichlet_alpha=draw(positive),
        test_samples=draw(st.integers(1, 10**5)),
        seed=draw(st.integers(-(2**63), 2**63 - 1)),
        out_dir=draw(text_without_surrogates),
        torch_threads=draw(st.integers(1, 64)),
    )


@pytest.mark.slow  # (hypothesis: 150 configs, ~5 s)
@settings(max_examples=150, deadline=None)
@given(configs())
def test_any_valid_config_round_trips_through_toml(config: RunConfig) -> None:
    mapping = config.to_mapping()
    assert tomllib.loads(config.to_toml()) == mapping
    assert RunConfig.from_mapping(tomllib.loads(config.to_toml())) == config


def test_from_toml_reads_a_run_table(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[run]\nmode = "sl"\ndevices = 3\nsplit_point = [1, 2, 3]\n')
    config = RunConfig.from_toml(path)
    assert config == RunConfig(mode="sl", devices=3, split_point=(1, 2, 3))


def test_from_toml_reads_a_network_table(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("devices = 1\n[network]\nup_mbps = 10\ndown_mbps = 25\n")
    assert RunConfig.from_toml(path).network == {"up_mbps": 10, "down_mbps": 25}


def test_from_toml_applies_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('mode = "fl"\nepochs = 9\n')
    config = RunConfig.from_toml(path, epochs=2, devices=None, seed=5)
    assert (config.mode, config.epochs, config.devices, config.seed) == ("fl", 2, 2, 5)
    with pytest.raises(ConfigError, match="'epochs'"):
        RunConfig.from_toml(path, epochs=0)
    with pytest.raises(ConfigError, match="'bogus'"):
        RunConfig.from_toml(path, bogus=1)


@pytest.mark.parametrize("table", ["", "[run]\n"])
def test_unknown_key_is_named(tmp_path: Path, table: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f'{table}mode = "pipar"\nsplit_pont = 2\n')
    with pytest.raises(ConfigError, match="'split_pont'"):
        RunConfig.from_toml(path)
    with pytest.raises(ConfigError, match="'zzz'"):
        RunConfig.from_mapping({"zzz": 1})


def test_invalid_value_in_a_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("devices = 0\n")
    with pytest.raises(ConfigError, match="'devices'"):
        RunConfig.from_toml(path)


def test_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=r"absent\.toml"):
        RunConfig.from_toml(path)
    with pytest.raises(ConfigError, match="cannot read"):
        RunConfig.from_toml(tmp_path)  # a directory


@pytest.mark.parametrize("text", ["mode = \n", "mode = 'pipar\n", "[run\n", "a = 1\na = 2\n"])
def test_invalid_toml_is_named(tmp_path: Path, text: str) -> None:
    path = tmp_path / "broken.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"broken\.toml.*not valid TOML"):
        RunConfig.from_toml(path)


def test_errors_are_one_line() -> None:
    for key, value, others in BAD_VALUES:
        with pytest.raises(ConfigError) as info:
            _config(**others, **{key: value})
        assert "\n" not in str(info.value), (key, value)


@pytest.mark.parametrize("network", ["nope", {"up_mbps": None, "down_mbps": 10},
                                     {"up_mbps": 10}, {"up_mbps": -1, "down_mbps": 10}])
def test_bad_networks_are_refused_when_the_config_is_made(network: object) -> None:
    with pytest.raises(ConfigError, match="'network'"):
        RunConfig(network=network)  # type: ignore[arg-type]


def test_a_file_cannot_mix_top_level_keys_and_a_run_table(tmp_path: Path) -> None:
    path = tmp_path / "mixed.toml"
    path.write_text('epochs = 9\n[run]\nmode = "sl"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="not both"):
        RunConfig.from_toml(path)


def test_asteroids_stage_groups_round_trip_through_toml(tmp_path: Path) -> None:
    config = RunConfig(mode="asteroid", devices=3,
                       parallel_batches=2,
                       options={"partition": [2], "stage_groups": [[0, 1], [2]]})
    path = tmp_path / "run.toml"
    path.write_text(config.to_toml())
    assert RunConfig.from_toml(path) == config


def test_a_trimmed_mean_that_would_trim_nothing_says_how_many_devices_it_needs() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig(devices=4, options={"aggregation": "trimmed-mean"})
    assert str(info.value) == (
        "config key 'trim_fraction': got 0.2, expected at least 5 devices a round to trim "
        "any (floor(0.2 x 4) = 0: nothing would be trimmed), or trim_fraction >= 0.25")
