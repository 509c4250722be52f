"""What the coordinator derives from the config before any device joins: the run's kind
of data and its evaluation set ([Note: the devices' data] in coordinator.py), whether
the cost tables given fit the model, the largest frame a connection may carry until
the run is planned, and the scales its stages judge what devices send by.

Functions of the config and the model, kept apart from the coordinator's connections
and rounds.
"""

from __future__ import annotations

import copy

import torch

from aiopipe import data as datasets
from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError
from aiopipe.metrics.trace import MAX_REPORT_SLICES, REPORT_SLICE_BYTES
from aiopipe.models.crossing import crossing_bytes
from aiopipe.protocol import HEADER_SLACK_BYTES
from aiopipe.runtime.factories import make_loss
from aiopipe.runtime.judge import cut_scales
from aiopipe.runtime.plan import unit_crossings
from aiopipe.scheduler.costs import CostTable

__all__ = ["check_tables", "cut_priors", "evaluation_data", "frame_cap"]


def evaluation_data(config: RunConfig) -> tuple[datasets.DataKind, datasets.Dataset | None]:
    """The run's kind of data, and the coordinator's evaluation set (the test split of
    ``config.dataset``, ``test_samples`` of it; None when 0).

    Raises:
        ConfigError: the dataset is unknown or unreadable.
    """
    known = datasets.data_format(config.dataset)
    test_set = None
    if config.test_samples or known is None:  # an entry point: only its data can tell
        test_set = datasets.open_device_data(config.dataset, split="test", seed=config.seed,
                                             size=config.test_samples or None)
    if known is None:
        assert test_set is not None
        known = datasets.kind_of(test_set)
    return known, test_set if config.test_samples else None


def frame_cap(config: RunConfig, model: torch.nn.Sequential, data: datasets.DataKind
              ) -> int:
    """The largest frame a device's connection may carry before the run is planned:
    the whole model's state, an activation of the whole batch, a round's action list and
    the largest round report a device sends (`MAX_REPORT_SLICES`)."""
    state = model.state_dict()
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    batch = config.batch_size
    widest = max(crossing_bytes(c) for c in (data.inputs, *unit_crossings(model, data.inputs)))
    activation = batch * (widest + crossing_bytes((data.target,)))
    actions = 16 * (6 * batch + 2)
    return int(max(state_bytes, activation) + HEADER_SLACK_BYTES + 256 * len(state) + actions
               + REPORT_SLICE_BYTES * MAX_REPORT_SLICES)


def check_tables(units: int, **tables: CostTable | None) -> None:
    """Each given cost table is the model's: one row per split unit.

    Raises:
        ConfigError: one is not (naming it), or a server table comes without devices'.
    """
    if tables.get("server_cost_table") is not None and tables.get("cost_table") is None:
        raise ConfigError("server_cost_table needs cost_table: the devices' own")
    for name, table in tables.items():
        if table is not None and table.units != units:
            raise ConfigError(f"{name} has {table.units} units, the model {units}: it was "
                              "measured for another model")


def cut_priors(config: RunConfig, model: torch.nn.Sequential, test_set: datasets.Dataset,
               rows: int) -> tuple[tuple[float, float], ...]:
    """The scales of the data at each cut of the initial ``model`` (a copy of it) on the
    first ``rows`` samples of the evaluation set: what the coordinator's stages judge the
    first activations and gradients a device sends against, as devices judge their
    neighbours' ([Note: judging arrivals] in aiopipe/runtime/judge.py). Compute thread."""
    x, y = test_set.batch(range(min(max(rows, 2), len(test_set))))
    return cut_scales(copy.deepcopy(model), make_loss(config), x, y)
