"""Models as sequences of split units: the PiPar zoo, and splitting any such model.

A model is an ``nn.Sequential`` whose top-level children are the split units; `build`
makes the zoo's models by name (`MODEL_NAMES`), `as_units` accepts a user's own (an
``nn.Sequential`` as it is, any other ``nn.Module`` traced and cut between its children:
`split_units`), and `split` cuts one in a device half and a server half that share its
modules, `partition` in any number of consecutive stages. `add_lora` fine-tunes a model through
low-rank adapters (`LoRALinear`) and `merge_lora` folds them back for export.
"""

from __future__ import annotations

from aiopipe.models.adapters import LoRALinear, add_lora, lora_parameters, merge_lora
from aiopipe.models.split import (
    as_sequential,
    frozen_parameters,
    merge_states,
    model_digest,
    partition,
    split,
    unit_count,
    units_of,
    without_frozen,
)
from aiopipe.models.trace import as_units, split_here, split_units
from aiopipe.models.zoo import MIN_SIDE, MODEL_NAMES, build

__all__ = [
    "MIN_SIDE",
    "MODEL_NAMES",
    "LoRALinear",
    "add_lora",
    "as_sequential",
    "as_units",
    "build",
    "frozen_parameters",
    "lora_parameters",
    "merge_lora",
    "merge_states",
    "model_digest",
    "partition",
    "split",
    "split_here",
    "split_units",
    "unit_count",
    "units_of",
    "without_frozen",
]
