"""What a star's device keeps of its stage between its rounds.

[Note: a round's local optimizer] Textbook FedAvg (McMahan et al. 2017; Flower's
``FedAvg`` and its clients) starts each round's local optimizer fresh: a sampled device
loads the global model and trains it with an optimizer that has no state, so SGD's
momentum starts at zero every round. aiopipe used to keep each device's optimizer
across its rounds, and with it the device's stage (its model copy) and copies of its
optimizer's state from the start of its last three rounds ([Note: a redone round] in
aiopipe.runtime.holdings): in a population sampled per round, memory grew with every
device that had ever trained (vgg5's fl: 15-20 MiB each, 10.7 GiB after 10 rounds of
100 devices from 1,000). The star's ``local_optimizer`` option makes it a choice:

- ``"fresh"`` (the default): each round's optimizer starts with no state (on the
  device, and on the coordinator's replica of its server half in sfl and pipar:
  `ReplicaPool`); no round-start copies are needed, since a redone round starts from
  nothing too; after the round the device drops its stage.
- ``"kept"``: the momentum carries over from the device's last round, as before. After
  the round the device drops its stage (model copy, gradients, optimizer) and keeps only
  the optimizer's state, by parameter name (`Holdings.put_aside`: the optimizer's own
  tensors, not copied); the next round builds its stage from the model template, loads
  the round's weights and starts a new optimizer from that state
  (`make_optimizer(previous=...)`), which steps bit for bit as the one kept whole
  would have. Round-start copies are kept only for rounds that can still be redone.

A device sampled again gets the weights in its `RoundStart` either way, so dropping the
stage loses nothing. Its round result, which shares the trained stage's memory, stays
until the coordinator acknowledges it (the next `RoundStart`, or a `RoundAccepted` when
the device is not drawn for the next round: aiopipe.runtime.acknowledgements), and its
control loop lets the `RoundStart` go once the round is over. So what a
device holds between rounds is nothing (fresh) or its momentum (kept), and a
simulation's memory follows the devices sampled in a round, not those that have ever
trained. DP-SGD's stage (an Opacus wrapper, costly to build) stays whole between rounds.
"""

from __future__ import annotations

import dataclasses

from aiopipe.runtime.device_context import DeviceContext
from aiopipe.runtime.holdings import StageRules
from aiopipe.runtime.systems.star.options import StarOptions

__all__ = ["keeping_rules", "set_aside"]


def keeping_rules(rules: StageRules, options: StarOptions) -> StageRules:
    """``rules`` with what the star's options say of the stage between rounds."""
    return dataclasses.replace(rules, fresh_optimizer=options.local_optimizer == "fresh",
                               sets_aside=options.privacy != "dp-sgd")


def set_aside(node: DeviceContext, rules: StageRules) -> None:
    """After a round: drop the node's stage and the round's bookkeeping, keeping its
    optimizer's state alone unless the rules start each round's optimizer fresh (no-op
    unless ``rules.sets_aside``)."""
    work = node.work
    if work is None or not rules.sets_aside:
        return
    node.work, node.assignment = None, None  # (the next round's stage is built anew)
    node.delivery.end_round()
    work.clear()  # (nothing is in flight after a round: its gradients, if any)
    node.holdings.put_aside(work, keep_optimizer=not rules.fresh_optimizer)
