"""``GET /metrics`` over real websockets (server and devices in one event loop, as in
tests/runtime/test_runtime_websocket.py): prometheus-client's text, per device, read from
the coordinator at scrape time, each server with its own registry."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aiopipe import Device, RunConfig, RunResult, Server
from aiopipe.auth import mint_token
from aiopipe.metrics.results import EpochMetrics

SECRET = b"test-secret-of-32-bytes-at-least"
#: 2 devices, 4 iterations an epoch, aggregated every 2: 2 rounds an epoch, 2 epochs
CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=80, batch_size=20, epochs=2,
                   split_point=2, parallel_batches=2, test_samples=40, seed=5,
                   aggregation_every=2)
REPO = Path(__file__).resolve().parents[2]

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def _parse(text: str) -> Samples:
    """Sample name -> {sorted labels: value}; each family's TYPE is checked against its
    samples by the parser."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _per_device(samples: Samples, name: str) -> dict[int, float]:
    return {int(dict(labels)["device"]): value for labels, value in samples[name].items()}


def _one(samples: Samples, name: str) -> float:
    (value,) = samples[name].values()
    return value


async def _device(url: str, k: int, *, listen: bool = False) -> None:
    async with Device(url, k, token=mint_token(SECRET, k),
                      listen=("127.0.0.1", 0) if listen else None) as device:
        await device.run()


async def _scrape(server: Server) -> tuple[str, aiohttp.ClientResponse]:
    async with (aiohttp.ClientSession() as http,
                http.get(server.url.removesuffix("/ws") + "/metrics") as response):
        return await response.text(), response


async def _run_and_scrape(config: RunConfig, *, listen: bool = False
                          ) -> tuple[RunResult, Samples, aiohttp.ClientResponse]:
    async with Server(config, token_secret=SECRET, join_timeout=60) as server:
        async with asyncio.TaskGroup() as tasks:
            for k in range(config.devices):
                tasks.create_task(_device(server.url, k, listen=listen))
            result = await server.run()
        text, response = await _scrape(server)
    return result, _parse(text), response


async def test_metrics_describe_each_device_of_a_finished_run() -> None:
    result, m, response = await _run_and_scrape(CONFIG)
    last = result.final
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=")
    assert response.headers.get("Connection", "").lower() == "close"  # force_close kept

    # the series that were there before prometheus-client, under their old names
    assert _one(m, "aiopipe_epochs_finished") == 2
    assert _one(m, "aiopipe_devices_connected") == 0
    assert _one(m, "aiopipe_epoch_seconds") == pytest.approx(last.time_s)
    assert _one(m, "aiopipe_test_accuracy") == pytest.approx(last.accuracy)
    busy = {dict(k)["resource"]: v for k, v in m["aiopipe_busy_seconds"].items()}
    assert busy == pytest.approx(dict(last.busy_s))

    # the run
    assert m["aiopipe_run_info"] == {(("mode", "pipar"),): 1.0}
    assert _one(m, "aiopipe_devices") == 2
    assert _one(m, "aiopipe_devices_joined") == 2
    assert _one(m, "aiopipe_epoch") == 2  # the last of 2, counted from 1
    assert _one(m, "aiopipe_rounds_started_total") == 4
    assert _one(m, "aiopipe_replans_total") == 0
    assert _one(m, "aiopipe_train_loss") == pytest.approx(last.loss)
    assert _one(m, "aiopipe_train_accuracy") == pytest.approx(last.train_accuracy)
    assert _one(m, "aiopipe_epoch_samples") == last.samples == 160
    assert _one(m, "aiopipe_epoch_bytes_up") == last.bytes_up > 0
    assert _one(m, "aiopipe_epoch_bytes_down") == last.bytes_down > 0
    assert _one(m, "aiopipe_epoch_devices_lost") == 0
    assert _one(m, "aiopipe_epoch_updates_refused") == 0
    assert "aiopipe_held_out_accuracy" not in m  # no device holds held-out data: unknown

    # per device
    assert _per_device(m, "aiopipe_device_connected") == {0: 0, 1: 0}
    assert _per_device(m, "aiopipe_device_samples_total") == {0: 160, 1: 160}
    assert _per_device(m, "aiopipe_device_epoch_samples") == {0: 80, 1: 80}
    assert _per_device(m, "aiopipe_device_rounds_total") == {0: 4, 1: 4}
    assert _per_device(m, "aiopipe_device_lost_epochs_total") == {0: 0, 1: 0}
    assert _per_device(m, "aiopipe_device_refused_epochs_total") == {0: 0, 1: 0}
    assert _per_device(m, "aiopipe_device_split_point") == {0: 2, 1: 2}
    assert _per_device(m, "aiopipe_device_parallel_batches") == {0: 2, 1: 2}
    up = _per_device(m, "aiopipe_device_bytes_up_total")
    down = _per_device(m, "aiopipe_device_bytes_down_total")
    assert set(up) == set(down) == {0, 1}
    assert all(v > 0 for v in (*up.values(), *down.values()))
    assert sum(up.values()) >= last.bytes_up  # totals over the run hold the last epoch's
    assert sum(down.values()) >= last.bytes_down
    # the server computes each device's loss (split learning): they weigh up to the epoch's
    loss = _per_device(m, "aiopipe_device_train_loss")
    assert set(loss) == {0, 1}
    assert all(math.isfinite(v) and v > 0 for v in loss.values())
    assert sum(loss[k] * last.device_samples[k] for k in loss) / last.samples == \
        pytest.approx(last.loss)


