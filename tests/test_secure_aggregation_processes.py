"""Secure aggregation (SecAgg+) between real processes: a server and five device
processes over websockets authenticated by per-device tokens, fl with
``secure_aggregation``; device 4 seals broken shares for a neighbour. The neighbour
masks without it and blames it ([Note: secagg blame]), the server leaves it out of
every round, the honest four lose nothing, and the model is what the same run gives in
one process (in virtual time). (That a secure run's model is plain FedAvg's within the
fixed-point bound: tests/runtime/test_runtime_secure_aggregation.py.)"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from real_processes import ProcessFleet

pytest.importorskip("cryptography")

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.auth import mint_token
from aiopipe.secagg import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SECRET = "secure-aggregation-test-secret-0123456789"
BAD = 4

#: ``python -m tampering_device ARGS``: ``python -m aiopipe.device ARGS`` whose sealed
#: shares for its lowest neighbour have a byte flipped
TAMPERING_DEVICE = '''
import runpy

from aiopipe.secagg import client

honest = client.Client.share


def share(self, advertised):
    sealed = honest(self, advertised)
    victim = min(sealed)
    sealed[victim] = sealed[victim][:-1] + bytes([sealed[victim][-1] ^ 1])
    return sealed


client.Client.share = share
runpy.run_module("aiopipe.device", run_name="__main__")
'''


def _tampering_share(bad: int) -> Any:
    """`Client.share` as TAMPERING_DEVICE's, for client ``bad`` only (one process)."""
    honest = Client.share

    def share(self: Client, advertised: Mapping[int, Any]) -> dict[int, bytes]:
        sealed = honest(self, advertised)
        if self.id == bad:
            victim = min(sealed)
            sealed[victim] = sealed[victim][:-1] + bytes([sealed[victim][-1] ^ 1])
        return sealed

    return share


async def test_a_device_process_sealing_broken_shares_is_left_out_and_costs_no_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = {"mode": "fl", "model": "vgg5", "devices": 5, "samples_per_device": 40,
           "batch_size": 10, "epochs": 2, "test_samples": 20, "seed": 5,
           "secure_aggregation": True}
    (tmp_path / "tampering_device.py").write_text(TAMPERING_DEVICE)
    async with ProcessFleet(tmp_path, run) as fleet:
        server = await fleet.start_server("--token-secret", SECRET)
        devices = [await fleet.start_device(k, "--token", mint_token(SECRET.encode(), k))
                   for k in range(BAD)]
        devices.append(await fleet.start(f"device{BAD}", [
            "tampering_device", "--server", fleet.url, "--device-id", str(BAD),
            "--token", mint_token(SECRET.encode(), BAD)], env={"PYTHONPATH": str(tmp_path)}))
        await fleet.finish(server, devices, within=240)
    assert [e["device_samples"] for e in fleet.metrics()] == [[40] * 4 + [0]] * 2
    log = server.output.text()
    assert log.count(f"device {BAD} is left out, its shares did not open for devices [0]") == 2
    assert "do not open; masked without them" in devices[0].output.text()
    config = RunConfig.from_toml(fleet.config_file)
    monkeypatch.setattr(Client, "share", _tampering_share(BAD))
    alike = await simulate(config, clock=VirtualClock())
    assert [e.device_samples for e in alike.epochs] == [(40, 40, 40, 40, 0)] * 2
    from safetensors.torch import load_file

    got = load_file(str(fleet.out_dir / "model.safetensors"))
    for key, want in alike.model.state_dict().items():
        assert torch.allclose(got[key].double(), want.double(), rtol=0, atol=1e-6), key
