"""One numbering for people (issue 42, item 5): epochs and rounds count from 1 wherever a
person or their code reads them: `EpochMetrics.epoch`, the table, ``metrics.jsonl`` (and
its round trip through a checkpoint), the log, ``/status``, and the testing kit's
``lost=``, `Fleet.at_iteration` and `Fleet.activations_in` (the records of what a system
changed: tests/runtime/test_runtime_pipeline_faults.py). The runtime's own indices
(loops, wire messages, traces) stay 0-based; the coordinator converts once."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.cli import epoch_row
from aiopipe.errors import ConfigError
from aiopipe.runtime.coordinator import _epoch_from
from aiopipe.testing import assert_exact_accounting, open_fleet, uniform_costs

#: 2 devices x 40 samples, B = 10: 4 iterations an epoch, 2 rounds of 2; 2 epochs.
CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=40, batch_size=10, epochs=2,
                   split_point=2, parallel_batches=2, aggregation_every=2, test_samples=20,
                   network="4g")

EPOCH_IN_LOG = re.compile(r"\bepoch (\d+)")


@pytest.mark.slow
async def test_a_simulation_numbers_its_epochs_from_1_everywhere(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out_dir = tmp_path / "run"
    caplog.set_level(logging.INFO, logger="aiopipe")
    result = await simulate(CONFIG.replace(out_dir=str(out_dir)), clock=VirtualClock(),
                            cost_table=uniform_costs(CONFIG))
    # the Python object a user's code reads: printed as it is
    assert [m.epoch for m in result.epochs] == [1, 2]
    assert result.final.epoch == CONFIG.epochs
    # the table and metrics.jsonl say the same
    assert [epoch_row(m).split()[0] for m in result.epochs] == ["1", "2"]
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2]
    # a checkpoint's (and --resume's) copy of a finished epoch reads back as it was
    assert [_epoch_from(json.loads(line)).epoch for line in lines] == [1, 2]
    # the log names the epochs 1 and 2, never 0 (nor 3)
    named = [int(n) for record in caplog.records
             for n in EPOCH_IN_LOG.findall(record.getMessage())]
    assert named
    assert set(named) == {1, 2}, named


@pytest.mark.slow  # (the fast subset's slowest: the full suite runs it)
async def test_the_kit_and_the_log_number_a_lost_round_alike(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiopipe")
    async with open_fleet(CONFIG) as fleet:
        training = fleet.train()
        await fleet.at_iteration(1, 1, epoch=1)  # device 1's first iteration of the run
        assert fleet.activations_in(1, 1) > 0  # in the run's round 1
        status = fleet.node.describe()  # what GET /status answers
        assert (status["epoch"], status["round"]) == (1, 1)
        fleet.kill(1)
        fleet.start_device(1)
        result = await training
    first, second = result.epochs
    assert first.device_samples == (40, 20)  # its round 1 of epoch 1 counted nothing
    assert second.device_samples == (40, 40)
    assert "round 1 goes on without device 1" in caplog.text
    assert_exact_accounting(result, lost={1: [(1, 1)]})  # (epoch 1, round 1)
    # the old 0-based numbering names a round the run has not: said, not misread
    with pytest.raises(ConfigError, match="round 0 of epoch 0"):
        assert_exact_accounting(result, lost={1: [(0, 0)]})
    # and a wrong epoch is told apart from the right one
    with pytest.raises(AssertionError, match=r"epoch 2: device 1 counted 40 samples, "
                                             r"expected 20"):
        assert_exact_accounting(result, lost={1: [(2, 1)]})
