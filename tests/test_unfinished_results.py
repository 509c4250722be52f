"""A run that fails keeps what it finished (issue 41; [Note: results on every ending] in
aiopipe/metrics/results.py): ``metrics.jsonl`` of the finished epochs, the model as the
last of them left it, and ``unfinished.txt`` saying why, in virtual time here; between
real processes (the server and the launcher, whose device processes are killed after an
epoch): tests/test_unfinished_processes.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.metrics.results import UNFINISHED_NAME, EpochMetrics

CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=80, batch_size=20, epochs=4,
                   split_point=2, parallel_batches=2, test_samples=40, seed=5)


class Boom(RuntimeError):
    """What the failing run raises."""


def _fail_in_epoch(n: int) -> Callable[[EpochMetrics], None]:
    """A progress callback that fails the run once epoch ``n`` (counted from 1) ended."""

    def progress(m: EpochMetrics) -> None:
        if m.epoch == n:
            raise Boom(f"the operator's dashboard crashed after epoch {n}")

    return progress


@pytest.mark.slow
async def test_a_simulation_that_fails_keeps_its_finished_epochs_and_model(
        tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    with pytest.raises(Boom):
        await simulate(CONFIG.replace(out_dir=str(out_dir)), clock=VirtualClock(),
                       progress=_fail_in_epoch(2))
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2]
    reason = (out_dir / UNFINISHED_NAME).read_text()
    assert reason.startswith("training failed: the operator's dashboard crashed after epoch 2")
    # the model is the one two finished epochs make
    two = await simulate(CONFIG.replace(epochs=2), clock=VirtualClock())
    kept = load_file(out_dir / "model.safetensors")
    want = two.model.state_dict()
    assert kept.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(kept[key], value, rtol=0, atol=0)
    assert (out_dir / "config.toml").exists()

