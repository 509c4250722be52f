"""Ctrl-C (SIGINT) or SIGTERM of a server process mid-run is orderly: the devices are told
the server was interrupted and exit with that one line, the finished epochs' metrics
are written, and no process prints a traceback. SIGINT works even when the server
inherited it ignored (a shell's background job: this suite started with ``&``)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from real_processes import ProcessFleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = {"mode": "pipar", "devices": 2, "samples_per_device": 100, "batch_size": 20,
       "epochs": 50, "parallel_batches": 2, "test_samples": 100}


@pytest.mark.parametrize(("stop", "code", "said"), [(signal.SIGINT, 130, "interrupted"),
                                                    (signal.SIGTERM, 143, "terminated")])
async def test_stopping_the_server_tells_the_devices_and_keeps_finished_epochs(
        tmp_path: Path, stop: signal.Signals, code: int, said: str) -> None:
    async with ProcessFleet(tmp_path, RUN) as fleet:
        server = await fleet.start_server()
        devices = [await fleet.start_device(k) for k in range(2)]
        await server.output.wait_for(r"^\s+2\s", within=120)  # the second epoch's row
        server.send_signal(stop)
        assert await server.wait(60) == code, fleet.all_output()
        codes = [await device.wait(60) for device in devices]
    everything = fleet.all_output()
    assert codes == [1, 1], everything
    for device in devices:
        assert "the server was interrupted" in device.output.text(), everything
    assert "Traceback" not in everything
    assert "never retrieved" not in everything
    assert said in server.output.text()
    assert len(fleet.metrics()) >= 2
