"""Secure aggregation (SecAgg+) between real processes: a server and four device
processes over websockets authenticated by per-device tokens, fl with
``secure_aggregation``; the run completes and its model equals plain FedAvg's (the same
run in one process, in virtual time) within the fixed-point bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from real_processes import ProcessFleet

pytest.importorskip("cryptography")

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.auth import mint_token
from aiopipe.secagg import FixedPoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SECRET = "secure-aggregation-test-secret-0123456789"


async def test_four_device_processes_aggregate_securely(tmp_path: Path) -> None:
    run = {"mode": "fl", "model": "vgg5", "devices": 4, "samples_per_device": 40,
           "batch_size": 10, "epochs": 1, "test_samples": 20, "seed": 5,
           "secure_aggregation": True}
    async with ProcessFleet(tmp_path, run) as fleet:
        server = await fleet.start_server("--token-secret", SECRET)
        devices = [await fleet.start_device(k, "--token", mint_token(SECRET.encode(), k))
                   for k in range(4)]
        await fleet.finish(server, devices, within=240)
    assert [e["device_samples"] for e in fleet.metrics()] == [[40] * 4]
    config = RunConfig.from_toml(fleet.config_file)
    assert config.options.secure_aggregation
    plain = await simulate(config.replace(options={"secure_aggregation": False}),
                           clock=VirtualClock())
    from safetensors.torch import load_file

    got = load_file(str(fleet.out_dir / "model.safetensors"))
    # e / W: the sum's error for 4 devices over their summed weight (4: equal samples)
    bound = FixedPoint.for_sum(config.options.secure_aggregation_clip, 4).error_bound / 4
    changed = False
    for key, want in plain.model.state_dict().items():
        slack = bound + want.double().abs() * 2.0**-23
        assert ((got[key].double() - want.double()).abs() <= slack).all(), key
        changed |= not torch.equal(got[key], want)
    assert changed  # the model did come through the fixed-point sum
