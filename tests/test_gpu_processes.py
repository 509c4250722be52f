"""Nodes whose stages compute on a CUDA GPU, between real processes (runs where a GPU is
at hand, skipped elsewhere): PiPar's server halves on the GPU (``--torch-device cuda``),
one device on the GPU and one on the CPU; what they train equals the same run in one
process on the CPU, up to float32's rounding (TF32 turned off: with it, cuDNN's
convolutions round their inputs to 10 bits and the weights drift by a few percent)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from real_processes import ProcessFleet

from aiopipe import RunConfig, VirtualClock, simulate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]


async def test_a_server_and_a_device_on_the_gpu_train_what_the_cpu_trains(
        tmp_path: Path) -> None:
    run = {"mode": "pipar", "model": "vgg5", "devices": 2, "samples_per_device": 120,
           "batch_size": 30, "split_point": 2, "parallel_batches": 3, "epochs": 2,
           "test_samples": 60, "learning_rate": 0.05, "seed": 3}
    exact = {"NVIDIA_TF32_OVERRIDE": "0"}  # cuBLAS and cuDNN: no TF32 rounding
    async with ProcessFleet(tmp_path, run) as fleet:
        server = await fleet.start_server("--torch-device", "cuda", env=exact)
        devices = [await fleet.start_device(0, "--torch-device", "cuda", env=exact),
                   await fleet.start_device(1, "--torch-device", "cpu")]
        await fleet.finish(server, devices, within=240)
    epochs = fleet.metrics()
    assert [e["samples"] for e in epochs] == [240, 240]
    want = await simulate(RunConfig.from_toml(fleet.config_file), clock=VirtualClock())
    from safetensors.torch import load_file

    got = load_file(str(fleet.out_dir / "model.safetensors"))
    # float32 on both sides, summed in other orders: each tensor within 0.1% of its scale
    worst = {key: float((got[key].float() - value.float()).abs().max()
                        / max(float(value.float().abs().max()), 1e-6))
             for key, value in want.model.state_dict().items()}
    print(f"largest deviation, relative to the tensor's scale: {max(worst.values()):.2e}")
    assert max(worst.values()) < 1e-3, worst
