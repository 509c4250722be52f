"""Devices on data of their own, between real processes: each device process reads its own
directory of MNIST files, the server process opens no training data at all (an audit
hook records every file it opens), FedAvg weights follow what the devices announced; a
user's ``module:function`` dataset and model factory work from the command lines, and a
device that built another model is refused with one line."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from real_processes import REPO, ProcessFleet

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.data import open_device_data

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: Installed in the server process only: every file it opens goes to $AIOPIPE_OPENED.
AUDIT = '''
import os, sys
_log = os.environ.get("AIOPIPE_OPENED")
if _log:
    _out = open(_log, "a")
    def _hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            _out.write(os.fsdecode(args[0]) + "\\n")
            _out.flush()
    sys.addaudithook(_hook)
'''


def _write_mnist(directory: Path, prefix: str, count: int, seed: int) -> None:
    """``count`` 28x28 digits whose brightness tells their label, as MNIST idx files."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, count).astype(np.uint8)
    images = rng.integers(0, 120, (count, 28, 28)).astype(np.uint8)
    images[:, 8:20, 8:20] += (labels * 12).astype(np.uint8)[:, None, None]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{prefix}-images-idx3-ubyte").write_bytes(
        struct.pack(">IIII", 0x803, count, 28, 28) + images.tobytes())
    (directory / f"{prefix}-labels-idx1-ubyte").write_bytes(
        struct.pack(">II", 0x801, count) + labels.tobytes())


async def test_devices_train_on_their_own_files_and_the_server_opens_none(
        tmp_path: Path) -> None:
    devices = [tmp_path / "device-data-0", tmp_path / "device-data-1"]
    _write_mnist(devices[0], "train", 200, seed=1)  # 180 to train on (10% val)
    _write_mnist(devices[1], "train", 400, seed=2)  # 360
    evaluation = tmp_path / "server-test"
    _write_mnist(evaluation, "t10k", 60, seed=3)  # the server's test set: no training data
    audit = tmp_path / "audit"
    audit.mkdir()
    (audit / "sitecustomize.py").write_text(AUDIT)
    opened = tmp_path / "server-opened.txt"
    run = {"mode": "pipar", "model": "vgg5", "dataset": f"mnist:{evaluation}", "devices": 2,
           "batch_size": 30, "split_point": 2, "parallel_batches": 3, "epochs": 2,
           "test_samples": 60, "learning_rate": 0.05, "seed": 3}
    work = tmp_path / "work"
    work.mkdir()
    async with ProcessFleet(work, run) as fleet:
        server = await fleet.start_server(env={"PYTHONPATH": str(audit),
                                               "AIOPIPE_OPENED": str(opened)})
        processes = [await fleet.start_device(k, "--data", f"mnist:{devices[k]}")
                     for k in range(2)]
        await fleet.finish(server, processes, within=240)
    epochs = fleet.metrics()
    assert [e["device_samples"] for e in epochs] == [[180, 360]] * 2
    files = opened.read_text().splitlines()
    assert files, "the audit hook recorded nothing"
    assert not [f for f in files if "device-data" in f or "train-" in f], files
    # what the processes trained equals the same run in one process, in virtual time
    own = [open_device_data(f"mnist:{d}") for d in devices]
    config = RunConfig.from_toml(fleet.config_file)
    want = await simulate(config, clock=VirtualClock(), datasets=own)
    from safetensors.torch import load_file

    got = load_file(str(fleet.out_dir / "model.safetensors"))
    for key, value in want.model.state_dict().items():
        assert torch.allclose(got[key], value, rtol=1e-5, atol=1e-6), key


MYLAB = REPO / "examples" / "mylab.py"


async def test_the_examples_own_data_and_model_from_the_command_lines(tmp_path: Path) -> None:
    """examples/mylab.py as its docstring runs it: the server on the lab's model and
    test split, each device on its own draw of records, unequal in size. First, a device
    whose copy of mylab.py is another version (a wider net) is refused at once with one
    line that says why, and the server says so too; the run then goes on with the
    right ones."""
    (tmp_path / "mylab.py").write_text(MYLAB.read_text())
    other = tmp_path / "device-side"
    other.mkdir()
    (other / "mylab.py").write_text(MYLAB.read_text().replace("width: int = 32",
                                                              "width: int = 48"))
    run = {"mode": "pipar", "model": "mylab:net", "dataset": "mylab:data", "devices": 2,
           "batch_size": 16, "split_point": 1, "parallel_batches": 2, "epochs": 3,
           "test_samples": 200, "learning_rate": 0.05}
    async with ProcessFleet(tmp_path, run) as fleet:
        server = await fleet.start_server()
        stranger = await fleet.start_device(0, "--data", "mylab:data", cwd=other)
        second = await fleet.start_device(1, "--data", "mylab:data", "--seed", "2",
                                          "--held-out", "mylab:data")
        code = await stranger.wait(120)
        text = stranger.output.text()
        assert code == 1, fleet.all_output()
        assert "Traceback" not in text, text
        (line,) = [li for li in text.splitlines() if "refused" in li]
        assert line.startswith("python -m aiopipe.device [device 0]: failed: server refused "
                               "device 0: device 0 built another model than the server"), line
        await server.output.wait_for("refused device 0: device 0 built another model",
                                     within=30)
        processes = [await fleet.start_device(0, "--data", "mylab:data", "--seed", "1",
                                              "--samples", "200"), second]
        await fleet.finish(server, processes, within=180)
    epochs = fleet.metrics()
    assert [e["device_samples"] for e in epochs] == [[192, 400]] * 3  # whole batches of 16
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    assert epochs[-1]["accuracy"] > 0.6  # three conditions: chance is 1/3
    # device 1 evaluated every epoch's model on its own test split; device 0 has none
    assert [list(e["device_accuracy"]) for e in epochs] == [["1"]] * 3
    assert epochs[-1]["held_out_accuracy"] == epochs[-1]["device_accuracy"]["1"] > 0.6
    config = (fleet.out_dir / "config.toml").read_text()
    assert 'model = "mylab:net"' in config
    assert 'dataset = "mylab:data"' in config