async def test_a_pipeline_reports_the_loss_of_its_last_stage_only() -> None:
    config = RunConfig(mode="pipeline", devices=3, samples_per_device=32, batch_size=8,
                       epochs=1, parallel_batches=4, test_samples=0, seed=5,
                       options={"partition": [1, 3]})
    result, m, _ = await _run_and_scrape(config, listen=True)
    assert _per_device(m, "aiopipe_device_train_loss") == {
        2: pytest.approx(result.final.loss)}
    assert _per_device(m, "aiopipe_device_samples_total") == {0: 32, 1: 32, 2: 32}
    assert _per_device(m, "aiopipe_device_rounds_total") == {0: 1, 1: 1, 2: 1}
    assert math.isnan(_one(m, "aiopipe_test_accuracy"))  # no test set, as before
    assert "aiopipe_device_split_point" not in m  # a pipeline's plan has units, not P


async def test_before_the_first_epoch_only_what_is_known_is_reported() -> None:
    async with Server(CONFIG, token_secret=SECRET, join_timeout=60) as server:
        text, _ = await _scrape(server)
    m = _parse(text)
    assert _one(m, "aiopipe_epoch") == 0  # none yet
    assert _one(m, "aiopipe_epochs_finished") == 0
    assert _one(m, "aiopipe_devices_joined") == 0
    assert _per_device(m, "aiopipe_device_samples_total") == {0: 0, 1: 0}
    assert _per_device(m, "aiopipe_device_bytes_up_total") == {0: 0, 1: 0}
    assert _per_device(m, "aiopipe_device_connected") == {0: 0, 1: 0}
    for unknown in ("aiopipe_epoch_seconds", "aiopipe_train_loss", "aiopipe_busy_seconds",
                    "aiopipe_device_train_loss", "aiopipe_device_epoch_samples"):
        assert unknown not in m


async def test_each_server_has_its_own_registry_not_the_global_one() -> None:
    from prometheus_client import REGISTRY

    from aiopipe.runtime.prometheus import registry_for

    other = CONFIG.replace(devices=3)
    async with (Server(CONFIG, token_secret=SECRET) as a,
                Server(other, token_secret=SECRET) as b):
        text_a, _ = await _scrape(a)
        text_b, _ = await _scrape(b)
        await _scrape(a)
        assert registry_for(a.node) is registry_for(a.node)
        assert registry_for(a.node) is not registry_for(b.node)
    assert _one(_parse(text_a), "aiopipe_devices") == 2
    assert _one(_parse(text_b), "aiopipe_devices") == 3
    assert not [f for f in REGISTRY.collect() if f.name.startswith("aiopipe")]


@pytest.mark.slow
def test_import_aiopipe_and_its_routes_does_not_load_prometheus_client() -> None:
    code = ("import json, sys\n"
            "import aiopipe, aiopipe.api, aiopipe.runtime.http\n"
            "print(json.dumps([m for m in ('prometheus_client', 'aiopipe.runtime.prometheus')"
            " if m in sys.modules]))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


async def test_lost_and_refused_devices_are_counted_per_finished_epoch() -> None:
    """Finished epochs as the coordinator records them (a run with faults is
    tests/runtime/test_runtime_faults.py's); each counts once per device it names."""
    epoch = EpochMetrics(epoch=1, time_s=1.0, busy_s={}, idle_s={}, loss=2.0, accuracy=0.5,
                         train_accuracy=0.25, samples=120, bytes_up=10, bytes_down=20,
                         plan=[], device_samples=(80, 40), devices_lost=(1,),
                         updates_refused=(0, 1))
    async with Server(CONFIG, token_secret=SECRET) as server:
        server.node.epochs += [epoch, dataclasses.replace(epoch, epoch=2, updates_refused=(1,))]
        # the coordinator keys device_loss by the epoch's 0-based index: 1 is epoch 2
        server.node.device_loss = {1: {0: (160.0, 80), 1: (20.0, 40)}}
        text, _ = await _scrape(server)
    m = _parse(text)
    assert _per_device(m, "aiopipe_device_lost_epochs_total") == {0: 0, 1: 2}
    assert _per_device(m, "aiopipe_device_refused_epochs_total") == {0: 1, 1: 2}
    assert _per_device(m, "aiopipe_device_samples_total") == {0: 160, 1: 80}
    assert _per_device(m, "aiopipe_device_train_loss") == {0: 2.0, 1: 0.5}
    assert _one(m, "aiopipe_epoch_devices_lost") == 1
    assert _one(m, "aiopipe_epoch_updates_refused") == 1
    assert "aiopipe_device_held_out_accuracy" not in m  # no family without a sample


@pytest.mark.slow
async def test_asteroid_reports_the_loss_of_its_last_stages_devices() -> None:
    """The last stage is a group (devices 1 and 2): each reports the loss of its rows."""
    config = RunConfig(mode="asteroid", devices=3, samples_per_device=32, batch_size=8,
                       epochs=1,
                       parallel_batches=2, test_samples=0, seed=5,
                       options={"partition": [2], "stage_groups": [[0], [1, 2]]})
    result, m, _ = await _run_and_scrape(config, listen=True)
    loss = _per_device(m, "aiopipe_device_train_loss")
    assert set(loss) == {1, 2}
    rows = {int(e["device"]): e["rows"][1] - e["rows"][0] for e in result.final.plan}
    assert sum(loss[k] * rows[k] for k in loss) / sum(rows[k] for k in loss) == \
        pytest.approx(result.final.loss)
